"""What the endpoints share. `Serving` holds the served model's name and limits, the worker and the prompter;
`Generation` (the completions and chat endpoints) submits engine requests to the worker and answers from their
outputs: one loop for a whole response, one for a stream (SSE, ending with `data: [DONE]`).

Every error a client caused is a protocol.ApiError (its status and the parameter it names); the app turns it
into OpenAI's error body (lumen/serve/app.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ...engine.admission import prompt_id_end
from ...engine.engine import RequestError
from ...engine.sampling.sampler import SamplerError
from ...engine.structured import StructuredOutputError
from ...engine.structured.matcher import GRAMMAR_FAILED
from ...errors import ContextError
from .. import protocol as P
from ..prompts import Prompter
from ..responses import DONE, Reply, sse
from ..worker import QueueFull, ShuttingDown, TooManyRequests, Worker

log = logging.getLogger("lumen.serve")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Settings:
    model_id: str
    api_key: str | None = None
    max_body_bytes: int = 16 * 2 ** 20
    max_n: int = 64                           # choices per request
    speculative: str | None = None            # the default speculative decoding of requests that do not say
    ui: bool = False                          # the chat page and the dashboard (lumen.serve.ui); cli: unless --no-ui
    tool_call_parser: str | None = None       # --tool-call-parser: a lumen.serve.tools parser, "none"; None: auto
    allowed_origins: tuple[str, ...] = ("*",)  # --allowed-origins: browser pages that may call the API (CORS)


def request_id(request: Request) -> str:
    """The request's id: the Gate's (X-Request-Id, lumen/serve/gate.py), or a new one where no Gate runs."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = request.state.request_id = uuid.uuid4().hex
    return rid


class Serving:
    """What every endpoint knows: the settings, the worker (an EngineWorker, or a RemoteWorker over Ray), its
    engine (or a stand-in with the engine's tokenizer, config, parts and max_model_len) and the prompter."""

    def __init__(self, worker: Worker, prompter: Prompter, settings: Settings):
        self.worker, self.prompter, self.settings = worker, prompter, settings
        self.engine = worker.engine

    def check_model(self, name: str | None) -> None:
        """A request that names a model must name the served one; null or "" is the served one (as vLLM takes it)."""
        if name and name != self.settings.model_id:
            raise P.ApiError(404, f"the model {name!r} does not exist (this server serves "
                                  f"{self.settings.model_id!r})", "model")

    def vocab_end(self) -> int:
        """One past the largest token id a prompt (or /detokenize) may hold: the tokenizer's last, not the model's
        embedding rows past it (lumen.engine.admission.prompt_id_end)."""
        return prompt_id_end(self.engine.tokenizer, self.engine.config.n_vocab)


