"""The ingress's side of the engine: EngineWorker's interface (submit, outputs, abort, abort_all, stop, sent,
draining) over a handle to the engine deployment, so the HTTP layer (lumen.serve.app) runs unchanged on it.

    submit(prompts, params)   awaits the replica's answer: Accepted -> a Submission whose outputs a task pumps
                              from the stream; Refused -> the exception the single process raises (QueueFull,
                              ShuttingDown, ValueError and the engine's, a grammar that fails against the
                              vocabulary among them), raised again here, so the client gets the same status
    abort(sub)                cancels the stream; the replica aborts the requests (their KV blocks are freed)
    a replica that dies       its submissions fail with 503 (the client may retry: another replica serves)

The wire (replica -> ingress): each output without its prompt ids, its earlier token ids and logprobs, and (until
it is final) its metrics; `Stream` puts the full RequestOutput back together as the app expects it.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from ...engine.sequence import RequestMetrics, RequestOutput
from ..worker import SHUTDOWN, ShuttingDown, Submission

log = logging.getLogger("lumen.serve")
REPLICA_FAILED = "the replica serving this request failed; try again"


# ---- the wire
@dataclass
class Accepted:
    request_ids: list[str]
    replica: str


@dataclass
class Refused:
    error: Exception              # the exception the single process raises (QueueFull, ShuttingDown, ValueError and
    #                               the engine's: SamplerError with its param, StructuredOutputError...), as it is


@dataclass
class Failed:
    status: int
    message: str


def refused(e: Exception) -> Refused:
    """A replica's refusal as it crosses to the ingress: the exception itself (Ray pickles it), so the ingress
    raises what the single process raises; one that would not come back whole goes as a ValueError."""
    try:
        back = pickle.loads(pickle.dumps(e))
        if type(back) is type(e) and str(back) == str(e) and vars(back) == vars(e):
            return Refused(e)
    except Exception:                             # noqa: BLE001 - any failure to pickle: the fallback below
        pass
    return Refused(ValueError(str(e)))


def pack(out: RequestOutput, sent: dict[str, int]) -> RequestOutput:
    """An output as it goes over the wire: only the new logprob entries (sent: how many went before), no prompt
    or earlier token ids, the text and metrics only when final."""
    lp = None
    if out.logprobs is not None:
        start = sent.get(out.request_id, 0)
        lp, sent[out.request_id] = out.logprobs[start:], len(out.logprobs)
    return replace(out, prompt_token_ids=[], token_ids=[], logprobs=lp, text=out.text if out.finished else "",
                   metrics=out.metrics if out.finished else None)


class Stream:
    """A submission's outputs put back together from the wire."""

    def __init__(self, request_ids: list[str], prompts: list[list[int]]):
        self.prompt = dict(zip(request_ids, prompts, strict=True))
        self.tokens: dict[str, list[int]] = {r: [] for r in request_ids}
        self.logprobs: dict[str, list] = {r: [] for r in request_ids}
        self.text: dict[str, str] = {r: "" for r in request_ids}

    def unpack(self, out: RequestOutput) -> RequestOutput:
        rid = out.request_id
        self.tokens[rid] += out.delta_token_ids
        self.text[rid] += out.delta_text
        lp = None
        if out.logprobs is not None:
            self.logprobs[rid] += out.logprobs
            lp = list(self.logprobs[rid])
        return replace(out, prompt_token_ids=self.prompt[rid], token_ids=list(self.tokens[rid]), logprobs=lp,
                       text=out.text if out.finished else self.text[rid],
                       metrics=out.metrics if out.metrics is not None else _NO_METRICS)

    def ended(self, rid: str, reason: str, error: str | None = None) -> RequestOutput:
        """The final output of a request the stream did not finish (cancelled, or the replica died)."""
        return RequestOutput(rid, self.prompt[rid], list(self.tokens[rid]), self.text[rid], True, reason,
                             RequestMetrics(prompt_tokens=len(self.prompt[rid])), error=error)


_NO_METRICS = RequestMetrics()


