"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's log-probability given the tokens before
it, computed on request while the prompt is prefilled, and max_tokens=0 (the prompt only, to score it).

They are the log-softmax of the one-sequence forward's logits (Model.logits) to float64 rounding, whatever the
chunking, the batch, the prefix cache or a preemption; the float64 reference forward (tests/ref_forward.py) is
as close as the quantized weights let it be. A prefix-cache hit never covers tokens whose logprobs are wanted (a
cached block's logits were never computed), and the request's own blocks are named for the next one. Asking for
them changes nothing else: the generated tokens and their logprobs are those of the request without them.
"""
import numpy as np
import pytest

import lumen
from goldens import corpus
from lumen import SamplingParams
from lumen.engine.engine import Engine
from lumen.engine.sampling.sampler import SamplerError
from lumen.kernels.attention import BLOCK

TOL = 1e-9                 # the same logits bits, log-softmaxed in float64 by two summation orders


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=2048, threads=2)


def text_ids(model, n, offset=0):
    return model.tokenize(corpus()["ppl_text"] * 4)[offset:offset + n]


def expected(model, ids, k):
    """[None, (log p, top k), ...] from the log-softmax of Model.logits over the whole prompt, in float64."""
    x = model.logits(ids).astype(np.float64)                         # (N, V)
    lp = x - (x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)))[:, None]
    out = [None]
    for p in range(len(ids) - 1):
        top = np.lexsort((np.arange(lp.shape[1]), -lp[p]))[:k]      # highest first, ties to the lower id
        out.append((lp[p, ids[p + 1]], [(int(i), lp[p, i]) for i in top]))
    return out


def assert_same(got, want):
    assert len(got) == len(want) and got[0] is None
    for i, (g, w) in enumerate(zip(got[1:], want[1:]), 1):
        assert abs(g[0] - w[0]) < TOL, f"prompt token {i}: {g[0]} vs {w[0]}"
        assert [t for t, _ in g[1]] == [t for t, _ in w[1]], f"prompt token {i}: top ids differ"
        assert all(abs(a - b) < TOL for (_, a), (_, b) in zip(g[1], w[1]))


@pytest.mark.parametrize("budget", [16, 37, 512])
def test_prompt_logprobs_are_the_model_logits_any_chunking_and_batch(model, budget):
    """Prefilled in chunks of 16 or 37 tokens (block-aligned and not) or whole, beside other requests."""
    ids = text_ids(model, 70)
    eng = Engine(model, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=budget, kv_cache_mb=32,
                 scheduler="fcfs")
    others = [text_ids(model, 25, 100), text_ids(model, 50, 200)]
    outs = eng.generate([others[0], ids, others[1]],
                        [SamplingParams(max_tokens=5, temperature=0),
                         SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3),
                         SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=0)])
    assert_same(outs[1].prompt_logprobs, expected(model, ids, 3))
    assert_same(outs[2].prompt_logprobs, expected(model, others[1], 0))
    assert outs[0].prompt_logprobs is None and outs[1].finish_reason == "length"


def test_generated_tokens_and_logprobs_do_not_change(model):
    ids = text_ids(model, 40, 300)
    eng = Engine(model, max_model_len=512, max_num_seqs=2, max_num_batched_tokens=16, kv_cache_mb=16)
    plain = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=2)
    a, b = eng.generate([ids, ids], [plain, plain.replace(prompt_logprobs=1)])
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.text == b.text


def test_prefix_cache_is_not_taken_over_the_scored_prompt(model):
    """A cached prompt is computed again when its logprobs are wanted; the scoring request's own blocks serve the
    next request as a prefix hit."""
    eng = Engine(model, max_model_len=512, max_num_seqs=2, max_num_batched_tokens=64, kv_cache_mb=16)
    ids = text_ids(model, 3 * BLOCK + 5, 500)
    warm = eng.generate([ids], SamplingParams(max_tokens=2, temperature=0))[0]
    scored = eng.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0]
    assert scored.metrics.cached_tokens == 0 and scored.token_ids == warm.token_ids
    assert_same(scored.prompt_logprobs, expected(model, ids, 0))
    fresh = text_ids(model, 3 * BLOCK + 5, 700)
    first = eng.generate([fresh], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    after = eng.generate([fresh], SamplingParams(max_tokens=1, temperature=0))[0]
    assert first.metrics.cached_tokens == 0 and after.metrics.cached_tokens == 3 * BLOCK


def test_preempted_request_keeps_one_entry_per_prompt_token(model):
    """A pool too small for both requests' whole runs preempts one; its recomputation adds no prompt logprobs."""
    a_ids, b_ids = text_ids(model, 60, 900), text_ids(model, 60, 1000)
    per_block = model.runner.kv_bytes_per_block
    eng = Engine(model, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32,
                 kv_cache_mb=10 * per_block / 2 ** 20, scheduler="fcfs")
    p = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = eng.generate([a_ids, b_ids], p)
    assert eng.stats()["preemptions"] > 0
    for o, ids in zip(outs, (a_ids, b_ids)):
        assert len(o.token_ids) == 60
        assert_same(o.prompt_logprobs, expected(model, ids, 1))


def test_max_tokens_zero_scores_the_prompt_only(model):
    ids = text_ids(model, 30, 1200)
    eng = Engine(model, max_model_len=512, max_num_seqs=2, max_num_batched_tokens=16, kv_cache_mb=16)
    o = eng.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert o.finished and o.finish_reason == "length" and o.token_ids == [] and o.text == ""
    assert o.metrics.generated_tokens == 0 and o.metrics.stop_reason == "length"
    assert_same(o.prompt_logprobs, expected(model, ids, 2))
    plain = eng.generate([ids], SamplingParams(max_tokens=0))[0]     # the prompt computed (cached), nothing more
    assert plain.finish_reason == "length" and plain.token_ids == [] and plain.prompt_logprobs is None
    assert eng.stats()["kv_free_blocks"] == eng.stats()["kv_blocks"]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_prompt_logprobs_range(bad):
    with pytest.raises(SamplerError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
    with pytest.raises(SamplerError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


@pytest.mark.slow
def test_prompt_logprobs_match_the_float64_reference(model):
    """Against the log-softmax of the float64 reference forward: as close as the 4-bit weights allow (measured on
    these 40 tokens: mean |diff| 0.084, max 0.32; the greedy top-1 agrees almost everywhere)."""
    from ref_forward import RefModel, forward
    ids = text_ids(model, 40)
    eng = Engine(model, max_model_len=512, max_num_seqs=2, max_num_batched_tokens=16, kv_cache_mb=16)
    got = eng.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs
    z = forward(RefModel(model.gguf, model.config), ids)                # (N, V) float64
    lp = z - (z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)))[:, None]
    ref = np.array([lp[p, ids[p + 1]] for p in range(len(ids) - 1)])
    diff = np.abs(np.array([g[0] for g in got[1:]]) - ref)
    top1 = np.mean([g[1][0][0] == int(lp[p].argmax()) for p, g in enumerate(got[1:])])
    print(f"\nprompt logprobs vs float64 reference: mean |diff| {diff.mean():.4f}, max {diff.max():.4f}, "
          f"top-1 agreement {top1:.3f}")
    assert diff.mean() < 0.15 and diff.max() < 0.6 and top1 >= 0.85
