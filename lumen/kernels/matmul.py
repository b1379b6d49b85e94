"""Quantized matmul: out (N, d_out) f32 = x (N, n_in) f32 @ W.T, W a GGUF-quantized (d_out, n_in) weight.

How (lumen/kernels/simd.py has the tile kernels and why they are built as they are):
- `prepare(raw, qtype)` repacks the raw GGUF bytes once, at load time, into the layout of lumen.kernels.layout:
  tiles of R = 64 rows with the row index before the 4 columns of an int32 lane ("lanes = rows", as ggml's
  repacked kernels), no larger than the GGUF tensor: nibbles, the fifth bits (Q5) or the top two bits (Q6_K) as
  bit planes, Q8_0 bytes (+128), and the scales as the GGUF stores them (f16 d, f16 m, 6-bit K-quant scales and
  mins as bytes, Q6_K's int8 sub-block scales). The F32 family (F32, F16, BF16) is kept as f32 (T, n_in, R).
- Activations are rounded once per call the way llama.cpp's CPU backend rounds them for the weight type
  (`quantize_x`, lumen.format.quants.ACT_FORMAT): 8-bit blocks of 32 with an f16 scale (Q8_0/Q8_1) for the 32-block
  types, 8-bit blocks of 256 with an f32 scale (Q8_K) for the K types, f16 / bf16 for F16 / BF16 weights. So the
  products are the ones llama.cpp computes, and every dot product of the 8-bit families is an exact integer:
  unsigned weight bytes times signed activation bytes (vpdpbusd where the CPU has AVX512-VNNI,
  lumen.kernels.simd), minus the zero point times the activations' integer sum (the types without an offset);
  the scales are expanded in registers and the float step (simd: fused multiply-adds) is the same operations in
  the same order for every path.
- N = 1 (decode): the tile kernel streams one tile's groups in memory order with its 64 row sums in registers.
- N > 1 (batched): each half tile (32 rows) is applied to NR = 4 activation rows per pass, groups outer, each
  weight quad unpacked once for the 4 rows and each activation quad broadcast once for the half tile's 2 vectors
  (of the remaining N % 4 rows, two as one pass over the whole tile in memory order, 2 rows x 4 vectors, and a
  last one with the N = 1 kernel; 3 rows of a wide matrix as one pass over activations padded to 4 rows,
  lumen.kernels.policy.pad_rows), while the tile is in cache; the next tile is
  prefetched into L2 meanwhile (lumen.kernels.simd has the measurements). Every row gets the same operations as
  in the N = 1 kernel, so the two paths agree bit for bit.
- Prefill-sized N, the Q4, Q5 and Q6 families (lumen.kernels.policy.unpack_rows): each tile is first unpacked to
  one byte per column in the worker's scratch (the Q8 family's layout), and the NR-row passes read that with the
  type's scales and zero point (simd.tile_<type>_u): the same integer sums and float steps, so the same bits,
  with the unpacking (an and and a shift per quad, and the fifth or the top two bits: 3-4 more operations) done
  once per tile instead of once per NR rows.
- Parallelism: each thread takes a contiguous chunk of tiles; one parallel region per call, which may cover up
  to 3 matrices of the same input (q/k/v, gate/up). The activations are rounded first, once (`prepare_x`;
  from lumen.kernels.policy.PAR_QUANT_VALUES values on, the rows spread over the threads: serial, the rounding
  of prefill's rows is a fifth of a matmul's time).
`matmul(out, x, w, qtype)` picks the path by N. `w` is a Packed (fast) or raw GGUF bytes (packed on every call:
correct, but slow; the forward pass should call prepare once at load time).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from lumen.format.quants import ACT_BF16, ACT_F16, ACT_FORMAT, ACT_Q8, ACT_Q8K, QT, quant_info
from lumen.kernels.jit import compiled_only
from lumen.kernels.layout import F32, FORMAT, Q5, Q6, Q8, R, s_tile
from lumen.kernels.kinds import (ALL, MATMUL, ONE, PASS, PASS_U, TILES, abi_guard, address, call, call_borrowed,
                                 is_table, require_abi, sets, switch)
from lumen.kernels.policy import PAD_ROWS, UNPACK_ROWS, UNPACKED, pad_rows, parallel_quantize, unpack_rows
from lumen.kernels.scratch import per_thread
from lumen.kernels.simd import (NR, NR2, NVP, UNPACKED_GROUP, absmax, data_at, f16_round, first_with_abs,
                               prefetch_lines, quantize_block)
from lumen.kernels.work import STATIC, claim, counters


class Packed(NamedTuple):
    """A weight repacked by `prepare`. Read-only after creation."""
    qtype: int
    d_out: int
    n_in: int
    family: int
    q: np.ndarray      # quantized: (T, G * GROUP_BYTES[family]) u8 | F32: (T, n_in, R) f32
    s: np.ndarray      # (T, scale record bytes) u8; F32: (T, 0)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.s.nbytes


# ---------------------------------------------------------------- load time: raw GGUF bytes -> Packed

def _u16(b: np.ndarray) -> np.ndarray:
    """(..., 2) u8 little-endian -> (...) u16 (an f16's bits, kept as they are)."""
    return np.ascontiguousarray(b).view(np.uint16)[..., 0]


def _k_scale_min(sc: np.ndarray):
    """(rows, nb, 12) u8 packed 6-bit scales/mins -> sc, m (rows, nb, 8) u8."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale.astype(np.uint8), mins.astype(np.uint8)


def _decode(raw: np.ndarray, qt: QT, n_in: int):
    """raw (rows, row_bytes) u8 -> (u (rows, n_in) u8 unsigned values, per-group scale fields (rows, G, P),
    per-256-block scale fields (rows, G/8, P') or None). u is what the kernel multiplies before the zero point:
    Q4 nibble 0..15, Q5 0..31, Q6_K 0..63, Q8_0 value + 128. Scale fields are the GGUF's own bits: f16 as u16,
    K-quant 6-bit scales and mins as u8, Q6_K's int8 scales as u8."""
    rows, G = raw.shape[0], n_in // 32
    if qt in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
        blk = raw.reshape(rows, G, quant_info(qt).type_size)
        d = _u16(blk[..., 0:2])
        if qt == QT.Q8_0:
            u = (blk[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            return u.reshape(rows, n_in), d[..., None], None
        has_m = qt in (QT.Q4_1, QT.Q5_1)
        p = 4 if has_m else 2
        fields = np.stack([d, _u16(blk[..., 2:4])], axis=-1) if has_m else d[..., None]
        qh = None
        if qt in (QT.Q5_0, QT.Q5_1):
            qh = np.ascontiguousarray(blk[..., p:p + 4]).view(np.uint32)[..., 0]      # (rows, G)
            p += 4
        nib = blk[..., p:p + 16]
        u = np.concatenate([nib & 15, nib >> 4], axis=-1)                               # (rows, G, 32)
        if qh is not None:
            u = u | (((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        return u.reshape(rows, n_in), fields, None
    if qt in (QT.Q4_K, QT.Q5_K):
        nsb = n_in // 256
        blk = raw.reshape(rows, nsb, quant_info(qt).type_size)
        sc, mn = _k_scale_min(blk[..., 4:16])                                           # (rows, nsb, 8)
        p, qh = 16, None
        if qt == QT.Q5_K:
            qh, p = blk[..., 16:48], 48                                                  # bit s: sub-block s
        ql = blk[..., p:p + 128].reshape(rows, nsb, 4, 32)
        u = np.stack([ql & 15, ql >> 4], axis=3).reshape(rows, nsb, 8, 32)
        if qh is not None:
            hb = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            u = u | (hb << 4).astype(np.uint8)
        return (u.reshape(rows, n_in), np.stack([sc, mn], axis=-1).reshape(rows, G, 2),
                np.stack([_u16(blk[..., 0:2]), _u16(blk[..., 2:4])], axis=-1))
    if qt == QT.Q6_K:
        nsb = n_in // 256
        blk = raw.reshape(rows, nsb, 210)
        ql = blk[..., 0:128].reshape(rows, nsb, 2, 64)
        qh = blk[..., 128:192].reshape(rows, nsb, 2, 32)
        lo = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
        hi = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=3)                # (rows, nsb, 2, 4, 32)
        return ((lo | (hi << 4)).reshape(rows, n_in), blk[..., 192:208].reshape(rows, G, 2),
                _u16(blk[..., 208:210])[..., None])
    raise AssertionError(qt)


def _tiles(a: np.ndarray, T: int) -> np.ndarray:
    """(rows, *rest) -> (T, *rest, R): pad rows to T*R with zeros and move the row index innermost."""
    pad = np.zeros((T * R,) + a.shape[1:], dtype=a.dtype)
    pad[:a.shape[0]] = a
    pad = pad.reshape((T, R) + a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(pad, 1, -1))


def _planes(u: np.ndarray, fam: int, T: int, G: int) -> np.ndarray:
    """u (T*R, n_in) u8 unsigned values -> (T, G * GROUP_BYTES[fam]) u8 (lumen.kernels.layout)."""
    u = u.reshape(T, R, G, 32)
    if fam == Q8:                                                   # (T, G, 8, R, 4)
        return np.ascontiguousarray(u.reshape(T, R, G, 8, 4).transpose(0, 2, 3, 1, 4)).reshape(T, -1)
    lo = (u & 15).reshape(T, R, G, 2, 4, 4)
    parts = [(lo[:, :, :, 0] | (lo[:, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4).reshape(T, G, -1)]  # (T, G, 4, R, 4)
    hi = (u >> 4).astype(np.uint32)
    byte = 8 * np.arange(4, dtype=np.uint32)
    if fam == Q6:                                                   # Q6: 2 words, byte b bits 2m.. = column 4(4j+m)+b
        h = hi.reshape(T, R, G, 2, 4, 4) << (byte[None, :] + 2 * np.arange(4, dtype=np.uint32)[:, None])
        parts.append(h.sum(axis=(4, 5), dtype=np.uint32).transpose(0, 2, 3, 1))             # (T, G, 2, R)
    elif fam == Q5:                                                 # Q5: byte b bit k = column 4k+b
        h = hi.reshape(T, R, G, 8, 4) << (byte[None, :] + np.arange(8, dtype=np.uint32)[:, None])
        parts.append(h.sum(axis=(3, 4), dtype=np.uint32).transpose(0, 2, 1))                 # (T, G, R)
    return np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(T, G, -1) for p in parts],
                          axis=2).reshape(T, -1)


def prepare(raw: np.ndarray, qtype) -> Packed:
    """Repack raw GGUF bytes (d_out, row_bytes) u8 of type qtype for the matmul kernels (see module doc)."""
    info = quant_info(qtype)
    _check(isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.ndim == 2,
           f"raw weight must be a 2D uint8 array (d_out, row_bytes), got {getattr(raw, 'dtype', type(raw))} "
           f"{getattr(raw, 'shape', '')}")
    _check(raw.shape[1] % info.type_size == 0 and raw.shape[1] > 0,
           f"{info.name} rows must be a whole number of {info.type_size}-byte blocks, got {raw.shape[1]} bytes")
    raw = np.ascontiguousarray(raw)
    qt = QT(int(qtype))
    d_out = raw.shape[0]
    n_in = raw.shape[1] // info.type_size * info.block_size
    fam = FORMAT[qt][0]
    _check(fam == F32 or n_in % 32 == 0, f"n_in = {n_in} must be a multiple of 32")
    T = (d_out + R - 1) // R
    G = n_in // 32
    if fam == F32:
        if qt == QT.F32:
            vals = raw.view(np.float32)
        elif qt == QT.F16:
            vals = raw.view(np.float16).astype(np.float32)
        else:
            vals = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return Packed(int(qtype), d_out, n_in, fam, _tiles(vals, T), np.zeros((T, 0), np.uint8))
    u, per_g, per_b = _decode(raw, qt, n_in)
    pad = np.zeros((T * R, n_in), np.uint8)
    pad[:d_out] = u
    s = _tiles(per_g, T).reshape(T, -1).view(np.uint8)                      # (T, G, P, R) fields
    if per_b is not None:
        s = np.concatenate([s, _tiles(per_b, T).reshape(T, -1).view(np.uint8)], axis=1)
    s = np.ascontiguousarray(s)
    assert s.shape[1] == s_tile(FORMAT[qt][1], G)
    return Packed(int(qtype), d_out, n_in, fam, _planes(pad, fam, T, G), s)


@njit(cache=True, inline="always")
def round_f16(v):
    """v rounded to the nearest float16 value (ties to even, subnormals, overflow to inf), returned as f32."""
    return f16_round(np.float32(v))


@njit(cache=True, inline="always")
def round_bf16(v):
    """v rounded to the nearest bfloat16 value (ties to even), returned as f32."""
    a = abs(np.float64(v))
    if a == 0.0 or a != a or a == np.inf:
        return np.float32(v)
    m, e = math.frexp(a)
    r = math.ldexp(np.rint(m * 256.0), e - 8)
    return np.float32(r if v > 0 else -r)


@compiled_only(c_wrapper=True)
def quantize_row(i, xq, xd, xs, xi, x, fmt):
    """Row i of quantize_x (i < N). A function of its own, which quantize_x calls through its address
    (`quantize_address`), serially or from its parallel region: as the region's body and the serial loop's it was
    compiled about six times on a first run (the region's four libraries, and each caller's linked copy)."""
    n = x.shape[1]
    if fmt == ACT_Q8:
        for g in range(n // 32):
            xo = i * n + 32 * g
            amax = absmax(x, xo, 32)
            d = round_f16(amax / np.float32(127.0))
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            quantize_block(x, xo, xq, xo, xi, 2 * (xo // 32), inv, 32, False)
            xd[i, g] = d
            xs[i, g] = d * np.float32(xi[i, g, 0] + xi[i, g, 1])
        return
    for b0 in range(0, n, 256):
        xo = i * n + b0
        amax = absmax(x, xo, 256)
        mx = first_with_abs(x, xo, 256, amax)
        iscale = np.float32(-127.0) / mx if amax > 0 else np.float32(0.0)
        d = np.float32(1.0) / iscale if amax > 0 else np.float32(0.0)
        quantize_block(x, xo, xq, xo, xi, 2 * (xo // 32), iscale, 256, True)
        for g in range(b0 // 32, (b0 + 256) // 32):
            xd[i, g] = d
            xs[i, g] = np.float32(xi[i, g, 0] + xi[i, g, 1])


@compiled_only
def _zero_rows(xq, xd, xs, xi, N):
    """The Acts' rows N .. Np - 1 zeroed."""
    for i in range(N, xq.shape[0]):
        for k in range(xq.shape[1]):
            xq[i, k] = 0
        for g in range(xd.shape[1]):
            xd[i, g] = 0.0
            xs[i, g] = 0.0
            xi[i, g, 0] = 0
            xi[i, g, 1] = 0


QUANT_SIGNATURE = (types.int64, types.Array(types.int8, 2, "C"), types.Array(types.float32, 2, "C"),
                   types.Array(types.float32, 2, "C"), types.Array(types.int32, 3, "C"),
                   types.Array(types.float32, 2, "C"), types.int64)     # quantize_row's, compiled once


_quant_types = abi_guard("quantize_row", QUANT_SIGNATURE[1:])


@compiled_only(parallel=True)
def _quantize_rows_par(fn, xq, xd, xs, xi, x, fmt):
    for i in prange(x.shape[0]):
        call_borrowed(fn, (np.int64(i), xq, xd, xs, xi, x, fmt))


@njit(cache=True, no_cfunc_wrapper=True)
def quantize_x(xq, xd, xs, xi, x, fmt, fn, par):
    """xq (Np, n_in) i8, xd (Np, G) f32, xs (Np, G) f32, xi (Np, G, 2) i32 <- x (N, n_in) f32, N <= Np; rows >= N
    are zeroed.

    As llama.cpp's CPU backend quantizes activations for the weight type (lumen.format.quants.ACT_FORMAT):
      ACT_Q8  (Q8_0/Q8_1): blocks of 32, q = rint(x * 127/amax), scale d = f16(amax/127)
      ACT_Q8K (Q8_K):      blocks of 256, iscale = -127/max (max: the first value of largest |x|), q = min(127,
                           rint(iscale * x)), d = 1/iscale (f32)
    (the vector parts in lumen.kernels.simd: absmax, first_with_abs, quantize_block). x, xq, xi C-contiguous.
    xd[g] is the scale of group g (of 32; one Q8_K block spans 8 groups), xi[g, h] = sum(q) over half h (16 values)
    and xs[g] = d * (xi[g, 0] + xi[g, 1]) (the group's scaled sum, rounded once; for ACT_Q8K unscaled, exact: the
    kernels scale a block's sums by d once). Rows are independent:
    with par, the rows are spread over the threads (the same values). fn: the address of quantize_row
    (`quantize_address`), which computes each row."""
    _quant_types((xq, xd, xs, xi, x, fmt))
    if par:
        _quantize_rows_par(fn, xq, xd, xs, xi, x, fmt)
    else:
        for i in range(x.shape[0]):
            call_borrowed(fn, (i, xq, xd, xs, xi, x, fmt))
    _zero_rows(xq, xd, xs, xi, x.shape[0])


@functools.lru_cache(maxsize=None)
def quantize_address() -> int:
    """The address of quantize_row compiled for QUANT_SIGNATURE (compiled now, or loaded from the cache)."""
    return address(quantize_row, QUANT_SIGNATURE, "quantize")


@compiled_only
def round_x(xf, x, fmt):
    """xf (Np, n_in) f32 <- x (N, n_in) rounded as the float formats' vec_dot_type (F32: as is, F16, BF16);
    rows >= N are zeroed."""
    N = x.shape[0]
    for i in range(xf.shape[0]):
        for k in range(xf.shape[1]):
            if i >= N:
                xf[i, k] = 0.0
            elif fmt == ACT_F16:
                xf[i, k] = round_f16(x[i, k])
            elif fmt == ACT_BF16:
                xf[i, k] = round_bf16(x[i, k])
            else:
                xf[i, k] = x[i, k]




# ---- tiles of one matrix against N activation rows (both paths)

class Mat(NamedTuple):
    """One packed matrix as the kernels take it (the arrays of a Packed)."""
    qt: int            # its GGML type
    q: np.ndarray      # (T, G * GROUP_BYTES[family]) u8 tiles; (0, 0) for the F32 family
    qf: np.ndarray     # (T, n_in, R) f32 tiles of the F32 family; (0, 0, R) otherwise
    s: np.ndarray      # (T, scale record bytes) u8; (T, 0) for the F32 family


class Acts(NamedTuple):
    """The activations x (N, n_in) rounded for a weight type by `prepare_x`: the 8-bit formats fill xq, xd, xs,
    xi (G = n_in / 32 groups), the float formats xf."""
    xq: np.ndarray     # (N, n_in) i8
    xd: np.ndarray     # (N, G) f32 scale of each group
    xs: np.ndarray     # (N, G) f32 scaled sums
    xi: np.ndarray     # (N, G, 2) i32 integer half sums
    xf: np.ndarray     # (N, n_in) f32


_TILES = {int(t): tuple(f"tile_{t.name.lower()}_{k}" for k in ("1", "n", "2"))
          for t in (QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K, QT.Q8_0)}


# the batched kernels over a tile unpacked into the Q8 family's layout (lumen.kernels.simd.unpack_*), for the
# types lumen.kernels.policy.unpack_rows names
_TILES_U = {t: f"tile_{QT(t).name.lower()}_u" for t in UNPACKED}


def _kind_types(kinds):
    """The matrix types an overload's kinds argument compiles for: a kinds value's (lumen.kernels.kinds), or the one
    type a literal type id names (the per-type entries below); None for a type id not yet a literal (Numba then
    tries again with the literal)."""
    if isinstance(kinds, types.IntegerLiteral):
        return (kinds.literal_value,)
    if isinstance(kinds, types.Integer):
        return None
    return sets(kinds)[0]


# The tile kernels of lumen.kernels.simd are called from here only, through run_one, run_rows and run_unpacked:
# each compiles, for a kinds value, the dispatch over its types (lumen.kernels.kinds.switch), and given an entry
# table calls the type's entry there (tile_one, tile_rows_at, tile_unpacked_at: the same code compiled for that
# one type), each (array, offset) of the kernels' flat arguments passed as one address
# (lumen.kernels.simd.data_at). So `tiles`, given the table, is one function for every type (compiled per type it
# took 3.4-3.7 s of a cold start for each), and a type compiles its kernels only. A call takes integers only
# (Numba's array structs would be about 700 bytes a call), and a batched call runs all NR-row passes of a half
# tile (an unpacked tile: the unpacking and all passes), so the calls are one per tile in decode and at most two
# per tile and matrix in a batch, whatever N. (The unpacking, then each half tile's passes, as three calls: 3-4%
# slower than compiled into `tiles`, 1.5B Q4_K at 128-512 rows; as one, 0.99-1.00.)

def run_unpacked(kinds, qt, nb, out, oo, ld, q, qo, s, so, xq, xd, xs, xi, G, wbuf, wo):
    """A whole tile of a type of _TILES_U for activation rows 0 .. nb - 1 (nb a multiple of NR): the tile's G groups
    at q.flat[qo:] unpacked to one byte per column at wbuf.flat[wo:] (lumen.kernels.simd.unpack_<type>), then each
    half tile's NR-row passes over that (tile_<qt>_u, no prefetching), output rows at oo + i ld; for the kinds'
    types of _TILES_U (none: nothing; the caller never takes this path). Compiled code only."""
    raise NotImplementedError("run_unpacked runs in compiled code only")


@overload(run_unpacked, inline="always")
def _run_unpacked(kinds, qt, nb, out, oo, ld, q, qo, s, so, xq, xd, xs, xi, G, wbuf, wo):
    import lumen.kernels.simd as simd
    if is_table(kinds):
        def table_impl(kinds, qt, nb, out, oo, ld, q, qo, s, so, xq, xd, xs, xi, G, wbuf, wo):
            call(kinds[PASS_U + qt], (qt, np.int64(nb), data_at(out, oo), np.int64(ld), data_at(q, qo), data_at(s, so),
                                      data_at(xq, 0), data_at(xd, 0), data_at(xs, 0), data_at(xi, 0), np.int64(G),
                                      data_at(wbuf, wo)))
        return table_impl
    qts = _kind_types(kinds)
    if qts is None:
        return None
    qts = [t for t in qts if t in _TILES_U]
    if not qts:
        return lambda kinds, qt, nb, out, oo, ld, q, qo, s, so, xq, xd, xs, xi, G, wbuf, wo: None
    unpack = switch(tuple((t, simd.UNPACK[t]) for t in qts), 7)
    many = switch(tuple((t, getattr(simd, _TILES_U[t])) for t in qts), 19)

    def impl(kinds, qt, nb, out, oo, ld, q, qo, s, so, xq, xd, xs, xi, G, wbuf, wo):
        unpack(qt, q, qo, s, so, wbuf, wo, G)
        zero = np.int64(0)                            # no prefetching: a constant, so the kernel has none
        for v0 in range(0, R // 16, NVP):
            for i in range(0, nb, NR):
                many(qt, out, oo + i * ld, ld, wbuf, wo, s, so, xq, i * 32 * G, xd, i * G, xs, i * G, xi, 2 * i * G,
                     G, np.int64(v0), zero, zero)
    return impl


def _tile_switch(kinds, k, nargs):
    """The dispatch over the kinds' types to kernel k of _TILES (0: one row, 1: NR rows, 2: NR2 rows), taking nargs
    arguments (Q8_0's for a model of none of them); None while the type id is not yet a literal (_kind_types)."""
    import lumen.kernels.simd as simd
    qts = _kind_types(kinds)
    if qts is None:
        return None
    qts = [t for t in qts if t in _TILES] or [int(QT.Q8_0)]
    return switch(tuple((t, getattr(simd, _TILES[t][k])) for t in qts), nargs)


def run_one(kinds, qt, out, oo, ld, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G):
    """tile_<qt>_1 of lumen.kernels.simd (its flat arguments), for the kinds' types. Compiled code only. (A loop
    over rows in here, for fewer calls, made the kernel 7-14% slower: 1.5B Q4_K, 1 and 2 rows.)"""
    raise NotImplementedError("run_one runs in compiled code only")


@overload(run_one, inline="always")
def _run_one(kinds, qt, out, oo, ld, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G):
    if is_table(kinds):
        def table_impl(kinds, qt, out, oo, ld, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G):
            call(kinds[ONE + qt], (qt, data_at(out, oo), np.int64(ld), data_at(q, qo), data_at(s, so),
                                   data_at(xq, xo), data_at(xd, xdo), data_at(xs, xso), data_at(xi, xio), np.int64(G)))
        return table_impl
    one = _tile_switch(kinds, 0, 16)
    if one is None:
        return None
    return lambda kinds, qt, out, oo, ld, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G: one(
        qt, out, oo, ld, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G)


def run_rows(kinds, qt, nb, out, oo, ld, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G, v0, p0, chunk, per, qb):
    """tile_<qt>_n of lumen.kernels.simd (its flat arguments) for activation rows i = 0, NR, ..., nb - NR (nb a
    multiple of NR), or tile_<qt>_2 for nb = NR2 (the whole tile, v0 = 0): output rows at oo + i ld, the
    activations' at their offsets + i rows; the k-th of them, pass p = p0 + k of the tile, prefetches `per` bytes
    per group from qb + p chunk bytes past the tile's (none once p chunk >= qb: `tiles` spreads the next tile over
    its passes). For the kinds' types. Compiled code only."""
    raise NotImplementedError("run_rows runs in compiled code only")


@overload(run_rows, inline="always")
def _run_rows(kinds, qt, nb, out, oo, ld, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G, v0, p0, chunk, per, qb):
    if is_table(kinds):
        def table_impl(kinds, qt, nb, out, oo, ld, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G, v0, p0, chunk,
                       per, qb):
            call(kinds[PASS + qt], (qt, np.int64(nb), data_at(out, oo), np.int64(ld), data_at(q, qo), data_at(s, so),
                                    data_at(xq, xo), data_at(xd, xdo), data_at(xs, xso), data_at(xi, xio),
                                    np.int64(G), np.int64(v0), np.int64(p0), np.int64(chunk), np.int64(per),
                                    np.int64(qb)))
        return table_impl
    many = _tile_switch(kinds, 1, 19)
    if many is None:
        return None
    two = _tile_switch(kinds, 2, 19)

    def impl(kinds, qt, nb, out, oo, ld, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G, v0, p0, chunk, per, qb):
        p = p0
        if nb == NR2:
            pfb = per if p * chunk < qb else np.int64(0)
            two(qt, out, oo, ld, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G, v0, qb + p * chunk, pfb)
            return
        for i in range(0, nb, NR):
            pfb = per if p * chunk < qb else np.int64(0)
            many(qt, out, oo + i * ld, ld, q, qo, s, so, xq, xo + i * 32 * G, xd, xdo + i * G, xs, xso + i * G, xi,
                 xio + 2 * i * G, G, v0, qb + p * chunk, pfb)
            p += 1
    return impl


@compiled_only(c_wrapper=True)
def tile_one(qt, out, ld, q, s, xq, xd, xs, xi, G):
    """run_one for the one matrix type qt, a literal (so compiled per type: entry_signature), on addresses: the
    entry of an entry table that `tiles`, given the table, calls for a matrix of type qt."""
    z = np.int64(0)
    run_one(qt, qt, out, z, ld, q, z, s, z, xq, z, xd, z, xs, z, xi, z, G)


@compiled_only(c_wrapper=True)
def tile_rows_at(qt, nb, out, ld, q, s, xq, xd, xs, xi, G, v0, p0, chunk, per, qb):
    """run_rows for the one matrix type qt (as tile_one)."""
    z = np.int64(0)
    run_rows(qt, qt, nb, out, z, ld, q, z, s, z, xq, z, xd, z, xs, z, xi, z, G, v0, p0, chunk, per, qb)


@compiled_only(c_wrapper=True)
def tile_unpacked_at(qt, nb, out, ld, q, s, xq, xd, xs, xi, G, wbuf):
    """run_unpacked for the one matrix type qt (as tile_one)."""
    z = np.int64(0)
    run_unpacked(qt, qt, nb, out, z, ld, q, z, s, z, xq, xd, xs, xi, G, wbuf, z)


ENTRIES = {ONE: (tile_one, tuple(_TILES)), PASS: (tile_rows_at, tuple(_TILES)),
           PASS_U: (tile_unpacked_at, tuple(_TILES_U))}
"""slot: (the entry's function, the matrix types that have one) of an entry table (lumen.kernels.entries)."""


def entry_signature(fn, qt: int) -> tuple:
    """The types an entry of ENTRIES is compiled for in an entry table, for matrix type qt: a literal, so each
    type's is its own code, and integers."""
    n = {tile_one: 9, tile_rows_at: 15, tile_unpacked_at: 11}[fn]
    return (types.literal(int(qt)), *(types.int64,) * n)


def tile_row(kinds, dst, r0, c0, w, t, x, i):
    """dst[r0, c0 : c0 + R] = tile t of the matrix w (a Mat of a quantized type) times activation row i of x (Acts).
    Compiled code only."""
    raise NotImplementedError("tile_row runs in compiled code only")


@overload(tile_row, inline="always")
def _tile_row(kinds, dst, r0, c0, w, t, x, i):
    def impl(kinds, dst, r0, c0, w, t, x, i):
        G = x.xd.shape[1]
        ld = dst.shape[1]
        run_one(kinds, w.qt, dst, r0 * ld + c0, ld, w.q, t * w.q.shape[1], w.s, t * w.s.shape[1], x.xq,
                i * 32 * G, x.xd, i * G, x.xs, i * G, x.xi, 2 * i * G, G)
    return impl


def tile_passes(kinds, dst, c0, w, t, x, i0, nb, v0, p0, chunk, per):
    """dst[i, c0 + 16 v0 : c0 + 16 (v0 + NVP)] (i0 <= i < i0 + nb, nb a multiple of NR) = the tile's rows 16 v0 ..
    16 (v0 + NVP) - 1 of tile t of the matrix w times activation rows i of x, in passes of NR rows; nb = NR2: all the
    tile's rows in one pass (run_rows, its prefetching from p0, chunk and per). Compiled code only."""
    raise NotImplementedError("tile_passes runs in compiled code only")


@overload(tile_passes, inline="always")
def _tile_passes(kinds, dst, c0, w, t, x, i0, nb, v0, p0, chunk, per):
    def impl(kinds, dst, c0, w, t, x, i0, nb, v0, p0, chunk, per):
        G = x.xd.shape[1]
        qb = w.q.shape[1]
        ld = dst.shape[1]
        run_rows(kinds, w.qt, nb, dst, i0 * ld + c0, ld, w.q, t * qb, w.s, t * w.s.shape[1], x.xq, i0 * 32 * G,
                 x.xd, i0 * G, x.xs, i0 * G, x.xi, 2 * i0 * G, G, v0, p0, chunk, per, qb)
    return impl


def tile_unpacked(kinds, out, c0, w, t, x, nb, wbuf, wo):
    """out[i, c0 : c0 + R] (i < nb, a multiple of NR) = tile t of the matrix w (a type of _TILES_U) times
    activation rows i of x, the tile first unpacked to a byte per column (and its scales to f32) at wbuf.flat[wo:]
    and the NR-row passes reading that: the same integer sums and float steps, so the same bits (run_unpacked).
    Compiled code only."""
    raise NotImplementedError("tile_unpacked runs in compiled code only")


@overload(tile_unpacked, inline="always")
def _tile_unpacked(kinds, out, c0, w, t, x, nb, wbuf, wo):
    def impl(kinds, out, c0, w, t, x, nb, wbuf, wo):
        run_unpacked(kinds, w.qt, nb, out, c0, out.shape[1], w.q, t * w.q.shape[1], w.s, t * w.s.shape[1], x.xq,
                     x.xd, x.xs, x.xi, x.xd.shape[1], wbuf, wo)
    return impl


@compiled_only
def tile_f32_mv(facc, w, x):
    """facc (R,) = w (n_in, R) f32 . x (n_in,) f32."""
    for r in range(R):
        facc[r] = 0.0
    for k in range(w.shape[0]):
        xk = x[k]
        for r in range(R):
            facc[r] += w[k, r] * xk


@compiled_only
def tiles_1(out, w, x, facc, t0, t1, kinds):
    """`tiles` for one activation row (decode): each tile through tile_row, a last partial tile through facc.
    (LLVM inlines it into `tiles`; kept out of line, decode was no faster.)"""
    d_out = out.shape[1]
    zero = np.int64(0)
    for t in range(t0, t1):
        full = (t + 1) * R <= d_out
        dst, c0 = (out, t * R) if full else (facc, zero)
        tile_row(kinds, dst, zero, c0, w, t, x, zero)
        if not full:
            for r in range(d_out - t * R):
                out[0, t * R + r] = facc[0, r]


@compiled_only(c_wrapper=True)
def tiles(out, w, x, facc, wbuf, wo, t0, t1, kinds):
    """out[:, tiles t0..t1-1] = W . x for all N rows of out (N, d_out): W the Mat w (its tiles q and scale records
    s, or qf for the F32 family), x the Acts rounded by prepare_x. Per tile: the next tile prefetched, then each
    half tile over NR rows per pass, of the rest (N % NR) two as one pass over the whole tile (NR2) and a last one
    alone; 3 rows of a wide matrix (policy.pad_rows) as one pass over the activations padded to NR rows (x holds
    NR rows, prepare_x zeroed the padding) into facc (1, NR * R) f32, then copied out. A last tile of fewer than R
    rows goes one row at a time through facc (and so does every F32-family tile). From
    lumen.kernels.policy.unpack_rows rows on (prefill), each tile is first unpacked to a byte per column into
    wbuf.flat[wo:] (this worker's scratch, when it holds G * UNPACKED_GROUP bytes) and the passes read that
    (tile_unpacked): the unpacking is then done once per tile instead of once per NR rows. kinds: a kinds value,
    whose types' kernels are compiled in, or an entry table, whose kernels it calls (run_one and its like): then
    one compiled function for every type."""
    N, d_out = out.shape
    if w.qf.shape[0] > 0:
        for t in range(t0, t1):
            n = min(R, d_out - t * R)
            for i in range(N):
                tile_f32_mv(facc[0], w.qf[t], x.xf[i])
                for r in range(n):
                    out[i, t * R + r] = facc[0, r]
        return
    if N == 1:
        return tiles_1(out, w, x, facc, t0, t1, kinds)
    G = x.xd.shape[1]
    qb = w.q.shape[1]
    sb = w.s.shape[1]
    # 3 rows of a wide matrix (lumen.kernels.policy.pad_rows): one NR-row pass over the activations padded to NR
    # rows (prepare_x zeroes the padding) into facc, when both have room, and the rows copied out; else the rows
    # past N - N % NR go one at a time
    pad = pad_rows(N, G * 32) and x.xd.shape[0] >= NR and facc.shape[1] >= NR * R
    nb = NR if pad else N - N % NR                    # rows in passes of NR
    dst = facc.reshape((NR, R)) if pad else out       # where the passes write
    pre = unpack_rows(N, w.qt) and wbuf.shape[1] >= G * UNPACKED_GROUP
    zero = np.int64(0)
    for t in range(t0, t1):
        full = (t + 1) * R <= d_out
        i0 = 0
        if full and nb > 0 and pre:
            if t + 1 < t1:                             # the next tile into L2 while this one is computed
                prefetch_lines(w.q, (t + 1) * qb, qb)
                prefetch_lines(w.s, (t + 1) * sb, sb)
            tile_unpacked(kinds, out, t * R, w, t, x, nb, wbuf, wo)
            i0 = nb
        elif full and nb > 0:
            # the next tile streams into L2 while this one is computed: each of the P passes prefetches its 1/P
            # share of it, spread over its groups (lumen.kernels.simd has the measurements)
            P = nb // NR * (R // 16 // NVP)
            chunk = -(-qb // P // 64) * 64
            per = -(-chunk // G // 64) * 64 if t + 1 < t1 else zero
            c0 = zero if pad else t * R
            for v0 in range(0, R // 16, NVP):          # half a tile at a time, its NR-row passes over it
                tile_passes(kinds, dst, c0, w, t, x, zero, nb, np.int64(v0), v0 // NVP * (nb // NR), chunk, per)
            if pad:
                for i in range(N):
                    for r in range(R):
                        out[i, t * R + r] = dst[i, r]
            i0 = min(nb, N)
        if full and N - i0 >= NR2:                     # two of the rows left: one pass over the whole tile
            fetch = i0 == 0 and t + 1 < t1             # (the passes above prefetched the next tile, if any ran)
            chunk = -(-qb // 64) * 64
            tile_passes(kinds, out, t * R, w, t, x, np.int64(i0), np.int64(NR2), zero, zero, chunk,
                        -(-chunk // G // 64) * 64 if fetch else zero)
            i0 += NR2
        for i in range(i0, N):
            dst, r0, c0 = (out, np.int64(i), t * R) if full else (facc, zero, zero)
            tile_row(kinds, dst, r0, c0, w, t, x, np.int64(i))
            if not full:
                for r in range(d_out - t * R):
                    out[i, t * R + r] = facc[0, r]


def _arg_types() -> tuple:
    """Numba types of (Mat, Acts, a 2-d f32 array, a 2-d u8 array) as matmul_kernel passes them."""
    f32_2, u8_2 = types.Array(types.float32, 2, "C"), types.Array(types.uint8, 2, "C")
    mat = types.NamedTuple((types.int64, u8_2, types.Array(types.float32, 3, "C"), u8_2), Mat)
    acts = types.NamedTuple((types.Array(types.int8, 2, "C"), f32_2, f32_2, types.Array(types.int32, 3, "C"), f32_2),
                            Acts)
    return mat, acts, f32_2, u8_2


def tiles_signature(kinds_type) -> tuple:
    """The Numba types `tiles` is compiled for in an entry table (lumen.kernels.entries): what matmul_kernel
    passes it (run_tiles checks), with the table as its kinds."""
    mat, acts, f32_2, u8_2 = _arg_types()
    return (f32_2, mat, acts, f32_2, u8_2, types.int64, types.int64, types.int64, kinds_type)


def run_tiles(kinds, out, w, x, facc, wbuf, wo, t0, t1):
    """tiles(out, w, x, facc, wbuf, wo, t0, t1, kinds), compiled in for a kinds value, or called through the entry
    table (lumen.kernels.entries) at w's type. Compiled code only."""
    raise NotImplementedError("run_tiles runs in compiled code only")


@overload(run_tiles, inline="always")
def _run_tiles(kinds, out, w, x, facc, wbuf, wo, t0, t1):
    if not is_table(kinds):
        return lambda kinds, out, w, x, facc, wbuf, wo, t0, t1: tiles(out, w, x, facc, wbuf, wo, t0, t1, kinds)
    require_abi("the tiles entries", (out, w, x, facc, wbuf, wo, t0, t1), tiles_signature(kinds)[:-1])

    def impl(kinds, out, w, x, facc, wbuf, wo, t0, t1):
        call(kinds[TILES + w.qt], (out, w, x, facc, wbuf, wo, t0, t1, kinds))
    return impl


@njit(parallel=True, cache=True)
def matmul_kernel(outs, ws, n, x, facc, wbuf, work, kinds):
    """outs[m] (N, d_out_m) = W_m . x for the first n (1..3) matrices of the 3-tuple ws (Mats), all over the same
    activations x (Acts), already rounded (`prepare_x`); an F32-family matrix runs alone (n = 1). One parallel
    region: the tiles of the n matrices, taken in order, are split into one contiguous share per worker, cut into
    work[1] chunks; a worker claims its own share's chunks from the front and, once it has none left, steals the
    others' from the back (lumen.kernels.work.claim) until none is left (`tiles`); work[0] = STATIC keeps each
    worker to its own share (the old split, for measurements). facc (threads, R) f32 and wbuf (threads, bytes) u8:
    per-worker scratch (lumen.kernels.scratch.per_thread; wbuf holds a tile unpacked for prefill, `tiles`, and may
    have 0 bytes: the passes then unpack as they go). kinds (lumen.kernels.kinds): the types the tile dispatch is
    compiled for, or the entry table whose `tiles` of each type it calls (run_tiles).
    A tile's outputs are one worker's, computed the same way whichever worker it is, so the bits do not depend on
    the distribution (tests/engine/test_threads.py); lumen/kernels/work.py has the measurements."""
    # (the region takes the Mats' fields as tuples: Numba's gufunc wrapper rejects a tuple of Mats)
    qts, qs, qfs, ss = ((ws[0].qt, ws[1].qt, ws[2].qt), (ws[0].q, ws[1].q, ws[2].q), (ws[0].qf, ws[1].qf, ws[2].qf),
                        (ws[0].s, ws[1].s, ws[2].s))
    total = 0
    for m in range(n):
        total += ss[m].shape[0]
    nw = min(facc.shape[0], total)
    static = work[0] == STATIC
    per = work[1]
    for c in range(nw):
        work[8 * (c + 1)] = 0
    for c in prange(nw):
        ci = np.int64(c)
        for v in range(nw if not static else 1):        # its own share first, then the others' (stealing)
            owner = (ci + v) % nw
            lo, hi = owner * total // nw, (owner + 1) * total // nw
            size = max(np.int64(1), (hi - lo) // per) if not static else hi - lo
            while True:
                k = claim(work, 8 * (owner + 1), (hi - lo + size - 1) // size, v == 0)
                if k < 0:
                    break
                a0, b0 = lo + k * size, min(hi, lo + (k + 1) * size)
                base = 0
                for m in range(n):
                    T = ss[m].shape[0]
                    a, b = max(a0, base), min(b0, base + T)
                    if a < b:
                        run_tiles(kinds, outs[m], Mat(qts[m], qs[m], qfs[m], ss[m]), x, facc[ci:ci + 1], wbuf,
                                  ci * wbuf.shape[1], a - base, b - base)
                    base += T


def matmul_signature() -> tuple:
    """The Numba types matmul_kernel is compiled for in an entry table (lumen.kernels.entries): what mm3
    (lumen.model.forward) passes it (run_matmul checks)."""
    mat, acts, f32_2, u8_2 = _arg_types()
    i64_1 = types.Array(types.int64, 1, "C")
    return types.UniTuple(f32_2, 3), types.UniTuple(mat, 3), types.int64, acts, f32_2, u8_2, i64_1, i64_1


def run_matmul(outs, ws, n, x, facc, wbuf, work, kinds):
    """matmul_kernel(outs, ws, n, x, facc, wbuf, work, kinds), compiled in for a kinds value, or called through the
    entry table: then the caller does not compile its parallel region (about 3.5 s of a cold start), and the
    process that makes the table or the precompiling child compiles it, whichever is free first
    (lumen.model.precompile). Compiled code only."""
    raise NotImplementedError("run_matmul runs in compiled code only")


@overload(run_matmul, inline="always")
def _run_matmul(outs, ws, n, x, facc, wbuf, work, kinds):
    if not is_table(kinds):
        return lambda outs, ws, n, x, facc, wbuf, work, kinds: matmul_kernel(outs, ws, n, x, facc, wbuf, work, kinds)
    require_abi("the matmul entry", (outs, ws, types.int64, x, facc, wbuf, work, kinds), matmul_signature())
    return lambda outs, ws, n, x, facc, wbuf, work, kinds: call(kinds[MATMUL], (outs, ws, np.int64(n), x, facc,
                                                                                wbuf, work, kinds))


@njit(cache=True, no_cfunc_wrapper=True)
def prepare_x_at(x_out, x, fmt, quant):
    """Round x (N, n_in) to activation format fmt into the Acts x_out: xq (N, n_in) i8, xd (N, G), xs (N, G) f32,
    xi (N, G, 2) i32 for the 8-bit formats (quant: `quantize_address()`), xf (N, n_in) f32 for the float ones.
    The input of matmul_kernel."""
    if fmt == ACT_Q8 or fmt == ACT_Q8K:
        quantize_x(x_out.xq, x_out.xd, x_out.xs, x_out.xi, x, fmt, quant, parallel_quantize(x.shape[0], x.shape[1]))
    else:
        round_x(x_out.xf, x, fmt)


def prepare_x(x_out: Acts, x: np.ndarray, fmt: int) -> None:
    """prepare_x_at from Python."""
    prepare_x_at(x_out, x, fmt, quantize_address())


# ---------------------------------------------------------------- Python entries: validate, then call

def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _packed(w, qtype) -> Packed:
    if isinstance(w, Packed):
        if w.qtype != qtype:
            _check(int(w.qtype) == int(qtype),
                   f"packed weight is {QT(w.qtype).name}, but qtype {QT(int(qtype)).name} was given")
        return w
    return prepare(w, qtype)


def _io_ok(out, x, w: Packed) -> bool:
    """The happy path of _check_io, without building any message (this runs on every call, ~1 us)."""
    return (type(out) is np.ndarray and type(x) is np.ndarray and out.dtype == np.float32
            and x.dtype == np.float32 and x.ndim == 2 and out.ndim == 2 and x.shape[0] >= 1
            and x.shape[1] == w.n_in and out.shape[0] == x.shape[0] and out.shape[1] == w.d_out
            and x.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable
            and not np.may_share_memory(out, x))


def _check_io(out, x, w: Packed):
    """Raise ValueError naming the first thing wrong with out/x for weight w (the kernels trust all of it)."""
    if _io_ok(out, x, w):
        return
    for name, a in (("out", out), ("x", x)):
        _check(isinstance(a, np.ndarray), f"{name} must be a numpy array, got {type(a).__name__}")
        _check(a.dtype == np.float32, f"{name} must be float32, got {a.dtype}")
        _check(a.flags.c_contiguous, f"{name} must be C-contiguous")
    _check(out.flags.writeable, "out must be writeable")
    _check(x.ndim == 2 and out.ndim == 2, f"x and out must be 2D (N, n_in) and (N, d_out), got {x.shape}, {out.shape}")
    _check(x.shape[1] == w.n_in, f"x has {x.shape[1]} columns but the weight has n_in = {w.n_in}")
    _check(out.shape == (x.shape[0], w.d_out), f"out must have shape {(x.shape[0], w.d_out)}, got {out.shape}")
    _check(x.shape[0] >= 1, "x must have at least one row")
    _check(not np.may_share_memory(out, x), "out must not overlap x")
    raise AssertionError("unreachable: _io_ok and the checks disagree")


def _run(out: np.ndarray, x: np.ndarray, w: Packed) -> np.ndarray:
    fmt = ACT_FORMAT[QT(int(w.qtype))]
    acts = new_acts(act_rows(x.shape[0]), w.n_in, fmt)
    prepare_x(acts, x, fmt)
    facc = per_thread((numba.get_num_threads(), FACC), np.float32)
    m = mat(w)
    matmul_kernel((out, out, out), (m, m, m), 1, acts, facc, unpack_scratch(facc.shape[0], w.n_in, x.shape[0]),
                  counters(facc.shape[0]), ALL)
    return out


FACC = NR * R            # f32 per worker of matmul_kernel's facc: a padded pass's NR rows of a tile (`tiles`)


@njit(cache=True, inline="always")
def act_rows(n):
    """The rows of the Acts for n activation rows: PAD_ROWS padded to NR (`tiles` may run them as one NR-row pass,
    lumen.kernels.policy.pad_rows)."""
    return NR if n == PAD_ROWS else n


def unpack_scratch(threads: int, n_in: int, n_rows: int | None = None) -> np.ndarray:
    """The matmul kernels' per-worker buffer for one unpacked tile of n_in columns (threads, bytes) u8; with
    n_rows given, 0 bytes when that many rows never take the unpacked path (lumen.kernels.policy.unpack_rows)."""
    need = n_rows is None or n_rows >= UNPACK_ROWS
    return per_thread((threads, n_in // 32 * UNPACKED_GROUP if need else 0), np.uint8)


def new_acts(N: int, n_in: int, fmt: int) -> Acts:
    """Zeroed Acts for N rows of n_in values in activation format fmt (the arrays of the other kind empty)."""
    q8, G = fmt in (ACT_Q8, ACT_Q8K), n_in // 32
    return Acts(xq=np.zeros((N, n_in if q8 else 0), np.int8), xd=np.zeros((N, G if q8 else 0), np.float32),
                xs=np.zeros((N, G if q8 else 0), np.float32), xi=np.zeros((N, G if q8 else 0, 2), np.int32),
                xf=np.zeros((N, 0 if q8 else n_in), np.float32))


def mat(w: Packed) -> Mat:
    """The kernels' view of a packed weight."""
    f32 = w.family == F32
    return Mat(int(w.qtype), _EMPTY_U8 if f32 else w.q, w.q if f32 else _EMPTY_F32, w.s)


def matvec(out: np.ndarray, x: np.ndarray, w, qtype) -> np.ndarray:
    """out (1, d_out) f32 = x (1, n_in) f32 @ W.T, the decode path. w: Packed or raw (d_out, row_bytes) u8."""
    w = _packed(w, qtype)
    _check_io(out, x, w)
    _check(x.shape[0] == 1, f"matvec takes one activation row, got N = {x.shape[0]} (use matmul_batched)")
    return _run(out, x, w)


def matmul_batched(out: np.ndarray, x: np.ndarray, w, qtype) -> np.ndarray:
    """out (N, d_out) f32 = x (N, n_in) f32 @ W.T for any N >= 1, the prefill path: each 64-row weight tile is
    read once (and unpacked once per NR rows) for all N rows; the results equal matvec's row by row, bit for bit.
    w: Packed or raw (d_out, row_bytes) u8."""
    w = _packed(w, qtype)
    _check_io(out, x, w)
    return _run(out, x, w)


def matmul(out: np.ndarray, x: np.ndarray, w, qtype) -> np.ndarray:
    """out (N, d_out) f32 = x (N, n_in) f32 @ W.T: matvec for N = 1 (decode), matmul_batched for N > 1 (prefill)."""
    if isinstance(x, np.ndarray) and x.ndim == 2 and x.shape[0] == 1:
        return matvec(out, x, w, qtype)
    return matmul_batched(out, x, w, qtype)


_EMPTY_U8 = np.zeros((0, 0), np.uint8)
_EMPTY_F32 = np.zeros((0, 0, R), np.float32)
