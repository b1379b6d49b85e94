"""The engine's step loop in a thread of its own, and the bridge between it and the server's asyncio loop.

    engine thread:  wait for work -> outs = engine.step() -> loop.call_soon_threadsafe(deliver, outs)
    event loop:     submit() adds requests (Engine.add_request is thread-safe), outputs() awaits their outputs,
                    abort() stops them (their KV blocks are freed at once)

The compiled forward pass releases the GIL, so the event loop keeps answering (/health, new requests, SSE
writes) while a step runs. Numba's thread count is per thread: the engine thread sets its own.

One HTTP request is one `Submission`: its engine requests (n choices x prompts) and the queue their outputs
arrive on. A request's outputs that its client has not taken yet are merged into one (as vLLM's output collector
does): a client that reads slowly, or not at all, costs one pending output per request, not one per step (each
holds all the token ids so far: quadratic in the tokens made). The waiting queue is bounded (max_queue engine requests): past it, submit raises QueueFull. On a
graceful shutdown, `drain` refuses new work and, after the timeout, aborts what is still running
(Submission.failure says why, for the HTTP layer to tell the client at once).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import replace
from typing import AsyncIterator, Protocol

from ..engine.sampling.params import SamplingParams
from ..engine.sequence import RequestMetrics, RequestOutput

log = logging.getLogger("lumen.serve")
SHUTDOWN = "the server is shutting down"


def _name_os_thread(name: str) -> None:
    """Name the calling thread for the OS (top -H, /proc/<pid>/task/*/comm; Linux only)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)      # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class QueueFull(Exception):
    """The waiting queue is full: try again later."""


class ShuttingDown(Exception):
    """The server is draining and takes no new requests."""


class TooManyRequests(ValueError):
    """One submission asks for more engine requests (prompts x n) than the waiting queue could ever hold."""


class OutputQueue:
    """A submission's outputs waiting for the HTTP layer, each request's in step order; asyncio.Queue's put_nowait,
    get, get_nowait, empty and qsize, and merge: put an output, merged into its request's output still waiting if
    there is one."""

    def __init__(self):
        self._items: deque[list] = deque()           # [output] boxes, oldest first
        self._last: dict[str, list] = {}             # request id -> its box still waiting (the newest)
        self._ready = asyncio.Event()

    def put_nowait(self, out: RequestOutput) -> None:
        box = [out]
        self._items.append(box)
        self._last[out.request_id] = box
        self._ready.set()

    def merge(self, out: RequestOutput) -> None:
        box = self._last.get(out.request_id)
        if box is None:
            return self.put_nowait(out)
        old = box[0]                                 # out's totals hold old's; its deltas follow old's
        box[0] = replace(out, delta_token_ids=old.delta_token_ids + out.delta_token_ids,
                         delta_text=old.delta_text + out.delta_text, delta_pieces=old.delta_pieces + out.delta_pieces)

    def get_nowait(self) -> RequestOutput:
        if not self._items:
            raise asyncio.QueueEmpty
        box = self._items.popleft()
        if self._last.get(box[0].request_id) is box:
            del self._last[box[0].request_id]
        return box[0]

    async def get(self) -> RequestOutput:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self.get_nowait()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


class Submission:
    """The engine requests of one HTTP request and the queue their outputs arrive on, in step order."""

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.open = set(request_ids)                 # not finished yet
        self.queue = OutputQueue()
        self.failure: tuple[int, str] | None = None  # (status, message) when the server ended it


class Worker(Protocol):
    """What the HTTP layer drives, whichever runs the requests: EngineWorker (one engine in this process) or
    lumen.serve.ray.remote.RemoteWorker (replicas on Ray Serve). The handlers use nothing else, so both serving
    paths answer the same way (tests/serve/test_serve_handlers.py checks that both classes have this shape)."""
    engine: object      # the Engine, or a stand-in with its tokenizer, config, parts and max_model_len
    draining: bool

    def start(self) -> None: ...
    def stop(self, timeout: float = 10.0) -> None: ...
    def drain(self, timeout: float) -> None: ...
    def abort_all(self, status: int, message: str) -> None: ...
    async def submit(self, prompts: list[list[int]], params: list) -> Submission: ...
    def outputs(self, sub: Submission) -> AsyncIterator[RequestOutput]: ...
    def abort(self, sub: Submission) -> None: ...
    def sent(self, out: RequestOutput) -> None: ...
    def submissions(self) -> list[Submission]: ...


class Recorder:
    """The serving profile of a server run (`lumen.serve --profile FILE`): the engine thread's profiler and, per
    request, when its tokens were sent; written to FILE when the server stops (lumen/profile/serving.py)."""

    def __init__(self, path: str):
        self.path = path
        self.prof = None                              # set by the engine thread, which runs inside the profile
        self.sent: dict[str, list] = {}
        self.traces: list = []

    def on_sent(self, out: RequestOutput) -> None:
        import time
        self.sent.setdefault(out.request_id, []).extend([time.perf_counter()] * len(out.delta_token_ids))
        if out.finished:
            from ..profile.serving import trace_of
            tr = trace_of(out)
            sent = self.sent.pop(out.request_id, [])
            tr.sent = sent if len(sent) == len(tr.made) else None
            self.traces.append(tr)

    def save(self) -> None:
        from ..profile import serving
        if self.prof is not None:
            serving.save(self.path, self.prof, self.traces)
            log.info("serving profile of %d requests written to %s (python -m lumen.profile --serving %s)",
                     len(self.traces), self.path, self.path)


class EngineWorker:
    def __init__(self, engine, *, max_queue: int = 256, metrics=None, profile_path: str | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.recorder = Recorder(profile_path) if profile_path else None
        self.tap = None                               # a lumen.serve.ui StepTap: records steps while a dashboard looks
        self.draining = False
        self._subs: dict[str, Submission] = {}       # engine request id -> its submission
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle (called on the event loop)
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="lumen-engine", daemon=True)
        self._thread.start()

    def drain(self, timeout: float) -> None:
        """Refuse new requests; abort those still running after `timeout` seconds."""
        if self.draining:
            return
        self.draining = True
        if self._loop is not None:
            self._loop.call_later(timeout, self.abort_all, 503, SHUTDOWN)

    def abort_all(self, status: int, message: str) -> None:
        """Fail every submission now: abort its requests in the engine and end its outputs at once, without waiting
        for the engine's final outputs, which come after the step that runs (a long prefill's; never, if the steps
        keep failing). Those still reach the metrics when they come."""
        subs = self.submissions()
        if subs:
            log.warning("aborting %d request(s): %s", len(subs), message)
        for sub in subs:
            sub.failure = (status, message)
            self.abort(sub)
            for rid in sub.open:
                if self._subs.pop(rid, None) is sub:
                    sub.queue.put_nowait(RequestOutput(rid, [], [], "", True, "abort", RequestMetrics()))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything and end the engine thread once the aborts are out."""
        self.abort_all(503, SHUTDOWN)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.recorder is not None:
            self.recorder.save()

    def sent(self, out: RequestOutput) -> None:
        """The HTTP layer sent this output's tokens (for the serving profile)."""
        if self.recorder is not None:
            self.recorder.on_sent(out)

    def submissions(self) -> list[Submission]:
        return list({id(s): s for s in self._subs.values()}.values())

    # ---- requests (called on the event loop)
    async def submit(self, prompts: list[list[int]], params: list[SamplingParams]) -> Submission:
        """Queue one engine request per (prompt, params). Raises ShuttingDown, QueueFull, TooManyRequests for
        more requests than the queue could ever hold, or the engine's ValueError (RequestError, ContextError,
        SamplerError) for a request it cannot serve; then nothing of this submission stays queued."""
        return self.submit_now(prompts, params)

    def submit_now(self, prompts: list[list[int]], params: list[SamplingParams],
                   extras: list[dict] | None = None) -> Submission:
        """submit, with each request's extra Engine.add_request keywords (extras[i]: kv_transfer_params ...)."""
        if self.draining:
            raise ShuttingDown(SHUTDOWN)
        if len(prompts) > self.max_queue:
            raise TooManyRequests(f"the request asks for {len(prompts)} completions (prompts x n); the server queues at "
                             f"most {self.max_queue}")
        if self.engine.num_waiting + len(prompts) > self.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.max_queue} requests); try again later")
        rids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                rids.append(self.engine.add_request(prompt, sp, **(extras[len(rids)] if extras else {})))
        except BaseException:
            for rid in rids:
                self.engine.abort(rid)
            self._wake.set()
            raise
        sub = Submission(rids)
        for rid in rids:
            self._subs[rid] = sub
        self._wake.set()
        return sub

    async def outputs(self, sub: Submission) -> AsyncIterator[RequestOutput]:
        """The submission's outputs as they come, until every request in it has finished."""
        while sub.open:
            out = await sub.queue.get()
            if out.finished:
                sub.open.discard(out.request_id)
            yield out

    def abort(self, sub: Submission) -> None:
        """Stop the submission's unfinished requests; their final outputs (finish_reason "abort") follow."""
        for rid in list(sub.open):
            self.engine.abort(rid)
        self._wake.set()

    # ---- the engine thread
    def _run(self) -> None:
        import numba
        _name_os_thread("lumen-engine")              # and the OpenMP workers it starts, which inherit the name
        numba.set_num_threads(self.engine.threads)
        if self.recorder is None:
            return self._steps()
        from ..profile import profile
        with profile() as prof:                       # this thread's steps, recorded op by op
            self.recorder.prof = prof
            self._steps()

    def _steps(self) -> None:
        engine, loop = self.engine, self._loop
        while True:
            if not engine.has_unfinished():
                if self._stop:
                    break
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outs = engine.step() if self.tap is None else self.tap.step(engine)
            except Exception as e:                    # an engine bug: fail what is in flight, keep serving
                log.exception("engine step failed")
                loop.call_soon_threadsafe(self.abort_all, 500, f"internal error: {type(e).__name__}: {e}")
                outs = []
                self._wake.wait(0.1)
            if outs:
                loop.call_soon_threadsafe(self._deliver, outs)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            if self.metrics is not None:
                self.metrics.observe(out)
            sub = self._subs.get(out.request_id)
            if sub is None:
                continue
            if out.finished:
                del self._subs[out.request_id]
            sub.queue.merge(out)
