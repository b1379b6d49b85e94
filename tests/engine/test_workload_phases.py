"""Workloads that push the engine's bookkeeping, each checked against every request run alone and against a pool
left whole: the prefix cache (shared prefixes longer than a block with divergent suffixes, identical prompts at
once, a prompt on a block boundary, eviction then reuse) against no prefix cache; max_model_len boundaries; an
abort at every phase a request passes through (waiting, mid chunked prefill, decoding, preempted, speculating);
and 200+ short mixed requests with aborts."""
import random

import pytest

import lumen
from lumen import SamplingParams
from lumen.engine.engine import Engine
from lumen.engine.sequence import Status
from lumen.errors import ContextError


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=512, threads=2)


@pytest.fixture(scope="module")
def text(model):
    return model.tokenize("The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, a "
                          "king counted his gardens and his numbers every morning. " * 12)


def summary(o):
    return o.token_ids, o.logprobs, o.finish_reason, o.text


def alone(model, reqs, max_model_len=256):
    """Each request run by itself: one sequence at a time, no prefix cache."""
    eng = Engine(model, max_num_seqs=1, kv_cache_mb=32, max_model_len=max_model_len, enable_prefix_caching=False)
    return [summary(o) for o in eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])]


def assert_empty(eng):
    eng.blocks.check()
    assert not eng.has_unfinished() and not eng._seqs and not eng._streams
    assert eng.blocks.num_free == eng.blocks.n_blocks and eng.stats()["kv_usage"] == 0.0
    assert not eng.speculator._drafts and not eng.speculator._source


def test_prefix_cache_outputs_equal_no_prefix_cache(model, text):
    """Shared prefixes of 40 tokens (past two blocks) with suffixes of 1 to 17 tokens, three identical prompts at
    once, a prompt of exactly two blocks, greedy and seeded: the same tokens and logprobs as each alone without a
    cache; then, once a pool too small to keep them has evicted the prefix, the same again."""
    greedy, seeded = SamplingParams(max_tokens=12, temperature=0, logprobs=1), SamplingParams(
        max_tokens=12, temperature=0.8, seed=5, logprobs=1)
    shared = text[:40]
    reqs = [(shared + text[60 + 9 * i:60 + 9 * i + n], sp) for i, (n, sp) in
            enumerate([(1, greedy), (5, seeded), (16, greedy), (17, greedy)])]
    reqs += [(text[100:140], seeded)] * 3 + [(text[:32], greedy), (text[:33], greedy)]
    want = alone(model, reqs)
    per = model.runner.kv_bytes_per_block
    eng = Engine(model, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_mb=per * 14 / 2 ** 20, max_model_len=256)
    first = [summary(o) for o in eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])]
    assert first == want
    assert eng.blocks.hit_tokens >= 3 * 32                   # the shared prefix, at least (2 blocks each)
    evicted = eng.blocks.evictions
    eng.generate([text[200:400]], SamplingParams(max_tokens=24, temperature=0))    # takes the whole pool
    assert eng.blocks.evictions > evicted
    again = [summary(o) for o in eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])]
    assert again == want
    assert_empty(eng)


def test_max_model_len_boundaries(model, text):
    """max_model_len 64: a 63-token prompt generates one token (max_tokens None or 1); 64 tokens, or a prompt plus
    max_tokens past 64, is a ContextError at add_request and an error result in generate, and the requests beside
    it run as they do alone."""
    eng = Engine(model, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_mb=8, max_model_len=64)
    g = SamplingParams(temperature=0, ignore_eos=True)
    for prompt, sp in [(text[:64], g.replace(max_tokens=1)), (text[:65], g), (text[:60], g.replace(max_tokens=5))]:
        with pytest.raises(ContextError):
            eng.add_request(prompt, sp)
    ok = [(text[:63], g), (text[:63], g.replace(max_tokens=1)), (text[:20], g.replace(max_tokens=44)),
          (text[3:40], g.replace(max_tokens=24, speculative="ngram"))]
    want = alone(model, ok, max_model_len=64)
    outs = eng.generate([text[:64], ok[0][0], text[:60], ok[1][0], ok[2][0], ok[3][0]],
                        [g.replace(max_tokens=1), ok[0][1], g.replace(max_tokens=5), ok[1][1], ok[2][1], ok[3][1]])
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "length", "length", "length"]
    assert "max_model_len" in outs[0].error and "max_model_len" in outs[2].error
    assert [summary(o) for o in outs[1:2] + outs[3:]] == want
    assert [len(o.token_ids) for o in outs[1:2] + outs[3:]] == [1, 1, 44, 24]
    assert_empty(eng)


