"""Quant table and dequant kernels: bit-exact against gguf-py's numpy reference (the oracle)."""
import numpy as np
import pytest
import gguf.quants
from gguf.constants import GGML_QUANT_SIZES

from lumen.errors import GGUFError, UnsupportedError
from lumen.format.gguf import GGUFFile
from lumen.kernels.dequant import dequantize
from lumen.format.quants import QT, QUANTS, SUPPORTED, dequantize_ref, quant_info, row_bytes

ALL = sorted(SUPPORTED, key=int)
BLOCK_TYPES = [t for t in ALL if QUANTS[t].block_size > 1]
# Byte offsets of the f16 fields inside one block (d, and m/dmin where there is one).
F16_FIELDS = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2),
              QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
QUANTIZABLE = [QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]  # gguf.quants.quantize has these


def ours(raw: np.ndarray, qtype, n_cols: int) -> np.ndarray:
    out = np.full((raw.shape[0], n_cols), np.nan, dtype=np.float32)
    return dequantize(np.ascontiguousarray(raw), qtype, out)


def assert_bit_exact(got: np.ndarray, want: np.ndarray):
    """Same bits everywhere, except NaN: NaN where the reference has NaN (payloads may differ after a multiply)."""
    assert got.shape == want.shape and got.dtype == want.dtype == np.float32
    g, w = got.view(np.uint32), want.view(np.uint32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), "NaN positions differ"
    bad = (g != w) & ~nan
    assert not bad.any(), f"{bad.sum()} of {bad.size} values differ, first at {np.argwhere(bad)[0]}: " \
                          f"{got[bad][0]!r} vs {want[bad][0]!r}"


def random_raw(qtype, rows: int, n_cols: int, rng, finite_scales: bool) -> np.ndarray:
    """Random bytes (rows, row_bytes); with finite_scales the f16 fields are random finite f16 values."""
    info = quant_info(qtype)
    raw = rng.integers(0, 256, size=(rows, row_bytes(qtype, n_cols)), dtype=np.uint8)
    if finite_scales and qtype in F16_FIELDS:
        blocks = raw.reshape(-1, info.type_size)
        for off in F16_FIELDS[qtype]:
            vals = (rng.standard_normal(blocks.shape[0]) * 10.0 ** rng.integers(-6, 2, blocks.shape[0]))
            blocks[:, off:off + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


# ---- the table ----

def test_table_matches_gguf():
    for qtype, info in QUANTS.items():
        assert (info.block_size, info.type_size) == GGML_QUANT_SIZES[qtype], info.name
    assert SUPPORTED == {QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
                         QT.Q4_K, QT.Q5_K, QT.Q6_K}


def test_type_ids_and_sizes_are_gguf_pys():
    """Lumen's own table of ggml's type ids and block sizes (not imported from gguf-py, for its import time) names
    each type as gguf-py does, with the same id and sizes; every type gguf-py knows is in it (a newer gguf-py
    than this table fails here, to be copied)."""
    from gguf import GGMLQuantizationType as GQT
    from lumen.format.quants import GGML_QUANT_SIZES as MINE
    assert {t.name: int(t) for t in QT} == {t.name: int(t) for t in GQT}
    assert {t.name: MINE[t] for t in QT} == {t.name: GGML_QUANT_SIZES[t] for t in GQT}


def test_row_bytes():
    assert row_bytes(QT.Q4_1, 576) == 18 * 20
    assert row_bytes(QT.Q6_K, 2048) == 8 * 210
    assert row_bytes(QT.F32, 3) == 12
    assert row_bytes(int(QT.Q8_0), 64) == 68
    with pytest.raises(GGUFError, match="multiple"):
        row_bytes(QT.Q4_K, 576)
    with pytest.raises(GGUFError):
        row_bytes(QT.Q8_0, 0)
    with pytest.raises(UnsupportedError, match="Q2_K"):
        row_bytes(QT.Q2_K, 256)
    with pytest.raises(UnsupportedError):
        row_bytes(12345, 256)


# ---- bit-exactness on made-up data ----

@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_finite_scales(qtype):
    rng = np.random.default_rng(int(qtype))
    n_cols = 2 * quant_info(qtype).block_size * 3
    raw = random_raw(qtype, 37, n_cols, rng, finite_scales=True)
    want = dequantize_ref(raw, qtype, (37, n_cols))
    assert np.isfinite(want).all()
    assert_bit_exact(ours(raw, qtype, n_cols), want)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_random_bytes(qtype):
    """Fully random bytes: scales may be subnormal, inf or NaN; results must still match the oracle."""
    rng = np.random.default_rng(100 + int(qtype))
    n_cols = quant_info(qtype).block_size * 8
    raw = random_raw(qtype, 300, n_cols, rng, finite_scales=False)
    assert_bit_exact(ours(raw, qtype, n_cols), dequantize_ref(raw, qtype, (300, n_cols)))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_data(qtype):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((19, 256)) * np.exp(rng.standard_normal((19, 1)))).astype(np.float32)
    x[3] = 0.0                                       # an all-zero row: d = 0
    x[4, :40] = 1e-6                                 # tiny values: subnormal f16 scales
    raw = np.ascontiguousarray(gguf.quants.quantize(x, qtype)).view(np.uint8).reshape(19, -1)
    assert_bit_exact(ours(raw, qtype, 256), dequantize_ref(raw, qtype, (19, 256)))


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16], ids=lambda t: t.name)
def test_every_16_bit_pattern(qtype):
    raw = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(256, 512)
    got = ours(raw, qtype, 256)
    want = dequantize_ref(raw, qtype, (256, 256))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))   # NaN payloads included: no arithmetic


