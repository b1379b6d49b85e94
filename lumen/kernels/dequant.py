"""Dequantize raw GGUF weight rows to float32: one Numba kernel per quant type, bit-exact with gguf-py's numpy.

Every kernel: out (rows, n_cols) f32  <-  raw (rows, row_bytes) u8. Output first, no allocation.
f16 fields are decoded through F16_TO_F32, a 65536-entry f32 table built by numpy itself, so the
decoding (NaN payloads, subnormals, -0) is the oracle's own.

No fastmath (like every float kernel in Lumen, see lumen/kernels/fp.py): every intermediate product is exact
in f32 anyway (f16 d has 11 significant bits, d*sc <= 19 bits, d*sc*q on Q4/Q5 <= 24 bits), but exactness
should not hang on that argument. These kernels are not on the hot path.
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from lumen.format.quants import QT, quant_info, row_bytes
from lumen.kernels.jit import compiled_only
from lumen.kernels.kinds import ALL, ROWS, call, is_table, require_abi, sets, switch

# f16 bit pattern -> f32 value, exactly as numpy converts it (the oracle's own conversion).
F16_TO_F32 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)   # (65536,) f32


@njit(inline="always")
def f16(lut, raw, o):
    """The f16 stored little-endian at raw[o:o+2], as f32."""
    return lut[np.int64(raw[o]) | (np.int64(raw[o + 1]) << 8)]


@njit(inline="always")
def u32(raw, o):
    return (np.uint32(raw[o]) | (np.uint32(raw[o + 1]) << np.uint32(8))
            | (np.uint32(raw[o + 2]) << np.uint32(16)) | (np.uint32(raw[o + 3]) << np.uint32(24)))


@njit(inline="always")
def k_scale_min(raw, o, j):
    """Q4_K/Q5_K: the 6-bit (scale, min) of sub-block j (0..7) from the 12 bytes at raw[o:o+12]."""
    if j < 4:
        return np.int32(raw[o + j] & 63), np.int32(raw[o + j + 4] & 63)
    sc = (raw[o + j + 4] & 0xF) | ((raw[o + j - 4] >> 6) << 4)
    m = (raw[o + j + 4] >> 4) | ((raw[o + j] >> 6) << 4)
    return np.int32(sc), np.int32(m)


# ---- one row each: out (n_cols,) f32 <- raw (row_bytes,) u8 ----

@compiled_only
def row_f32(out, raw, lut):
    w = raw.view(np.uint32)
    o = out.view(np.uint32)
    for i in range(o.size):
        o[i] = w[i]


@compiled_only
def row_f16(out, raw, lut):
    for i in range(out.size):
        out[i] = f16(lut, raw, 2 * i)


@compiled_only
def row_bf16(out, raw, lut):
    o = out.view(np.uint32)
    for i in range(o.size):
        o[i] = (np.uint32(raw[2 * i]) << np.uint32(16)) | (np.uint32(raw[2 * i + 1]) << np.uint32(24))


@compiled_only
def row_q8_0(out, raw, lut):
    for b in range(out.size // 32):
        o = 34 * b
        d = f16(lut, raw, o)
        for j in range(32):
            out[32 * b + j] = np.float32(np.int8(raw[o + 2 + j])) * d


@compiled_only
def row_q4_0(out, raw, lut):
    for b in range(out.size // 32):
        o = 18 * b
        d = f16(lut, raw, o)
        for j in range(16):
            q = raw[o + 2 + j]
            out[32 * b + j] = d * np.float32(np.int32(q & 15) - 8)
            out[32 * b + j + 16] = d * np.float32(np.int32(q >> 4) - 8)


@compiled_only
def row_q4_1(out, raw, lut):
    for b in range(out.size // 32):
        o = 20 * b
        d = f16(lut, raw, o)
        m = f16(lut, raw, o + 2)
        for j in range(16):
            q = raw[o + 4 + j]
            out[32 * b + j] = d * np.float32(q & 15) + m
            out[32 * b + j + 16] = d * np.float32(q >> 4) + m


@compiled_only
def row_q5_0(out, raw, lut):
    for b in range(out.size // 32):
        o = 22 * b
        d = f16(lut, raw, o)
        qh = u32(raw, o + 2)
        for j in range(16):
            q = raw[o + 6 + j]
            lo = np.int32(q & 15) | np.int32(((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4))
            hi = np.int32(q >> 4) | np.int32(((qh >> np.uint32(j + 16)) & np.uint32(1)) << np.uint32(4))
            out[32 * b + j] = d * np.float32(lo - 16)
            out[32 * b + j + 16] = d * np.float32(hi - 16)


@compiled_only
def row_q5_1(out, raw, lut):
    for b in range(out.size // 32):
        o = 24 * b
        d = f16(lut, raw, o)
        m = f16(lut, raw, o + 2)
        qh = u32(raw, o + 4)
        for j in range(16):
            q = raw[o + 8 + j]
            lo = np.int32(q & 15) | np.int32(((qh >> np.uint32(j)) & np.uint32(1)) << np.uint32(4))
            hi = np.int32(q >> 4) | np.int32(((qh >> np.uint32(j + 16)) & np.uint32(1)) << np.uint32(4))
            out[32 * b + j] = d * np.float32(lo) + m
            out[32 * b + j + 16] = d * np.float32(hi) + m


@compiled_only
def row_q4_k(out, raw, lut):
    for b in range(out.size // 256):
        o = 144 * b
        d = f16(lut, raw, o)
        dmin = f16(lut, raw, o + 2)
        for s in range(8):                       # sub-block s: 32 values, nibble half s % 2 of chunk s // 2
            sc, m = k_scale_min(raw, o + 4, s)
            ds = d * np.float32(sc)
            dm = dmin * np.float32(m)
            q0 = o + 16 + 32 * (s >> 1)
            sh = 4 * (s & 1)
            for l in range(32):
                out[256 * b + 32 * s + l] = ds * np.float32((raw[q0 + l] >> sh) & 15) - dm


@compiled_only
def row_q5_k(out, raw, lut):
    for b in range(out.size // 256):
        o = 176 * b
        d = f16(lut, raw, o)
        dmin = f16(lut, raw, o + 2)
        for s in range(8):
            sc, m = k_scale_min(raw, o + 4, s)
            ds = d * np.float32(sc)
            dm = dmin * np.float32(m)
            q0 = o + 48 + 32 * (s >> 1)
            sh = 4 * (s & 1)
            for l in range(32):
                q = ((raw[q0 + l] >> sh) & 15) | (((raw[o + 16 + l] >> s) & 1) << 4)
                out[256 * b + 32 * s + l] = ds * np.float32(q) - dm


@compiled_only
def row_q6_k(out, raw, lut):
    for b in range(out.size // 256):
        o = 210 * b
        d = f16(lut, raw, o + 208)
        for e in range(256):                     # e = 128*h + 32*k + l
            h = e >> 7
            k = (e >> 5) & 3
            l = e & 31
            lo = (raw[o + 64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 15
            hi = (raw[o + 128 + 32 * h + l] >> (2 * k)) & 3
            q = np.int32(lo | (hi << 4)) - 32
            ds = d * np.float32(np.int8(raw[o + 192 + (e >> 4)]))
            out[256 * b + e] = ds * np.float32(q)


# Type codes used inside the kernel (gguf ids).
_F32, _F16, _BF16, _Q8_0 = int(QT.F32), int(QT.F16), int(QT.BF16), int(QT.Q8_0)
_Q4_0, _Q4_1, _Q5_0, _Q5_1 = int(QT.Q4_0), int(QT.Q4_1), int(QT.Q5_0), int(QT.Q5_1)
_Q4_K, _Q5_K, _Q6_K = int(QT.Q4_K), int(QT.Q5_K), int(QT.Q6_K)


_ROWS = {_Q4_1: row_q4_1, _Q8_0: row_q8_0, _Q5_0: row_q5_0, _Q4_K: row_q4_k, _Q6_K: row_q6_k, _Q4_0: row_q4_0,
         _Q5_1: row_q5_1, _Q5_K: row_q5_k, _F32: row_f32, _F16: row_f16, _BF16: row_bf16}


def dequant_row(kinds, out, raw, lut, qtype):
    """out (n_cols,) f32 <- raw (row_bytes,) u8 of gguf type id qtype, one of the embedding types of the kinds
    (lumen.kernels.kinds; compiled code only)."""
    raise NotImplementedError("dequant_row runs in compiled code only")


@overload(dequant_row)
def _dequant_row(kinds, out, raw, lut, qtype):
    if is_table(kinds):                     # the entry table (lumen.kernels.entries): through its address
        require_abi("the row entries", (out, raw, lut, qtype), row_signature(kinds)[:-1])
        return lambda kinds, out, raw, lut, qtype: call(kinds[ROWS + qtype], (out, raw, lut, qtype, kinds))
    rows = switch(tuple((t, _ROWS[t]) for t in sets(kinds)[1] if t in _ROWS) or ((_F32, row_f32),), 3)

    def impl(kinds, out, raw, lut, qtype):
        rows(qtype, out, raw, lut)
    return impl


@compiled_only(c_wrapper=True)
def dequant_row_entry(out, raw, lut, qtype, kinds):
    """dequant_row with the kinds last: what an entry table calls (lumen.kernels.entries)."""
    dequant_row(kinds, out, raw, lut, qtype)


def row_signature(kinds_type) -> tuple:
    """The Numba types dequant_row_entry is compiled for in an entry table: one embedding row as the forward pass
    looks it up (a row of the GGUF mmap), with a kinds value of one type."""
    return (types.Array(types.float32, 1, "C"), types.Array(types.uint8, 1, "C"),
            types.Array(types.float32, 1, "C"), types.int64, kinds_type)


@njit(parallel=True, cache=True, no_cfunc_wrapper=True)
def dequant_rows(out, raw, lut, qtype):
    """out (rows, n_cols) f32 <- raw (rows, row_bytes) u8, one row per prange step. Shapes checked by caller."""
    for r in prange(out.shape[0]):
        dequant_row(ALL, out[r], raw[r], lut, qtype)


@njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def dequant_rows_here(out, raw, lut, qtype):
    """dequant_rows on the calling thread alone, without the GIL: for a caller that runs its own threads (the
    loader's packers), where a parallel region would start a thread pool per calling thread."""
    for r in range(out.shape[0]):
        dequant_row(ALL, out[r], raw[r], lut, qtype)


def dequantize(raw: np.ndarray, qtype, out: np.ndarray, *, parallel: bool = True) -> np.ndarray:
    """out (rows, n_cols) f32 <- raw (rows, row_bytes) u8 GGUF bytes of type qtype. Returns out. parallel: on
    Numba's threads (False: on the calling thread).

    Validates everything the kernel trusts: dtypes, 2D, C-contiguity, row_bytes matching n_cols.
    """
    info = quant_info(qtype)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"raw must be a 2D uint8 array (rows, row_bytes), got {getattr(raw, 'dtype', type(raw))} "
                         f"{getattr(raw, 'shape', '')}")
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.ndim != 2:
        raise ValueError(f"out must be a 2D float32 array (rows, n_cols), got {getattr(out, 'dtype', type(out))} "
                         f"{getattr(out, 'shape', '')}")
    if not raw.flags.c_contiguous or not out.flags.c_contiguous:
        raise ValueError("raw and out must be C-contiguous")
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    if out.shape[0] != raw.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows but raw has {raw.shape[0]}")
    if int(qtype) not in _ROWS:
        raise ValueError(f"no dequantizer for {info.name}")
    nb = row_bytes(qtype, out.shape[1])
    if raw.shape[1] != nb:
        raise ValueError(f"{info.name} rows of {out.shape[1]} values take {nb} bytes, raw rows have {raw.shape[1]}")
    if out.size:
        (dequant_rows if parallel else dequant_rows_here)(out, raw, F16_TO_F32, int(qtype))
    return out
