"""The serving engine: continuous batching over the paged KV cache, and the guarantee that makes it trustworthy:
a request's logits are bit-identical whatever runs beside it (batch invariance), with any chunk size or token
budget, with or without a prefix-cache hit, across preemption; seeded sampling gives the same tokens too.
Plus the engine API, its bookkeeping, and bad input."""
import hashlib
import threading

import numpy as np
import pytest

import lumen
from goldens import corpus
from lumen import SamplingParams
from lumen.engine.engine import Engine, RequestError
from lumen.errors import ContextError, LumenError
from lumen.kernels.attention import BLOCK
from lumen.engine.sampling.sampler import SamplerError
from lumen.engine.sequence import RequestMetrics

MODELS = ("smollm2-135m", "gemma3-270m")


@pytest.fixture(scope="module", params=MODELS)
def model(request, model_path_of):
    return lumen.load(model_path_of(request.param), ctx=2048, threads=2)


@pytest.fixture(scope="module")
def model_path_of(smollm2_path, gemma3_path):
    return {"smollm2-135m": smollm2_path, "gemma3-270m": gemma3_path}.get


def text_ids(model, n, offset=0):
    ids = model.tokenize(corpus()["ppl_text"] * 8)
    return ids[offset:offset + n]


def workload(model):
    """16 mixed requests: lengths from 3 to ~700 tokens (past 256 keys and Gemma's 512 window), shared prefixes
    (some ending mid-block, some on a block boundary), greedy and seeded sampling, a stop string."""
    base = text_ids(model, 700)
    shared = base[:100]
    reqs = []
    for i, n in enumerate([3, 17, 60, 130, 300, 520, 640, 33]):
        reqs.append((text_ids(model, n, offset=7 * i + 1), SamplingParams(max_tokens=24, temperature=0)))
    for i, extra in enumerate([5, 12, 28, 64]):                        # prefix-sharing requests
        reqs.append((shared + text_ids(model, extra, offset=200 + 9 * i), SamplingParams(max_tokens=20,
                                                                                          temperature=0)))
    reqs.append((base[:2 * BLOCK] + [base[5]], SamplingParams(max_tokens=16, temperature=0)))   # block boundary
    for i, seed in enumerate([1, 2, 3]):
        reqs.append((text_ids(model, 40 + 30 * i, offset=300 + i), SamplingParams(
            max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=seed, stop=("\n\n",))))
    return reqs


def logits_of(model, ids, out_ids):
    """The logits that chose each output token, run alone through Model (prefill then teacher-forced)."""
    full = model.logits(list(ids) + list(out_ids[:-1]))
    return full[len(ids) - 1:]


def row_hash(row: np.ndarray) -> str:
    """A logits row's bits, as a digest: Gemma's rows are 1 MB each, and a workload samples about 400 of them."""
    return hashlib.sha256(np.ascontiguousarray(row, np.float32).tobytes()).hexdigest()


class Recorder:
    """Wraps an engine's sampling to keep the digest of every logits row each request sampled from."""

    def __init__(self, engine):
        self.rows = {}
        orig = engine._choose

        def choose(seq, s, logits, row):
            self.rows.setdefault(seq.request_id, []).append(row_hash(logits[row]))
            return orig(seq, s, logits, row)
        engine._choose = choose


def run_engine(model, reqs, **kw):
    eng = Engine(model, max_model_len=1024, **kw)
    rec = Recorder(eng)
    try:
        outs = eng.generate([r for r, _ in reqs], [p for _, p in reqs])
    finally:
        del eng._choose                 # the wrapper refers to the engine: freed now, not at the module's end
    eng.blocks.check()
    return eng, outs, rec


@pytest.fixture(scope="module")
def alone(model):
    """Each request of the workload alone: one request at a time, generous budget."""
    reqs = workload(model)
    eng, outs, rec = run_engine(model, reqs, max_num_seqs=1, max_num_batched_tokens=1024, kv_cache_mb=64,
                                enable_prefix_caching=False)
    return reqs, outs, [rec.rows[o.request_id] for o in outs]


