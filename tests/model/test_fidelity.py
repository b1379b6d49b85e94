"""Fidelity against exact math: Lumen is as close to the float64 forward of the same quantized weights
(tests/ref_forward.py) as llama.cpp is, on the golden text of tests/data/fidelity.llamacpp.json.

Two measures per position p of the text, teacher forced (the prediction of token p+1):
- KL(f64 ‖ engine) = sum_v p_ref(v) log(p_ref(v) / p_engine(v)) over the whole vocabulary, averaged over positions;
- top-1: the engine's argmax equals the reference's.
llama.cpp's per-position figures are committed (tests/data/make_fidelity.py, llama-cpp-python 0.3.36); the test
never runs llama.cpp.

The bound. Lumen rounds like llama.cpp (activations to 8-bit blocks, K/V to f16), so both land at the same
distance from exact math, and which one is closer on a given text is decided by where summation-order
differences flip a rounding. Measured on this text, in standard errors (SE) of llama.cpp's mean, KL then top-1:
- llama.cpp with flash attention on instead of off: SmolLM2 +0.75, -0.3; Gemma -0.1, +1.6;
- the reference itself with llama.cpp's roundings but exact sums: SmolLM2 +1.5, -1.3; Gemma -0.5, -0.2;
- Lumen with llama.cpp's unfused float step in the matmuls: SmolLM2 +1.6, -1.1; Gemma -1.25, +0.44;
- Lumen today (fused multiply-adds): SmolLM2 +0.47, -0.32; Gemma -1.32, +0.44;
- Lumen compiled afresh vs loaded from Numba's cache (the issue-9 difference; a longer text): +0.7, -0.9.
A strict "no worse than llama.cpp" failed on SmolLM2 before the fused step and flips with any summation-order
change. So the test asserts that Lumen is not worse than llama.cpp by more than Z = 3 SE, with SE from the committed
per-position values (std/sqrt(N) for KL, sqrt(t(1-t)/N) for top-1): the bound moves only with the committed
data, never with Lumen's result. What it resolves: Gaussian noise added to Lumen's logits fails it from 0.03 rms
(SmolLM2) and 0.07 (Gemma), see test_the_bound_catches_a_real_difference; rounding to bf16 wherever llama.cpp
rounds to f16 (K, V, q, attention weights, the 8-bit blocks' scales) fails it on SmolLM2 (+3.6 SE) but not on
Gemma (-0.3 SE), where the 8-bit activations dominate the distance.

Qwen2.5-Coder-0.5B (qwen2: QKV biases, GQA 7:1, Q5_0/Q8_0/Q4_K/Q6_K) is measured the same way on a shorter text of
its own (its entry's `text`, about 280 tokens of code and Korean): the float64 forward of its 0.5B parameters and
151,936-token head is what this test spends its time on.
"""
import json
import math

import numpy as np
import pytest

import lumen
from goldens import DATA, MODEL_NAMES
from ref_forward import RefModel, compare

Z = 3.0                 # width of the bound in standard errors of llama.cpp's mean (see the docstring)
SIGMA = 0.1             # rms of the Gaussian noise added to Lumen's logits by the can-it-fail check (fails from
                        # about 0.03 on SmolLM2, 0.07 on Gemma)
REF_KL_MAX = 0.02       # both engines are within this of the reference (measured 0.004-0.007); a wrong one is far
                        # above (measured against Lumen: Gemma's without its sliding window 2.66, either model's
                        # with the other RoPE layout 5.8-6.1)


QWEN05 = "qwen2.5-coder-0.5b"
PATH_FIXTURES = {"smollm2-135m": "smollm2_path", "gemma3-270m": "gemma3_path", QWEN05: "qwen05_path"}
# Positions per pass over the reference's head, as bytes of one implementation's logits: the head is dequantized
# again at every pass, so Gemma's 1002 positions take 8 passes at 128 MB (compare: 22.7 s, peak RSS 1.07 GB on a
# 2-vCPU Xeon) against 16 at 64 MB (31.7 s); the 0.5B's in one, as tests/data/make_fidelity.py makes it. The
# figures do not depend on it (a prefill in chunks gives the bits of one prefill).
CHUNK_BYTES = {QWEN05: 1 << 28}


