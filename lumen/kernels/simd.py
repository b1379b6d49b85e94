"""The quantized tile kernels, written as LLVM vector IR: one 64-row weight tile times one activation row.

LLVM never emits vpdpbusd from Numba loops (shared/KERNELS.md), and the int16-lane loops it does emit top out
at about 25 G MAC/s per core here (3 instructions per 16 products, accumulators stored on every step).
vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products to an int32 lane: 32 products per
256-bit instruction. These intrinsics emit it directly when the CPU has AVX512-VNNI with AVX512-VL
(llvm.x86.avx512.vpdpbusd.256), and otherwise the same arithmetic as portable vector IR (widen, multiply, add)
that any LLVM target compiles; the integers are the same either way. The 64 row sums stay in registers across
the groups of a tile, and the float epilogue runs on them in place.

Weight layout of one group (32 columns j of 64 rows r), lanes = rows, 4 consecutive columns per int32 lane:
  u8 layout  (8, 64, 4) u8:  w[k, r, b] = column 4k + b of row r, unsigned: the kernel's value is u - z
  nib layout (4, 64, 4) u8:  w[k, r, b] = column 4k + b in the low nibble, column 16 + 4k + b in the high one
Per group and half h (16 columns): sum (u - z) x = sum u x - z sum x, an exact integer (|.| < 2^20), then the
float epilogue of lumen.kernels.matmul (d_w * d_x * sum, + min * d_x * sum x; Q6_K a scale per half).
Measured per core (one 640-column tile in L1, in-njit loop): the group dots alone 118-164 G MAC/s; whole
tiles against the Numba loops they replaced, at N = 512 on real weights: 2.5-4.1x.
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_features = llvm.get_host_cpu_features()
# LUMEN_NO_VNNI=1 compiles the portable IR even on a VNNI CPU (for tests; give it its own NUMBA_CACHE_DIR,
# because Numba's cache key knows the CPU but not this switch).
VNNI = (bool(_features.get("avx512vnni", False) and _features.get("avx512vl", False))
        and os.environ.get("LUMEN_NO_VNNI", "0") in ("", "0"))

ROWS = 64                      # rows of a tile (lumen.kernels.matmul.R)
_I8, _I32 = ir.IntType(8), ir.IntType(32)
_V8I32 = ir.VectorType(_I32, 8)
_V32I8 = ir.VectorType(_I8, 32)


def _data(context, builder, aty, aval, elty, off=None):
    """Pointer (elty*) to element `off` (an i64 count of the array's own elements) of the array's data."""
    arr = context.make_array(aty)(context, builder, aval)
    ptr = arr.data if off is None else builder.gep(arr.data, [off])
    return builder.bitcast(ptr, elty.as_pointer())


def _bcast32(builder, xp, quad):
    """The 4 bytes x[4 quad .. 4 quad + 3] as one int32, broadcast to 8 lanes."""
    p = builder.bitcast(builder.gep(xp, [ir.Constant(_I32, 4 * quad)]), _I32.as_pointer())
    s = builder.load(p, align=1)
    v = builder.insert_element(ir.Constant(_V8I32, ir.Undefined), s, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_V8I32, ir.Undefined), ir.Constant(_V8I32, [0] * 8))


def _dpbusd(builder, acc, u, x):
    """acc (8 x i32) + per lane: sum of 4 u8 bytes of u times the 4 i8 bytes of x (both 8 x i32 views)."""
    if VNNI:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8I32, [_V8I32] * 3),
                                            "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(fn, [acc, u, x])
    ub = builder.zext(builder.bitcast(u, _V32I8), ir.VectorType(_I32, 32))
    xb = builder.sext(builder.bitcast(x, _V32I8), ir.VectorType(_I32, 32))
    p = builder.mul(ub, xb)
    undef = ir.Constant(ir.VectorType(_I32, 32), ir.Undefined)
    for b in range(4):
        acc = builder.add(acc, builder.shuffle_vector(p, undef, ir.Constant(_V8I32, list(range(b, 32, 4)))))
    return acc


def _vload(builder, base, byte_off):
    p = builder.bitcast(builder.gep(base, [ir.Constant(_I32, byte_off)]), _V8I32.as_pointer())
    return builder.load(p, align=1)


# The intrinsics take whole C-contiguous arrays and flat element offsets into them, not views: a view made in
# a hot loop costs an atomic increment and decrement of the parent's reference count, and when two threads do
# that on one array the count's cache line moves between the cores on every call.


# ---- a whole tile: the group dots and the float epilogue, with the 64 row sums in registers across groups

_F32 = ir.FloatType()
_V8F32 = ir.VectorType(_F32, 8)
MODE_SCALE, MODE_OFFSET, MODE_TWO = 0, 1, 2   # d*sum | d*sum + min*sum(x) | two scales, one per half of 16


def _splat(builder, val, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), val, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_V8I32, [0] * 8))


def _constrained(builder, op, a, b):
    """a op b, each rounded on its own: the constrained intrinsics are never fused into an FMA by the backend
    (Numba's target allows contraction, which turned the epilogue's multiply-adds into FMAs: a 1-ulp change that
    moved Gemma's perplexity by 2%). The epilogue keeps the rounding of the Numba loops it replaced."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V8F32, [_V8F32, _V8F32, ir.MetaDataType(), ir.MetaDataType()]),
        f"llvm.experimental.constrained.{op}.v8f32")
    return builder.call(fn, [a, b, ir.MetaDataString(builder.module, "round.tonearest"),
                             ir.MetaDataString(builder.module, "fpexcept.ignore")])


def _mul(builder, a, b):
    return _constrained(builder, "fmul", a, b)


def _add(builder, a, b):
    return _constrained(builder, "fadd", a, b)


def _fload(builder, base, off):
    """8 floats at base + off (elements)."""
    return builder.load(builder.bitcast(builder.gep(base, [off]), _V8F32.as_pointer()), align=4)


def _make_tile(nib: bool, mode: int, z: int):
    K = 4 if nib else 8                        # 256-byte runs per group

    def codegen(context, builder, sig, args):
        (facc, fo, q, qo, s, so, o, oo, xq, xo, xd, xdo, xs, xso, G) = args
        ta = sig.args
        fp = _data(context, builder, ta[0], facc, _F32, fo)
        qp = _data(context, builder, ta[2], q, _I8, qo)
        sp = _data(context, builder, ta[4], s, _F32, so)
        op = _data(context, builder, ta[6], o, _F32, oo)
        xp = _data(context, builder, ta[8], xq, _I8, xo)
        dp = _data(context, builder, ta[10], xd, _F32, xdo)
        sxp = _data(context, builder, ta[12], xs, _F32, xso)
        i64 = ir.IntType(64)
        zero_i = ir.Constant(_V8I32, None)
        f_slots = [cgutils.alloca_once_value(builder, ir.Constant(_V8F32, None)) for _ in range(ROWS // 8)]
        zb = z * 0x01010101
        zv = ir.Constant(_V8I32, [zb - (1 << 32) if zb >= 1 << 31 else zb] * 8)
        mask = ir.Constant(_V8I32, [0x0F0F0F0F] * 8)
        four = ir.Constant(_V8I32, [4] * 8)
        with cgutils.for_range(builder, G) as loop:
            g = loop.index
            wg = builder.gep(qp, [builder.mul(g, ir.Constant(i64, K * ROWS * 4))])
            xg = builder.gep(xp, [builder.mul(g, ir.Constant(i64, 32))])
            xb = [_bcast32(builder, xg, k) for k in range(8)]
            c = []                              # z * sum of x over each half, in every lane
            for h in range(2):
                acc = zero_i
                for k in range(4 * h, 4 * h + 4):
                    acc = _dpbusd(builder, acc, zv, xb[k])
                c.append(acc)
            sd = _splat(builder, builder.load(builder.gep(dp, [g])), _V8F32)
            if mode == MODE_OFFSET:
                sx_s = builder.fadd(builder.load(builder.gep(sxp, [builder.mul(g, ir.Constant(i64, 2))])),
                                    builder.load(builder.gep(sxp, [builder.add(builder.mul(g, ir.Constant(i64, 2)),
                                                                               ir.Constant(i64, 1))])))
                sx = _splat(builder, sx_s, _V8F32)
            H = 2 if mode == MODE_TWO else 1
            for vec in range(ROWS // 8):
                a = [zero_i, zero_i]
                for k in range(4 if nib else 8):
                    w = _vload(builder, wg, k * ROWS * 4 + vec * 32)
                    if nib:
                        a[0] = _dpbusd(builder, a[0], builder.and_(w, mask), xb[k])
                        a[1] = _dpbusd(builder, a[1], builder.and_(builder.lshr(w, four), mask), xb[4 + k])
                    else:
                        a[k // 4] = _dpbusd(builder, a[k // 4], w, xb[k])
                sbase = builder.add(builder.mul(g, ir.Constant(i64, H * ROWS)), ir.Constant(i64, vec * 8))
                f = builder.load(f_slots[vec])
                if mode == MODE_TWO:        # f + d_x * (s0 * sum0 + s1 * sum1)
                    s0 = _fload(builder, sp, sbase)
                    s1 = _fload(builder, sp, builder.add(sbase, ir.Constant(i64, ROWS)))
                    a0 = builder.sitofp(builder.sub(a[0], c[0]), _V8F32)
                    a1 = builder.sitofp(builder.sub(a[1], c[1]), _V8F32)
                    f = _add(builder, f, _mul(builder, sd, _add(builder, _mul(builder, s0, a0), _mul(builder, s1, a1))))
                else:                       # f + ((d_w * d_x) * sum (+ min * (d_x * sum x)))
                    sv = _fload(builder, sp, sbase)
                    ai = builder.sub(builder.add(a[0], a[1]), builder.add(c[0], c[1]))
                    t = _mul(builder, _mul(builder, sv, sd), builder.sitofp(ai, _V8F32))
                    if mode == MODE_OFFSET:
                        ov = _fload(builder, op, builder.add(builder.mul(g, ir.Constant(i64, ROWS)),
                                                             ir.Constant(i64, vec * 8)))
                        t = _add(builder, t, _mul(builder, ov, sx))
                    f = _add(builder, f, t)
                builder.store(f, f_slots[vec])
        for vec in range(ROWS // 8):
            p = builder.bitcast(builder.gep(fp, [ir.Constant(i64, vec * 8)]), _V8F32.as_pointer())
            builder.store(builder.load(f_slots[vec]), p, align=4)
        return context.get_dummy_value()

    def typer(typingctx, facc, fo, q, qo, s, so, o, oo, xq, xo, xd, xdo, xs, xso, G):
        ip = types.intp
        return types.void(facc, ip, q, ip, s, ip, o, ip, xq, ip, xd, ip, xs, ip, ip), codegen

    typer.__name__ = f"tile_{'nib' if nib else 'u8'}_{mode}"
    return intrinsic(typer)


# tile_<layout>_<mode>(facc, fo, q, qo, s, so, o, oo, xq, xo, xd, xdo, xs, xso, G): facc.flat[fo : fo + 64] =
# the 64 rows of one tile (G groups at q.flat[qo:], scales at s.flat[so:] (G, H, 64), offsets at o.flat[oo:]
# (G, 64)) times one activation row (xq.flat[xo:] (32 G) i8, its scales xd.flat[xdo:] (G), its scaled half sums
# xs.flat[xso:] (G, 2)). Per group: d_x * d_w[r] * sum (u - z) x (+ min[r] * d_x * sum x), in that order.
tile_nib_scale = _make_tile(True, MODE_SCALE, 8)     # Q4_0
tile_nib_offset = _make_tile(True, MODE_OFFSET, 8)   # Q4_1, Q4_K
tile_u8_scale5 = _make_tile(False, MODE_SCALE, 16)   # Q5_0
tile_u8_offset5 = _make_tile(False, MODE_OFFSET, 16)  # Q5_1, Q5_K
tile_u8_scale8 = _make_tile(False, MODE_SCALE, 128)  # Q8_0
tile_u8_two = _make_tile(False, MODE_TWO, 32)        # Q6_K
