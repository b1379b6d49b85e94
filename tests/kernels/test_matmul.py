"""Quantized matmul against the float64 numpy reference, for every type and both paths.

The kernels first round the activations the way llama.cpp does for the weight type (Q8_0-style blocks of 32 with
an f16 scale, Q8_K blocks of 256 with an f32 scale, f16, bf16 or nothing: lumen.quants.round_activations_ref is
the numpy reference of that rounding), then compute exact integer or float products. So the reference is
x_hat @ W.T in float64, with x_hat = round_activations_ref(x) and W = dequantize_ref(raw), and what remains is
float32 rounding: scale products, per-group float accumulation and the folded offsets (o = m + 8d etc., bounded
by a few times the block's max |W|), covered by 1e-5 * sum_k blockmax|W[r,k]| * |x_hat[n,k]| per element. A
rounding of q that lands on a different integer because of float32 ties could add one step d of one activation
for one element; that is covered by adding max|W[r]| * max step of the row (a tie needs x*inv to be exactly
k + 0.5 in float32, so it is rare but possible on random data). The relative Frobenius error against |x_hat| @ |W|.T
must stay < 1e-5.
"""
import gguf
import numpy as np
import pytest

from lumen.format.gguf import GGUFFile
from lumen.kernels.matmul import matmul, matmul_batched, matvec, prepare
from lumen.kernels.policy import PAD_MIN_IN, UNPACKED
from lumen.format.quants import QT, SUPPORTED, dequantize_ref, quant_info, round_activations_ref, row_bytes

