"""Every kernel against its numpy float64 reference (lumen/kernels/reference.py), with an explicit tolerance.

Tolerances (float32 kernels against float64 references, inputs of order 1):
    RMSNorm                    rtol 1e-5, atol 1e-5
    SwiGLU / GeGLU / add       rtol 1e-5, atol 1e-5  (fast_exp is within 1e-6 relative)
    RoPE                       atol 1e-5 + 6e-8 * max_pos * max|x|: the table's float32 angles (as llama.cpp) drift
                               from the exact ones by ~ulp(pos); the table itself matches a scalar float32 replay
                               of ggml's loop (libm powf/cosf/sinf) within 2 ulp
    attention                  atol 2e-5, rtol 1e-4 (float32 scores, online softmax, float32 accumulation);
                               scores of size S >> 1 add 2e-6 * S to atol (test_attention_large_scores)
"""
import ctypes
import ctypes.util

import numpy as np
import pytest

from lumen.kernels import activation, attention, norm, rope
from lumen.kernels import reference as ref

RMS_TOL = dict(rtol=1e-5, atol=1e-5)
ACT_TOL = dict(rtol=1e-5, atol=1e-5)
ATT_TOL = dict(rtol=1e-4, atol=2e-5)


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---------------------------------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("n, dim", [(1, 576), (3, 640), (100, 576)])   # 100 x 576 takes the parallel kernel
def test_rmsnorm(rng, n, dim):
    x, w = randn(rng, n, dim, scale=3.0), randn(rng, dim)
    out = np.empty_like(x)
    assert norm.rmsnorm(out, x, w, 1e-5) is out
    np.testing.assert_allclose(out, ref.rmsnorm_ref(x, w, 1e-5), **RMS_TOL)
    want = ref.rmsnorm_ref(x, w, 1e-5)
    norm.rmsnorm(x, x, w, 1e-5)                                         # in place
    np.testing.assert_allclose(x, want, **RMS_TOL)


def test_rmsnorm_raw_kernels_agree(rng):
    x, w = randn(rng, 7, 576), randn(rng, 576)
    a, b = np.empty_like(x), np.empty_like(x)
    norm.rmsnorm_kernel(a, x, w, np.float32(1e-6))
    norm.rmsnorm_kernel_par(b, x, w, np.float32(1e-6))
    np.testing.assert_allclose(a, ref.rmsnorm_ref(x, w, 1e-6), **RMS_TOL)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n, heads", [(1, 4), (1, 1), (40, 4)])       # 40 x 4 heads takes the parallel kernel
def test_rmsnorm_heads(rng, n, heads):
    x, w = randn(rng, n, heads, 256, scale=5.0), randn(rng, 256)
    out = np.empty_like(x)
    norm.rmsnorm_heads(out, x, w, 1e-6)
    np.testing.assert_allclose(out, ref.rmsnorm_ref(x, w, 1e-6), **RMS_TOL)
    want = ref.rmsnorm_ref(x, w, 1e-6)
    norm.rmsnorm_heads(x, x, w, 1e-6)                                   # in place
    np.testing.assert_allclose(x, want, **RMS_TOL)


# ---------------------------------------------------------------------------------------------------- activations

@pytest.mark.parametrize("n", [1, 64])                                  # 64 x 1536 takes the parallel kernels
def test_swiglu_geglu(rng, n):
    gate, up = randn(rng, n, 1536, scale=4.0), randn(rng, n, 1536)
    gate[0, :8] = [-100, -30, -10, -1e-3, 0, 10, 30, 100]              # tails: exp clamps, no inf/nan
    # geglu rounds gelu's input and output to fp16 as llama.cpp does: the f32 gelu inside may sit on the other
    # side of an fp16 rounding boundary than the float64 reference's, one fp16 step (2^-10 relative) apart
    geglu_tol = dict(rtol=2.0 ** -10, atol=1e-6)
    for fn, want, tol in ((activation.swiglu, ref.swiglu_ref(gate, up), ACT_TOL),
                          (activation.geglu, ref.geglu_ref(gate, up), geglu_tol)):
        out = np.empty_like(gate)
        assert fn(out, gate, up) is out
        np.testing.assert_allclose(out, want, **tol)
        g, u = gate.copy(), up.copy()
        fn(g, g, up)                                                    # in place into gate
        np.testing.assert_allclose(g, want, **tol)
        fn(u, gate, u)                                                  # in place into up
        np.testing.assert_allclose(u, want, **ACT_TOL)


