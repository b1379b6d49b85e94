"""Quantized matmul: out (N, d_out) f32 = x (N, n_in) f32 @ W.T, W a GGUF-quantized (d_out, n_in) weight.

How (see shared/KERNELS.md and lumen/kernels/simd.py for the measurements behind each choice):
- `prepare(raw, qtype)` repacks the raw GGUF bytes once, at load time, into tiles of R = 64 rows laid out
  with the row index before the 4 columns of an int32 lane ("lanes = rows", as ggml's repacked kernels), so a
  group of 32 columns of 64 rows is 8 (or 4 for nibbles) runs of 256 contiguous bytes. Four families:
    Q4  (Q4_0, Q4_1, Q4_K): nibbles q (T, G, 4, R, 4) u8: byte [k, r, b] = column 4k+b | column 16+4k+b << 4,
                            value = s*(nib-8) + o
    Q5  (Q5_0, Q5_1, Q5_K): bytes q (T, G, 8, R, 4) u8 = q5 (0..31), value = s*(q5-16) + o. Nibbles plus
                            fifth-bit masks cost 5 G MAC/s per core against 25 for a byte plane (measured with
                            the int16 kernels), so these weights take 9 bits per value instead of 5.5-6.
    I8  (Q8_0, Q6_K):       bytes q (T, G, 8, R, 4) u8 = value + 128 (Q8_0) or q6 (0..63, value q6-32, a scale
                            per 16 columns)
    F32 (F32, F16, BF16):   f32 values  q (T, n_in, R) f32
  with G = n_in / 32 groups of 32 columns, T = ceil(d_out / R) tiles, scales s (T, G, H, R) f32 (H = 2 halves
  of 16 for Q6_K, else 1) and offsets o (T, G, R) f32, or (T, 0, R) for types without one.
- Activations are rounded once per call the way llama.cpp's CPU backend rounds them for the weight type
  (`quantize_x`, lumen.quants.ACT_FORMAT): 8-bit blocks of 32 with an f16 scale (Q8_0/Q8_1) for the 32-block
  types, 8-bit blocks of 256 with an f32 scale (Q8_K) for the K types, f16 / bf16 for F16 / BF16 weights. So the
  products are the ones llama.cpp computes, and every dot product of the 8-bit families is an exact integer:
  unsigned weight bytes times signed activation bytes, 4 products per int32 lane (vpdpbusd where the CPU has
  AVX512-VNNI, lumen.kernels.simd), minus the zero point times the activations' sum. Offsets cost one multiply
  per group: o * xs. Measured per core against the int16-lane loops this replaced (same bits), N = 512, real
  weights: Q4_1 2.8x, Q4_K 2.5x, Q5_0 2.8x, Q6_K 3.8x, Q8_0 4.1x; N = 1 Q8_0 head 2.1x.
- N = 1 (`matvec`): each thread takes a contiguous chunk of tiles; one parallel region per call.
- N > 1 (`matmul_batched`): each tile is applied to all N activation rows while it is in cache, with the same
  tile function as the N=1 path, so the two paths agree bit for bit.
`matmul(out, x, w, qtype)` picks the path by N. `w` is a Packed (fast) or raw GGUF bytes (packed on every call:
correct, but slow; the forward pass should call prepare once at load time).
"""
from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numba import njit, prange

import math

from lumen.kernels.layout import F32, FAMILY, I8, Q4, Q5, R
from lumen.kernels.scratch import per_thread
from lumen.kernels.simd import (tile_nib_offset, tile_nib_scale, tile_u8_offset5, tile_u8_scale5, tile_u8_scale8,
                                tile_u8_two)
from lumen.format.quants import ACT_BF16, ACT_F16, ACT_F32, ACT_FORMAT, ACT_Q8, ACT_Q8K, QT, quant_info, row_bytes