ALL = sorted(SUPPORTED, key=int)
FLOAT_TYPES = {QT.F32, QT.F16, QT.BF16}
F16_FIELDS = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2),
              QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def make_weight(qtype, d_out, n_in, rng) -> np.ndarray:
    """Raw bytes (d_out, row_bytes) u8: random blocks with finite f16 scales of moderate spread."""
    if qtype in FLOAT_TYPES:
        w = rng.standard_normal((d_out, n_in)).astype(np.float32)
        if qtype == QT.F32:
            return w.view(np.uint8)
        return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(d_out, -1)
    info = quant_info(qtype)
    raw = rng.integers(0, 256, size=(d_out, row_bytes(qtype, n_in)), dtype=np.uint8)
    blocks = raw.reshape(-1, info.type_size)
    for off in F16_FIELDS[qtype]:
        v = rng.standard_normal(blocks.shape[0]) * np.exp(rng.uniform(-2, 2, blocks.shape[0])) * 0.01
        blocks[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def bound(xh: np.ndarray, W: np.ndarray) -> np.ndarray:
    """Per-element float32 rounding bound (N, d_out) for out = xh @ W.T (module docstring)."""
    x64 = np.abs(xh.astype(np.float64))
    aw = np.abs(W)
    n_in = W.shape[1]
    g = 32 if n_in % 32 == 0 else 1
    wmax = aw.reshape(W.shape[0], -1, g).max(axis=2).repeat(g, axis=1)
    return 1e-5 * (x64 @ wmax.T) + 1e-30


def check(out: np.ndarray, x: np.ndarray, W: np.ndarray, qtype):
    xh = round_activations_ref(x, qtype)
    ref = xh.astype(np.float64) @ W.T
    err = np.abs(out.astype(np.float64) - ref)
    tol = bound(xh, W)
    bad = err > tol
    if bad.any():  # allow one activation step (a float32 rounding tie in q) on a few elements
        step = np.abs(x.astype(np.float64)).max(axis=1, keepdims=True) / 127.0
        tie = tol + step * np.abs(W).max(axis=1)[None, :]
        worst = np.unravel_index(np.argmax(err - tie), err.shape)
        assert (err <= tie).all(), f"{QT(qtype).name}: error {err[worst]:.3e} > bound {tie[worst]:.3e} at {worst}"
        assert bad.mean() < 1e-3, f"{QT(qtype).name}: {bad.sum()} elements off by more than float rounding"
    scale = np.linalg.norm(np.abs(xh.astype(np.float64)) @ np.abs(W).T)   # no cancellation in this one
    rel = np.linalg.norm(out - ref) / max(scale, 1e-30)
    assert rel < 1e-5, f"{QT(qtype).name}: relative error {rel:.2e}"


@pytest.fixture(scope="module")
def weights():
    """qtype -> (raw, packed, W f64) for a (100, 512) weight: 100 rows = one full tile of 64 and a partial one."""
    rng = np.random.default_rng(1)
    res = {}
    for qtype in ALL:
        raw = make_weight(qtype, 100, 512, rng)
        res[qtype] = raw, prepare(raw, qtype), dequantize_ref(raw, qtype, (100, 512)).astype(np.float64)
    return res


@pytest.mark.parametrize("N", [1, 3, 32, 70])
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_matmul_every_type(weights, qtype, N):
    raw, packed, W = weights[qtype]
    x = np.random.default_rng(N).standard_normal((N, 512)).astype(np.float32)
    x[0, :32] *= 100.0                              # one loud block, as real activations have
    out = np.full((N, 100), np.nan, np.float32)
    matmul(out, x, packed, qtype)
    check(out, x, W, qtype)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_batched_equals_matvec_row_by_row(weights, qtype):
    """Both paths round the activations identically and differ only in float summation order."""
    raw, packed, W = weights[qtype]
    x = np.random.default_rng(5).standard_normal((9, 512)).astype(np.float32)
    batched = np.empty((9, 100), np.float32)
    matmul_batched(batched, x, packed, qtype)
    rows = np.empty((9, 100), np.float32)
    for n in range(9):
        matvec(rows[n:n + 1], x[n:n + 1], packed, qtype)
    tol = bound(round_activations_ref(x, qtype), W)
    assert (np.abs(batched.astype(np.float64) - rows) <= tol).all()
    one = np.empty((1, 100), np.float32)                  # the batched path also takes N = 1
    matmul_batched(one, x[:1], packed, qtype)
    np.testing.assert_allclose(one[0], batched[0], rtol=1e-5, atol=1e-6 * np.abs(batched[0]).max())


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_two_and_three_rows_have_the_bits_of_any_batch(qtype):
    """3 rows of a wide matrix (lumen.kernels.policy.pad_rows) run as one pass over activations padded to 4 rows,
    2 rows as one two-row pass over the whole tile, 6 and 7 as a pass of 4 and a two-row pass (and a row alone):
    each row's bits are those it gets in a batch of 9 (passes of 4 and a single row), and alone (the decode
    kernel)."""
    n_in = PAD_MIN_IN
    rng = np.random.default_rng(7)
    packed = prepare(make_weight(qtype, 100, n_in, rng), qtype)
    x = rng.standard_normal((9, n_in)).astype(np.float32)
    batch = np.empty((9, 100), np.float32)
    matmul_batched(batch, x, packed, qtype)
    for n in (2, 3, 6, 7):
        for first in (0, 9 - n):                          # rows of a full pass of the 9, and the last ones
            out = np.full((n, 100), np.nan, np.float32)
            matmul_batched(out, np.ascontiguousarray(x[first:first + n]), packed, qtype)
            assert np.array_equal(out, batch[first:first + n]), (n, first)
    one = np.empty((1, 100), np.float32)
    matvec(one, x[8:9], packed, qtype)
    assert np.array_equal(one, batch[8:9])


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q6_K, QT.F16], ids=lambda t: t.name)
def test_raw_weight_same_as_packed(weights, qtype):
    raw, packed, W = weights[qtype]
    x = np.random.default_rng(6).standard_normal((3, 512)).astype(np.float32)
    a, b = np.empty((3, 100), np.float32), np.empty((3, 100), np.float32)
    matmul(a, x, raw, qtype)
    matmul(b, x, packed, qtype)
    assert np.array_equal(a, b)


def test_odd_float_width():
    """F32/F16/BF16 have block size 1: n_in need not be a multiple of 32."""
    rng = np.random.default_rng(2)
    for qtype in FLOAT_TYPES:
        raw = make_weight(qtype, 7, 45, rng)
        W = dequantize_ref(raw, qtype, (7, 45)).astype(np.float64)
        for N in (1, 5):
            x = rng.standard_normal((N, 45)).astype(np.float32)
            out = np.empty((N, 7), np.float32)
            matmul(out, x, raw, qtype)
            check(out, x, W, qtype)