PHASES = ("waiting", "prefill", "decoding", "preempted", "speculating")


def phase_of(seq):
    if seq.status is Status.WAITING:
        return "preempted" if seq.metrics.preemptions else "waiting" if seq.num_computed == 0 else None
    if 0 < seq.num_computed < len(seq.prompt_ids) - 1:
        return "prefill"
    if seq.metrics.spec_steps:
        return "speculating"
    if len(seq.output_ids) >= 2 and seq.spec is None:
        return "decoding"
    return None


def test_an_abort_at_every_phase_leaves_the_others_and_the_pool_whole(model, text):
    """A pool that preempts, a budget that chunks prompts, n-gram speculation: the first request seen in each phase
    is aborted there (between steps). Every other request ends as it does alone, and nothing is left held."""
    rng = random.Random(3)
    reqs = []
    for i in range(14):
        n = rng.choice([8, 30, 70, 90])
        reqs.append((text[5 * i:5 * i + n], SamplingParams(
            max_tokens=rng.choice([6, 20, 30]), temperature=rng.choice([0, 0.8]), seed=i, ignore_eos=True,
            speculative="ngram" if i % 3 == 0 else None)))
    want = alone(model, reqs)
    per = model.runner.kv_bytes_per_block
    eng = Engine(model, max_num_seqs=6, max_num_batched_tokens=24, kv_cache_mb=per * 16 / 2 ** 20,
                 max_model_len=256, scheduler="fcfs")
    rids = [eng.add_request(p, sp) for p, sp in reqs]
    aborted, done = {}, {}
    for _ in range(3000):
        if not eng.has_unfinished():
            break
        for rid in rids:
            seq = eng._seqs.get(rid)
            ph = None if seq is None else phase_of(seq)
            if ph is not None and ph not in aborted.values():
                aborted[rid] = ph
                eng.abort(rid)
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        eng.blocks.check()
    assert sorted(aborted.values()) == sorted(PHASES)
    assert sorted(done) == sorted(rids)
    assert all(done[r].finish_reason == "abort" for r in aborted)
    kept = [i for i, r in enumerate(rids) if r not in aborted]
    assert [summary(done[rids[i]]) for i in kept] == [want[i] for i in kept]
    assert eng.scheduler.num_preemptions > 0
    assert_empty(eng)


def test_two_hundred_short_mixed_requests_leave_the_pool_empty(model, text):
    """220 short requests (1 to 40 prompt tokens, 0 to 8 new ones; greedy, seeded, n-gram speculation, stop strings,
    logprobs) added between steps into a pool that preempts, 1 in 8 aborted: each gets one final output, those not
    aborted the tokens they get alone, and the pool, the queues and the speculator end empty."""
    rng = random.Random(8)
    reqs = []
    for i in range(220):
        a, n = rng.randrange(0, len(text) - 40), rng.choice([1, 2, 15, 16, 17, 40])
        reqs.append((text[a:a + n], SamplingParams(
            max_tokens=rng.choice([0, 1, 2, 4, 8]), temperature=rng.choice([0, 0, 1.0]), seed=i, logprobs=1,
            speculative=rng.choice([None, "ngram"]), stop=rng.choice([(), ("e",)]))))
    want = alone(model, reqs)
    per = model.runner.kv_bytes_per_block
    eng = Engine(model, max_num_seqs=12, max_num_batched_tokens=48, kv_cache_mb=per * 6 / 2 ** 20,
                 max_model_len=256)
    index, done, aborted = {}, {}, set()
    todo = list(range(len(reqs)))
    for _ in range(5000):
        if not todo and not eng.has_unfinished():
            break
        for _ in range(rng.choice([0, 1, 3, 6])):
            if todo:
                i = todo.pop(0)
                index[eng.add_request(*reqs[i])] = i
        live = [r for r in index if r not in done and r not in aborted]
        if live and rng.random() < 0.15:
            r = rng.choice(live)
            eng.abort(r)
            aborted.add(r)
        for o in eng.step():
            assert o.request_id not in done, "a second final output"
            if o.finished:
                done[o.request_id] = o
    assert sorted(done) == sorted(index) and len(done) == len(reqs)
    kept = [r for r in index if r not in aborted and done[r].finish_reason != "abort"
            and not (reqs[index[r]][1].speculative and reqs[index[r]][1].temperature)]
    assert len(kept) > 100
    assert [summary(done[r]) for r in kept] == [want[index[r]] for r in kept]
    assert eng.scheduler.num_preemptions > 0
    assert_empty(eng)
