"""The HTTP layer: OpenAI JSON in, engine requests out, tokens streamed back. It only translates: sampling,
stopping and detokenizing happen in the engine, so the server answers what `Model.generate` would.

    POST /v1/completions, /v1/chat/completions     streamed (SSE, ending with `data: [DONE]`) or not
    POST /tokenize, /detokenize                    vLLM's and llama-server's shapes
    GET  /v1/models, /v1/models/{id}, /health, /metrics
    GET  /, /dashboard (+ /dashboard/data, /ui/*)   the chat page and the live dashboard (lumen.serve.ui)

Every request passes the Gate first (lumen.serve.gate: request id, API key, body bound, log line, 500s).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import RequestError
from ..engine.sampler import SamplerError
from ..errors import ContextError
from . import protocol as P
from .metrics import CONTENT_TYPE, Metrics
from .prompts import Prompter
from .gate import Gate
from .responses import DONE, Reply, sse
from .ui import PAGES, StepTap, ui_router
from .worker import EngineWorker, QueueFull, ShuttingDown

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


def build_app(worker: EngineWorker, prompter: Prompter, metrics: Metrics, settings: Settings) -> FastAPI:
    engine = worker.engine
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="Lumen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, e: P.ApiError):
        retry = {"Retry-After": "1"} if e.status in (429, 503) else None      # the openai client honours it
        return JSONResponse(e.body(), status_code=e.status, headers=retry)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(P.error_body(e.status_code, msg), status_code=e.status_code)

    def check_model(name: str | None) -> None:
        if name is not None and name != settings.model_id:
            raise P.ApiError(404, f"the model {name!r} does not exist (this server serves "
                                  f"{settings.model_id!r})", "model")

    def model_card() -> dict:
        return {"id": settings.model_id, "object": "model", "created": created, "owned_by": "lumen",
                "root": str(engine.parts.path), "max_model_len": engine.max_model_len}

    # ---- the two generation endpoints
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = P.parse(await request.body(), P.CompletionRequest)
        check_model(req.model)
        params = P.speculation(P.completion_params(req, settings.max_n), req, settings.speculative)
        prompts = await asyncio.to_thread(prompter.completion, req.prompt)
        echo = None
        if req.echo:                              # each prompt's text: as sent, or its token ids decoded
            sent = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
            echo = [p if isinstance(p, str) else engine.tokenizer.decode(ids) for p, ids in zip(sent, prompts)]
        return await generate(request, "completion", req, prompts, params, echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = P.parse(await request.body(), P.ChatCompletionRequest)
        check_model(req.model)
        params = P.speculation(P.chat_params(req, settings.max_n), req, settings.speculative)
        prompts = [await asyncio.to_thread(prompter.chat, req.messages, req.add_generation_prompt)]
        return await generate(request, "chat", req, prompts, params)

    async def generate(request: Request, kind: str, req, prompts: list[list[int]], params, echo=None):
        rid = request.state.request_id
        reply = Reply(kind, f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{rid}", settings.model_id,
                      int(time.time()), prompter, n=req.n, prompts=prompts, logprobs=params[0].logprobs,
                      return_token_ids=req.return_token_ids, echo=echo)
        sub = await submit([p for p in prompts for _ in params], params * len(prompts),
                           "prompt" if kind == "completion" else "messages")
        index = {r: i for i, r in enumerate(sub.request_ids)}
        if req.stream:
            return StreamingResponse(stream(request, reply, sub, index, req.include_usage),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        watcher = asyncio.create_task(_disconnected(request))
        watcher.add_done_callback(lambda t: t.cancelled() or worker.abort(sub))
        try:
            async for out in worker.outputs(sub):
                if out.finished:
                    reply.finals[index[out.request_id]] = out
        finally:
            watcher.cancel()
            worker.abort(sub)                     # a no-op once all finished
        fail = _failure(sub, reply.finals.values())
        if fail is not None:
            raise P.ApiError(*fail)
        request.state.usage = reply.usage()
        response = JSONResponse(reply.body())
        for out in reply.finals.values():
            worker.sent(_all_at_once(out))
        return response

    async def submit(prompts, params, prompt_param: str):
        try:
            sub = worker.submit(prompts, params)     # a remote worker's submit is awaited: it answers once a
            return await sub if inspect.isawaitable(sub) else sub     # replica took it (lumen.serve.ray.remote)
        except ShuttingDown as e:
            raise P.ApiError(503, str(e)) from None
        except QueueFull as e:
            raise P.ApiError(429, str(e)) from None
        except SamplerError as e:                 # a token id in the params outside the vocabulary
            raise P.ApiError(400, str(e), str(e).split(" ", 1)[0]) from None
        except (ContextError, RequestError) as e:     # the prompt: too long, empty, ids outside the vocabulary
            raise P.ApiError(400, str(e), prompt_param) from None
        except ValueError as e:
            raise P.ApiError(400, str(e), "n") from None

    def _all_at_once(out):                        # a non-streamed reply sends every token with the response
        from dataclasses import replace
        return replace(out, delta_token_ids=out.token_ids)

    async def stream(request: Request, reply: Reply, sub, index: dict, include_usage: bool):
        finished = False
        try:
            for chunk in reply.opening(include_usage):
                yield sse(chunk)
            async for out in worker.outputs(sub):
                fail = _failure(sub, [out] if out.finished else [])
                if fail is not None:
                    yield sse(P.error_body(*fail))
                    break
                chunk = reply.chunk(index[out.request_id], out, include_usage)
                if chunk is not None:
                    yield sse(chunk)
                worker.sent(out)
            else:
                request.state.usage = reply.usage()
                if include_usage:
                    yield sse(reply.usage_chunk())
            yield DONE
            finished = True
        finally:
            if not finished or sub.open:
                worker.abort(sub)

    # ---- tokenizer endpoints
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = P.parse(await request.body(), P.TokenizeRequest)
        check_model(req.model)
        add = req.add_special_tokens if req.add_special_tokens is not None else req.add_special
        if req.messages is not None:
            text = prompter.render(req.messages, req.add_generation_prompt)
        elif req.prompt is not None:                                    # vLLM: special tokens added by default
            text, add = req.prompt, add is not False
        elif req.content is not None:                                   # llama-server: not by default
            text, add = req.content, bool(add)
        else:
            raise P.ApiError(400, "give prompt, content or messages", "prompt")
        ids = await asyncio.to_thread(prompter.encode, text, add_special=add is not False)
        tokens = ids
        if req.with_pieces:
            tokens = []
            for i in ids:
                b = engine.tokenizer.token_bytes(i, special=True)
                try:
                    piece = b.decode("utf-8")
                except UnicodeDecodeError:
                    piece = list(b)
                tokens.append({"id": i, "piece": piece})
        return {"tokens": tokens, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = P.parse(await request.body(), P.DetokenizeRequest)
        check_model(req.model)
        V = engine.config.n_vocab
        bad = [t for t in req.tokens if not 0 <= t < V]
        if bad:
            raise P.ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{V - 1})", "tokens")
        text = engine.tokenizer.decode(req.tokens, special=True)
        return {"prompt": text, "content": text}

    # ---- the rest
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != settings.model_id:
            raise P.ApiError(404, f"the model {name!r} does not exist", "model")
        return model_card()

    @app.get("/health")
    async def health():
        if worker.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if settings.ui:                               # GET /, /dashboard, /dashboard/data, /ui/* (lumen.serve.ui)
        worker.tap = StepTap()
        app.include_router(ui_router(metrics.registry, worker.tap, model_id=settings.model_id,
                                     max_model_len=engine.max_model_len, speculative=settings.speculative))
    app.add_middleware(Gate, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       open_paths=PAGES if settings.ui else ())
    return app


def _failure(sub, finals) -> tuple[int, str] | None:
    """(status, message) when the submission did not end normally: the server ended it, or the engine failed
    one of its requests."""
    if sub.failure is not None:
        return sub.failure
    for out in finals:
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
