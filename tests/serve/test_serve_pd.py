"""Disaggregated serving (lumen.serve.ray.pd): the decode replica's hand-off against a stand-in prefill pool
(threshold, pull, recompute or 503 on failure, release when cancelled, metrics), the command line's checks, and one
end-to-end run of `python -m lumen.serve --prefill-replicas 1 --decode-replicas 1` as a user starts it: greedy
output equal to one process for prompts through the prefill pool (one with min_tokens) and past it, the transfer metrics, and a SIGINT
that leaves no process the server started."""
import asyncio
import inspect
import os
import signal
import sys
import threading
import time

import httpx
import pytest

import lumen
from lumen import SamplingParams
from lumen.engine.engine import Engine
from lumen.engine.kv_transfer import DO_REMOTE_DECODE

pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

from lumen.engine.kv_transfer import PREFILL_PARAMS  # noqa: E402
from lumen.serve.ray.pd import HandOff, PDSettings, PrefillReplica  # noqa: E402
from lumen.serve.worker import EngineWorker, ShuttingDown  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from servers import ServerProcess  # noqa: E402
from test_serve import reference, strip_end  # noqa: E402

PROMPT_LONG = "The history of the Roman empire is long and complicated, and historians disagree. " * 8


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=1024, threads=1)


class Response:
    """As Ray Serve's DeploymentResponse: awaiting it waits for the call, and a wait that is cancelled (timed out)
    leaves the call running; cancel() stops it (Ray Serve cancels the replica's task for it)."""

    def __init__(self, result):
        if asyncio.iscoroutine(result):
            self.task = asyncio.ensure_future(result)
        else:
            self.task = asyncio.get_running_loop().create_future()
            self.task.set_result(result)
        self.cancelled = False

    def __await__(self):
        return asyncio.shield(self.task).__await__()

    def cancel(self):
        self.cancelled = True
        self.task.cancel()


class Stream:
    """As Ray Serve's DeploymentResponseGenerator (a streaming method's call): its items as they come; cancel()
    stops the method on its replica."""

    def __init__(self, gen):
        self.gen, self.cancelled = gen, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.gen.__anext__()

    def cancel(self):
        self.cancelled = True
        asyncio.ensure_future(self.gen.aclose())


class Call:
    """handle.method.remote(*args) as Ray's DeploymentHandle: a Response, or a Stream for a streaming method (the
    calls made are kept in `made`)."""

    def __init__(self, fn, made: list | None = None):
        self.fn, self.made = fn, made

    def remote(self, *args):
        result = self.fn(*args)
        r = Stream(result) if inspect.isasyncgen(result) else Response(result)
        if self.made is not None:
            self.made.append((args, r))
        return r


class StandIn:
    """A prefill pool of one in-process Engine, behind the calls the decode replica makes (fail: which dies)."""

    def __init__(self, engine, fail: str | None = None):
        self.engine, self.fail, self.released = engine, fail, []
        self.prefill, self.export_kv = Call(self._prefill), Call(self._export)
        self.release_kv = Call(lambda replica, rid: self.released.append(rid) or self.engine.kv.release(rid))

    def options(self, stream: bool = False):
        return self

    async def _prefill(self, prompts, params):
        if self.fail == "prefill":
            raise ConnectionError("the prefill replica died")
        rid = self.engine.add_request(prompts[0], PREFILL_PARAMS,
                                      kv_transfer_params={DO_REMOTE_DECODE: True})
        while True:
            for o in self.engine.step():
                if o.request_id == rid and o.finished:
                    yield {"replica": "p0", "kv_transfer_params": o.kv_transfer_params, "prefill_s": 0.0}
                    return

    async def _export(self, replica, rid, first, end):
        if self.fail == "export":
            raise ConnectionError("the prefill replica died")
        if self.fail == "hang":
            await asyncio.sleep(60)
        return self.engine.kv.export(rid, first, end)