@pytest.fixture(scope="module", params=[*MODEL_NAMES, QWEN05])
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_path(model_name, request):
    return request.getfixturevalue(PATH_FIXTURES[model_name])


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads((DATA / "fidelity.llamacpp.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def measured(model_name, model_path, committed):
    """Lumen's logits, and Lumen's logits plus Gaussian noise of SIGMA, against the float64 reference, over the
    committed token ids: one pass over the reference, one Lumen prefill chunk at a time."""
    g = committed["models"][model_name]
    ids = g["tokens"]
    m = lumen.load(model_path, ctx=2048, threads=2)
    m.reset()
    noise = []  # one (chunk, V) block of N(0, SIGMA^2), drawn once and added to every chunk

    def logits_of(a, b):
        assert m.n_past == a
        z = m.prefill(ids[a:b], all_logits=True)                          # (b - a, V) float32
        if not noise:
            noise.append(np.random.default_rng(0).standard_normal(z.shape, dtype=np.float32) * np.float32(SIGMA))
        return [z, z + noise[0][:b - a]]

    lum, noisy = compare(RefModel(m.gguf, m.config), ids, logits_of, n_others=2,
                         chunk_bytes=CHUNK_BYTES.get(model_name, 1 << 27))
    return g, lum, noisy


def figures(kl: np.ndarray, agree: np.ndarray) -> tuple[float, float, float, float]:
    """mean KL, its standard error, top-1 rate, its standard error."""
    n = len(kl)
    t = float(agree.mean())
    return float(kl.mean()), float(kl.std(ddof=1) / math.sqrt(n)), t, math.sqrt(t * (1 - t) / n)


def bounds(g: dict) -> tuple[float, float, float, float]:
    """llama.cpp's mean KL and top-1 (recomputed from the committed per-position values) and the bounds."""
    kl = np.asarray(g["kl"])
    agree = np.asarray(g["top1_ref"]) == np.asarray(g["top1_llamacpp"])
    k, k_se, t, t_se = figures(kl, agree)
    assert abs(k - g["kl_mean"]) < 1e-6 and abs(t - g["top1"]) < 1e-12  # the summary matches its positions
    return k, k + Z * k_se, t, t - Z * t_se


@pytest.mark.slow
def test_reference_is_the_one_measured_against(measured):
    """The reference here gives what it gave when llama.cpp's numbers were made: the same argmax at every position
    and the same loss on every next token, so the committed numbers apply to this machine's reference."""
    g, lum, _ = measured
    np.testing.assert_array_equal(lum.top_ref, g["top1_ref"])
    np.testing.assert_allclose(lum.nll_ref, g["ref_nll_next"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_reference_agrees_with_both_engines(measured):
    """Two independent engines, Lumen and llama.cpp, are both close to the reference: it computes the model."""
    g, lum, _ = measured
    assert g["kl_mean"] < REF_KL_MAX
    assert lum.kl.mean() < REF_KL_MAX


@pytest.mark.slow
def test_lumen_is_as_faithful_as_llamacpp(model_name, measured):
    g, lum, _ = measured
    k, k_se, t, t_se = figures(lum.kl, lum.top_ref == lum.top_other)
    kl_llama, kl_bound, top1_llama, top1_bound = bounds(g)
    n = len(lum.kl)
    print(f"\n{model_name}, {n} positions: KL(f64 || Lumen) {k:.6f} ± {k_se:.6f} vs llama.cpp {kl_llama:.6f} "
          f"(bound {kl_bound:.6f}, Lumen at {(k - kl_llama) / (kl_bound - kl_llama) * Z:+.2f} SE); "
          f"top-1 Lumen {t * 100:.2f}% vs llama.cpp {top1_llama * 100:.2f}% (bound {top1_bound * 100:.2f}%, "
          f"Lumen at {(t - top1_llama) / (top1_llama - top1_bound) * Z:+.2f} SE)")
    assert k <= kl_bound, f"{model_name}: KL(f64 || Lumen) {k:.6f} > llama.cpp's {kl_llama:.6f} + {Z} SE"
    assert t >= top1_bound, f"{model_name}: top-1 {t:.4f} < llama.cpp's {top1_llama:.4f} - {Z} SE"


@pytest.mark.slow
def test_the_bound_catches_a_real_difference(model_name, measured):
    """Lumen's own logits plus Gaussian noise of SIGMA rms fail the KL bound: the test can fail."""
    g, lum, noisy = measured
    k = float(noisy.kl.mean())
    kl_llama, kl_bound, _, _ = bounds(g)
    print(f"\n{model_name}: Lumen + N(0, {SIGMA}^2) noise: KL {k:.6f} vs bound {kl_bound:.6f}; top-1 "
          f"{np.mean(noisy.top_ref == noisy.top_other) * 100:.2f}%")
    assert k > kl_bound


def test_committed_figures_match_their_positions(committed):
    """The committed llama.cpp summaries (kl_mean, top1) are what their per-position values give, and the bounds
    lie beyond them: what the slow tests above measure Lumen against, checked without measuring."""
    assert set(committed["models"]) == {*MODEL_NAMES, QWEN05}
    for name, g in committed["models"].items():
        kl_llama, kl_bound, top1_llama, top1_bound = bounds(g)
        assert len(g["kl"]) == len(g["top1_ref"]) == len(g["top1_llamacpp"]) > 100, name
        assert 0 < kl_llama < kl_bound < REF_KL_MAX and 0 < top1_bound < top1_llama <= 1, name
