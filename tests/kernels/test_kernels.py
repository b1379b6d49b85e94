"""Every kernel against its numpy float64 reference (lumen/kernels/reference.py), with an explicit tolerance.

Tolerances (float32 kernels against float64 references, inputs of order 1):
    RMSNorm                    rtol 1e-5, atol 1e-5
    SwiGLU / GeGLU / add       rtol 1e-5, atol 1e-5  (fp.exp_f32 is within 2e-7 relative)
    RoPE                       atol 1e-5 + 6e-8 * max_pos * max|x|: the table's float32 angles (as llama.cpp) drift
                               from the exact ones by ~ulp(pos); the table itself matches a scalar float32 replay
                               of ggml's loop (libm powf/cosf/sinf) within 2 ulp
    attention                  atol 2e-5, rtol 1e-4 (float32 scores, online softmax, float32 accumulation; K/V are
                               f16 values, as the cache stores them); scores of size S >> 1 add 2e-6 * S to atol
                               (test_attention_large_scores). Between its own paths attention is exact: split or
                               not, alone or batched, prefill or decode give the same bits.
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


@pytest.mark.parametrize("fn", ["rmsnorm_row", "swiglu_row", "geglu_row", "add_row"])
def test_row_functions_serial_equals_parallel(rng, fn):
    """The serial row loop and the parallel region (lumen.kernels.rows) run the same row function: the same bits,
    whatever the row count."""
    from lumen.kernels.rows import rows
    fn = getattr(norm if fn == "rmsnorm_row" else activation, fn)
    x, y, w = randn(rng, 7, 576, scale=3.0), randn(rng, 7, 576), randn(rng, 576)
    a, b = np.zeros_like(x), np.zeros_like(x)
    rows(fn, 7, False, a, x, y, v=w, f=1e-6)
    rows(fn, 7, True, b, x, y, v=w, f=1e-6)
    assert np.abs(a).sum() > 0
    np.testing.assert_array_equal(a, b)
    if fn is norm.rmsnorm_row:
        np.testing.assert_allclose(a, ref.rmsnorm_ref(x, w, 1e-6), **RMS_TOL)


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
    activation.swiglu(out, x[None], np.ones_like(x)[None])
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

NAN16 = np.uint16(0x7E00)                                               # f16 NaN: every slot no token owns


def make_cache(rng, n_kv, ctx, hd, hd_v=None):
    """Contiguous K/V (n_kv, ctx, hd[_v]) with f16 values: the reference's input."""
    f16 = lambda *s: randn(rng, *s).astype(np.float16).astype(np.float32)  # noqa: E731
    return f16(n_kv, ctx, hd), f16(n_kv, ctx, hd_v or hd)