def forget(engine):
    """The engine's prefix cache forgets everything (as if evicted)."""
    engine.blocks.by_name.clear()
    engine.blocks._name_of = [None] * engine.blocks.n_blocks


def metric(registry, name: str) -> dict:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(name):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_hand_off_pulls_long_prompts_and_handles_failures(model):
    mk = lambda: Engine(model, max_num_seqs=4, max_num_batched_tokens=128, kv_cache_mb=16)  # noqa: E731
    long_ids, short_ids = model.tokenize(PROMPT_LONG), model.tokenize("Hello there")
    sp = SamplingParams(max_tokens=8, temperature=0)
    want = mk().generate([long_ids, short_ids], sp)
    pre, dec = mk(), mk()
    free_pre, free_dec = pre.blocks.num_free, dec.blocks.num_free

    def run(handoff, prompts):
        extras = asyncio.run(handoff.extras(prompts, [sp] * len(prompts)))
        rids = [dec.add_request(p, sp, **x) for p, x in zip(prompts, extras)]
        outs = {}
        while dec.has_unfinished():
            outs.update({o.request_id: o for o in dec.step()})
        return extras, [outs[r].token_ids for r in rids]

    reg = CollectorRegistry()
    h = HandOff(dec, StandIn(pre), PDSettings(threshold=64), reg, "m")
    extras, got = run(h, [long_ids, short_ids, long_ids])          # n=2 of the long one share one pull
    assert got == [want[0].token_ids, want[1].token_ids, want[0].token_ids]
    assert pre.kv.stats.exported == 1
    assert "kv_data" in extras[0] and extras[1] == {} and extras[2]["kv_data"] is extras[0]["kv_data"]
    m = metric(reg, "lumen:kv_transfer")
    assert m['lumen:kv_transfers_total{model_name="m",result="pulled"}'] == 1
    assert m['lumen:kv_transfers_total{model_name="m",result="local"}'] == 1
    assert m['lumen:kv_transfer_bytes_total{model_name="m"}'] == extras[0]["kv_data"].nbytes > 0
    # now cached on the decode side: no pull
    extras, got = run(h, [long_ids])
    assert extras == [{}] and got == [want[0].token_ids]
    # a prefill replica that dies: recomputed here (same tokens), or 503 with "error"; a pull that hangs times out
    for fail in ("prefill", "export", "hang"):
        forget(dec)
        h = HandOff(dec, StandIn(pre, fail), PDSettings(threshold=64, pull_timeout_s=0.2), CollectorRegistry(), "m")
        extras, got = run(h, [long_ids])
        assert extras == [{}] and got == [want[0].token_ids]
        h = HandOff(dec, StandIn(pre, fail), PDSettings(threshold=64, failure="error", pull_timeout_s=0.2),
                    CollectorRegistry(), "m")
        forget(dec)
        with pytest.raises(ShuttingDown, match="prefill replica"):
            asyncio.run(h.extras([long_ids], [sp]))
        pre.kv.expire(time.perf_counter() + 1e6)                   # holds the failed pulls left: their timeout
    # the client leaves while the KV is pulled: the hold is released on the prefill side at once
    forget(dec)
    stand_in = StandIn(pre, "hang")
    h = HandOff(dec, stand_in, PDSettings(threshold=64), CollectorRegistry(), "m")

    async def cancelled():
        t = asyncio.ensure_future(h.extras([long_ids], [sp]))
        await asyncio.sleep(0.3)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
    asyncio.run(cancelled())
    assert len(stand_in.released) == 1 and pre.kv.num_holds == 0
    for e, free in ((pre, free_pre), (dec, free_dec)):
        e.blocks.check()
        assert e.blocks.num_free == free and e.blocks.num_pinned == 0


