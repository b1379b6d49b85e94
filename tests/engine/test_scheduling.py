"""Measured-cost scheduling: the step cost model (fit, calibration and its cache, drift), the budget decisions
for SLO targets, and the engine running on them with the same outputs as the fixed budget (batch invariance)."""
import logging
import math

import numpy as np
import pytest

import lumen
from lumen import Engine, SamplingParams
from lumen.engine.costs.budget import MeasuredBudget
from lumen.engine.costs.steps import CostModel, Fit, cache_path, calibrate, fit


def test_fit_recovers_a_known_cost_surface():
    truth = Fit(knee=48, floor=0.006, per_token=40e-6, per_seq=50e-6, per_key=2e-9)
    rng = np.random.default_rng(0)
    samples = []
    for T, S, K in [(1, 1, 100), (4, 4, 800), (16, 16, 4000), (32, 1, 528), (128, 1, 8256), (512, 1, 131328),
                    (64, 8, 3000), (256, 4, 40000), (1024, 1, 524800), (8, 8, 16000)]:
        samples.append((T, S, K, truth.predict(T, S, K) * (1 + 0.01 * rng.standard_normal())))
    got = fit(samples)
    assert got.knee == 48
    assert math.isclose(got.floor, truth.floor, rel_tol=0.1)
    assert math.isclose(got.per_token, truth.per_token, rel_tol=0.1)
    assert got.rel_err_median < 0.02
    assert all(v >= 0 for v in (got.floor, got.per_token, got.per_seq, got.per_key))


def test_drift_scales_predictions_and_refit_follows():
    cm = CostModel(Fit(knee=8, floor=0.01, per_token=1e-3, per_seq=0, per_key=0), [(1, 1, 1, 0.01), (64, 1, 1, 0.066)])
    for _ in range(100):                          # the machine got twice as slow
        cm.observe(1, 1, 1, 0.02)
    assert 1.8 < cm.drift < 2.05 and cm.drifting
    assert math.isclose(cm.predict(1, 1, 1), 0.02, rel_tol=0.1)
    cm.REFIT = 110
    for _ in range(10):
        cm.observe(64, 1, 1, 0.132)
    assert cm.drift == 1.0 and cm.fit.predict(1, 1, 1) > 0.012   # refitted on the recent steps


class FakeSeq:
    def __init__(self, n_tokens, computed, n_out, first_token, arrival):
        self.tokens = [1] * n_tokens
        self.num_computed = computed
        self.output_ids = [1] * n_out
        self.metrics = type("M", (), {"first_token": first_token, "arrival": arrival})()

    @property
    def num_tokens(self):
        return len(self.tokens)


class FakeScheduler:
    def __init__(self, running, waiting, max_num_seqs=16):
        self.running, self.waiting, self.max_num_seqs = running, waiting, max_num_seqs


LINEAR = CostModel(Fit(knee=16, floor=0.010, per_token=0.001, per_seq=0.0, per_key=0.0))   # 10 ms + 1 ms/token


def test_budget_without_targets_takes_the_most_tokens():
    b = MeasuredBudget(LINEAR, max_tokens=512)
    sch = FakeScheduler([FakeSeq(101, 100, 5, 0.0, 0.0)], [FakeSeq(300, 0, 0, None, 0.0)])
    d = b.decide(sch, now=1.0)
    assert d.budget == 1 + 300 and d.limit_s is None


def test_budget_keeps_the_decodes_tpot():
    """Decodes at their TPOT budget limit the chunk that rides along: 10 ms + 1 ms/token past 16 tokens under a
    50 ms limit leaves room for about 56 tokens; with no decodes the prefill takes all it can."""
    b = MeasuredBudget(LINEAR, max_tokens=512, slo_ttft_s=10.0, slo_tpot_s=0.05)
    dec = [FakeSeq(101, 100, 10, first_token=0.45, arrival=0.0) for _ in range(4)]   # 10 tokens in 0.55 s: 0.05 left
    sch = FakeScheduler(dec, [FakeSeq(400, 0, 0, None, arrival=0.9)])
    d = b.decide(sch, now=1.0)
    assert math.isclose(d.limit_s, 0.05, rel_tol=1e-6)
    assert d.predicted_s <= d.limit_s and 4 + 32 <= d.budget <= 4 + 56
    assert "limit" in d.rejected
    alone = b.decide(FakeScheduler([], [FakeSeq(400, 0, 0, None, arrival=0.9)]), now=1.0)
    assert alone.budget == 400


