"""The forward pass against llama.cpp's golden outputs (tests/data) and against a float64 numpy reference.

llama.cpp rounds activations to 8 bits per block, keeps K/V in f16 and reads gelu from an f16 table; Lumen rounds
the same way, but not bit for bit (summation orders, its exp/tanh approximations). Rounding steps are
discontinuous, so a 1e-7 difference upstream flips some roundings downstream and the logits of two faithful
implementations differ by ~0.1-0.5: llama.cpp's own batched and token-by-token evaluations of the same
SmolLM2 tokens differ by a median 0.23 in their top-10 logits (measured with llama-cpp-python 0.3.36 here), and
the Gemma golden file, made with llama.cpp's repacked kernels elsewhere, differs from llama.cpp's plain kernels
here by 0.2-0.6 (tests/data/README.md). So greedy text and perplexity equal to llama.cpp's are reported (pytest -s
shows them), and asserted only loosely enough that no rounding can trip them; how close Lumen is to exact math,
against how close llama.cpp is, is asserted in test_fidelity.py.
"""
import json
import math

import numpy as np
import pytest

import lumen
from goldens import DATA, golden
from lumen.errors import ContextError
from ref_forward import RefModel, forward
from synth import write_model

GAP_NEAR_TIE = 0.1        # the near-tie: llama.cpp's own top-1 and top-2 within this
GAP_NOISE = 0.5           # divergences above the near-tie must still be below llama.cpp's own noise (see above)
# Loose guards against a broken forward (decode path included), far outside any rounding difference: Lumen's
# perplexity was -2.6% to +3.2% off the golden files' (fresh and cached compiles), and llama.cpp's own
# runs here and elsewhere agree on 376 of 384 greedy argmaxes (2 points; tests/data/README.md)
PPL_GUARD = 0.25          # relative to llama.cpp's perplexity on the same 512 tokens
TOP1_GUARD = 0.85         # agreement with llama.cpp's argmax on its own greedy tokens


@pytest.fixture(scope="module")
def models():
    return {}


def get(models, name):
    if name not in models:
        models[name] = lumen.load(name, ctx=2048, threads=2)
    return models[name]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """RMS of a - b relative to the RMS of b's rows around their means."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b - b.mean(1, keepdims=True)))


def nll_of(logits: np.ndarray, ids) -> np.ndarray:
    x = logits[:-1].astype(np.float64)
    m = x.max(1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(1))
    return lse - x[np.arange(len(ids) - 1), np.asarray(ids[1:])]


@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_greedy_matches_llamacpp(models, name):
    """48 greedy tokens per golden prompt against llama.cpp's, reported: where each diverges and llama.cpp's own
    top-1/top-2 gap there. Two faithful engines diverge wherever a rounding difference outweighs the gap, so only
    a loose guard is asserted: the first token agrees for at least half the prompts (llama.cpp's first-step gaps
    are at least 0.77 on five of the eight SmolLM2 prompts and at least 1.2 on five of the eight Gemma ones)."""
    m = get(models, name)
    g = golden(name)
    report, matched, total, first_ok = [], 0, 0, 0
    for case in g["greedy"]:
        assert m.tokenize(case["prompt"]) == case["prompt_ids"]
        out = [t.id for t in m.generate(case["prompt_ids"], max_tokens=48, temperature=0.0)]
        ref = case["ids"]
        div = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
        if div is None and len(out) != len(ref):  # one of them stopped early (end of generation)
            div = min(len(out), len(ref))
        total += len(ref)
        first_ok += div != 0
        if div is None:
            matched += len(ref)
            continue
        matched += div
        gap = case["top10"][div][0][1] - case["top10"][div][1][1]
        report.append((case["prompt"], div, round(gap, 4)))
    near = [r for r in report if r[2] < GAP_NEAR_TIE]
    print(f"\n{name}: {matched}/{total} greedy tokens before divergence; first token equal for {first_ok}/"
          f"{len(g['greedy'])} prompts; divergences (prompt, step, llama.cpp top1-top2 gap): {report}; "
          f"{len(near)} of {len(report)} at near-ties (< {GAP_NEAR_TIE})")
    assert 2 * first_ok >= len(g["greedy"]), f"{name}: the first greedy token differs for most prompts"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_teacher_forced_top1_and_perplexity(models, name):
    """Top-1 on llama.cpp's greedy tokens (prompt, then token by token: the decode path) and perplexity on 512
    tokens, reported against llama.cpp's; asserted only within the loose guards above."""
    m = get(models, name)
    g = golden(name)
    agree = total = 0
    for case in g["greedy"]:
        m.reset()
        logits = m.prefill(case["prompt_ids"])
        for step, ref in enumerate(case["top10"]):
            agree += int(np.argmax(logits)) == ref[0][0]
            total += 1
            if step + 1 < len(case["top10"]):
                logits = m.decode(case["ids"][step])
    rate = agree / total
    ids = g["ppl"]["ids"]
    logits = m.logits(ids)                                          # (512, V) float32
    # 64 rows at a time (each row's loss is computed alone, so the same bits): a float64 copy of all 512 rows of
    # Gemma's 262144-entry vocabulary would be 1 GB per temporary
    nll = np.concatenate([nll_of(logits[a:a + 65], ids[a:a + 65]) for a in range(0, len(ids) - 1, 64)]).mean()
    del logits
    ppl, ref_ppl = math.exp(nll), g["ppl"]["ppl"]
    print(f"\n{name}: teacher-forced top-1 vs llama.cpp {agree}/{total} = {rate:.3f}; ppl {ppl:.4f} vs llama.cpp "
          f"{ref_ppl:.4f} ({(ppl / ref_ppl - 1) * 100:+.2f}%)")
    assert rate >= TOP1_GUARD
    assert abs(ppl / ref_ppl - 1) < PPL_GUARD