@pytest.mark.parametrize("qtype", [QT(t) for t in UNPACKED], ids=lambda t: t.name)
def test_unpacked_tiles_give_the_same_bits(weights, qtype):
    """From lumen.kernels.policy.unpack_rows's rows on, a matmul unpacks each tile once and its passes read the bytes
    (prefill); below, each pass unpacks as it goes, and one row runs the decode kernel. A row's bits must be the
    same on all three paths, whatever the other rows."""
    import numba
    from lumen.format.quants import ACT_FORMAT
    from lumen.kernels.kinds import ALL as KINDS
    from lumen.kernels.layout import R
    from lumen.kernels.matmul import mat, matmul_kernel, new_acts, prepare_x, unpack_scratch
    from lumen.kernels.policy import unpack_min_rows, unpack_rows
    from lumen.kernels.scratch import per_thread
    from lumen.kernels.work import counters
    raw, packed, W = weights[qtype]
    N = unpack_min_rows(int(qtype)) + 3                   # NR-row passes and 3 rows one at a time
    assert unpack_rows(N, int(qtype)) and not unpack_rows(N - 4, int(qtype))
    x = np.random.default_rng(8).standard_normal((N, 512)).astype(np.float32)
    x[5] *= 1e3
    fmt = ACT_FORMAT[QT(qtype)]
    acts = new_acts(N, 512, fmt)
    prepare_x(acts, x, fmt)
    th = numba.get_num_threads()
    m = mat(packed)
    outs = {}
    for name, wbuf in (("unpacked", unpack_scratch(th, 512)), ("as it goes", unpack_scratch(th, 512, 1))):
        out = np.full((N, 100), np.nan, np.float32)
        matmul_kernel((out, out, out), (m, m, m), 1, acts, per_thread((th, R), np.float32), wbuf, counters(th),
                      KINDS)
        outs[name] = out
    rows = np.empty((N, 100), np.float32)
    for n in range(N):
        matvec(rows[n:n + 1], x[n:n + 1], packed, qtype)
    assert np.array_equal(outs["unpacked"], outs["as it goes"])
    assert np.array_equal(outs["unpacked"], rows)
    check(outs["unpacked"], x, W, qtype)


@pytest.mark.parametrize("fmt", ["q8", "q8k"])
def test_activation_rounding_parallel_equals_serial(fmt):
    """prepare_x spreads the rows of a large N over the threads (lumen.kernels.policy.parallel_quantize): every
    field must equal the serial rounding's bits, NaNs are skipped by the block maximum as the scalar rule does,
    and the rows past N are zeroed."""
    import numba
    from lumen.format.quants import ACT_Q8, ACT_Q8K
    from lumen.kernels.matmul import quantize_address, quantize_x
    from lumen.kernels.policy import parallel_quantize
    act = ACT_Q8 if fmt == "q8" else ACT_Q8K
    rng = np.random.default_rng(21)
    N, Np, n = 70, 73, 512
    x = (rng.standard_normal((N, n)) * np.exp(rng.uniform(-3, 3, (N, 1)))).astype(np.float32)
    x[3, :256] = 0.0                                  # all-zero blocks: scale 0, q 0
    x[5, 7] = np.nan                                  # a NaN is skipped by the maximum
    x[6, 40] = -1e4                                   # a loud negative value (Q8_K's max keeps its sign)
    assert parallel_quantize(N, n)
    G = n // 32

    def fields():
        return [np.full((Np, n), 99, np.int8), np.full((Np, G), 9.0, np.float32), np.full((Np, G), 9.0, np.float32),
                np.full((Np, G, 2), 9, np.int32)]
    serial, par = fields(), fields()
    quantize_x(*serial, x, act, quantize_address(), False)
    for threads in sorted({1, numba.get_num_threads()}):
        numba.set_num_threads(threads)
        try:
            quantize_x(*par, x, act, quantize_address(), True)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        for a, b in zip(serial, par):
            assert np.array_equal(a, b)
    for a in serial:
        assert not a[N:].any()
    assert not serial[0][3, :256].any() and not serial[1][3, :8].any()
    def scale(row, b0):                               # the block's scale by the rule of quantize_x's docstring
        blk = x[row, b0:b0 + (32 if act == ACT_Q8 else 256)]
        a = np.abs(blk[~np.isnan(blk)])
        if act == ACT_Q8:
            return np.float32(np.float16(a.max() / np.float32(127)))
        return np.float32(1) / (np.float32(-127) / blk[np.flatnonzero(np.abs(blk) == a.max())[0]])
    assert serial[1][5, 0] == scale(5, 0)
    assert serial[1][6, 1] == scale(6, 32 if act == ACT_Q8 else 0) > 0