def test_budget_with_one_target_alone():
    """Either SLO may be given alone: a TPOT target alone keeps the decodes' pace (no TTFT deadline is looked
    for), a TTFT target alone lets the prefill take what it needs."""
    dec = [FakeSeq(101, 100, 10, first_token=0.45, arrival=0.0) for _ in range(4)]
    sch = FakeScheduler(dec, [FakeSeq(400, 0, 0, None, arrival=0.9)])
    d = MeasuredBudget(LINEAR, max_tokens=512, slo_tpot_s=0.05).decide(sch, now=1.0)
    assert d.predicted_s <= d.limit_s and 4 + 32 <= d.budget <= 4 + 56
    d = MeasuredBudget(LINEAR, max_tokens=512, slo_ttft_s=2.0).decide(sch, now=1.0)
    assert d.limit_s is None and d.budget == 4 + 400


def test_budget_grows_the_chunk_for_a_ttft_deadline():
    """The oldest waiting request would miss its 2 s TTFT at the pace the decodes allow (a 50 ms step floor, so
    small chunks take many steps): the chunk grows to what its deadline needs."""
    steep = CostModel(Fit(knee=16, floor=0.050, per_token=0.001, per_seq=0.0, per_key=0.0))
    b = MeasuredBudget(steep, max_tokens=1024, slo_ttft_s=2.0, slo_tpot_s=0.06)
    dec = [FakeSeq(51, 50, 20, first_token=0.0, arrival=0.0)]                  # 20 tokens in 1 s: 0.2 s left
    waiting = FakeSeq(900, 0, 0, None, arrival=0.0)                              # 1 s left, 900 tokens to go
    d = b.decide(FakeScheduler(dec, [waiting]), now=1.0)
    assert d.budget - 1 == 900 and "TTFT" in d.rejected
    late = b.decide(FakeScheduler(dec, [FakeSeq(900, 0, 0, None, arrival=-0.5)]), now=1.0)   # cannot make it
    assert late.budget - 1 < 900


def _costs(ms_per_token: float, floor_ms: float, upto: int = 2048):
    """StepCosts measured on a linear machine: floor + ms_per_token per token."""
    from lumen.engine.costs.steps import StepCosts
    c = StepCosts()
    n = 1
    while n <= upto:
        c.add(n, (floor_ms + ms_per_token * n) / 1e3)
        n = n + 1 if n < 32 else n * 2
    return c


def test_paced_budget_keeps_decode_steps_near_a_decode_steps_time():
    """With decodes running, a prompt chunk rides along only as far as the step stays within pace x a decode
    step's time (here 100 ms + 5 ms/token: 16 decodes alone 180 ms, so at pace 1.5 at most 270 ms: 16 more
    tokens); alone, the prompt takes the whole budget; with no step measured yet, MIN_CHUNK."""
    from lumen.engine.costs.budget import PacedBudget
    from lumen.engine.costs.steps import StepCosts
    dec = [FakeSeq(101, 100, 10, first_token=0.45, arrival=0.0) for _ in range(16)]
    long_prompt = FakeSeq(2000, 0, 0, None, arrival=0.9)
    b = PacedBudget(_costs(5.0, 100.0), max_tokens=512, pace=1.5)
    d = b.decide(FakeScheduler(dec, [long_prompt]), now=1.0)
    assert d.budget == 16 + 16 and d.predicted_s <= d.limit_s + 1e-9 and math.isclose(d.limit_s, 0.27)
    wide = PacedBudget(_costs(5.0, 100.0), max_tokens=512, pace=4.0).decide(FakeScheduler(dec, [long_prompt]), 1.0)
    assert wide.budget == 16 + 48 and wide.predicted_s <= wide.limit_s     # 720 ms; step times by 64-token bucket
    alone = b.decide(FakeScheduler([], [long_prompt]), now=1.0)
    assert alone.budget == 512
    new = PacedBudget(StepCosts(), max_tokens=512).decide(FakeScheduler(dec, [long_prompt]), now=1.0)
    assert new.budget == 16 + PacedBudget.MIN_CHUNK
    done = b.decide(FakeScheduler(dec, []), now=1.0)
    assert done.budget == 512 and "no prefill" in done.rejected