@pytest.mark.slow
def test_gemma3_long_context_sliding_window(models):
    """Past the 512-token window (tests/data/gemma3-270m.longctx.llamacpp.json, made with llama.cpp here)."""
    m = get(models, "gemma3-270m")
    d = json.loads((DATA / "gemma3-270m.longctx.llamacpp.json").read_text())
    ids = d["tokens"]
    assert m.tokenize(d["text"]) == ids
    # teacher-forced in chunks of 32 positions (the same bits as one call): keep only each position's loss and
    # argmax, never all 1475 x 262144 logits (1.5 GB, and float64 copies of them; chunks of 128 still took the
    # test process 0.7 GB past its other peaks, most of the clean-clone CI's peak RSS)
    m.reset()
    nll, argmax = [], []
    for a in range(0, len(ids), 32):
        rows = m.prefill(ids[a:a + 32], all_logits=True)
        argmax += rows.argmax(1).tolist()
        nxt = ids[a + 1:a + 33]                                   # what each row predicts
        nll.append(nll_of(np.concatenate([rows[:len(nxt)], rows[:1]]), [ids[a]] + nxt))  # (last row: unused pad)
    nll = np.concatenate(nll)
    ref = np.asarray(d["nll_per_token"])
    tf = d["teacher_forced"]
    top1 = np.mean([argmax[p] == top[0][0] for p, top in zip(tf["positions"], tf["top10"])])
    late = np.mean([argmax[p] == top[0][0] for p, top in zip(tf["positions"], tf["top10"]) if p >= 512])
    print(f"\ngemma3 long context: nll {nll.mean():.5f} vs llama.cpp {ref.mean():.5f}; past 512: {nll[511:].mean():.5f}"
          f" vs {ref[511:].mean():.5f}; top-1 {top1:.3f} (past 512: {late:.3f})")
    assert abs(nll[511:].mean() - ref[511:].mean()) < 0.02      # without the window this is 8.28 vs 2.92
    assert abs(nll.mean() - ref.mean()) < 0.02
    assert late >= 0.9
    # greedy past the window
    gr = d["greedy"]
    out = [t.id for t in m.generate(gr["prompt_ids"], max_tokens=len(gr["ids"]))]
    div = next((i for i, (a, b) in enumerate(zip(out, gr["ids"])) if a != b), None)
    if div is not None:
        gap = gr["top10"][div][0][1] - gr["top10"][div][1][1]
        print(f"long-context greedy diverges at step {div}, llama.cpp gap {gap:.4f}")
        assert gap < GAP_NOISE