CONFIGS = {
    "batched, budget 256": dict(max_num_seqs=16, max_num_batched_tokens=256, kv_cache_mb=256),
    "batched, budget 37 (odd chunks)": dict(max_num_seqs=8, max_num_batched_tokens=37, kv_cache_mb=256),
    "tight pool (preemption)": dict(max_num_seqs=16, max_num_batched_tokens=128, kv_cache_mb=None),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_batch_invariance(model, alone, config):
    """Every request's sampling logits and tokens are bit-identical to its run alone, batched with 15 others,
    under a small or odd token budget (chunked prefill, prefix-cache hits) or a pool small enough to preempt."""
    reqs, ref_outs, ref_rows = alone
    kw = dict(CONFIGS[config])
    if kw["kv_cache_mb"] is None:        # room for about 1.3 of the longest requests: forces preemption
        per_block = model.runner.kv_bytes_per_block
        kw["kv_cache_mb"] = 55 * per_block / 2 ** 20
    eng, outs, rec = run_engine(model, reqs, **kw)
    for i, (o, ref) in enumerate(zip(outs, ref_outs)):
        assert o.finish_reason == ref.finish_reason and o.token_ids == ref.token_ids, i
        rows = rec.rows[o.request_id]
        assert len(rows) == len(ref_rows[i])
        for k, (a, b) in enumerate(zip(rows, ref_rows[i])):
            assert a == b, f"request {i}, token {k}: logits differ"
    st = eng.stats()
    print(f"\n{config}: {st}")
    if "preemption" in config:
        assert st["preemptions"] > 0
    else:
        assert st["prefix_hit_tokens"] > 0
    assert st["kv_free_blocks"] == st["kv_blocks"]       # nothing leaked


def test_engine_matches_model_alone(model, alone):
    """The engine's greedy logits for a request equal Model's teacher-forced logits for the same tokens."""
    reqs, outs, rows = alone
    for (ids, p), o, r in list(zip(reqs, outs, rows))[:4]:
        assert r == [row_hash(x) for x in logits_of(model, ids, o.token_ids)]


def test_generate_stream_and_step_api(model):
    eng = Engine(model, max_model_len=512, max_num_seqs=4, kv_cache_mb=32)
    p = SamplingParams(max_tokens=8, temperature=0)
    ids = text_ids(model, 20)
    full = eng.generate([ids], p)[0]
    assert full.finished and full.finish_reason == "length" and len(full.token_ids) == 8
    assert full.text == model.detokenize(full.token_ids)
    m = full.metrics
    assert m.ttft_s > 0 and m.tpot_s > 0 and len(m.itl) == 7 and m.prompt_tokens == 20 and m.e2e_s >= m.ttft_s
    streamed = list(eng.stream(ids, p))
    assert [o.delta_token_ids[0] for o in streamed] == full.token_ids
    assert "".join(o.delta_text for o in streamed) == full.text and streamed[-1].finished
    rid = eng.add_request(ids, p)
    seen = []
    while eng.has_unfinished():
        seen += [o for o in eng.step() if o.request_id == rid]
    assert seen[-1].token_ids == full.token_ids and all(not o.finished for o in seen[:-1])
    assert eng.stats()["kv_free_blocks"] == eng.stats()["kv_blocks"]


def test_prefix_cache_hit_counts_and_eviction(model):
    eng = Engine(model, max_model_len=512, max_num_seqs=2, kv_cache_mb=model.runner.kv_bytes_per_block * 20 / 2 ** 20)
    assert eng.blocks.n_blocks == 20
    p = SamplingParams(max_tokens=2, temperature=0)
    prefix = text_ids(model, 5 * BLOCK)
    a = eng.generate([prefix + [11]], p)[0]
    b = eng.generate([prefix + [12]], p)[0]
    assert a.metrics.cached_tokens == 0 and b.metrics.cached_tokens == 5 * BLOCK
    # a request needing 19 of the 20 blocks evicts 4 of the prefix's 5 named blocks: the least recently freed
    # first, and within a freed sequence its tail first, so the first block survives
    eng.generate([text_ids(model, 18 * BLOCK, offset=400)], p)
    assert eng.blocks.evictions == 4
    c = eng.generate([prefix + [13]], p)[0]
    assert c.metrics.cached_tokens == BLOCK
    eng.generate([text_ids(model, 19 * BLOCK, offset=700)], p)         # needs the whole pool: evicts the rest
    d = eng.generate([prefix + [14]], p)[0]
    assert d.metrics.cached_tokens == 0
    assert eng.blocks.hit_tokens == 6 * BLOCK and eng.blocks.query_tokens == 4 * 81 + 18 * BLOCK + 19 * BLOCK
    eng.blocks.check()


def test_abort_frees_blocks_at_once_and_from_another_thread(model):
    eng = Engine(model, max_model_len=512, max_num_seqs=4, kv_cache_mb=32)
    p = SamplingParams(max_tokens=50, temperature=0)
    keep = eng.add_request(text_ids(model, 30), p)
    gone = eng.add_request(text_ids(model, 40, offset=50), p)
    eng.step()
    used = eng.blocks.n_blocks - eng.blocks.num_free
    t = threading.Thread(target=eng.abort, args=(gone,))
    t.start()
    t.join()
    assert eng.blocks.n_blocks - eng.blocks.num_free < used           # freed before the next step
    outs = eng.step()
    assert any(o.request_id == gone and o.finish_reason == "abort" for o in outs)
    eng.abort(gone)                                                   # finished: no-op
    eng.abort("no-such-request")                                      # unknown: no-op
    while eng.has_unfinished():
        outs = eng.step()
    assert outs[-1].request_id == keep and outs[-1].finish_reason == "length"
    assert eng.blocks.num_free == eng.blocks.n_blocks


def test_add_request_from_threads_while_stepping(model):
    eng = Engine(model, max_model_len=512, max_num_seqs=8, kv_cache_mb=64)
    p = SamplingParams(max_tokens=6, temperature=0)
    ids = [eng.add_request(text_ids(model, 10), p)]
    errors = []

    def add(k):
        try:
            ids.append(eng.add_request(text_ids(model, 12 + k, offset=k), p))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=add, args=(k,)) for k in range(6)]
    done = {}
    for th in threads:
        th.start()
        for o in eng.step():
            done[o.request_id] = o
    for th in threads:
        th.join()
    while eng.has_unfinished():
        for o in eng.step():
            done[o.request_id] = o
    assert not errors and all(done[i].finished and len(done[i].token_ids) == 6 for i in ids)