def test_silu_over_the_exp_range():
    x = np.linspace(-87, 88, 100_001).astype(np.float32)
    out = np.empty_like(x)[None]
    # fast_exp through silu(x) * 1 = x / (1 + exp(-x)) over the whole unclamped input range
    activation.swiglu_kernel(out, x[None], np.ones_like(x)[None])
    np.testing.assert_allclose(out[0], ref.silu_ref(x), rtol=2e-6, atol=1e-30)


def test_add(rng):
    for n in (1, 200):
        x, y = randn(rng, n, 576), randn(rng, n, 576)
        want = x.astype(np.float64) + y
        assert activation.add(x, y) is x
        np.testing.assert_allclose(x, want, **ACT_TOL)


# ---------------------------------------------------------------------------------------------------- RoPE

def rope_tol(x, max_pos):
    return 1e-5 + 6e-8 * max_pos * float(np.abs(x).max())


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot, head_dim", [(64, 64), (32, 64), (256, 256)])
def test_rope(rng, neox, n_rot, head_dim):
    base = 10000.0 if head_dim == 64 else 1e6
    x = randn(rng, 128, 9, head_dim)                                    # 128 x 9 rows takes the parallel kernel
    pos = rng.permutation(600)[:128]
    cos, sin = rope.rope_cache(base, n_rot, 600)
    y = x.copy()
    assert rope.rope(y, pos, cos, sin, neox) is y
    np.testing.assert_allclose(y, ref.rope_ref(x, pos, base, n_rot, neox), rtol=0, atol=rope_tol(x, 600))
    np.testing.assert_array_equal(y[..., n_rot:], x[..., n_rot:])       # dimensions past n_rot pass through
    z = x[:1].copy()                                                    # decode: serial kernel, same result
    rope.rope(z, pos[:1], cos, sin, neox)
    np.testing.assert_array_equal(z, y[:1])


@pytest.mark.parametrize("neox", [False, True])
def test_rope_far_positions(rng, neox):
    x = randn(rng, 4, 3, 64)
    pos = np.array([0, 1, 29999, 30000], dtype=np.int32)
    cos, sin = rope.rope_cache(10000.0, 64, 30001)
    y = x.copy()
    rope.rope(y, pos, cos, sin, neox)
    np.testing.assert_allclose(y, ref.rope_ref(x, pos, 10000.0, 64, neox), rtol=0, atol=rope_tol(x, 30000))
    np.testing.assert_array_equal(y[0], x[0])                           # position 0 is the identity


def test_rope_freq_factors_and_scale(rng):
    x = randn(rng, 5, 4, 64)
    pos = np.arange(100, 105)
    ff = rng.uniform(1.0, 8.0, 32).astype(np.float32)
    cos, sin = rope.rope_cache(500000.0, 64, 200, freq_scale=0.25, freq_factors=ff)
    y = x.copy()
    rope.rope(y, pos, cos, sin, False)
    want = ref.rope_ref(x, pos, 500000.0, 64, False, freq_scale=0.25, freq_factors=ff)
    np.testing.assert_allclose(y, want, rtol=0, atol=rope_tol(x, 200))