# ---- real weights, real shapes

SMOLLM2_SHAPES = {"blk.0.attn_q.weight": (576, 576), "blk.0.attn_k.weight": (192, 576),
                  "blk.0.ffn_up.weight": (1536, 576), "blk.0.ffn_down.weight": (576, 1536),
                  "token_embd.weight": (49152, 576)}
GEMMA3_SHAPES = {"blk.0.attn_q.weight": (1024, 640), "blk.0.attn_k.weight": (256, 640),
                 "blk.0.attn_v.weight": (256, 640), "blk.0.ffn_gate.weight": (2048, 640),
                 "blk.0.ffn_down.weight": (640, 2048), "blk.0.attn_output.weight": (640, 1024)}


def real_case(path, shapes):
    """(name, qtype, raw (d_out, row_bytes) u8, (d_out, n_in)) of the named tensors, read with lumen.gguf
    (test_gguf.py checks it against gguf-py, whose reader takes about 700 MB and 15-50 s on Gemma's vocabulary)."""
    g = GGUFFile(path)
    for name, (d_out, n_in) in shapes.items():
        t = g.tensors[name]
        assert t.dims == (n_in, d_out)
        yield name, QT(int(t.qtype)), t.data, (d_out, n_in)


CHECK_ROWS = 4096  # the float64 reference of a large matrix is built and checked this many output rows at a time


def check_real(path, shapes, types):
    rng = np.random.default_rng(11)
    seen = set()
    for name, qtype, raw, (d_out, n_in) in real_case(path, shapes):
        packed = prepare(raw, qtype)
        for N in (1, 32) if d_out <= 4096 else (1, 5):
            x = rng.standard_normal((N, n_in)).astype(np.float32)
            out = np.empty((N, d_out), np.float32)
            matmul(out, x, packed, qtype)
            for r in range(0, d_out, CHECK_ROWS):  # SmolLM2's head in float64 whole: 226 MB, x3 inside check
                rows = slice(r, min(r + CHECK_ROWS, d_out))
                W = dequantize_ref(raw[rows], qtype, (rows.stop - r, n_in)).astype(np.float64)
                check(np.ascontiguousarray(out[:, rows]), x, W, qtype)
        seen.add((name, qtype))
    assert len(seen) == len(shapes)
    assert {q for _, q in seen} == types


@pytest.mark.slow
def test_smollm2_real_shapes(smollm2_path):
    check_real(smollm2_path, SMOLLM2_SHAPES, {QT.Q4_1, QT.Q8_0})


def test_gemma3_real_shapes(gemma3_path):
    check_real(gemma3_path, GEMMA3_SHAPES, {QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K})


# ---- refusing what the kernels would read out of bounds