def test_bad_requests_are_errors_of_their_own(model):
    eng = Engine(model, max_model_len=256, max_num_seqs=4, kv_cache_mb=model.runner.kv_bytes_per_block * 8 / 2 ** 20)
    with pytest.raises(ContextError, match="max_model_len"):
        eng.add_request(list(range(1, 300)))                           # longer than max_model_len
    with pytest.raises(ContextError, match="plus max_tokens"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=254))
    with pytest.raises(RequestError, match="KV blocks"):                 # can never fit the pool
        eng.add_request(list(range(1, 140)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request([1, 10 ** 9])
    with pytest.raises(SamplerError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(SamplerError, match="top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(SamplerError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={"x": 1})
    with pytest.raises(SamplerError, match="num_speculative_tokens is used with speculative"):
        SamplingParams(num_speculative_tokens=3)                         # would do nothing
    assert SamplingParams(speculative="ngram", num_speculative_tokens=3).num_speculative_tokens == 3
    with pytest.raises(SamplerError, match="stop_token_ids"):
        eng.add_request([1, 2], SamplingParams(stop_token_ids=[10 ** 9]))
    outs = eng.generate([[1, 2, 3], [], list(range(1, 400)), [4, 5]], SamplingParams(max_tokens=4, temperature=0))
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "empty" in outs[1].error and "max_model_len" in outs[2].error


def test_a_kv_cache_the_machine_cannot_map_is_a_lumen_error(model, monkeypatch):
    """generate --ctx 10000000 --force-ctx died with a bare "[Errno 12] Cannot allocate memory": the mmap of a
    230 GB KV cache fails on a 24 GB machine. (Made to fail here whatever the machine's memory.)"""
    import errno
    import lumen.engine.runner as runner

    def no_memory(shape, dtype):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    monkeypatch.setattr(runner, "lazy_zeros", no_memory)
    with pytest.raises(LumenError, match=r"the KV cache of 256 tokens needs [\d.]+ GB, more than this machine can "
                                         r"map: use a smaller context"):
        Engine(model, max_model_len=256, max_num_seqs=1, kv_cache_mb=model.runner.kv_bytes_per_block * 16 / 2 ** 20)


def test_nan_logits_affect_that_request_only(model):
    eng = Engine(model, max_model_len=256, max_num_seqs=4, kv_cache_mb=16)
    p = SamplingParams(max_tokens=5, temperature=0)
    ref = eng.generate([[5, 6, 7], [8, 9, 10]], p)
    orig = eng._choose
    bad = {}

    def choose(seq, s, logits, row):
        if seq.request_id == bad.get("id"):
            logits[row] = np.nan
        return orig(seq, s, logits, row)
    eng._choose = choose
    a = eng.add_request([5, 6, 7], p)
    bad["id"] = eng.add_request([8, 9, 10], p)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs[bad["id"]].finish_reason == "error" and "NaN" in outs[bad["id"]].error
    assert outs[a].token_ids == ref[0].token_ids
    assert eng.blocks.num_free == eng.blocks.n_blocks


def test_stop_conditions(model):
    eng = Engine(model, max_model_len=512, max_num_seqs=2, kv_cache_mb=16)
    ids = text_ids(model, 20)
    free = eng.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0]
    tok = free.token_ids[4]
    o = eng.generate([ids], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[tok]))[0]
    assert o.finish_reason == "stop" and o.stop_reason == tok and o.token_ids == free.token_ids[:5]
    o = eng.generate([ids], SamplingParams(max_tokens=12, temperature=0, min_tokens=8, stop_token_ids=[tok]))[0]
    assert len(o.token_ids) >= 8
    word = free.text[len(free.text) // 2:][:3]
    o = eng.generate([ids], SamplingParams(max_tokens=12, temperature=0, stop=[word]))[0]
    assert o.finish_reason == "stop" and o.stop_reason == word and word not in o.text
    assert free.text.startswith(o.text)
    n_before = len(o.token_ids)                   # min_tokens holds against a stop string too (as in vLLM)
    o = eng.generate([ids], SamplingParams(max_tokens=12, temperature=0, stop=[word], min_tokens=n_before + 2))[0]
    assert len(o.token_ids) >= n_before + 2 and free.text.startswith(o.text) and len(o.text) > len(free.text) // 2
    bias = eng.generate([ids], SamplingParams(max_tokens=3, temperature=0, logit_bias={7: 100}))[0]
    assert bias.token_ids == [7, 7, 7]
    lp = eng.generate([ids], SamplingParams(max_tokens=3, temperature=0, logprobs=3))[0]
    assert lp.token_ids == free.token_ids[:3] and len(lp.logprobs) == 3
    for tok, (lp_tok, top) in zip(lp.token_ids, lp.logprobs):
        assert top[0][0] == tok and abs(top[0][1] - lp_tok) < 1e-9 and lp_tok <= 0 and len(top) == 3


def test_model_generate_runs_through_the_engine(model):
    ids = text_ids(model, 30)
    toks = [t.id for t in model.generate(ids, max_tokens=10)]
    eng = Engine(model, max_model_len=512, max_num_seqs=4, kv_cache_mb=16)
    assert eng.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0].token_ids[:len(toks)] == toks


@pytest.fixture(scope="module")
def small(smollm2_path):
    return lumen.load(smollm2_path, ctx=256, threads=2)


def test_a_runner_loads_its_forward_pass_without_running_it(small):
    """Runner.load (what the CLI calls before the prompt's clock starts): the forward pass's code at the runner's
    types, and no step: nothing written to the KV cache; the next request's tokens are those of an engine that
    did not load first."""
    ids, p = text_ids(small, 20), SamplingParams(max_tokens=6, temperature=0)
    loaded = Engine(small, max_model_len=256, max_num_seqs=1, kv_cache_mb=4)
    loaded.runner.load()
    assert loaded.runner._entry is not None
    assert not loaded.runner.kv.k.any() and not loaded.runner.kv.v.any()
    plain = Engine(small, max_model_len=256, max_num_seqs=1, kv_cache_mb=4)
    assert loaded.generate([ids], p)[0].token_ids == plain.generate([ids], p)[0].token_ids


def test_a_stream_asks_its_stop_before_every_step(small):
    """Engine.stream(stop=...): asked before each step the iterator runs, a prompt's chunks included (lumen.chat's
    Ctrl-C); true ends the stream and aborts the request; a later one runs whole."""
    eng = Engine(small, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=16, kv_cache_mb=16)
    asked = []
    cut = eng.stream("the cat sat on the mat " * 10, SamplingParams(max_tokens=8, temperature=0),
                     stop=lambda: asked.append(1) or len(asked) > 2)
    assert list(cut) == [] and len(asked) == 3            # two prompt chunks ran, then the stop was heard
    assert eng.num_running == eng.num_waiting == 0 and not eng._streams
    whole = list(eng.stream("The capital of France is", SamplingParams(max_tokens=4, temperature=0),
                            stop=lambda: False))
    assert whole[-1].finished and len(whole[-1].token_ids) == 4


def test_interleaved_and_dropped_streams_each_get_their_own_tokens(small):
    """Two Model.generate iterators (one-sequence engine) interleaved: each gets all its tokens, none hangs;
    one dropped before its first next is aborted, not left to run."""
    a, b = "The capital of France is", "def fibonacci(n):"
    want = {p: [t.id for t in small.generate(p, max_tokens=6)] for p in (a, b)}
    ia, ib = small.generate(a, max_tokens=6), small.generate(b, max_tokens=6)
    got = {a: [next(ia).id], b: [next(ib).id]}
    got[a] += [t.id for t in ia]
    got[b] += [t.id for t in ib]
    assert got == want
    unused = small.generate(a, max_tokens=6)
    del unused
    assert not small.engine._streams and small.engine.num_running == small.engine.num_waiting == 0
    eng = Engine(small, max_model_len=256, max_num_seqs=2, kv_cache_mb=16)
    sa, sb = eng.stream(a, SamplingParams(max_tokens=6, temperature=0)), eng.stream(b, SamplingParams(
        max_tokens=6, temperature=0))
    outs = {a: [next(sa)], b: [next(sb)]}
    outs[a] += list(sa)
    outs[b] += list(sb)
    assert {p: [o.delta_token_ids[0] for o in outs[p]] for p in outs} == want


def test_model_generate_from_two_threads(small):
    want = [t.id for t in small.generate("The capital of France is", max_tokens=8)]
    got = {}

    def run(i):
        got[i] = [t.id for t in small.generate("The capital of France is", max_tokens=8)]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert got == {0: want, 1: want}


def test_engine_generate_from_two_threads(small):
    """Two threads in Engine.generate at once on one engine: each gets its own results, whichever thread's step
    finished them (each took the other's final outputs and looped for ever)."""
    eng = Engine(small, max_model_len=256, max_num_seqs=4, kv_cache_mb=16)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = {k: [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=3 + 4 * k, temperature=0))]
            for k in range(2)}
    got = {}

    def run(k):
        got[k] = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=3 + 4 * k, temperature=0))]
    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(2)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not any(t.is_alive() for t in threads), "Engine.generate hung"
    assert got == want
    assert not eng.has_unfinished() and not eng._streams and eng.blocks.num_free == eng.blocks.n_blocks