def test_hand_off_skips_requests_the_decode_engine_refuses(model):
    """A request the decode engine refuses anyway (prompt + max_tokens past max_model_len) is not prefilled on the
    prefill pool nor its KV pulled first: submit answers its 400 at once, as one process does."""
    mk = lambda: Engine(model, max_num_seqs=4, max_num_batched_tokens=128, kv_cache_mb=16)  # noqa: E731
    ids = model.tokenize(PROMPT_LONG)
    pre, dec = mk(), mk()
    stand_in = StandIn(pre)
    stand_in.prefill.made = []
    reg = CollectorRegistry()
    h = HandOff(dec, stand_in, PDSettings(threshold=64), reg, "m")
    sp = SamplingParams(max_tokens=dec.max_model_len, temperature=0)
    assert asyncio.run(h.extras([ids], [sp])) == [{}]
    assert stand_in.prefill.made == [] and pre.kv.stats.held == 0
    assert metric(reg, "lumen:kv_transfers_total") == {}
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        dec.add_request(ids, sp)


def test_hand_off_leaves_prompt_logprobs_to_the_decode_engine(model):
    """prompt_logprobs (a completion's echo with logprobs) need the prompt computed by the engine that answers:
    such a request is prefilled on the decode replica, not pulled and then refused (400) as it was."""
    mk = lambda: Engine(model, max_num_seqs=4, max_num_batched_tokens=128, kv_cache_mb=16)  # noqa: E731
    ids = model.tokenize(PROMPT_LONG)
    sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    want = mk().generate([ids], sp)[0]
    pre, dec = mk(), mk()
    reg = CollectorRegistry()
    h = HandOff(dec, StandIn(pre), PDSettings(threshold=64), reg, "m")
    extras = asyncio.run(h.extras([ids], [sp]))
    assert extras == [{}] and pre.kv.stats.held == 0
    assert metric(reg, "lumen:kv_transfers_total") == {'lumen:kv_transfers_total{model_name="m",result="local"}': 1.0}
    rid = dec.add_request(ids, sp, **extras[0])
    outs = {}
    while dec.has_unfinished():
        outs.update({o.request_id: o for o in dec.step()})
    assert outs[rid].token_ids == want.token_ids and len(outs[rid].prompt_logprobs) == len(want.prompt_logprobs)


def prefill_replica(engine, name: str) -> PrefillReplica:
    """A PrefillReplica over `engine` without Ray: its worker's engine thread started on the running loop."""
    r = PrefillReplica.__new__(PrefillReplica)
    r.replica, r.engine = name, engine
    r.worker = EngineWorker(engine, max_queue=16)
    r.worker.start()
    return r


class Pool:
    """The prefill deployment's handle over such replicas: prefill to route(prompt ids), export_kv and release_kv
    to the replica they name (as lumen.serve.ray.router's DIRECT); the calls made in `made`."""

    def __init__(self, replicas, route):
        self.made: list = []
        by_name = {r.replica: r for r in replicas}
        self.prefill = Call(lambda prompts, params: route(prompts[0]).prefill(prompts, params), self.made)
        self.export_kv = Call(lambda replica, *args: by_name[replica].export_kv(replica, *args), self.made)
        self.release_kv = Call(lambda replica, rid: by_name[replica].release_kv(replica, rid), self.made)

    def options(self, stream: bool = False):
        return self


def stall(engine) -> tuple[threading.Event, list[int]]:
    """From now on the engine's thread hangs after each step (a stuck replica) until the event is set; the list
    gets the engine's free blocks at each hang."""
    gate, free = threading.Event(), []
    step = engine.step

    def stuck():
        out = step()
        free.append(engine.blocks.num_free)
        gate.wait()
        return out
    engine.step = stuck
    return gate, free