class Packed(NamedTuple):
    """A weight repacked by `prepare`. Read-only after creation."""
    qtype: int
    d_out: int
    n_in: int
    family: int
    q: np.ndarray      # Q4 (T,G,4,R,4) u8 | Q5, I8 (T,G,8,R,4) u8 | F32 (T,n_in,R) f32
    s: np.ndarray      # (T,G,H,R) f32 scales; F32 family: (T,0,1,R)
    o: np.ndarray      # (T,G,R) f32 offsets, or (T,0,R)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.s.nbytes + self.o.nbytes


# ---------------------------------------------------------------- load time: raw GGUF bytes -> Packed

def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) u8 little-endian f16 -> (...) f32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _k_scale_min(sc: np.ndarray):
    """(rows, nb, 12) u8 packed 6-bit scales/mins -> sc, m (rows, nb, 8) as f32."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale.astype(np.float32), mins.astype(np.float32)


def _decode(raw: np.ndarray, qtype, n_in: int):
    """raw (rows, row_bytes) u8 -> (values (rows, n_in) int, scale (rows, G, H) f32, offset (rows, G) f32 or None).

    values are what the family's kernel multiplies: Q4 nibble 0..15, Q5 0..31, I8 signed int8, F32 floats.
    """
    rows = raw.shape[0]
    G = n_in // 32
    qt = QT(int(qtype))
    if qt == QT.F32:
        return raw.view(np.float32), None, None
    if qt == QT.F16:
        return raw.view(np.float16).astype(np.float32), None, None
    if qt == QT.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32), None, None

    if qt in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
        blk = raw.reshape(rows, G, quant_info(qt).type_size)
        d = _f16(blk[..., 0:2])
        if qt == QT.Q8_0:
            return blk[..., 2:].view(np.int8).reshape(rows, n_in), d[..., None], None
        has_m = qt in (QT.Q4_1, QT.Q5_1)
        p = 4 if has_m else 2
        m = _f16(blk[..., 2:4]) if has_m else None
        qh = None
        if qt in (QT.Q5_0, QT.Q5_1):
            qh = np.ascontiguousarray(blk[..., p:p + 4]).view(np.uint32)[..., 0]      # (rows, G)
            p += 4
        nib = blk[..., p:p + 16]
        q = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.int32)             # (rows, G, 32)
        if qh is not None:
            q |= ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32) << 4
        # kernel value is s*(q - zero) + o with zero = 8 (Q4) or 16 (Q5): fold zero*s into the offset
        zero = 16 if qh is not None else 8
        if has_m:
            off = m + np.float32(zero) * d
        else:                                                        # symmetric: s*(q-zero) exactly
            off = None
        return q.reshape(rows, n_in), d[..., None], off

    if qt in (QT.Q4_K, QT.Q5_K):
        nsb = n_in // 256
        blk = raw.reshape(rows, nsb, quant_info(qt).type_size)
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mn = _k_scale_min(blk[..., 4:16])
        ds = d[..., None] * sc                                        # (rows, nsb, 8) sub-block scales
        dm = dmin[..., None] * mn
        p = 16
        qh = None
        if qt == QT.Q5_K:
            qh = blk[..., 16:48]                                      # (rows, nsb, 32): bit s = sub-block s
            p = 48
        ql = blk[..., p:p + 128].reshape(rows, nsb, 4, 32)
        q = np.stack([ql & 15, ql >> 4], axis=3).reshape(rows, nsb, 8, 32).astype(np.int32)
        if qh is not None:
            hb = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            q |= hb.astype(np.int32) << 4
        zero = 16 if qh is not None else 8
        off = (np.float32(zero) * ds - dm).reshape(rows, G)
        return q.reshape(rows, n_in), ds.reshape(rows, G, 1), off

    if qt == QT.Q6_K:
        nsb = n_in // 256
        blk = raw.reshape(rows, nsb, 210)
        ql = blk[..., 0:128].reshape(rows, nsb, 2, 64)
        qh = blk[..., 128:192].reshape(rows, nsb, 2, 32)
        sc = blk[..., 192:208].view(np.int8).astype(np.float32)      # (rows, nsb, 16)
        d = _f16(blk[..., 208:210])
        lo = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
        hi = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=3)  # (rows, nsb, 2, 4, 32)
        q = (lo | (hi << 4)).astype(np.int16) - 32
        s = (d[..., None] * sc).reshape(rows, G, 2)
        return q.reshape(rows, n_in).astype(np.int8), s, None
    raise AssertionError(qt)


def _tiles(a: np.ndarray, T: int) -> np.ndarray:
    """(rows, *rest) -> (T, *rest, R): pad rows to T*R with zeros and move the row index innermost."""
    pad = np.zeros((T * R,) + a.shape[1:], dtype=a.dtype)
    pad[:a.shape[0]] = a
    pad = pad.reshape((T, R) + a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(pad, 1, -1))


def _quads(a: np.ndarray, T: int) -> np.ndarray:
    """(rows, G, K, 4) -> (T, G, K, R, 4): pad rows to T*R with zeros, rows before the 4 bytes of a lane."""
    pad = np.zeros((T * R,) + a.shape[1:], dtype=a.dtype)
    pad[:a.shape[0]] = a
    return np.ascontiguousarray(pad.reshape((T, R) + a.shape[1:]).transpose(0, 2, 3, 1, 4))


def prepare(raw: np.ndarray, qtype) -> Packed:
    """Repack raw GGUF bytes (d_out, row_bytes) u8 of type qtype for the matmul kernels (see module doc)."""
    info = quant_info(qtype)
    _check(isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.ndim == 2,
           f"raw weight must be a 2D uint8 array (d_out, row_bytes), got {getattr(raw, 'dtype', type(raw))} "
           f"{getattr(raw, 'shape', '')}")
    _check(raw.shape[1] % info.type_size == 0 and raw.shape[1] > 0,
           f"{info.name} rows must be a whole number of {info.type_size}-byte blocks, got {raw.shape[1]} bytes")
    raw = np.ascontiguousarray(raw)
    d_out = raw.shape[0]
    n_in = raw.shape[1] // info.type_size * info.block_size
    fam = FAMILY[QT(int(qtype))]
    _check(fam == F32 or n_in % 32 == 0, f"n_in = {n_in} must be a multiple of 32")
    T = (d_out + R - 1) // R
    G = n_in // 32
    vals, s, o = _decode(raw, qtype, n_in)
    f32_empty = np.zeros((T, 0, R), np.float32)
    if fam == F32:
        return Packed(int(qtype), d_out, n_in, fam, _tiles(vals.astype(np.float32), T),
                      np.zeros((T, 0, 1, R), np.float32), f32_empty)
    s_t = _tiles(s.astype(np.float32), T)
    o_t = f32_empty if o is None else _tiles(o.astype(np.float32), T)
    if fam == Q4:                                # nibbles: column 4k+b low, 16+4k+b high (lumen.kernels.simd)
        v = vals.reshape(d_out, G, 2, 4, 4)
        q = _quads(((v[:, :, 0] & 15) | ((v[:, :, 1] & 15) << 4)).astype(np.uint8), T)
    else:                                        # unsigned u = value + zero point: Q5 raw 0..31, I8 + 32/128
        z = {Q5: 0, I8: 32 if s.shape[2] == 2 else 128}[fam]
        q = _quads((vals.astype(np.int16) + z).astype(np.uint8).reshape(d_out, G, 8, 4), T)
    return Packed(int(qtype), d_out, n_in, fam, q, s_t, o_t)


# ---------------------------------------------------------------- kernels

@njit(cache=True, inline="always")
def round_f16(v):
    """v rounded to the nearest float16 value (ties to even, subnormals, overflow to inf), returned as f32."""
    a = abs(np.float64(v))
    if a == 0.0 or a != a:
        return np.float32(v)
    if a >= 65520.0:
        r = np.inf
    elif a < 6.103515625e-05:                       # f16 subnormal grid: multiples of 2^-24
        r = np.rint(a * 16777216.0) / 16777216.0
    else:
        m, e = math.frexp(a)                        # a = m * 2^e, m in [0.5, 1): keep 11 significant bits
        r = math.ldexp(np.rint(m * 2048.0), e - 11)
    return np.float32(r if v > 0 else -r)


@njit(cache=True, inline="always")
def round_bf16(v):
    """v rounded to the nearest bfloat16 value (ties to even), returned as f32."""
    a = abs(np.float64(v))
    if a == 0.0 or a != a or a == np.inf:
        return np.float32(v)
    m, e = math.frexp(a)
    r = math.ldexp(np.rint(m * 256.0), e - 8)
    return np.float32(r if v > 0 else -r)


@njit(cache=True)
def quantize_x(xq, xd, xs, x, fmt):
    """xq (Np, n_in) i8, xd (Np, G) f32, xs (Np, G, 2) f32 <- x (N, n_in) f32, N <= Np; rows >= N are zeroed.

    As llama.cpp's CPU backend quantizes activations for the weight type (lumen.quants.ACT_FORMAT):
      ACT_Q8  (Q8_0/Q8_1): blocks of 32, q = rint(x * 127/amax), scale d = f16(amax/127)
      ACT_Q8K (Q8_K):      blocks of 256, iscale = -127/max (max: the value of largest |x|), q = min(127,
                           rint(iscale * x)), d = 1/iscale (f32)
    xd[g] is the scale of group g (of 32; one Q8_K block spans 8 groups), xs[g, h] = d * sum(q) over half h."""
    N, n = x.shape
    G = n // 32
    for i in range(xq.shape[0]):
        if i >= N:
            for k in range(n):
                xq[i, k] = 0
            for g in range(G):
                xd[i, g] = 0.0
                xs[i, g, 0] = 0.0
                xs[i, g, 1] = 0.0
            continue
        B = 32 if fmt == ACT_Q8 else 256
        for b0 in range(0, n, B):
            amax = np.float32(0.0)
            mx = np.float32(0.0)
            for j in range(b0, b0 + B):
                a = abs(x[i, j])
                if a > amax:
                    amax = a
                    mx = x[i, j]
            if fmt == ACT_Q8:
                d = round_f16(amax / np.float32(127.0))
                inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
                for j in range(b0, b0 + B):
                    xq[i, j] = np.int8(np.rint(x[i, j] * inv))
            else:
                iscale = np.float32(-127.0) / mx if amax > 0 else np.float32(0.0)
                d = np.float32(1.0) / iscale if amax > 0 else np.float32(0.0)
                for j in range(b0, b0 + B):
                    xq[i, j] = np.int8(min(np.float32(127.0), np.rint(x[i, j] * iscale)))
            for g in range(b0 // 32, (b0 + B) // 32):
                xd[i, g] = d
                for h in range(2):
                    sm = np.int32(0)
                    for j in range(32 * g + 16 * h, 32 * g + 16 * h + 16):
                        sm += np.int32(xq[i, j])
                    xs[i, g, h] = d * np.float32(sm)


@njit(cache=True)
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


# ---- one tile of R rows against one activation row, accumulated in facc (R,) f32 (both paths)

@njit(cache=True)
def tile_mv(facc, c, fam, q, t, s, o, xq, xd, xs, i):
    """facc[c] (R,) = tile t of q . activation row i of xq, for the 8-bit families. q (T, G, 4, R, 4) u8 nibbles
    (Q4) or (T, G, 8, R, 4) u8 (Q5, I8), s (T, G, H, R), o (T, OG, R); xq (Np, n_in), xd (Np, G), xs (Np, G, 2).
    Whole arrays and indices, no views (lumen.kernels.simd, where the tile kernels are).

    Per group of 32 columns the integer sums of each half, sum (u - z) x = sum u x - z sum x, are exact; the
    float epilogue is the one ggml's x86 dot products apply per block: acc = fma(d_w * d_x, sum, acc)
    (then fma(min, d_x * sum x, acc); Q6_K: fma(d_x, fma(s0, sum0, s1 * sum1), acc))."""
    G, K, H, OG, n_in = q.shape[1], q.shape[2], s.shape[2], o.shape[1], xq.shape[1]
    fo, qo, so, oo = c * R, t * G * K * R * 4, t * G * H * R, t * OG * R
    xo, xdo, xso = i * n_in, i * G, i * G * 2
    if fam == Q4:
        if OG > 0:
            tile_nib_offset(facc, fo, q, qo, s, so, o, oo, xq, xo, xd, xdo, xs, xso, G)
        else:
            tile_nib_scale(facc, fo, q, qo, s, so, o, oo, xq, xo, xd, xdo, xs, xso, G)
    elif fam == Q5:
        if OG > 0:
            tile_u8_offset5(facc, fo, q, qo, s, so, o, oo, xq, xo, xd, xdo, xs, xso, G)
        else:
            tile_u8_scale5(facc, fo, q, qo, s, so, o, oo, xq, xo, xd, xdo, xs, xso, G)
    elif H == 2:
        tile_u8_two(facc, fo, q, qo, s, so, o, oo, xq, xo, xd, xdo, xs, xso, G)
    else:
        tile_u8_scale8(facc, fo, q, qo, s, so, o, oo, xq, xo, xd, xdo, xs, xso, G)


@njit(cache=True)
def tile_f32_mv(facc, w, x):
    """facc (R,) = w (n_in, R) f32 . x (n_in,) f32."""
    for r in range(R):
        facc[r] = 0.0
    for k in range(w.shape[0]):
        xk = x[k]
        for r in range(R):
            facc[r] += w[k, r] * xk


@njit(parallel=True, cache=True)
def matvec_kernel(out, fam, fmt, q, qf, s, o, x, xq2, xd2, xs2, xf2, facc):
    """out (d_out,) = W . x for one activation row. The weight is in q for the 8-bit families, qf for F32 (the
    other is empty). x (1, n_in) f32 is first rounded (serially) to the activation format fmt: into xq2
    (1, n_in) i8, xd2 (1, G), xs2 (1, G, 2) for the 8-bit formats, into xf2 (1, n_in) f32 for the float ones.
    facc (nch, R) f32: per-chunk scratch (lumen.kernels.scratch.per_thread); nch chunks of tiles."""
    T = s.shape[0]
    d_out = out.shape[0]
    nch = facc.shape[0]
    if fam != F32:
        quantize_x(xq2, xd2, xs2, x, fmt)
    else:
        round_x(xf2, x, fmt)
    for c in prange(nch):
        for t in range(c * T // nch, (c + 1) * T // nch):
            if fam == F32:
                tile_f32_mv(facc[c], qf[t], xf2[0])
            else:
                tile_mv(facc, c, fam, q, t, s, o, xq2, xd2, xs2, 0)
            n = min(R, d_out - t * R)
            for r in range(n):
                out[t * R + r] = facc[c, r]


# ---- N > 1: per tile of R weight rows, applied to all N activation rows while it is in cache

@njit(parallel=True, cache=True)
def batched_kernel(out, fam, q, qf, s, o, xq, xd, xs, xf, facc):
    """out (N, d_out) = W . x for N activation rows, already rounded (`prepare_x`): xq (Np, n_in) i8, xd (Np, G),
    xs (Np, G, 2) for the 8-bit formats, xf (Np, n_in) f32 for the float ones. Each tile of R weight rows is
    applied to all N rows before the next (it stays in L1/L2), with the same tile functions as matvec_kernel,
    so every output equals matvec's bit for bit. Weight arrays and scratch as in matvec_kernel."""
    T = s.shape[0]
    N, d_out = out.shape
    nch = facc.shape[0]
    for c in prange(nch):
        for t in range(c * T // nch, (c + 1) * T // nch):
            n = min(R, d_out - t * R)
            for i in range(N):
                if fam == F32:
                    tile_f32_mv(facc[c], qf[t], xf[i])
                else:
                    tile_mv(facc, c, fam, q, t, s, o, xq, xd, xs, i)
                for r in range(n):
                    out[i, t * R + r] = facc[c, r]


@njit(cache=True)
def prepare_x(xq, xd, xs, xf, x, fmt):
    """Round x (N, n_in) to activation format fmt: into xq (N, n_in) i8, xd (N, G), xs (N, G, 2) for the 8-bit
    formats, into xf (N, n_in) f32 for the float ones. The input of batched_kernel."""
    if fmt == ACT_Q8 or fmt == ACT_Q8K:
        quantize_x(xq, xd, xs, x, fmt)
    else:
        round_x(xf, x, fmt)


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


def _weights(w: Packed):
    """(q, qf) kernel arguments: the family's array in its slot, an empty array of fixed type in the other."""
    if w.family == F32:
        return _EMPTY_U8_5, w.q
    return w.q, _EMPTY_F32_3


def _chunks(T: int) -> int:
    return max(1, min(T, numba.get_num_threads()))


def matvec(out: np.ndarray, x: np.ndarray, w, qtype) -> np.ndarray:
    """out (1, d_out) f32 = x (1, n_in) f32 @ W.T, the decode path. w: Packed or raw (d_out, row_bytes) u8."""
    w = _packed(w, qtype)
    _check_io(out, x, w)
    _check(x.shape[0] == 1, f"matvec takes one activation row, got N = {x.shape[0]} (use matmul_batched)")
    T, G, nch = w.s.shape[0], w.n_in // 32, _chunks(w.s.shape[0])
    fmt = ACT_FORMAT[QT(int(w.qtype))]
    if w.family == F32:
        xq, xd, xs, xf = _EMPTY_I8_2, _EMPTY_F32_2, _EMPTY_F32_3, np.empty((1, w.n_in), np.float32)
    else:
        xq = np.empty((1, w.n_in), np.int8)
        xd = np.empty((1, G), np.float32)
        xs = np.empty((1, G, 2), np.float32)
        xf = _EMPTY_F32_2
    facc = per_thread((nch, R), np.float32)
    matvec_kernel(out[0], w.family, fmt, *_weights(w), w.s, w.o, x, xq, xd, xs, xf, facc)
    return out


def matmul_batched(out: np.ndarray, x: np.ndarray, w, qtype) -> np.ndarray:
    """out (N, d_out) f32 = x (N, n_in) f32 @ W.T for any N >= 1, the prefill path: each 64-row weight tile is
    read once (and unpacked once) for all N rows; the results equal matvec's row by row, bit for bit.
    w: Packed or raw (d_out, row_bytes) u8."""
    w = _packed(w, qtype)
    _check_io(out, x, w)
    N = x.shape[0]
    nch = _chunks(w.s.shape[0])
    G = w.n_in // 32
    fmt = ACT_FORMAT[QT(int(w.qtype))]
    f32 = w.family == F32
    xq = np.empty((N, 0 if f32 else w.n_in), np.int8)
    xd = np.empty((N, 0 if f32 else G), np.float32)
    xs = np.empty((N, 0 if f32 else G, 2), np.float32)
    xf = np.empty((N, w.n_in if f32 else 0), np.float32)
    prepare_x(xq, xd, xs, xf, x, fmt)
    facc = per_thread((nch, R), np.float32)
    batched_kernel(out, w.family, *_weights(w), w.s, w.o, xq, xd, xs, xf, facc)
    return out


def matmul(out: np.ndarray, x: np.ndarray, w, qtype) -> np.ndarray:
    """out (N, d_out) f32 = x (N, n_in) f32 @ W.T: matvec for N = 1 (decode), matmul_batched for N > 1 (prefill)."""
    if isinstance(x, np.ndarray) and x.ndim == 2 and x.shape[0] == 1:
        return matvec(out, x, w, qtype)
    return matmul_batched(out, x, w, qtype)


_EMPTY_U8_5 = np.zeros((0, 0, 0, 0, 0), np.uint8)
_EMPTY_I8_2 = np.zeros((0, 0), np.int8)
_EMPTY_F32_2 = np.zeros((0, 0), np.float32)
_EMPTY_F32_3 = np.zeros((0, 0, 2), np.float32)