def paged(rng, k, v, spare=3):
    """The same K/V in a pool with scattered blocks (and spare ones); unused slots hold NaN."""
    n_kv, ctx, hd = k.shape
    nb = -(-ctx // attention.BLOCK) + spare
    kp, vp = attention.kv_pools(nb, n_kv, hd, v.shape[2])
    kp[:], vp[:] = NAN16, NAN16
    table = rng.permutation(nb)[None, :].astype(np.int64)
    pos = np.arange(ctx)
    attention.kv_store(kp, vp, k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy(),
                       table[0, pos // attention.BLOCK] * attention.BLOCK + pos % attention.BLOCK)
    return kp, vp, table


def run_attention(q, pools, pos0, scale, window, lanes=None, split=None):
    kp, vp, table = pools
    out = np.empty((q.shape[0], q.shape[1], vp.shape[3]), np.float32)
    scratch = attention.attention_scratch(q.shape[1], vp.shape[3], table.shape[1] * attention.BLOCK, lanes)
    positions = pos0 + np.arange(q.shape[0])
    return attention.attention(out, q, kp, vp, positions, np.zeros(q.shape[0], np.int64), table, scale, window,
                               scratch, split)


GQA = [(4, 4), (9, 3), (8, 2), (4, 1), (6, 1)]                          # ratios 1, 3, 4, MQA x2


@pytest.mark.parametrize("n_heads, n_kv", GQA)
@pytest.mark.parametrize("n, pos0", [(1, 0), (1, 44), (20, 0), (13, 37)])   # decode, prefill, chunk after pos0
def test_attention_gqa_causal(rng, n_heads, n_kv, n, pos0):
    hd = 32
    k, v = make_cache(rng, n_kv, pos0 + n, hd)
    q = randn(rng, n, n_heads, hd)
    got = run_attention(q, paged(rng, k, v), pos0, hd ** -0.5, 0)
    np.testing.assert_allclose(got, ref.attention_ref(q, k, v, pos0, hd ** -0.5), **ATT_TOL)


@pytest.mark.parametrize("window", [1, 5, 19, 20, 64])
@pytest.mark.parametrize("n, pos0", [(20, 0), (1, 19), (7, 13)])
def test_attention_sliding_window(rng, window, n, pos0):
    k, v = make_cache(rng, 1, pos0 + n, 64)
    q = randn(rng, n, 4, 64)
    got = run_attention(q, paged(rng, k, v), pos0, 0.125, window)
    np.testing.assert_allclose(got, ref.attention_ref(q, k, v, pos0, 0.125, window), **ATT_TOL)


@pytest.mark.parametrize("ctx", [1, 2, 15, 16, 17, 127, 128, 129, 300, 513])   # around BLOCK and CHUNK
@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_attention_split_decode_is_the_same_bits(rng, ctx, lanes):
    """A decode token gets the same bits from the split-K kernel (its chunks spread over `lanes` threads, some
    idle) as from the per-token kernel, and the right answer."""
    k, v = make_cache(rng, 3, ctx, 64)
    pools = paged(rng, k, v)
    q = randn(rng, 1, 9, 64)
    split = run_attention(q, pools, ctx - 1, 0.125, 0, lanes, split=True)
    whole = run_attention(q, pools, ctx - 1, 0.125, 0, lanes, split=False)
    np.testing.assert_array_equal(split, whole)
    np.testing.assert_allclose(split, ref.attention_ref(q, k, v, ctx - 1, 0.125), **ATT_TOL)


@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 1, 256)])            # SmolLM2, Gemma3
def test_attention_long_context(rng, shape):
    n_heads, n_kv, hd = shape
    ctx = 1000
    k, v = make_cache(rng, n_kv, ctx, hd)
    pools = paged(rng, k, v)
    scale = hd ** -0.5
    q1 = randn(rng, 1, n_heads, hd, scale=3.0)                          # peaky softmax
    np.testing.assert_allclose(run_attention(q1, pools, ctx - 1, scale, 0),
                               ref.attention_ref(q1, k, v, ctx - 1, scale), **ATT_TOL)
    q = randn(rng, 5, n_heads, hd)                                      # last chunk of a prefill
    np.testing.assert_allclose(run_attention(q, pools, ctx - 5, scale, 0),
                               ref.attention_ref(q, k, v, ctx - 5, scale), **ATT_TOL)
    np.testing.assert_allclose(run_attention(q1, pools, ctx - 1, scale, 512),   # gemma-style window
                               ref.attention_ref(q1, k, v, ctx - 1, scale, 512), **ATT_TOL)