@pytest.mark.parametrize("failure", ["recompute", "error"])
def test_hand_off_gives_up_on_a_prefill_replica_that_hangs(model, failure):
    """A prefill replica stuck mid-prefill: past --pd-prefill-timeout the decode replica cancels the call (the
    replica aborts the request and frees its blocks) and recomputes the prompt or answers 503, while a request
    served by a healthy prefill replica at the same time is pulled as usual; a client that leaves while waiting
    cancels the call too; no block is left taken anywhere."""
    mk = lambda: Engine(model, max_num_seqs=4, max_num_batched_tokens=128, kv_cache_mb=16)  # noqa: E731
    hung_ids = model.tokenize(PROMPT_LONG)                         # > 128 tokens: two prefill chunks
    ok_ids = model.tokenize("Rivers run to the sea, and the sea is never full. " * 8)
    sp = SamplingParams(max_tokens=8, temperature=0)
    want = [o.token_ids for o in mk().generate([hung_ids, ok_ids], sp)]
    hung, ok, dec = mk(), mk(), mk()
    free = {e: e.blocks.num_free for e in (hung, ok, dec)}
    gate, hung_free = stall(hung)
    timeout = 3.0
    reg = CollectorRegistry()

    async def serve():
        replicas = [prefill_replica(hung, "hung"), prefill_replica(ok, "ok")]
        pool = Pool(replicas, lambda ids: replicas[0] if ids == hung_ids else replicas[1])
        h = HandOff(dec, pool, PDSettings(threshold=64, failure=failure, prefill_timeout_s=timeout), reg, "m")
        t0 = time.perf_counter()

        async def one(ids):
            try:
                return await h.extras([ids], [sp]), time.perf_counter() - t0
            except ShuttingDown as e:
                return e, time.perf_counter() - t0
        try:
            got = await asyncio.gather(one(hung_ids), one(ok_ids))
            left = asyncio.ensure_future(h.extras([hung_ids], [sp]))   # and a client that leaves meanwhile
            await asyncio.sleep(0.5)
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await left
            await asyncio.sleep(0.05)                              # the cancelled calls' aborts run
            return got, pool.made
        finally:
            gate.set()
            for r in replicas:
                r.worker.stop()

    # a test-level timeout: a hand-off that waits forever fails here instead of hanging the suite
    [(hung_x, hung_s), (ok_x, ok_s)], made = asyncio.run(asyncio.wait_for(serve(), 30))
    assert hung_free and hung_free[0] < free[hung]                  # the stuck replica held blocks mid-prefill
    assert timeout <= hung_s < timeout + 5 and ok_s < timeout      # the other request did not wait for it
    prefills = [r for args, r in made if len(args) == 2 and args[0] == [hung_ids]]
    assert len(prefills) == 2 and all(r.cancelled for r in prefills)   # the calls given up on: cancelled there
    assert "kv_data" in ok_x[0]
    m = metric(reg, "lumen:kv_transfers_total")
    assert m['lumen:kv_transfers_total{model_name="m",result="pulled"}'] == 1
    if failure == "error":
        assert isinstance(hung_x, ShuttingDown) and "prefill replica" in str(hung_x)
        assert m['lumen:kv_transfers_total{model_name="m",result="error"}'] == 1
        prompts, extras = [ok_ids], ok_x
    else:
        assert hung_x == [{}]                                      # run here instead
        assert m['lumen:kv_transfers_total{model_name="m",result="recomputed"}'] == 1
        prompts, extras = [hung_ids, ok_ids], hung_x + ok_x
    rids = [dec.add_request(p, sp, **x) for p, x in zip(prompts, extras)]
    outs = {}
    while dec.has_unfinished():
        outs.update({o.request_id: o for o in dec.step()})
    assert [outs[r].token_ids for r in rids] == want[-len(prompts):]
    for e in (hung, ok, dec):
        e.blocks.check()
        assert e.blocks.num_free == free[e] and e.blocks.num_pinned == 0 and e.kv.num_holds == 0