def test_one_slow_step_does_not_widen_the_paced_limit():
    """A step that ran slow once (a pause, a neighbour) moves its bucket by at most 20%, and a bucket that reads
    high (its first step was slow) cannot make a few decodes look expensive: a step costs no more than a larger
    one. So 4 decodes keep a limit near their real 12 ms step and get a small chunk, not the whole budget."""
    from lumen.engine.costs.budget import PacedBudget
    c = _costs(0.5, 10.0)                                   # 10 ms + 0.5 ms/token: 16 decodes 18 ms, 512 266 ms
    c.add(16, 0.5)                                          # one 500 ms hiccup
    assert c.predict(16) <= 0.018 * 1.2 + 1e-9
    c.ema[4] = 0.125                                        # a bucket whose steps all ran slow
    assert c.predict(4) == 0.125 and c.at_most(4) == c.predict(5) and c.at_most(4) < 0.013
    assert c.at_most(4096) == c.predict(4096)              # nothing larger measured: the prediction
    dec = [FakeSeq(101, 100, 10, first_token=0.45, arrival=0.0) for _ in range(4)]
    d = PacedBudget(c, max_tokens=512, pace=1.5).decide(FakeScheduler(dec, [FakeSeq(2000, 0, 0, None, 0.9)]), 1.0)
    assert d.limit_s < 0.04 and d.budget - 4 <= 16, d                   # pace 1.5 or 20 ms more: 32.5 ms


def test_a_bucket_that_read_slow_once_does_not_keep_its_chunks_out():
    """33..64-token steps measured once at 60 ms (a first call) while 22 tokens take 12 ms and 512 take 106 ms:
    a step rises no faster than linearly, so the 40-token chunk is priced on that line (~20 ms), under the 26 ms
    limit, instead of never being tried again."""
    from lumen.engine.costs.budget import PacedBudget
    from lumen.engine.costs.steps import StepCosts
    c = StepCosts()
    for n, ms in ((1, 5.0), (4, 5.6), (22, 12.0), (64, 60.0), (512, 106.0)):
        c.add(n, ms / 1e3)
    assert c.predict(40) == 0.060 and math.isclose(c.at_least(40), 0.012 + (0.106 - 0.012) * 42 / 490)
    assert c.at_least(512) == c.predict(512) and c.at_least(1) == c.predict(1)   # no neighbour on one side
    dec = [FakeSeq(101, 100, 10, first_token=0.45, arrival=0.0) for _ in range(4)]
    d = PacedBudget(c, max_tokens=512, pace=1.5).decide(FakeScheduler(dec, [FakeSeq(150, 0, 0, None, 0.9)]), 1.0)
    assert d.budget == 4 + 48 and d.predicted_s <= d.limit_s, d