def test_rope_cache_replays_ggml_float32():
    """The table equals ggml_rope_cache_init's float32 loop (libm powf, cosf, sinf) to within 2 ulp."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    for name in ("powf", "cosf", "sinf"):
        getattr(libm, name).restype = ctypes.c_float
    libm.powf.argtypes = [ctypes.c_float, ctypes.c_float]
    libm.cosf.argtypes = libm.sinf.argtypes = [ctypes.c_float]
    base, n_rot = 10000.0, 64
    ff = np.linspace(1.0, 4.0, n_rot // 2).astype(np.float32)
    cos, sin = rope.rope_cache(base, n_rot, 30001, freq_factors=ff)
    theta_scale = np.float32(libm.powf(np.float32(base), np.float32(-2.0) / np.float32(n_rot)))
    for p in (1, 7, 1000, 4097, 30000):
        theta = np.float32(p)
        for i in range(n_rot // 2):
            t = np.float32(np.float32(1.0) * (theta / ff[i]))
            assert abs(cos[p, i] - libm.cosf(t)) <= 2.4e-7, (p, i)
            assert abs(sin[p, i] - libm.sinf(t)) <= 2.4e-7, (p, i)
            theta = np.float32(theta * theta_scale)


# ---------------------------------------------------------------------------------------------------- attention

def make_cache(rng, n_kv, ctx, hd, hd_v=None, max_ctx=None):
    max_ctx = max_ctx or ctx + 7                                        # cache longer than the filled part
    k = np.full((n_kv, max_ctx, hd), np.nan, np.float32)                # unfilled rows are NaN: must never be read
    v = np.full((n_kv, max_ctx, hd_v or hd), np.nan, np.float32)
    k[:, :ctx] = randn(rng, n_kv, ctx, hd)
    v[:, :ctx] = randn(rng, n_kv, ctx, hd_v or hd)
    return k, v


def run_attention(q, k, v, pos0, scale, window, lanes=None):
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float32)
    scratch = attention.attention_scratch(q.shape[1], v.shape[2], lanes)
    return attention.attention(out, q, k, v, pos0, scale, window, scratch)


GQA = [(4, 4), (9, 3), (8, 2), (4, 1), (6, 1)]                          # ratios 1, 3, 4, MQA x2


@pytest.mark.parametrize("n_heads, n_kv", GQA)
@pytest.mark.parametrize("n, pos0", [(1, 0), (1, 44), (20, 0), (13, 37)])   # decode, prefill, chunk after pos0
def test_attention_gqa_causal(rng, n_heads, n_kv, n, pos0):
    hd = 32
    k, v = make_cache(rng, n_kv, pos0 + n, hd)
    q = randn(rng, n, n_heads, hd)
    got = run_attention(q, k, v, pos0, hd ** -0.5, 0)
    np.testing.assert_allclose(got, ref.attention_ref(q, k, v, pos0, hd ** -0.5), **ATT_TOL)


@pytest.mark.parametrize("window", [1, 5, 19, 20, 64])
@pytest.mark.parametrize("n, pos0", [(20, 0), (1, 19), (7, 13)])
def test_attention_sliding_window(rng, window, n, pos0):
    k, v = make_cache(rng, 1, pos0 + n, 64)
    q = randn(rng, n, 4, 64)
    got = run_attention(q, k, v, pos0, 0.125, window)
    np.testing.assert_allclose(got, ref.attention_ref(q, k, v, pos0, 0.125, window), **ATT_TOL)


@pytest.mark.parametrize("ctx", [1, 2, 31, 32, 33, 63, 64, 65, 97])   # around TILE (32) multiples
@pytest.mark.parametrize("lanes", [1, 2, 3, 4])                         # split-K slices, some empty
def test_attention_decode_tiles_and_splits(rng, ctx, lanes):
    k, v = make_cache(rng, 3, ctx, 64)
    q = randn(rng, 1, 9, 64)
    got = run_attention(q, k, v, ctx - 1, 0.125, 0, lanes)
    np.testing.assert_allclose(got, ref.attention_ref(q, k, v, ctx - 1, 0.125), **ATT_TOL)


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 1, 256)])            # SmolLM2, Gemma3
def test_attention_long_context(rng, shape):
    n_heads, n_kv, hd = shape
    ctx = 1000
    k, v = make_cache(rng, n_kv, ctx, hd)
    scale = hd ** -0.5
    q1 = randn(rng, 1, n_heads, hd, scale=3.0)                          # peaky softmax
    np.testing.assert_allclose(run_attention(q1, k, v, ctx - 1, scale, 0),
                               ref.attention_ref(q1, k, v, ctx - 1, scale), **ATT_TOL)
    q = randn(rng, 5, n_heads, hd)                                      # last chunk of a prefill
    np.testing.assert_allclose(run_attention(q, k, v, ctx - 5, scale, 0),
                               ref.attention_ref(q, k, v, ctx - 5, scale), **ATT_TOL)
    np.testing.assert_allclose(run_attention(q1, k, v, ctx - 1, scale, 512),   # gemma-style window
                               ref.attention_ref(q1, k, v, ctx - 1, scale, 512), **ATT_TOL)


def test_attention_large_scores(rng):
    """Scores of a few hundred: the running max must keep exp in range (no inf/nan, right answer).

    A float32 score of size S is off by ~S * 1e-6, which scales its softmax weight by that relative amount, so the
    tolerance here grows with max |S|: atol 2e-5 + 2e-6 * max|S|."""
    k, v = make_cache(rng, 2, 100, 64)
    q = randn(rng, 6, 4, 64, scale=30.0)
    got = run_attention(q, k, v, 94, 1.0, 0)
    s_max = max(float(np.abs(q[:, h] @ k[h // 2, :100].T).max()) for h in range(4))
    assert s_max > 100
    np.testing.assert_allclose(got, ref.attention_ref(q, k, v, 94, 1.0), rtol=1e-4, atol=2e-5 + 2e-6 * s_max)


def test_attention_value_head_dim_differs(rng):
    k, v = make_cache(rng, 2, 40, 32, hd_v=48)
    q = randn(rng, 3, 4, 32)
    got = run_attention(q, k, v, 37, 0.2, 0)
    assert got.shape == (3, 4, 48)
    np.testing.assert_allclose(got, ref.attention_ref(q, k, v, 37, 0.2), **ATT_TOL)


def test_attention_raw_kernels_agree_on_decode(rng):
    """The prefill kernel with N == 1 and the split-K decode kernel give the same answer."""
    k, v = make_cache(rng, 3, 300, 64)
    q = randn(rng, 1, 9, 64)
    a, b = np.empty_like(q), np.empty_like(q)
    attention.attention_kernel(a, q, k, v, 299, np.float32(0.125), 0, *attention.attention_scratch(9, 64, 2))
    attention.attention_decode_kernel(b, q, k, v, 299, np.float32(0.125), 0, *attention.attention_scratch(9, 64, 2))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_kv_store(rng):
    k_cache, v_cache = np.zeros((3, 16, 8), np.float32), np.zeros((3, 16, 4), np.float32)
    k, v = randn(rng, 5, 3, 8), randn(rng, 5, 3, 4)
    attention.kv_store(k_cache, v_cache, k, v, 10)
    np.testing.assert_array_equal(k_cache[:, 10:15], k.transpose(1, 0, 2))
    np.testing.assert_array_equal(v_cache[:, 10:15], v.transpose(1, 0, 2))
    assert not k_cache[:, :10].any() and not k_cache[:, 15:].any() and not v_cache[:, :10].any()


def test_prefill_then_decode_matches_full_prefill(rng):
    """Consistency through the cache: prefill(all) == prefill(k) + decode(rest)."""
    n_heads, n_kv, hd, n = 4, 1, 64, 40
    q, k, v = randn(rng, n, n_heads, hd), randn(rng, n, n_kv, hd), randn(rng, n, n_kv, hd)
    kc, vc = np.zeros((n_kv, 64, hd), np.float32), np.zeros((n_kv, 64, hd), np.float32)
    attention.kv_store(kc, vc, k, v, 0)
    full = run_attention(q, kc, vc, 0, 0.125, 8)
    kc2, vc2 = np.zeros_like(kc), np.zeros_like(vc)
    attention.kv_store(kc2, vc2, k[:30], v[:30], 0)
    parts = [run_attention(q[:30], kc2, vc2, 0, 0.125, 8)]
    for t in range(30, n):
        attention.kv_store(kc2, vc2, k[t:t + 1], v[t:t + 1], t)
        parts.append(run_attention(q[t:t + 1], kc2, vc2, t, 0.125, 8))
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- validation

def test_wrappers_reject_bad_input(rng):
    x, w = randn(rng, 2, 8), randn(rng, 8)
    buf = np.zeros(32, np.float32)
    bad = [
        lambda: norm.rmsnorm(np.empty_like(x), x.astype(np.float64), w, 1e-5),            # dtype
        lambda: norm.rmsnorm(np.empty_like(x), randn(rng, 2, 16)[:, ::2], w, 1e-5),   # layout
        lambda: norm.rmsnorm(np.empty_like(x), x, w[:7], 1e-5),                           # weight length
        lambda: norm.rmsnorm(np.empty((3, 8), np.float32), x, w, 1e-5),                   # out shape
        lambda: norm.rmsnorm_heads(np.empty((1, 2, 8), np.float32), randn(rng, 1, 2, 8), w[:4], 1e-5),
        lambda: activation.swiglu(np.empty_like(x), x, randn(rng, 2, 9)),                 # up shape
        lambda: activation.geglu(np.empty_like(x), x[None], x[None]),                     # ndim
        lambda: activation.add(x, randn(rng, 3, 8)),
        lambda: activation.swiglu(buf[8:24].reshape(2, 8), buf[:16].reshape(2, 8), x),    # partial overlap
        lambda: norm.rmsnorm(buf[8:24].reshape(2, 8), buf[:16].reshape(2, 8), w, 1e-5),
        lambda: activation.swiglu(np.empty_like(x), x, x.astype(np.float16)),
        lambda: rope.rope(randn(rng, 2, 1, 8), np.array([0, 9]), *rope.rope_cache(1e4, 8, 9), True),  # pos >= table
        lambda: rope.rope(randn(rng, 2, 1, 8), np.array([0, -1]), *rope.rope_cache(1e4, 8, 9), True),
        lambda: rope.rope(randn(rng, 2, 1, 8), np.array([0.0, 1.0]), *rope.rope_cache(1e4, 8, 9), True),
        lambda: rope.rope(randn(rng, 2, 1, 8), np.array([0]), *rope.rope_cache(1e4, 8, 9), True),     # count
        lambda: rope.rope(randn(rng, 2, 1, 8), np.array([0, 1]), *rope.rope_cache(1e4, 16, 9), True),  # n_rot
        lambda: rope.rope_cache(1e4, 7, 9),                                               # odd n_rot
        lambda: rope.rope_cache(1e4, 8, 9, freq_factors=np.ones(3, np.float32)),
    ]
    k, v = np.zeros((2, 16, 8), np.float32), np.zeros((2, 16, 8), np.float32)
    q, out = randn(rng, 3, 4, 8), np.empty((3, 4, 8), np.float32)
    bad += [
        lambda: attention.attention(out, q, k, v, 14, 0.3),                                # past the cache
        lambda: attention.attention(out, q, k, v, -1, 0.3),
        lambda: attention.attention(out, randn(rng, 3, 3, 8), k, v, 0, 0.3),               # 3 heads on 2 kv heads
        lambda: attention.attention(out, randn(rng, 3, 4, 6), k, v, 0, 0.3),               # head_dim
        lambda: attention.attention(out[:2], q, k, v, 0, 0.3),                             # out shape
        lambda: attention.attention(out, q, k, v[:, :8], 0, 0.3),                          # caches differ
        lambda: attention.attention(out, q, k, v, 0, 0.3, window=-1),
        lambda: attention.attention(out, q, k.astype(np.float64), v, 0, 0.3),
        lambda: attention.attention(out, q, k, v, 0, 0.3, scratch=attention.attention_scratch(9, 8, 2)),
        lambda: attention.kv_store(k, v, randn(rng, 3, 2, 8), randn(rng, 3, 2, 8), 14),   # past the cache
        lambda: attention.kv_store(k, v, randn(rng, 3, 1, 8), randn(rng, 3, 1, 8), 0),    # kv heads
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call {i} did not raise")


@pytest.mark.parametrize("n_heads, n_kv", [(9, 3), (4, 1)])
@pytest.mark.parametrize("n, pos0, window", [(23, 0, 0), (13, 37, 0), (30, 5, 8), (11, 60, 16), (9, 0, 64)])
def test_attention_prefill_blocks_equal_tokens_one_by_one(rng, n_heads, n_kv, n, pos0, window):
    """Every token of a prefill must get, bit for bit, what the prefill kernel gives that token alone (what decode
    runs below the split-K threshold): the property behind prefill(all) == prefill(k) + decode(rest). (Blocks
    of 4 query tokens sharing each K/V row were tried and measured no faster: Gemma 1-thread prefill attention
    303 vs 273 ms per 512 tokens.)"""
    hd = 32
    k, v = make_cache(rng, n_kv, pos0 + n, hd)
    q = randn(rng, n, n_heads, hd)
    scr = attention.attention_scratch(n_heads, hd, 2)
    a = np.empty_like(q)
    attention.attention_kernel(a, q, k, v, pos0, np.float32(hd ** -0.5), window, *scr)
    for t in range(n):
        b = np.empty_like(q[t:t + 1])
        attention.attention_kernel(b, q[t:t + 1], k, v, pos0 + t, np.float32(hd ** -0.5), window, *scr)
        assert np.array_equal(a[t], b[0]), t
    np.testing.assert_allclose(a, ref.attention_ref(q, k, v, pos0, hd ** -0.5, window), **ATT_TOL)