class _StepsInTheGap(dict):
    """Engine._streams for the test below: the first time a step hands out its outputs, another thread follows
    stream `other` (given a second to step, which it can only once the step lock is free)."""
    other = thread = None

    def __init__(self):
        super().__init__()
        self.errors, self.outs = [], None

    def get(self, key, default=None):
        if self.thread is None and self.other is not None:
            def follow():
                try:
                    self.outs = list(self.other)
                except Exception as e:              # noqa: BLE001 (reported by the test)
                    self.errors.append(e)
            self.thread = threading.Thread(target=follow)
            self.thread.start()
            self.thread.join(1.0)
        return super().get(key, default)


def test_a_stream_followed_from_another_thread_gets_outputs_made_by_this_one(small):
    """Outputs are in their streams' queues before the step lock is released: a stream stepping from another
    thread right after a step that finished its request finds its final output, not an empty engine (it raised
    "left the engine without a final output", now and then, under Model.generate from several threads)."""
    eng = Engine(small, max_model_len=256, max_num_seqs=2, kv_cache_mb=16)
    eng._streams = gap = _StepsInTheGap()
    sp = SamplingParams(max_tokens=1, temperature=0)
    mine = eng.stream("The capital of France is", sp)
    gap.other = eng.stream("def fibonacci(n):", sp)
    assert [o.finished for o in mine] == [True]
    gap.thread.join(60)
    assert gap.errors == [] and [(o.finished, len(o.token_ids)) for o in gap.outs] == [(True, 1)]
    assert not eng.has_unfinished() and eng.blocks.num_free == eng.blocks.n_blocks


