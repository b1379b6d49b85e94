"""The engine deployment: one Engine per replica, stepped by the same EngineWorker as the single process.

    generate(prompts, params)   a streaming method: first Accepted (the engine request ids) or Refused (the
                                exception that kept it from the queue: a full queue, a parameter or prompt the
                                engine refuses, a grammar that fails against the vocabulary), then lists of
                                outputs as they come, then Failed if the replica ended the requests (shutdown);
                                cancelling the stream aborts them
    record_routing_stats()      called by Ray Serve every request_routing_stats_period_s; what the router reads:
                                the replica's cached prefix blocks (their names, shortened), its load, and its
                                /metrics text (lumen.serve.ray.metrics merges them)
    info()                      the engine's limits, which the ingress needs to validate requests

Outputs go over the wire without what the ingress already has (remote.pack): no prompt ids, no repeated token
ids or logprobs, the metrics only with the final output.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import time

from ..worker import EngineWorker, QueueFull, ShuttingDown
from .remote import Accepted, Failed, pack, refused

log = logging.getLogger("lumen.serve")
NAME_BYTES = 8                     # a cached block's name as reported to the router: its digest's first 8 bytes


class EngineReplica:
    """Ray Serve builds one per replica (serve.deployment(EngineReplica)): app.load_engine(model, config)."""
    worker_class = EngineWorker               # lumen.serve.ray.pd's decode replica submits through a hand-off

    async def __init__(self, model: str, model_name: str, config, max_queue: int):
        from ray import serve
        from ..app import load_engine
        from ..metrics import Metrics
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id if ctx is not None else f"pid{os.getpid()}"
        self.engine = await asyncio.to_thread(load_engine, model, config)
        gc.collect()                              # what loading made lives as long as the replica: out of the
        gc.freeze()                               # collector's walks (lumen.serve.cli, before serving)
        self.metrics = Metrics(self.engine, model_name)
        self.worker = self.worker_class(self.engine, max_queue=max_queue, metrics=self.metrics)
        self.worker.start()                       # the engine thread, bridged to this replica's event loop
        s = self.engine.stats()
        log.info("replica %s (pid %d): %d threads, max_model_len %d, %d KV blocks", self.replica, os.getpid(),
                 self.engine.threads, self.engine.max_model_len, s["kv_blocks"])

    def info(self) -> dict:
        e = self.engine
        return {"max_model_len": e.max_model_len, "threads": e.threads, "kv_blocks": e.blocks.n_blocks,
                "replica": self.replica, "pid": os.getpid()}

    async def generate(self, prompts: list[list[int]], params: list):
        try:
            await self.compile_grammar(params[0].constraint if params else None)
            sub = await self.worker.submit(prompts, params)
        except (QueueFull, ShuttingDown, ValueError) as e:     # StructuredOutputError is a ValueError
            yield refused(e)
            return
        yield Accepted(sub.request_ids, self.replica)
        sent: dict[str, int] = {}                 # request id -> logprob entries already sent
        try:
            while sub.open:
                batch = [await sub.queue.get()]
                while not sub.queue.empty():      # what piled up while the last batch went out: one message
                    batch.append(sub.queue.get_nowait())
                for out in batch:
                    if out.finished:
                        sub.open.discard(out.request_id)
                yield [pack(out, sent) for out in batch]
            if sub.failure is not None:
                yield Failed(*sub.failure)
        finally:
            self.worker.abort(sub)                # the stream was cancelled (client gone) or ended: a no-op then

    async def compile_grammar(self, constraint) -> None:
        """Wait (off the event loop) for the compilation of the request's constraint, as the single process's
        HTTP layer does (lumen.serve.openai.serving): a grammar that fails against the vocabulary is refused
        (StructuredOutputError) and never reaches the engine, which then finds it in its cache."""
        if constraint is not None:
            await asyncio.wrap_future(self.engine.structured.compiler.submit(constraint))

    def record_routing_stats(self) -> dict:
        bm, s = self.engine.blocks, self.engine.stats()
        return {"replica": self.replica, "pid": os.getpid(), "taken_at": time.time(), "running": s["running"],
                "waiting": s["waiting"], "kv_usage": s["kv_usage"],
                "blocks": [name[:NAME_BYTES] for name in list(bm.by_name)], "metrics": self.metrics.render()}

    def check_health(self) -> None:
        t = self.worker._thread
        if t is not None and not t.is_alive():
            raise RuntimeError("the engine thread has stopped")

    def __del__(self):
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.stop()