def test_f32_bits_pass_through():
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2 ** 32, size=(5, 64), dtype=np.uint32)
    bits[0, :4] = [0x7F800001, 0xFFC00000, 0x7F800000, 0x80000000]   # sNaN, qNaN, inf, -0
    got = ours(bits.view(np.uint8), QT.F32, 64)
    assert np.array_equal(got.view(np.uint32), bits)


# ---- bit-exactness on the real models ----

def real_tensors(path, max_rows=4096):
    """(name, qtype, raw (rows, row_bytes) u8, shape) for every tensor; huge ones cut to max_rows rows. Read
    with lumen.gguf (test_gguf.py checks it against gguf-py tensor by tensor): gguf-py's reader parses
    Gemma's 262144-token vocabulary field by field, about 700 MB and 15-50 s."""
    g = GGUFFile(path)
    for t in g.tensors.values():
        raw = t.data                                      # (rows, row_bytes) u8 view of the mmap
        rows = raw.shape[0]
        if rows > max_rows:   # head, middle and tail of e.g. the 262144-row embedding
            idx = np.r_[0:max_rows // 2, rows // 2:rows // 2 + max_rows // 4, rows - max_rows // 4:rows]
            raw = raw[idx]
        yield t.name, QT(int(t.qtype)), raw, (raw.shape[0], t.dims[0])


def check_model(path, expect_types):
    seen = set()
    for name, qtype, raw, shape in real_tensors(path):
        assert_bit_exact(ours(raw, qtype, shape[1]), dequantize_ref(raw, qtype, shape))
        seen.add(qtype)
    assert seen == expect_types


def test_smollm2_tensors_bit_exact(smollm2_path):
    check_model(smollm2_path, {QT.Q4_1, QT.Q8_0, QT.F32})


def test_gemma3_tensors_bit_exact(gemma3_path):
    check_model(gemma3_path, {QT.Q5_0, QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.F32})


# ---- the dispatcher refuses what the kernel would read out of bounds ----

def test_dequantize_validates():
    raw = np.zeros((4, 40), dtype=np.uint8)        # Q4_1, 64 columns
    out = np.zeros((4, 64), dtype=np.float32)
    dequantize(raw, QT.Q4_1, out)
    with pytest.raises(ValueError, match="raw rows have 40"):
        dequantize(raw, QT.Q4_1, np.zeros((4, 96), dtype=np.float32))
    with pytest.raises(ValueError, match="rows"):
        dequantize(raw, QT.Q4_1, np.zeros((3, 64), dtype=np.float32))
    with pytest.raises(ValueError, match="float32"):
        dequantize(raw, QT.Q4_1, np.zeros((4, 64), dtype=np.float64))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(raw.view(np.int8), QT.Q4_1, out)
    with pytest.raises(ValueError, match="contiguous"):
        dequantize(np.zeros((4, 80), dtype=np.uint8)[:, ::2], QT.Q4_1, out)
    with pytest.raises(GGUFError, match="multiple"):
        dequantize(np.zeros((4, 40), dtype=np.uint8), QT.Q4_1, np.zeros((4, 65), dtype=np.float32))
    with pytest.raises(UnsupportedError):
        dequantize(raw, QT.Q2_K, out)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_quantize_q4_0_is_ggml_bit_for_bit(scale):
    """quantize_q4_0 rounds as ggml's quantize_row_q4_0_ref (gguf-py's numpy port): blocks of zeros, of equal values,
    a tie for the largest magnitude between a positive and a negative value, values on a rounding boundary."""
    from lumen.format.quants import quantize_q4_0
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((32, 256)) * scale).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = np.float32(scale)
    x[2, :32] = 0
    x[2, 3], x[2, 9] = scale, -scale
    x[3, :32] = np.arange(-16, 16, dtype=np.float32) * np.float32(scale / 2)
    got = quantize_q4_0(x)
    assert got.shape == (32, 256 // 32 * 18) and got.dtype == np.uint8
    assert np.array_equal(got, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0))
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_q4_0(x[:, :48])