def test_model_generate_stop_string_is_one_string(small):
    """stop="answer" stops at "answer", not at the "a" of "Paris" (a string is not a list of characters)."""
    free = "".join(t.text for t in small.generate("The capital of France is", max_tokens=8))
    assert free.startswith(" Paris") and "answer" in free
    text = "".join(t.text for t in small.generate("The capital of France is", max_tokens=8, stop="answer"))
    assert text == free.split("answer")[0]
    listed = "".join(t.text for t in small.generate("The capital of France is", max_tokens=8, stop=["answer"]))
    assert listed == text
    unset = "".join(t.text for t in small.generate("The capital of France is", max_tokens=8, stop=None))
    assert unset == free                                     # None: no stop strings, as vLLM's default
    for bad in ("", [""], [None]):
        with pytest.raises(SamplerError, match="stop"):
            small.generate("The capital of France is", max_tokens=8, stop=bad)


@pytest.mark.parametrize("prompt", [None, 7, ["a", "b"], [1.5, 2.7], [True], [], "", [1, 10 ** 9]])
def test_model_generate_bad_prompt_is_a_request_error(small, prompt):
    """Model.generate checks a prompt as the engine does: no TypeError from int(), no float ids truncated."""
    with pytest.raises(RequestError, match="prompt|token id"):
        small.generate(prompt, max_tokens=2)
    assert [t.id for t in small.generate([1, 2, 3], max_tokens=2)]


@pytest.mark.parametrize("params", [{"max_tokens": 2}, 2, "greedy"])
def test_model_generate_params_not_sampling_params_is_a_type_error(small, params):
    with pytest.raises(TypeError, match="params must be a lumen.SamplingParams"):
        small.generate("Hello", params)


def test_model_generate_max_tokens_none_is_the_rest_of_the_context(small):
    """max_tokens=None as a keyword means what SamplingParams(max_tokens=None) does: up to the context's end."""
    ids = small.tokenize("The capital of France is")
    stats = RequestMetrics()
    kw = [t.id for t in small.generate(ids, max_tokens=None, ignore_eos=True, stats=stats)]
    sp = [t.id for t in small.generate(ids, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))]
    assert kw == sp and stats.gen_tokens == small.n_ctx - len(ids)