@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_prefill_chunks_and_decode_are_consistent(models, name):
    """prefill(all) == prefill(k) + decode(rest): the N>1 and N=1 kernels produce the same bits per row, and so
    does chunked prefill (n_batch smaller than the prompt)."""
    m = get(models, name)
    ids = golden(name)["ppl"]["ids"][:100]
    full = m.logits(ids)
    m.reset()
    part = m.prefill(ids[:37], all_logits=True)
    rows = [m.decode(t).copy() for t in ids[37:]]
    np.testing.assert_array_equal(part, full[:37])
    np.testing.assert_array_equal(np.stack(rows), full[37:])
    small = lumen.load(name, ctx=256, threads=2, n_batch=16)
    np.testing.assert_array_equal(small.logits(ids), full)


def test_context_overflow_is_a_clear_error(models):
    m = lumen.load("smollm2-135m", ctx=32, threads=2)
    with pytest.raises(ContextError, match="context of 32 tokens"):
        m.logits(list(range(40)))
    with pytest.raises(ContextError, match="exceeds the context"):
        list(m.generate(list(range(20)), max_tokens=20))
    m.reset()
    m.prefill(list(range(30)))
    m.decode(5)
    m.decode(6)
    with pytest.raises(ContextError):
        m.decode(7)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.logits([1, 2, 10 ** 6])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_synthetic_architectures_match_numpy_reference(tmp_path, arch):
    """Every architecture on a tiny random GGUF against the float64 numpy forward with llama.cpp's roundings."""
    path = tmp_path / f"{arch}.gguf"
    write_model(path, arch, seed=3, pre="qwen2" if arch == "qwen2" else "smollm")
    m = lumen.load(path, ctx=64, threads=2)
    ids = list(np.random.default_rng(0).integers(0, m.config.n_vocab, 40))
    got = m.logits(ids)
    ref = forward(RefModel(m.gguf, m.config, llama_numerics=True), ids)
    exact = forward(RefModel(m.gguf, m.config), ids)
    # relative RMS error over the logits' spread. Measured: 0.03-0.04 against both references (the 8-bit
    # activation rounding on random weights); the same model with the other RoPE layout is at 1.16
    assert rel_err(got, ref) < 0.1, arch
    assert rel_err(got, exact) < 0.1, arch
    assert np.mean(got.argmax(1) == exact.argmax(1)) >= 0.85


def test_tied_output_and_qwen2_bias_are_used(tmp_path):
    """Dropping output.weight ties the head to token_embd; the qwen2 biases change the result."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_model(a, "llama", drop=("output.weight",))
    m = lumen.load(a, ctx=32)
    ids = [5, 6, 7, 8]
    ref = forward(RefModel(m.gguf, m.config, llama_numerics=True), ids)
    assert rel_err(m.logits(ids), ref) < 0.1
    write_model(b, "qwen2", seed=1)
    q = lumen.load(b, ctx=32)
    with_bias = q.logits(ids)
    w = q.parts.bundle
    off, n = w.attn_q_bias[0]
    w.fvec[off:off + n] = 0.0                                                      # zero blk.0 q bias
    assert np.abs(q.logits(ids) - with_bias).max() > 1e-3


def test_logits_from_two_threads(models):
    """Model.logits from two threads: each gets its own input's logits (the runner and n_past are shared)."""
    import threading
    m = get(models, "smollm2-135m")
    a = m.tokenize("The capital of France is Paris, and the capital of Germany is Berlin. " * 6)
    b = m.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n" * 5)
    want = {0: m.logits(a), 1: m.logits(b)}
    got = {0: [], 1: []}

    def run(i, ids):
        got[i] += [m.logits(ids) for _ in range(3)]
    threads = [threading.Thread(target=run, args=x) for x in ((0, a), (1, b))]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    assert all(len(got[i]) == 3 and all(np.array_equal(g, want[i]) for g in got[i]) for i in (0, 1))
