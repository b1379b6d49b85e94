"""Integer dot products of one 32-column group of a 64-row weight tile, written as LLVM vector IR.

LLVM never emits vpdpbusd from Numba loops (shared/KERNELS.md), and the int16-lane loops it does emit top out
at about 25 G MAC/s per core here (3 instructions per 16 products). vpdpbusd multiplies 4 unsigned bytes by 4
signed bytes and adds the 4 products to an int32 lane: 32 products per 256-bit instruction. These intrinsics
emit it directly when the CPU has AVX512-VNNI with AVX512-VL (llvm.x86.avx512.vpdpbusd.256), and otherwise
the same arithmetic as portable vector IR (widen, multiply, add), which any x86-64 or other LLVM target
compiles; the results are the same integers either way.

Weight layout of one group (32 columns j of 64 rows r), lanes = rows, 4 consecutive columns per int32 lane:
  u8 layout  (8, 64, 4) u8:  w[k, r, b] = value of column 4k + b of row r, unsigned (a zero point is
                             subtracted by the caller: sum_j (u - z) x = sum_j u x - z sum_j x)
  nib layout (4, 64, 4) u8:  w[k, r, b] = column 4k + b in the low nibble, column 16 + 4k + b in the high one
Both produce A (2, 64) int32: A[h, r] = sum over the half h (columns 16h .. 16h+15) of u[r, j] * x[j].
Exact: |A| <= 16 * 255 * 128 < 2^20.
"""
from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_features = llvm.get_host_cpu_features()
VNNI = bool(_features.get("avx512vnni", False) and _features.get("avx512vl", False))

ROWS = 64                      # rows of a tile (lumen.kernels.matmul.R)
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
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


def _vstore(builder, v, ap, h, vec):
    p = builder.bitcast(builder.gep(ap, [ir.Constant(_I32, h * ROWS + vec * 8)]), _V8I32.as_pointer())
    builder.store(v, p, align=4)


# The arguments are whole C-contiguous arrays and flat element offsets into them, not views: a view made in a
# hot loop costs an atomic increment and decrement of the parent's reference count, and when two threads do
# that on one array the count's cache line moves between the cores on every call.

@intrinsic
def dot_u8_group(typingctx, A, ao, w, wo, x, xo):
    """A.flat[ao : ao + 128] as (2, 64) i32 <- the half sums of the u8-layout group at w.flat[wo : wo + 2048]
    ((8, 64, 4) u8) times x.flat[xo : xo + 32] (i8). Offsets are in elements; bounds are the caller's contract."""
    def codegen(context, builder, sig, args):
        ap = _data(context, builder, sig.args[0], args[0], _I32, args[1])
        wp = _data(context, builder, sig.args[2], args[2], _I8, args[3])
        xp = _data(context, builder, sig.args[4], args[4], _I8, args[5])
        xs = [_bcast32(builder, xp, k) for k in range(8)]
        zero = ir.Constant(_V8I32, None)
        for h in range(2):
            for vec in range(ROWS // 8):
                acc = zero
                for k in range(4 * h, 4 * h + 4):
                    acc = _dpbusd(builder, acc, _vload(builder, wp, k * ROWS * 4 + vec * 32), xs[k])
                _vstore(builder, acc, ap, h, vec)
        return context.get_dummy_value()
    return types.void(A, types.intp, w, types.intp, x, types.intp), codegen


@intrinsic
def dot_nib_group(typingctx, A, ao, w, wo, x, xo):
    """As dot_u8_group for the nibble-layout group at w.flat[wo : wo + 1024] ((4, 64, 4) u8)."""
    def codegen(context, builder, sig, args):
        ap = _data(context, builder, sig.args[0], args[0], _I32, args[1])
        wp = _data(context, builder, sig.args[2], args[2], _I8, args[3])
        xp = _data(context, builder, sig.args[4], args[4], _I8, args[5])
        xs = [_bcast32(builder, xp, k) for k in range(8)]
        mask = ir.Constant(_V8I32, [0x0F0F0F0F] * 8)
        four = ir.Constant(_V8I32, [4] * 8)
        zero = ir.Constant(_V8I32, None)
        for vec in range(ROWS // 8):
            lo_acc, hi_acc = zero, zero
            for k in range(4):
                b = _vload(builder, wp, k * ROWS * 4 + vec * 32)
                lo_acc = _dpbusd(builder, lo_acc, builder.and_(b, mask), xs[k])
                hi_acc = _dpbusd(builder, hi_acc, builder.and_(builder.lshr(b, four), mask), xs[4 + k])
            _vstore(builder, lo_acc, ap, 0, vec)
            _vstore(builder, hi_acc, ap, 1, vec)
        return context.get_dummy_value()
    return types.void(A, types.intp, w, types.intp, x, types.intp), codegen