# ---- the worker
class RemoteSubmission(Submission):
    """A submission served by a replica: its output stream and the task pumping it."""

    def __init__(self, request_ids: list[str], replica: str, stream: Stream, gen):
        super().__init__(request_ids)
        self.replica, self.stream, self.gen = replica, stream, gen
        self.gen_done = False                     # the stream has ended
        self.pump: asyncio.Task | None = None


class ModelInfo:
    """What the HTTP layer reads from an engine, without loading the weights: the GGUF's metadata, config and
    tokenizer, and the replicas' max_model_len."""

    def __init__(self, model: str, max_model_len: int):
        from ...model.parts import build_tokenizer, open_gguf
        from ...model.store import resolve
        path = resolve(model)
        g, cfg = open_gguf(path)
        self.parts = SimpleNamespace(path=Path(path), gguf=g)
        self.config, self.tokenizer, self.max_model_len = cfg, build_tokenizer(g.metadata), max_model_len


class RemoteWorker:
    steps_here = False                            # the engines step in the replicas: no StepTap in the ingress

    def __init__(self, handle, engine: ModelInfo):
        self.handle = handle.options(stream=True)
        self.engine = engine
        self.draining = False
        self._subs: set[RemoteSubmission] = set()

    # ---- lifecycle (the app's lifespan; Ray Serve drains the replicas itself)
    def start(self) -> None:
        pass

    def stop(self, timeout: float = 10.0) -> None:
        self.abort_all(503, SHUTDOWN)

    def drain(self, timeout: float) -> None:
        self.draining = True
        asyncio.get_running_loop().call_later(timeout, self.abort_all, 503, SHUTDOWN)

    def abort_all(self, status: int, message: str) -> None:
        for sub in list(self._subs):
            sub.failure = (status, message)
            self.abort(sub)

    def sent(self, out: RequestOutput) -> None:
        pass

    def submissions(self) -> list[RemoteSubmission]:
        return list(self._subs)

    # ---- requests
    async def submit(self, prompts: list[list[int]], params: list) -> RemoteSubmission:
        if self.draining:
            raise ShuttingDown(SHUTDOWN)
        gen = self.handle.generate.remote(prompts, params)
        try:
            first = await gen.__anext__()
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:                    # noqa: BLE001 - the replica failed before answering
            log.warning("a replica failed before accepting a request: %s: %s", type(e).__name__, e)
            gen.cancel()
            raise ShuttingDown(REPLICA_FAILED) from None
        if isinstance(first, Refused):
            raise first.error
        sub = RemoteSubmission(first.request_ids, first.replica, Stream(first.request_ids, prompts), gen)
        self._subs.add(sub)
        sub.pump = asyncio.create_task(self._pump(sub))
        return sub

    async def outputs(self, sub: RemoteSubmission):
        while sub.open:
            out = await sub.queue.get()
            if out.finished:
                sub.open.discard(out.request_id)
            yield out

    def abort(self, sub: RemoteSubmission) -> None:
        if not sub.gen_done:
            sub.gen.cancel()

    async def _pump(self, sub: RemoteSubmission) -> None:
        """The stream's outputs onto the submission's queue; whatever ends it, every request gets a final."""
        reason, error, pending = "abort", None, set(sub.request_ids)
        try:
            async for msg in sub.gen:
                if isinstance(msg, Failed):
                    sub.failure = (msg.status, msg.message)
                    continue
                for out in msg:
                    if out.finished:
                        pending.discard(out.request_id)
                    sub.queue.put_nowait(sub.stream.unpack(out))
        except asyncio.CancelledError:
            pass
        except Exception as e:                    # noqa: BLE001 - cancelled (RequestCancelledError) or the replica died
            from ray.serve.exceptions import RequestCancelledError
            if not isinstance(e, RequestCancelledError):
                log.warning("replica %s failed with %d request(s) in flight: %s: %s", sub.replica, len(pending),
                            type(e).__name__, e)
                if sub.failure is None:
                    sub.failure = (503, REPLICA_FAILED)
                reason, error = "error", f"{type(e).__name__}"
        finally:
            sub.gen_done = True
            self._subs.discard(sub)
            for rid in sorted(pending):
                sub.queue.put_nowait(sub.stream.ended(rid, reason, error))

