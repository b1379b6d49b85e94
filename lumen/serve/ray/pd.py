"""Disaggregated serving on Ray Serve: a pool of prefill replicas beside a pool of decode replicas
(`lumen.serve --prefill-replicas P --decode-replicas D`), the KV moved between them as whole-block runs
(lumen.engine.kv_transfer).

    client -> ingress (unchanged: lumen.serve.app over a RemoteWorker) -> a decode replica (prefix-aware router)
    decode replica, per distinct prompt:
        uncached = the prompt tokens its own prefix cache lacks (exact: its block manager)
        uncached < threshold      run it here, as a colocated replica does (short prompts do not pay for PD)
        else  prefill.prefill([ids], params)          a prefill replica (prefix-aware router) runs it with
                                                    max_tokens=1 and holds its KV: {replica, kv_transfer_params}
              prefill.export_kv(replica, rid, first, end)   routed to that replica (router.DIRECT): the blocks
                                                    this replica lacks, numpy arrays through Ray's object store;
                                                    the hold is released as they are copied out
              engine.add_request(ids, params, kv_transfer_params=..., kv_data=...)   decoded here
    a failure (the prefill replica died, it sent nothing for --pd-prefill-timeout, the pull timed out, the KV
    expired): --kv-failure recompute runs the prompt here instead; error answers 503. A refusal (the prefill pool's
    queue is full) always runs it here. A call given up on is cancelled (Ray Serve cancels its task on the
    replica, which aborts the request and so frees or releases its blocks); awaiting a handle call with a timeout
    alone would not stop it there.

The decode replica, not the ingress, decides and drives the hand-off: only it knows exactly which blocks its cache
holds, and so which requests have many uncached tokens and which blocks to pull (vLLM's proxy asks the prefill
first and cannot know). Held blocks are released by the export, by release_kv when the decode side gives up
(cancelled), and after the engine's kv_hold_timeout_s (expired every routing-stats period, 1 s): the last also
covers a prefill that finished just as the decode replica gave up on it.

Metrics of each decode replica (in /metrics with its replica label): lumen:kv_transfers_total{result=pulled|
recomputed|error|local}, lumen:kv_transfer_bytes_total, lumen:kv_handoff_seconds (the pull: export call, copy,
object store, write on admission excluded), lumen:pd_prefill_seconds (the remote prefill call),
lumen:kv_import_seconds_total (writing the runs into its blocks), lumen:kv_import_blocks_total and
lumen:kv_import_skipped_blocks_total.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily

from ...engine.admission import admit
from ...engine.kv_transfer import DO_REMOTE_DECODE, PREFILL_PARAMS, KVData, needed_blocks
from ...kernels.attention import BLOCK
from ..metrics import TTFT_BUCKETS
from ..worker import EngineWorker, QueueFull, ShuttingDown
from . import metrics as ray_metrics
from .app import ENGINE, Ingress
from .replica import EngineReplica

log = logging.getLogger("lumen.serve")
PREFILL = "LumenPrefill"
HEARTBEAT_S = 1.0                      # a prefill replica's "alive" items, while its engine steps
PREFILL_FAILED = "the prefill replica serving this request failed; try again"


@dataclass(frozen=True)
class PDSettings:
    """threshold: uncached prompt tokens from which a request goes through the prefill pool; failure: "recompute"
    or "error" when the hand-off fails; prefill_timeout_s: the longest wait for the prefill replica's next
    heartbeat, sent while its engine steps (a replica that hangs must not hang the request; one that is merely busy
    with a queue of long prompts is not given up on, its work redone here); pull_timeout_s: the longest wait for the
    KV once prefilled. The threshold's default: the hand-off adds ~31 ms to a request's TTFT, as long as a local
    prefill of ~59 tokens takes on SmolLM2-135M at one thread, fewer on larger models (profiling/pd_serving.py
    threshold)."""
    threshold: int = 64
    failure: str = "recompute"
    pull_timeout_s: float = 30.0
    prefill_timeout_s: float = 60.0

    def __post_init__(self):
        if self.failure not in ("recompute", "error"):
            raise ValueError(f"kv failure policy must be 'recompute' or 'error', got {self.failure!r}")
        if not isinstance(self.threshold, int) or self.threshold < 0:
            raise ValueError(f"the PD threshold must be a non-negative number of tokens, got {self.threshold!r}")
        for name in ("pull_timeout_s", "prefill_timeout_s"):
            if not 0 < getattr(self, name) < 1e6:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}")


class PrefillReplica(EngineReplica):
    """A replica of the prefill pool: runs prompts to their first token and holds their KV for a decode replica."""

    async def prefill(self, prompts: list[list[int]], params):
        """One prompt (prompts: [its ids], as generate's first argument, which the router reads) to its first
        token, its KV held. A streaming method: {"alive": engine steps} at most every HEARTBEAT_S while this
        replica's engine steps (the prompt progresses, or those queued before it do), then the result:
        {"replica", "kv_transfer_params", "prefill_s"}, or {"refused": kind, "message"}."""
        t0 = time.perf_counter()
        try:
            sub = self.worker.submit_now(prompts[:1], [PREFILL_PARAMS],    # (its token is the decode's to make)
                                         [{"kv_transfer_params": {DO_REMOTE_DECODE: True}}])
        except (QueueFull, ShuttingDown, ValueError) as e:
            yield {"refused": type(e).__name__, "message": str(e)}
            return
        final, steps = None, self.engine.steps
        try:
            while sub.open:
                try:
                    out = await asyncio.wait_for(sub.queue.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    if self.engine.steps != steps:    # a stuck engine sends none: the decode side gives up
                        steps = self.engine.steps
                        yield {"alive": steps}
                    continue
                if out.finished:
                    sub.open.discard(out.request_id)
                    final = out
        finally:
            self.worker.abort(sub)                    # cancelled: the request stops (no-op once finished)
        if final is None or final.kv_transfer_params is None:
            yield {"refused": "value", "message": (final and final.error) or "the prefill did not finish"}
            return
        yield {"replica": self.replica, "kv_transfer_params": final.kv_transfer_params,
               "prefill_s": time.perf_counter() - t0}

    async def export_kv(self, replica: str, request_id: str, first: int, end: int):
        """The held blocks first .. end-1 of request_id (lumen.engine.kv_transfer.export), then released."""
        if replica != self.replica:
            raise RuntimeError(f"export_kv for replica {replica} reached {self.replica}")
        return await asyncio.to_thread(self.engine.kv.export, request_id, first, end)

    def release_kv(self, replica: str, request_id: str) -> bool:
        return self.engine.kv.release(request_id)

    def record_routing_stats(self) -> dict:
        self.engine.kv.expire()                       # holds nobody pulled, even while the engine is idle
        return super().record_routing_stats()


class HandOff:
    """A decode replica's side of the hand-off, apart from Ray (tests drive it with a stand-in prefill handle)."""

    def __init__(self, engine, prefill, settings: PDSettings, registry, model_name: str):
        self.engine, self.prefill, self.settings = engine, prefill, settings
        labels = ["model_name"]
        self.transfers = Counter("lumen:kv_transfers", "Prompts by how their KV was made: pulled from a prefill "
                                 "replica, recomputed here after a failed hand-off, error (answered 503), or "
                                 "local (too few uncached tokens for the prefill pool).", labels + ["result"],
                                 registry=registry)
        self.bytes = Counter("lumen:kv_transfer_bytes", "KV bytes pulled from prefill replicas.", labels,
                             registry=registry).labels(model_name)
        self.handoff = Histogram("lumen:kv_handoff_seconds", "Pulling a prompt's KV from the prefill replica (the "
                                 "export call, its copy and the object store).", labels, buckets=TTFT_BUCKETS,
                                 registry=registry).labels(model_name)
        self.prefill_s = Histogram("lumen:pd_prefill_seconds", "The prefill pool's call, queue included.", labels,
                                   buckets=TTFT_BUCKETS, registry=registry).labels(model_name)
        self.model_name = model_name
        registry.register(_ImportState(engine, model_name))

    def count(self, result: str) -> None:
        self.transfers.labels(self.model_name, result).inc()

    async def extras(self, prompts: list[list[int]], params: list) -> list[dict]:
        """Each request's add_request keywords: the pulled KV for prompts with many uncached tokens (one pull per
        distinct prompt: n choices share it), {} for the rest. ShuttingDown (503) on a failure with "error"."""
        out: list[dict] = [{} for _ in prompts]
        e = self.engine
        try:                                          # one this engine refuses (prompt + max_tokens past
            for ids, sp in zip(prompts, params):      # max_model_len, ...) is refused by submit as it is:
                admit(ids, sp, e.tokenizer, e.config.n_vocab, e.max_model_len, e.blocks.n_blocks)   # no prefill
        except ValueError:
            return out
        seen: dict[tuple, dict] = {}
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            key = tuple(ids)
            if key not in seen:
                seen[key] = await self.pull(ids, sp)
            out[i] = seen[key]
        return out

    async def pull(self, ids: list[int], params) -> dict:
        if params.prompt_logprobs is not None:        # they need the prompt computed here (Engine.add_request)
            self.count("local")
            return {}
        first = self.engine.kv.first_missing(ids)
        if len(ids) - 1 - first * BLOCK < self.settings.threshold:
            self.count("local")
            return {}
        got = call = None
        try:
            t0 = time.perf_counter()
            call = self.prefill.options(stream=True).prefill.remote([ids], params)
            got = await last(call, self.settings.prefill_timeout_s, "the prefill pool")
            self.prefill_s.observe(time.perf_counter() - t0)
            if "refused" in got:                      # not queued there (full, say): run it here
                log.info("prefill pool refused a request (%s): running it here", got["message"])
                self.count("local")
                return {}
            p = got["kv_transfer_params"]
            t1 = time.perf_counter()
            runs = await bounded(self.prefill.export_kv.remote(got["replica"], p["remote_request_id"], first,
                                                               needed_blocks(p, len(ids))),
                                 self.settings.pull_timeout_s, "the KV pull")
            self.handoff.observe(time.perf_counter() - t1)
        except asyncio.CancelledError:                # the client left: let the prefill replica go now
            if got is None and call is not None:
                call.cancel()                         # the prefill in flight: its replica aborts it
            elif got is not None and "kv_transfer_params" in got:
                self.prefill.release_kv.remote(got["replica"], got["kv_transfer_params"]["remote_request_id"])
            raise
        except Exception as e:                        # noqa: BLE001 - the replica died, timed out, the KV expired
            log.warning("KV hand-off failed (%s: %s): %s", type(e).__name__, str(e).splitlines()[0] if str(e) else "",
                        "recomputing here" if self.settings.failure == "recompute" else "answering 503")
            if self.settings.failure == "error":
                self.count("error")
                raise ShuttingDown(PREFILL_FAILED) from None
            self.count("recomputed")
            return {}
        data = KVData(runs)
        self.bytes.inc(data.nbytes)
        self.count("pulled")
        return {"kv_transfer_params": p, "kv_data": data}


async def bounded(call, timeout_s: float, what: str):
    """The result of a handle call (a Ray Serve DeploymentResponse), awaited for at most timeout_s seconds; past
    that, the call is cancelled and TimeoutError raised. The cancel is what stops the call on its replica (Ray Serve
    cancels the replica's task for it): wait_for's own cancel only stops this side's wait."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        call.cancel()
        raise TimeoutError(f"{what} did not answer within {timeout_s:g} s") from None


async def last(call, timeout_s: float, what: str):
    """The last item of a streaming handle call (a Ray Serve DeploymentResponseGenerator) whose items each come
    within timeout_s of the one before (the prefill replica's heartbeats: a long queue of prompts there is progress,
    a replica that hangs sends nothing); past that, the call is cancelled and TimeoutError raised."""
    got, items = None, call.__aiter__()
    while True:
        try:
            got = await asyncio.wait_for(items.__anext__(), timeout_s)
        except StopAsyncIteration:
            return got
        except asyncio.TimeoutError:
            call.cancel()
            raise TimeoutError(f"{what} made no progress for {timeout_s:g} s") from None


class _ImportState:
    """The engine's import counters at scrape time: writing the pulled runs into its blocks (on admission)."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        st = self.engine.kv.stats
        for name, doc, v in (("kv_import_seconds", "Writing pulled KV runs into this replica's blocks.", st.import_s),
                             ("kv_import_blocks", "KV blocks written from pulled runs.", st.imported_blocks),
                             ("kv_import_skipped_blocks", "Blocks of pulled prompts this replica's prefix cache "
                              "held (not pulled, or not written).", st.skipped_blocks)):
            c = CounterMetricFamily(f"lumen:{name}", doc, labels=["model_name"])
            c.add_metric([self.model_name], v)
            yield c


class HandOffWorker(EngineWorker):
    """The decode replica's worker: each submission's prompts go through the hand-off first. Their requests arrive
    when the submission did: TTFT and queue time (/metrics, the dashboard) count the hand-off, as the client does."""
    handoff: HandOff | None = None

    async def submit(self, prompts: list[list[int]], params: list):
        arrival = time.perf_counter()
        extras = await self.handoff.extras(prompts, params) if self.handoff is not None else [{} for _ in prompts]
        return self.submit_now(prompts, params, [{**x, "arrival": arrival} for x in extras])


class DecodeReplica(EngineReplica):
    """A replica of the decode pool: the engine deployment the ingress calls, pulling KV from the prefill pool."""
    worker_class = HandOffWorker

    async def __init__(self, model: str, model_name: str, config, max_queue: int, prefill, settings: PDSettings):
        await super().__init__(model, model_name, config, max_queue)
        self.worker.handoff = HandOff(self.engine, prefill, settings, self.metrics.registry, model_name)


class PDIngress(Ingress):
    """The ingress with the prefill pool's handle too: its replicas' series appear in /metrics beside the decode
    pool's (the handle's router, made in this process by a first call, reports their stats)."""

    async def __init__(self, engine, prefill, model: str, settings, chat_template: str | None,
                       failure: str = "recompute"):
        await prefill.info.remote()
        ray_metrics.ALSO[ENGINE] = {PREFILL: "prefill"}
        await super().__init__(engine, model, settings, chat_template)
        self.pools = {ENGINE: True, PREFILL: failure == "error"}     # (app.ReplicaHealth)


def build_pd(model: str, config, settings, pd: PDSettings, *, prefill_replicas: int, decode_replicas: int,
             router: str = "prefix", max_queue: int = 256, chat_template: str | None = None,
             shutdown_timeout: float = 30.0, health_check_period_s: float = 2.0):
    """The application: the ingress over a decode deployment (named as app.build's engine deployment, so /metrics
    and the ingress read it the same) whose replicas call a prefill deployment."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from .app import INGRESS, MAX_CONSTRUCTOR_RETRIES, ROUTING_STATS_PERIOD_S
    from .router import LumenRouter
    max_num_seqs = config.max_num_seqs

    def deployment(cls, name: str, replicas: int):
        return serve.deployment(
            cls, name=name, num_replicas=replicas, ray_actor_options={"num_cpus": config.threads or 1},
            max_ongoing_requests=max_num_seqs + max_queue + 1,
            request_router_config=RequestRouterConfig(
                request_router_class=LumenRouter, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                request_router_kwargs={"policy": router, "imbalance": max_num_seqs // 2}),
            health_check_period_s=health_check_period_s, graceful_shutdown_timeout_s=shutdown_timeout,
            max_constructor_retry_count=MAX_CONSTRUCTOR_RETRIES)
    prefill = deployment(PrefillReplica, PREFILL, prefill_replicas).bind(model, settings.model_id, config, max_queue)
    decode = deployment(DecodeReplica, ENGINE, decode_replicas).bind(model, settings.model_id, config, max_queue,
                                                                     prefill, pd)
    ingress = serve.deployment(PDIngress, name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4096, graceful_shutdown_timeout_s=shutdown_timeout,
                               max_constructor_retry_count=MAX_CONSTRUCTOR_RETRIES)
    return ingress.bind(decode, prefill, model, settings, chat_template, pd.failure)