class Generation(Serving):
    """The completions and chat endpoints: their requests go to the worker, their outputs come back as a whole
    response or a stream."""

    kind = ""                                 # "completion" or "chat" (responses.Reply's kinds)
    id_prefix = ""                            # of the response id: cmpl-<request id>, chatcmpl-<request id>
    prompt_param = ""                         # the parameter a refused prompt is blamed on

    async def respond(self, request: Request, req, prompts: list[list[int]], params: list,
                      echo: list[str] | None = None, tool_parser=None, named_tool: bool = False):
        """Answer `req` (its prompts' token ids, one SamplingParams per choice): every prompt x choice is one
        engine request; streamed (req.stream) or whole."""
        reply = Reply(self.kind, f"{self.id_prefix}-{request_id(request)}", self.settings.model_id,
                      int(time.time()), self.prompter, n=req.n, prompts=prompts, logprobs=params[0].logprobs,
                      return_token_ids=req.return_token_ids, echo=echo, tool_parser=tool_parser,
                      named_tool=named_tool, include_stop=req.include_stop_str_in_output,
                      continuous_usage=req.continuous_usage)
        field = P.constraint_field(req) or ("tools" if tool_parser is not None else None)
        await self.compile_grammar(params[0].constraint, field)
        max_tokens_field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None \
            else "max_tokens"
        sub = await self.submit([p for p in prompts for _ in params], params * len(prompts), field, max_tokens_field,
                                "n" if req.n > 1 else self.prompt_param)
        index = {r: i for i, r in enumerate(sub.request_ids)}
        if req.stream:
            return StreamingResponse(self.stream(request, reply, sub, index, req.include_usage, field),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        worker = self.worker
        watcher = asyncio.create_task(_disconnected(request))
        watcher.add_done_callback(lambda t: t.cancelled() or worker.abort(sub))
        try:
            async for out in worker.outputs(sub):
                if out.finished:
                    reply.finals[index[out.request_id]] = out
        finally:
            watcher.cancel()
            worker.abort(sub)                     # a no-op once all finished
        fail = failure(sub, reply.finals.values(), field)
        if fail is not None:
            raise P.ApiError(*fail)
        request.state.usage = reply.usage()
        response = JSONResponse(reply.body())
        for out in reply.finals.values():         # a non-streamed reply sends every token with the response
            worker.sent(replace(out, delta_token_ids=out.token_ids))
        return response

    def blamed(self, e: SamplerError, params: list) -> str | None:
        """The parameter a SamplerError from the engine's request check is about: its own `param` if it names one,
        else the one holding token ids outside the vocabulary (the only parameters the engine checks against
        the model rather than on their own)."""
        if getattr(e, "param", None) is not None:
            return e.param
        V = self.engine.config.n_vocab
        for name in ("stop_token_ids", "logit_bias"):
            if any(t >= V for sp in params for t in getattr(sp, name)):
                return name
        return None

    def context_blamed(self, prompts: list[list[int]], params: list, max_tokens_param: str) -> str:
        """The parameter a request the engine cannot fit is about: max_tokens when every prompt is a valid one that
        leaves room in the context, but not the max_tokens asked beyond it; else the prompt."""
        L, V = self.engine.max_model_len, self.vocab_end()
        if all(0 < len(p) < L and all(0 <= t < V for t in p) for p in prompts) and any(
                sp.max_tokens is not None and len(p) + sp.max_tokens > L for p, sp in zip(prompts, params)):
            return max_tokens_param
        return self.prompt_param

    async def compile_grammar(self, constraint, param: str | None) -> None:
        """Wait (off the event loop) for the engine's compilation of the request's constraint, so that a grammar
        llguidance rejects against the vocabulary is a 400 that never reaches the engine; the engine then finds it
        in its cache. Nothing to do without a constraint, or with a worker whose engine is remote."""
        compiler = getattr(getattr(self.engine, "structured", None), "compiler", None)
        if constraint is None or compiler is None:
            return
        try:
            await asyncio.wrap_future(compiler.submit(constraint))
        except StructuredOutputError as e:
            raise grammar_error(e, param) from None

    async def submit(self, prompts: list[list[int]], params: list, constraint_param: str | None = None,
                     max_tokens_param: str = "max_tokens", many_param: str = "n"):
        """The worker's submission of these engine requests; its refusals as ApiErrors (constraint_param: the
        field a grammar the engine refuses is blamed on; max_tokens_param: the one max_tokens came from;
        many_param: the one blamed for more requests than the queue holds, n or the list of prompts)."""
        try:
            return await self.worker.submit(prompts, params)  # a remote worker answers once a replica took it
        except ShuttingDown as e:
            raise P.ApiError(503, str(e)) from None
        except QueueFull as e:
            raise P.ApiError(429, str(e)) from None
        except TooManyRequests as e:              # prompts x n beyond what the queue could ever hold
            raise P.ApiError(400, str(e), many_param) from None
        except StructuredOutputError as e:        # a remote engine's compile_grammar (lumen.serve.ray.replica)
            raise grammar_error(e, constraint_param) from None
        except SamplerError as e:                 # token ids in the params outside the vocabulary
            raise P.ApiError(400, str(e), self.blamed(e, params)) from None
        except (ContextError, RequestError) as e:     # the prompt (too long, empty, bad ids) or max_tokens
            raise P.ApiError(400, str(e), self.context_blamed(prompts, params, max_tokens_param)) from None
        except ValueError as e:                   # any other request the engine refuses
            raise P.ApiError(400, str(e)) from None

    async def stream(self, request: Request, reply: Reply, sub, index: dict, include_usage: bool,
                     grammar_param: str | None = None):
        """The SSE events of a streamed answer: the opening chunks, the chunks of each output that adds something,
        the usage chunk if asked for, then [DONE]; an error event instead when the submission fails (grammar_param:
        the field a grammar that fails is blamed on); an error event (500) and [DONE] if building an event
        fails, rather than a connection cut mid-stream."""
        worker, finished = self.worker, False
        try:
            for chunk in reply.opening(include_usage):
                yield sse(chunk)
            async for out in worker.outputs(sub):
                fail = failure(sub, [out] if out.finished else [], grammar_param)
                if fail is not None:
                    yield sse(P.error_body(*fail))
                    break
                for chunk in reply.chunks(index[out.request_id], out, include_usage):
                    yield sse(chunk)
                worker.sent(out)
            else:
                request.state.usage = reply.usage()
                if include_usage:
                    yield sse(reply.usage_chunk())
            yield DONE
            finished = True
        except Exception as e:                        # noqa: BLE001 - a fault of ours after the 200 went out: the
            log.exception("request %s: its stream failed", request_id(request))   # client gets an error event
            yield sse(P.error_body(500, f"internal error: {type(e).__name__}: {e}"))
            yield DONE
        finally:
            if not finished or sub.open:
                worker.abort(sub)


def grammar_error(e: StructuredOutputError, param: str | None) -> P.ApiError:
    """The 400 of a grammar that fails to compile against the vocabulary, naming the field that asked for it."""
    return P.ApiError(400, f"{param}: {e}" if param else str(e), param)


def failure(sub, finals, grammar_param: str | None = None) -> tuple | None:
    """(status, message[, param]) when the submission did not end normally: the server ended it, or the engine
    failed one of its requests. A grammar llguidance gives up on while generating (a limit of its lexer or parser,
    reached by a pattern such as ((a{100}){100}){100}) is the request's fault: a 400 naming grammar_param."""
    if sub.failure is not None:
        return sub.failure
    for out in finals:
        if out.finish_reason == "error" and grammar_param and (out.error or "").startswith(GRAMMAR_FAILED):
            why = out.error.split("\n", 1)[0].split(": ", 1)[-1]
            return 400, f"{grammar_param}: llguidance cannot follow this grammar: {why}", grammar_param
        if out.finish_reason == "error":
            return 500, f"internal error: {out.error}"
        if out.finish_reason == "abort":          # nobody but a gone client's watcher aborts without a failure
            return 499, "the client disconnected"
    return None


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read: the next message is the disconnect)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:                                # noqa: BLE001 - a broken connection is a gone client
        pass