def test_attention_large_scores(rng):
    """Scores of a few hundred: the running max must keep exp in range (no inf/nan, right answer).

    A float32 score of size S is off by ~S * 1e-6, which scales its softmax weight by that relative amount, so the
    tolerance here grows with max |S|: atol 2e-5 + 2e-6 * max|S|."""
    k, v = make_cache(rng, 2, 100, 64)
    q = randn(rng, 6, 4, 64, scale=30.0)
    got = run_attention(q, paged(rng, k, v), 94, 1.0, 0)
    s_max = max(float(np.abs(q[:, h] @ k[h // 2, :100].T).max()) for h in range(4))
    assert s_max > 100
    np.testing.assert_allclose(got, ref.attention_ref(q, k, v, 94, 1.0), rtol=1e-4, atol=2e-5 + 2e-6 * s_max)


def test_attention_value_head_dim_differs(rng):
    k, v = make_cache(rng, 2, 40, 32, hd_v=48)
    q = randn(rng, 3, 4, 32)
    got = run_attention(q, paged(rng, k, v), 37, 0.2, 0)
    assert got.shape == (3, 4, 48)
    np.testing.assert_allclose(got, ref.attention_ref(q, k, v, 37, 0.2), **ATT_TOL)


def test_kv_store_writes_f16_into_block_slots(rng):
    kp, vp = attention.kv_pools(4, 3, 8, 16)
    k, v = randn(rng, 5, 3, 8), randn(rng, 5, 3, 16)
    slots = np.array([33, 34, 7, 0, 63])                                # blocks 2, 2, 0, 0, 3
    attention.kv_store(kp, vp, k, v, slots)
    for t, s in enumerate(slots):
        b, j = divmod(int(s), attention.BLOCK)
        np.testing.assert_array_equal(kp[b, :, :, j].view(np.float16), k[t].astype(np.float16))
        np.testing.assert_array_equal(vp[b, :, j, :].view(np.float16), v[t].astype(np.float16))
    written = np.zeros((4, attention.BLOCK), bool)
    written.flat[slots] = True
    assert not kp.transpose(0, 3, 1, 2)[~written].any() and not vp.transpose(0, 2, 1, 3)[~written].any()


def test_prefill_then_decode_matches_full_prefill(rng):
    """Consistency through the cache, bit for bit: prefill(all) == prefill(k) + decode(rest)."""
    n_heads, n_kv, hd, n = 4, 1, 64, 300
    q, k, v = randn(rng, n, n_heads, hd), randn(rng, n, n_kv, hd), randn(rng, n, n_kv, hd)
    kp, vp = attention.kv_pools(32, n_kv, hd, hd)
    table = np.arange(32, dtype=np.int64)[None]
    attention.kv_store(kp, vp, k, v, np.arange(n))
    full = run_attention(q, (kp, vp, table), 0, 0.125, 200)
    kp2, vp2 = attention.kv_pools(32, n_kv, hd, hd)
    attention.kv_store(kp2, vp2, k[:30], v[:30], np.arange(30))
    parts = [run_attention(q[:30], (kp2, vp2, table), 0, 0.125, 200)]
    for t in range(30, n):
        attention.kv_store(kp2, vp2, k[t:t + 1], v[t:t + 1], np.array([t]))
        parts.append(run_attention(q[t:t + 1], (kp2, vp2, table), t, 0.125, 200))
    np.testing.assert_array_equal(np.concatenate(parts), full)


def test_attention_is_batch_invariant(rng):
    """Tokens of different sequences in one call (a ragged batch, own block tables, own positions) get the bits
    each gets alone; a NaN in one sequence's cache stays in that sequence."""
    n_heads, n_kv, hd = 9, 3, 64
    lens = [5, 140, 1, 300]
    caches = [make_cache(rng, n_kv, n, hd) for n in lens]
    nb = sum(-(-n // attention.BLOCK) for n in lens) + 2
    kp, vp = attention.kv_pools(nb, n_kv, hd, hd)
    kp[:], vp[:] = NAN16, NAN16
    free = list(rng.permutation(nb))
    table = np.zeros((len(lens), 20), np.int64)
    for s, (n, (k, v)) in enumerate(zip(lens, caches)):
        blocks = [free.pop() for _ in range(-(-n // attention.BLOCK))]
        table[s, :len(blocks)] = blocks
        pos = np.arange(n)
        attention.kv_store(kp, vp, k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy(),
                           table[s, pos // attention.BLOCK] * attention.BLOCK + pos % attention.BLOCK)
    # the step: the last 3 tokens of seq 1, the last token of each other sequence
    seqs = np.array([1, 1, 1, 0, 2, 3])
    positions = np.array([137, 138, 139, 4, 0, 299])
    q = randn(rng, len(seqs), n_heads, hd)
    scratch = attention.attention_scratch(n_heads, hd, 20 * attention.BLOCK, 2)
    out = np.empty_like(q)
    attention.attention(out, q, kp, vp, positions, seqs, table, 0.125, 0, scratch)
    for t in range(len(seqs)):
        alone = np.empty_like(q[:1])
        attention.attention(alone, q[t:t + 1], kp, vp, positions[t:t + 1], seqs[t:t + 1], table, 0.125, 0, scratch)
        np.testing.assert_array_equal(alone[0], out[t])
        k, v = caches[seqs[t]]
        np.testing.assert_allclose(out[t], ref.attention_ref(q[t:t + 1], k, v, positions[t], 0.125)[0], **ATT_TOL)
    b, j = table[2, 0], 0                                               # poison sequence 2's only key
    kp[b, :, 0, j] = NAN16
    attention.attention(out, q, kp, vp, positions, seqs, table, 0.125, 0, scratch)
    assert np.isnan(out[4]).all() and not np.isnan(np.delete(out, 4, axis=0)).any()


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
    kp, vp = attention.kv_pools(2, 2, 16, 16)                           # 32 slots
    q, out = randn(rng, 3, 4, 16), np.empty((3, 4, 16), np.float32)
    T, S0 = np.arange(2)[None], np.zeros(3, np.int64)
    P = np.arange(3)
    bad += [
        lambda: attention.attention(out, q, kp, vp, P + 30, S0, T, 0.3),                  # past the table
        lambda: attention.attention(out, q, kp, vp, P - 1, S0, T, 0.3),
        lambda: attention.attention(out, q, kp, vp, P, S0 + 1, T, 0.3),                   # no such sequence
        lambda: attention.attention(out, q, kp, vp, P, S0, T + 5, 0.3),                   # blocks outside the pool
        lambda: attention.attention(out, randn(rng, 3, 3, 16), kp, vp, P, S0, T, 0.3),    # 3 heads on 2 kv heads
        lambda: attention.attention(out, randn(rng, 3, 4, 12), kp, vp, P, S0, T, 0.3),    # head_dim
        lambda: attention.attention(out[:2], q, kp, vp, P, S0, T, 0.3),                   # out shape
        lambda: attention.attention(out, q, kp, vp[:1], P, S0, T, 0.3),                   # pools differ
        lambda: attention.attention(out, q, kp, vp, P, S0, T, 0.3, window=-1),
        lambda: attention.attention(out, q, kp.astype(np.float32), vp, P, S0, T, 0.3),
        lambda: attention.attention(out, q, kp, vp, P, S0, T, 0.3, scratch=attention.attention_scratch(9, 8, 32)),
        lambda: attention.attention(out, q, kp, vp, P, S0, T, 0.3, split=True),            # split takes one token
        lambda: attention.kv_store(kp, vp, randn(rng, 3, 2, 16), randn(rng, 3, 2, 16), P + 30),  # past the pool
        lambda: attention.kv_store(kp, vp, randn(rng, 3, 1, 16), randn(rng, 3, 1, 16), P),       # kv heads
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call {i} did not raise")


@pytest.mark.parametrize("n_heads, n_kv", [(9, 3), (4, 1)])
@pytest.mark.parametrize("n, pos0, window", [(23, 0, 0), (13, 37, 0), (30, 5, 8), (11, 60, 16), (9, 0, 64),
                                             (40, 250, 0), (20, 500, 300)])
def test_attention_prefill_blocks_equal_tokens_one_by_one(rng, n_heads, n_kv, n, pos0, window):
    """Every token of a prefill gets, bit for bit, what it gets alone (a decode step): the property behind
    prefill(all) == prefill(k) + decode(rest), across block and chunk boundaries and sliding windows."""
    hd = 32
    k, v = make_cache(rng, n_kv, pos0 + n, hd)
    pools = paged(rng, k, v)
    q = randn(rng, n, n_heads, hd)
    a = run_attention(q, pools, pos0, hd ** -0.5, window, lanes=2)
    for t in range(n):
        b = run_attention(q[t:t + 1], pools, pos0 + t, hd ** -0.5, window, lanes=2)
        assert np.array_equal(a[t], b[0]), t
    np.testing.assert_allclose(a, ref.attention_ref(q, k, v, pos0, hd ** -0.5, window), **ATT_TOL)


def test_row_functions_refuse_other_types(rng):
    """A row function is compiled for one signature (lumen.kernels.rows.ROW_SIGNATURE) and called through its
    address, so nothing would convert a strided view: compiling a call with one is a TypingError, not wrong rows."""
    from numba.core.errors import TypingError

    from lumen.kernels.rows import NO_P, NO_V, row_address, run_rows
    x = randn(rng, 4, 64)
    with pytest.raises(TypingError, match="compiled for"):
        run_rows(row_address(activation.add_row), False, 4, x[:, ::2], x[:, ::2], x[:, ::2], NO_V, NO_P,
                 np.float32(0), np.int64(0))


def test_row_ops_refuse_a_read_only_output(rng):
    """The row functions write through the output's data pointer (lumen.kernels.rows), which a read-only array
    does not stop: the checked wrappers refuse it, and leave it as it was."""
    x, w = randn(rng, 3, 64), randn(rng, 64)
    ro = x.copy()
    ro.setflags(write=False)
    before = ro.copy()
    cos, sin = rope.rope_cache(10000.0, 64, 8)
    for call in (lambda: norm.rmsnorm(ro, x, w, 1e-6), lambda: activation.swiglu(ro, x, x),
                 lambda: activation.add(ro, x), lambda: rope.rope(ro.reshape(3, 1, 64), np.arange(3), cos, sin, True),
                 lambda: norm.rmsnorm_heads(ro.reshape(3, 1, 64), x.reshape(3, 1, 64), w, 1e-6)):
        with pytest.raises(ValueError, match="writeable"):
            call()
    np.testing.assert_array_equal(ro, before)