def test_hand_off_waits_for_a_busy_prefill_replica(model, monkeypatch):
    """A prefill replica that takes longer than --pd-prefill-timeout but keeps stepping (a queue of long prompts
    ahead, a slow machine) is not given up on: its heartbeats keep the call alive and the KV is pulled, instead of
    the work being cancelled there and redone on the decode replica."""
    from lumen.serve.ray import pd
    monkeypatch.setattr(pd, "HEARTBEAT_S", 0.1)
    mk = lambda: Engine(model, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_mb=16)  # noqa: E731
    ids = model.tokenize(PROMPT_LONG)                              # > 128 tokens: 5 chunks of 32
    sp = SamplingParams(max_tokens=4, temperature=0)
    want = mk().generate([ids], sp)[0].token_ids
    slow, dec = mk(), mk()
    step = slow.step
    slow.step = lambda: time.sleep(0.3) or step()                  # >= 1.5 s in all, 0.3 s a step
    reg = CollectorRegistry()

    async def serve():
        r = prefill_replica(slow, "slow")
        pool = Pool([r], lambda ids: r)
        h = HandOff(dec, pool, PDSettings(threshold=64, prefill_timeout_s=0.8), reg, "m")
        try:
            t0 = time.perf_counter()
            return await h.extras([ids], [sp]), time.perf_counter() - t0, pool.made
        finally:
            r.worker.stop()

    extras, took, made = asyncio.run(asyncio.wait_for(serve(), 30))
    assert took > 0.8                                              # longer than the timeout, and yet:
    assert "kv_data" in extras[0] and not any(r.cancelled for _, r in made)
    m = metric(reg, "lumen:kv_transfers_total")
    assert m == {'lumen:kv_transfers_total{model_name="m",result="pulled"}': 1.0}
    rid = dec.add_request(ids, sp, **extras[0])
    outs = {}
    while dec.has_unfinished():
        outs.update({o.request_id: o for o in dec.step()})
    assert outs[rid].token_ids == want
    for e in (slow, dec):
        e.blocks.check()
        assert e.blocks.num_pinned == 0 and e.kv.num_holds == 0