def test_paced_limit_follows_the_concurrency_about_to_run():
    """At a wave's start 2 streams decode and 10 prompts wait: the limit is pace x a step of the 12 decodes about to
    run (100 ms + 1 ms/token: 112 ms, limit 168 ms), not of the 2 running, so chunks of 48 tokens admit the
    queue instead of 16-token ones keeping the batch small."""
    from lumen.engine.costs.budget import PacedBudget
    dec = [FakeSeq(101, 100, 10, first_token=0.45, arrival=0.0) for _ in range(2)]
    waiting = [FakeSeq(150, 0, 0, None, arrival=0.9) for _ in range(10)]
    b = PacedBudget(_costs(1.0, 100.0), max_tokens=512, pace=1.5)
    d = b.decide(FakeScheduler(dec, waiting), now=1.0)
    assert math.isclose(d.limit_s, 1.5 * 0.112) and d.budget == 2 + 48, d
    lone = b.decide(FakeScheduler(dec, waiting[:1]), now=1.0)         # 3 about to run: limit 154.5 ms
    assert math.isclose(lone.limit_s, 1.5 * 0.103) and lone.budget == 2 + 16


def test_admission_stops_where_the_decodes_would_miss_their_tpot():
    """10 ms a step plus 10 ms a sequence against a 45 ms TPOT target: 3 sequences decode within it (40 ms), 4 do
    not (50 ms), so no fourth request is admitted while 3 run; the scheduler honours the cap."""
    per_seq = CostModel(Fit(knee=64, floor=0.010, per_token=0.0, per_seq=0.010, per_key=0.0))
    b = MeasuredBudget(per_seq, max_tokens=512, slo_ttft_s=2.0, slo_tpot_s=0.045)
    dec = [FakeSeq(51, 50, 1, first_token=0.99, arrival=0.0) for _ in range(3)]
    d = b.decide(FakeScheduler(dec, [FakeSeq(40, 0, 0, None, arrival=0.5)]), now=1.0)
    assert d.max_running == 3 and "at most 3 running" in d.line(1)
    assert MeasuredBudget(per_seq, max_tokens=512).decide(FakeScheduler(dec, []), now=1.0).max_running is None


def test_scheduler_admits_up_to_max_running(model):
    eng = Engine(model, max_model_len=64, max_num_seqs=8, kv_cache_mb=8)
    for i in range(5):
        eng.add_request([10 + i, 11, 12], SamplingParams(max_tokens=4, temperature=0))
    plan = eng.scheduler.schedule(max_running=2)
    assert len(plan) == 2 and len(eng.scheduler.running) == 2 and eng.num_waiting == 3


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=64, threads=2)


def test_calibration_is_cached_per_model_machine_and_code(model, tmp_path, monkeypatch):
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    eng = Engine(model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_mb=8)
    first = calibrate(eng.runner, eng.cost_key, repeats=1)
    assert first.source == "measured" and cache_path(eng.cost_key).is_file() and len(first.samples) >= 10
    again = calibrate(eng.runner, eng.cost_key)
    assert again.source.startswith("cache") and again.samples == first.samples
    other = Engine(model, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, kv_cache_mb=8)
    assert cache_path(other.cost_key) != cache_path(eng.cost_key)    # another engine shape: another table