def test_bad_inputs_raise(weights):
    raw, packed, W = weights[QT.Q4_1]
    x = np.zeros((2, 512), np.float32)
    out = np.zeros((2, 100), np.float32)
    bad = [
        (np.zeros((2, 511), np.float32), out, "columns"),
        (x, np.zeros((2, 99), np.float32), "shape"),
        (x, np.zeros((3, 100), np.float32), "shape"),
        (x.astype(np.float64), out, "float32"),
        (x, out.astype(np.float64), "float32"),
        (np.zeros((2, 1024), np.float32)[:, ::2], out, "contiguous"),
        (np.zeros(512, np.float32), out, "2D"),
        (np.zeros((0, 512), np.float32), np.zeros((0, 100), np.float32), "at least one"),
    ]
    for xx, oo, msg in bad:
        for f in (matmul, matmul_batched):
            with pytest.raises(ValueError, match=msg):
                f(oo, xx, packed, QT.Q4_1)
    with pytest.raises(ValueError, match="one activation row"):
        matvec(out, x, packed, QT.Q4_1)
    with pytest.raises(ValueError, match="Q4_1"):
        matmul(out, x, packed, QT.Q8_0)
    ro = np.zeros((2, 100), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        matmul(ro, x, packed, QT.Q4_1)
    buf = np.zeros(1024, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        matmul_batched(buf[100:300].reshape(2, 100), buf.reshape(2, 512), packed, QT.Q4_1)
    with pytest.raises(ValueError, match="uint8"):
        prepare(raw.view(np.int8), QT.Q4_1)
    with pytest.raises(ValueError, match="blocks"):
        prepare(raw[:, :39], QT.Q4_1)
    with pytest.raises(ValueError, match="blocks"):
        prepare(np.zeros((4, 10), np.uint8), QT.Q4_1)   # half a block


PORTABLE_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K)
PORTABLE_ROWS = (3, 1, 67)   # a two-row pass and a row; the decode kernel; NR-row passes (Q5_0, Q6_K: over tiles
                             # unpacked first), a two-row pass and a row

PORTABLE_SCRIPT = r"""
import sys, numpy as np
import numba
import lumen.kernels.simd as simd
assert not simd.VNNI
from lumen.format.quants import ACT_FORMAT
from lumen.kernels.kinds import kinds
from lumen.kernels.layout import R
from lumen.kernels.matmul import mat, matmul_kernel, new_acts, prepare, prepare_x, unpack_scratch
from lumen.kernels.scratch import per_thread
from lumen.kernels.work import counters
sys.path.insert(0, sys.argv[1])
from test_matmul import PORTABLE_ROWS, PORTABLE_TYPES, make_weight
# compiled for the tested types only (an all-types build compiles every type's portable kernels: slow)
KINDS = kinds(mats=PORTABLE_TYPES, embd=(), acts=())
th = numba.get_num_threads()
rng = np.random.default_rng(7)
out = {}
for qt in PORTABLE_TYPES:
    raw = make_weight(qt, 80, 512, rng)
    p = prepare(raw, qt)
    for n in PORTABLE_ROWS:
        x = rng.standard_normal((n, 512)).astype(np.float32)
        acts = new_acts(n, 512, ACT_FORMAT[qt])
        prepare_x(acts, x, ACT_FORMAT[qt])
        o = np.zeros((n, 80), np.float32)
        m = mat(p)
        matmul_kernel((o, o, o), (m, m, m), 1, acts, per_thread((th, R), np.float32), unpack_scratch(th, 512),
                      counters(th), KINDS)
        out[f"{qt.name}_{n}"] = o
np.savez(sys.argv[2], **out)
"""


@pytest.mark.slow
def test_portable_ir_gives_the_same_bits(tmp_path):
    """Without AVX512-VNNI (forced by LUMEN_NO_VNNI=1, own Numba cache) the tile kernels compile to vpmaddubsw
    (AVX512BW or AVX2, lumen.kernels.simd.MADD) or portable vector IR; the integer sums, and so every output bit,
    must equal the vpdpbusd path's: the decode kernel, the two-row and the NR-row passes, and (Q5_0, Q6_K at 67
    rows) the passes over tiles unpacked first."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    import lumen.kernels.simd as simd
    env = dict(os.environ, LUMEN_NO_VNNI="1", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    res = tmp_path / "portable.npz"
    subprocess.run([sys.executable, "-c", PORTABLE_SCRIPT, str(Path(__file__).parent), str(res)], env=env,
                   check=True, timeout=600)
    assert_bits_of_this_build(np.load(res), simd.VNNI)


def assert_bits_of_this_build(got, *why):
    """got (PORTABLE_SCRIPT's outputs from another build) equals this build's, bit for bit, for every type and
    row count, and holds the float64 reference's bound."""
    rng = np.random.default_rng(7)
    for qt in PORTABLE_TYPES:
        raw = make_weight(qt, 80, 512, rng)
        p = prepare(raw, qt)
        for n in PORTABLE_ROWS:
            x = rng.standard_normal((n, 512)).astype(np.float32)
            o = np.zeros((n, 80), np.float32)
            matmul(o, x, p, qt)
            assert np.array_equal(got[f"{qt.name}_{n}"], o), (qt.name, n, *why)
            check(o, x, dequantize_ref(raw, qt, (80, 512)).astype(np.float64), qt)