@pytest.mark.parametrize("flags, message", [
    (["--prefill-replicas", "1"], "go together"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--replicas", "2"], "leave out --replicas"),
    (["--prefill-replicas", "0", "--decode-replicas", "1"], "at least 1"),
    (["--kv-failure", "error"], "need --prefill-replicas"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--pd-threshold", "-1"], "not be negative"),
    (["--pd-prefill-timeout", "5"], "need --prefill-replicas"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--pd-prefill-timeout", "0"], "positive number"),
])
def test_bad_pd_flags_are_one_line_errors(flags, message, capsys):
    from lumen.serve.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--model", "smollm2-135m", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and message in err[-1] and "Traceback" not in "".join(err)


def descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def alive(pids) -> set[int]:
    out = set()
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.add(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
def test_prefill_and_decode_replicas_serve_one_process_output(smollm2_path, model, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "local")          # a Ray instance of its own, never a cluster found here
    proc = ServerProcess([sys.executable, "-m", "lumen.serve", "--model", str(smollm2_path), "--prefill-replicas",
                          "1", "--decode-replicas", "1", "--threads", "1", "--max-model-len", "1024",
                          "--kv-cache-mb", "32", "--pd-threshold", "16", "--shutdown-timeout", "5"],
                         tmp_path / "server.log", health_timeout=240)
    started = set()
    try:
        prompts = [(PROMPT_LONG, {}), ("Once upon a time", {}),
                   (PROMPT_LONG[:200] + "Ships sailed the sea for years. " * 4, {}),   # partly cached on decode
                   ("Rivers run to the sea, and the sea is never full. " * 6, {"min_tokens": 11})]   # (not prefill's)
        with httpx.Client(base_url=proc.url, timeout=120) as http:
            for prompt, kw in prompts:
                ids = model.tokenize(prompt)
                want = model.detokenize(strip_end(model, reference(model, ids, max_tokens=12, temperature=0, **kw)))
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0, **kw})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want
            started = descendants(proc.p.pid)
            deadline = time.monotonic() + 15                # the replicas' metrics are at most ~1 s old
            while True:
                m, pools = {}, {}
                for line in http.get("/metrics").text.splitlines():
                    if not line.startswith("lumen:"):
                        continue
                    key, value = line.rsplit(" ", 1)
                    name = key.split("{")[0]
                    if 'result="' in key:
                        name += "|" + key.split('result="')[1].split('"')[0]
                    if name in ("lumen:kv_cache_free_blocks", "lumen:kv_cache_total_blocks", "lumen:kv_held_blocks"):
                        pools.setdefault(key.split('replica="')[1].split('"')[0], {})[name] = float(value)
                    m[name] = m.get(name, 0.0) + float(value)
                settled = all(p["lumen:kv_held_blocks"] == 0 and p["lumen:kv_cache_free_blocks"] ==
                              p["lumen:kv_cache_total_blocks"] for p in pools.values())   # reports lag up to ~1 s
                if (m.get("lumen:kv_transfers_total|pulled") == 3 and len(pools) == 2 and settled) \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        assert m.get("lumen:kv_transfers_total|pulled") == 3 and m.get("lumen:kv_transfers_total|local") == 1, m
        assert m["lumen:kv_transfer_bytes_total"] > 0 and m["lumen:kv_handoff_seconds_count"] == 3
        assert len(pools) == 2, pools                       # the prefill replica's series are there too
        for p in pools.values():                            # and no block is held or leaked on either
            assert p["lumen:kv_held_blocks"] == 0 and p["lumen:kv_cache_free_blocks"] == p["lumen:kv_cache_total_blocks"]
    finally:
        started |= descendants(proc.p.pid)
        code = proc.stop(signal.SIGINT, timeout=90)
    t0 = time.monotonic()
    while alive(started) and time.monotonic() - t0 < 30:
        time.sleep(0.5)
    left = alive(started)
    for p in left:                                      # ours: do not leave them to the next test
        os.kill(p, signal.SIGKILL)
    assert code == 0 and not left, f"exit {code}; left: {[psutil.Process(p).name() for p in left]}"


def test_decode_replica_times_its_requests_from_before_the_hand_off(model):
    """A decode replica's request arrives when its submission did, before the prefill pool ran its prompt: its TTFT
    (and /metrics' and the dashboard's) counts the hand-off, as the client's does. It used to start at the decode
    engine's add_request: 30 ms where the client waited 0.9 s (smollm2-135m, P1 D1, one thread each)."""
    from lumen.serve.ray.pd import HandOffWorker
    mk = lambda: Engine(model, max_num_seqs=4, max_num_batched_tokens=128, kv_cache_mb=16)  # noqa: E731
    pre, dec = mk(), mk()
    long_ids, short_ids = model.tokenize(PROMPT_LONG), model.tokenize("Hello there")
    sp = SamplingParams(max_tokens=2, temperature=0)

    class Slow(StandIn):                                # a prefill pool that takes 0.3 s to begin
        async def _prefill(self, prompts, params):
            await asyncio.sleep(0.3)
            async for item in super()._prefill(prompts, params):
                yield item
    worker = HandOffWorker(dec, max_queue=8)
    worker.handoff = HandOff(dec, Slow(pre), PDSettings(threshold=64), CollectorRegistry(), "m")
    t0 = time.perf_counter()
    sub = asyncio.run(worker.submit([long_ids, short_ids], [sp, sp]))
    assert time.perf_counter() - t0 >= 0.3
    seqs = [dec._seqs[rid] for rid in sub.request_ids]
    assert seqs[0].kv_data is not None                  # pulled: the long prompt went through the prefill pool
    assert all(t0 <= s.metrics.arrival <= t0 + 0.05 for s in seqs), [s.metrics.arrival - t0 for s in seqs]
    while dec.has_unfinished():
        dec.step()
    assert all(s.metrics.ttft_s >= 0.3 for s in seqs), [s.metrics.ttft_s for s in seqs]