def test_calibration_is_not_shared_by_cpus_of_one_name(tmp_path, monkeypatch):
    """Two "AMD EPYC" guests with 2 CPUs that differ only in family and model (Zen 4: 25, Zen 5: 26) get two cost
    tables; the same CPU gets the same one."""
    import lumen.machine as machine
    from lumen.cpu import read_cpuinfo
    from lumen.engine.costs.steps import CostKey
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    key = CostKey(gguf, threads=2, max_tokens=64, max_seqs=4, max_model_len=256)
    paths = []
    for family, model in ((25, 17), (26, 2), (25, 17)):
        info = read_cpuinfo(f"vendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                            f"model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: avx2 fma avx512f\n")
        monkeypatch.setattr(machine, "read_cpuinfo", lambda info=info: info)
        paths.append(cache_path(key))
    assert paths[0] != paths[1] and paths[0] == paths[2]


@pytest.mark.slow
def test_measured_scheduler_gives_the_same_outputs(model, caplog):
    """Budgets change how steps are cut, never what a request produces; every decision is logged with explain."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 40000, n).tolist() for n in (5, 70, 200, 33, 150)]
    p = SamplingParams(max_tokens=12, temperature=0)
    fixed = Engine(model, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=96, kv_cache_mb=32,
                   scheduler="fcfs")
    measured = Engine(model, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, kv_cache_mb=32,
                      scheduler="measured", slo_ttft_s=1.0, slo_tpot_s=0.05, cost_grid="tiny", explain=True)
    with caplog.at_level(logging.INFO, logger="lumen.engine"):
        got = measured.generate(prompts, p)
    assert [o.token_ids for o in got] == [o.token_ids for o in fixed.generate(prompts, p)]
    lines = [r.getMessage() for r in caplog.records if r.name == "lumen.engine"]
    assert len(lines) == measured.steps and all("predicted" in ln and "measured" in ln for ln in lines)
    assert all(d.measured_s is not None for d in measured.decisions)


def test_paced_default_spreads_a_long_prompt_over_the_streams_steps(model):
    """The stall, on purpose: a long prompt arrives while streams decode. With the paced default it is cut into
    many chunks, each step with the streams holding a small one; with a fixed budget it goes in one step. The
    tokens are the same either way (batch invariance)."""
    rng = np.random.default_rng(2)
    streams = [rng.integers(4, 40000, 8).tolist() for _ in range(4)]
    long_prompt = rng.integers(4, 40000, 400).tolist()
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    got = {}
    for sched in ("paced", "fcfs"):
        eng = Engine(model, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512, kv_cache_mb=32,
                     scheduler=sched)
        ids = [eng.add_request(s, p) for s in streams]
        for _ in range(12):                            # the streams decode, and the engine learns its step times
            eng.step()
        late = eng.add_request(long_prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        chunks, outs = [], {}
        while eng.has_unfinished():
            seq = eng._seqs.get(late)
            before = seq.num_computed if seq is not None else None
            for out in eng.step():
                if out.finished:
                    outs[out.request_id] = out.token_ids
            if seq is not None and before is not None and seq.num_computed > before and before < len(long_prompt):
                chunks.append(seq.num_computed - before)
        got[sched] = ([outs[i] for i in ids], outs[late], chunks)
    assert got["paced"][:2] == got["fcfs"][:2]
    assert len(got["fcfs"][2]) == 1                                  # one 400-token step beside the streams
    # spread over the streams' steps; how many depends on the step times measured (a busy neighbour's share of
    # the cores makes the decode steps, and so each chunk's allowance, longer: 2 chunks seen under a full suite)
    assert len(got["paced"][2]) >= 2 and max(got["paced"][2]) < 400


def test_bad_scheduler_settings(model):
    with pytest.raises(ValueError, match="scheduler"):
        Engine(model, max_model_len=64, kv_cache_mb=4, scheduler="magic")
    with pytest.raises(ValueError, match="need scheduler='measured'"):
        Engine(model, max_model_len=64, kv_cache_mb=4, scheduler="fcfs", slo_tpot_s=0.05)
    from lumen.engine.config import EngineConfig
    assert EngineConfig().scheduler == "paced"                        # the default: streams paced
    assert EngineConfig(slo_tpot_s=0.05).scheduler == "measured"      # an SLO alone picks the scheduler for it
    with pytest.raises(ValueError, match="pace"):
        EngineConfig(pace=0.5)
    with pytest.raises(ValueError, match="slo_ttft_s"):
        Engine(model, max_model_len=64, kv_cache_mb=4, scheduler="measured", slo_ttft_s=-1, cost_grid="tiny")


# ---------------------------------------------------------------- the block manager's API, the engine's config

def test_block_manager_api_admits_grows_names_and_frees():
    """A request is admitted with its cached prefix, grows, has its full blocks named once computed, and frees
    them; a second request with the same prefix shares those blocks; a request that does not fit changes
    nothing. The scheduler sees only these calls (no reference counts, no names)."""
    from lumen.engine.block_manager import BlockManager
    from lumen.kernels.attention import BLOCK
    bm = BlockManager(6, np.zeros((3, 6), np.int64))
    toks = list(range(2 * BLOCK + 3))
    miss = bm.cached_prefix(toks, len(toks) - 1)
    assert miss.n_tokens == 0 and miss.blocks == []
    assert bm.admit("a", miss, BLOCK, n_query=len(toks))           # a first chunk of one block
    assert bm.grow("a", len(toks)) and len(bm.held("a")) == 3
    bm.computed("a", toks, len(toks))                               # two full blocks named
    hit = bm.cached_prefix(toks, len(toks) - 1)
    assert hit.n_tokens == 2 * BLOCK and hit.blocks == bm.held("a")[:2]
    assert bm.admit("b", hit, len(toks))                            # shares a's two blocks, one of its own
    assert bm.held("b")[:2] == bm.held("a")[:2] and bm.num_free == 2
    assert bm.hit_tokens == 2 * BLOCK and bm.query_tokens == len(toks)
    assert not bm.grow("b", 6 * BLOCK) and len(bm.held("b")) == 3    # no room: nothing changed
    assert not bm.admit("c", bm.cached_prefix([], 0), 5 * BLOCK) and bm.num_free == 2
    bm.check()
    bm.grow("a", len(toks) + 2 * BLOCK)                              # room for a draft, then rejected:
    bm.computed("a", toks, len(toks))                                # the blocks past the tokens come back
    assert len(bm.held("a")) == 3
    bm.free("a")
    bm.free("b")
    bm.free("b")                                                     # freeing twice is a no-op
    assert bm.num_free == 6 and bm.usage == 0.0
    assert bm.cached_prefix(toks, len(toks) - 1).n_tokens == 2 * BLOCK   # freed, still cached
    bm.check()


def test_the_scheduler_spends_the_budget_and_prices_drafts_where_they_run():
    """The scheduler is the one owner of a step's budget: it asks k_for(seq, room, planned) for each decode at its
    place in the step, with the room its budget leaves and the tokens planned before it, and reserves what it
    answers (never past the budget)."""
    from lumen.engine.block_manager import BlockManager
    from lumen.engine.scheduler import Scheduler
    from lumen.engine.sequence import Sequence

    class Tok:
        def stream(self):
            return None
    bm = BlockManager(32, np.zeros((4, 32), np.int64), prefix_caching=False)
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    seqs = [Sequence(f"r{i}", [i + 1] * 2, SamplingParams(max_tokens=16), 16, Tok(), frozenset()) for i in range(3)]
    for seq in seqs:
        sch.add(seq)
    for s in sch.schedule():                          # prefill all three (2 tokens each)
        sch.computed(s)
    for seq in seqs:
        seq.tokens.append(7)                          # each sampled one token: now decoding
    asked = []

    def k_for(seq, room, planned):
        asked.append((seq.request_id, room, planned))
        return 4
    plan = sch.schedule(k_for=k_for)
    assert asked == [("r0", 7, 0), ("r1", 2, 5)]    # r2: no budget left, not asked
    assert [(s.seq.request_id, s.n, s.k) for s in plan] == [("r0", 1, 4), ("r1", 1, 2)]   # k capped to the room
    assert sum(s.n + s.k for s in plan) <= 8


def test_engine_config_checks_every_field_once():
    from lumen.engine.config import EngineConfig, SpeculativeConfig
    for bad, name in [(dict(max_num_seqs=0), "max_num_seqs"),
                      (dict(max_num_batched_tokens=True), "max_num_batched_tokens"),
                      (dict(max_model_len=1.5), "max_model_len"), (dict(kv_cache_mb=0), "kv_cache_mb"),
                      (dict(num_kv_blocks=-1), "num_kv_blocks"), (dict(cost_grid="huge"), "cost_grid"),
                      (dict(scheduler="measured", slo_tpot_s=float("inf")), "slo_tpot_s")]:
        with pytest.raises(ValueError, match=name):
            EngineConfig(**bad)
    for bad, name in [(dict(num_speculative_tokens=17), "num_speculative_tokens"),
                      (dict(ngram_min=3, ngram_max=2), "ngram_max")]:
        with pytest.raises(ValueError, match=name):
            SpeculativeConfig(**bad)
    c = EngineConfig.from_kwargs(max_num_seqs=4, num_speculative_tokens=3, adaptive_k=False)
    assert c.max_num_seqs == 4 and c.speculative == SpeculativeConfig(num_speculative_tokens=3, adaptive_k=False)
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        EngineConfig.from_kwargs(max_num_seq=4)                      # a typo is an error, not a default


def test_served_engine_forgets_its_warm_up_step(smollm2_path):
    """lumen.serve's warm-up step times loading the kernels; it must not stand as a 1-token step's cost when the
    paced budget sets the first requests' limits."""
    from lumen.engine.config import EngineConfig
    from lumen.serve.app import load_engine
    eng = load_engine(str(smollm2_path), EngineConfig(threads=2, max_model_len=64, kv_cache_mb=8))
    assert eng.steps == 1 and not eng.costs.ema and eng.costs.predict(1) is None
    eng.generate([[5, 6, 7]], lumen.SamplingParams(max_tokens=3, temperature=0))
    assert eng.costs.known(1) and eng.costs.known(3)


def test_queue_time_ends_when_the_scheduler_admits_a_request(model):
    """request_queue_time is arrival -> admitted, so it is shorter than the time to first token by the first
    step at least (it used to end after that step, and equalled TTFT for a one-chunk prompt)."""
    eng = Engine(model, max_model_len=64, max_num_seqs=1, kv_cache_mb=8)
    for i in range(2):
        eng.add_request([10 + i, 11, 12, 13], SamplingParams(max_tokens=3, temperature=0))
    done = {}
    for _ in range(50):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.metrics
        if not eng.has_unfinished():
            break
    first, second = sorted(done.values(), key=lambda m: m.first_token)
    for m in (first, second):
        assert m.queue_s < m.ttft_s
    assert second.queue_s >= first.e2e_s * 0.5     # it waited while the first ran (max_num_seqs=1)


@pytest.mark.parametrize("tiny", [True, False])
def test_calibration_grid_fits_the_engine_s_step(tiny):
    """Every shape calibration measures fits the runner's step (tokens and sequences); the tiny grid once had a
    18-token shape that crashed an engine with max_num_batched_tokens=16."""
    from lumen.engine.costs.steps import grid
    for max_tokens, max_seqs in [(16, 3), (8, 1), (512, 16), (33, 2)]:
        shapes = grid(max_tokens, max_seqs, 256, tiny)
        assert shapes and all(s.tokens <= max_tokens and s.seqs <= max_seqs for s in shapes), (max_tokens, max_seqs)


def test_drafted_tokens_never_preempt_another_request():
    """When the pool has no block for a decode's drafted tokens, it runs fewer of them (none, here) rather than
    preempt another request: a preemption recomputes a whole prompt, a draft saves a few steps at best."""
    from lumen.engine.block_manager import BlockManager
    from lumen.engine.scheduler import Scheduler
    from lumen.engine.sequence import Sequence
    from lumen.kernels.attention import BLOCK

    class Tok:
        def stream(self):
            return None
    bm = BlockManager(2, np.zeros((2, 2), np.int64), prefix_caching=False)
    sch = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [Sequence(f"r{i}", [i + 1] * (BLOCK - 1), SamplingParams(max_tokens=16), 16, Tok(), frozenset())
            for i in range(2)]
    for seq in seqs:
        sch.add(seq)
    for s in sch.schedule():                          # one block each, the pool now full
        sch.computed(s)
    for seq in seqs:
        seq.tokens.append(7)                          # each sampled one token: its block is exactly full
    plan = sch.schedule(k_for=lambda seq, room, planned: 4)
    assert [(s.seq.request_id, s.n, s.k) for s in plan] == [("r0", 1, 0), ("r1", 1, 0)]
    assert sch.num_preemptions == 0
