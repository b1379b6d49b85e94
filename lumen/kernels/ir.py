"""LLVM IR helpers shared by the intrinsic kernels (lumen.kernels.fp: float kernels; lumen.kernels.simd: the
quantized tile kernels): the vector types, pointers into Numba arrays, splats, intrinsic calls, and the float
operations whose rounding is written down (one `llvm.fma`, or a multiply / add that is never fused).

Every helper takes whole C-contiguous arrays and flat element offsets (no views: see lumen.kernels.simd), or in
their place an address (an integer: lumen.kernels.simd.data_at) of elements of the type the helper reads.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils

LANES = 16                     # lanes of a vector: 16 f32 or i32 (one zmm; two ymm on AVX2)
F16, F32 = ir.HalfType(), ir.FloatType()
I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
VF = ir.VectorType(F32, LANES)
VH = ir.VectorType(F16, LANES)
VI = ir.VectorType(I32, LANES)
VB = ir.VectorType(I8, 4 * LANES)
VB8 = ir.VectorType(I8, LANES)
V8I32 = ir.VectorType(I32, 8)
NEG_INF = float("-inf")


def ptr(context, builder, aty, aval, elty, off=None):
    """Pointer (elty*) to element `off` (an i64 count of the array's own elements) of the array's data; of an
    address's elties, given an address."""
    if isinstance(aty, types.Integer):
        p = builder.inttoptr(aval, elty.as_pointer())
        return p if off is None else builder.gep(p, [off])
    arr = context.make_array(aty)(context, builder, aval)
    p = arr.data if off is None else builder.gep(arr.data, [off])
    return builder.bitcast(p, elty.as_pointer())


def vload(builder, base, byte_off, ty=V8I32):
    """A vector of type ty at base (i8*) + byte_off (an int constant or i64 value)."""
    off = ir.Constant(I32, byte_off) if isinstance(byte_off, int) else byte_off
    return builder.load(builder.bitcast(builder.gep(base, [off]), ty.as_pointer()), align=1)


def i64(v):
    return ir.Constant(I64, v)


def ivec(v):
    """The 32-bit pattern v in every lane of a VI."""
    v &= 0xFFFFFFFF
    return ir.Constant(VI, [v - (1 << 32) if v >= 1 << 31 else v] * LANES)


def splat(builder, val, vty=VF):
    """val in every lane of a vector of type vty."""
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), val, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(I32, vty.count),
                                                                                   [0] * vty.count))


def const(val, ty):
    """val as a constant of type ty (in every lane of a vector type)."""
    return ir.Constant(ty, [val] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(ty, val)


def call(builder, name, ret, args):
    """A call of the LLVM intrinsic (or function) `name`, declared from the arguments' types."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def sfx(ty):
    """The overload suffix of an f32 type in intrinsic names: f32 or v<n>f32."""
    return f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"


def fma(builder, a, b, c):
    """a * b + c, rounded once (llvm.fma: an exact operation, never split or fused differently)."""
    return call(builder, f"llvm.fma.{sfx(a.type)}", a.type, [a, b, c])


def fmax(builder, a, b):
    """a if a > b else b (NaN in b propagates, NaN in a does not)."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def fold(builder, v, op):
    """op over the lanes of v in a fixed halving tree: op(v[i], v[i + 8]), then with [i + 4], [i + 2], [i + 1]."""
    n = LANES
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n, 2 * n))))
        v = op(lo, hi)
    return builder.extract_element(v, ir.Constant(I32, 0))


def hmax(builder, v):
    """Largest lane of v (exact whatever the order)."""
    return fold(builder, v, lambda a, b: fmax(builder, a, b))


def hsum(builder, v):
    """Sum of the lanes of v, in fold's fixed order."""
    return fold(builder, v, builder.fadd)


def constrained(builder, op, a, b):
    """a op b (VF), rounded on its own: the constrained intrinsics are never fused into an FMA by the backend
    (Numba's target allows contraction, and a contraction the code does not name is one the bits depend on: the
    compiler's choice, not ours)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(VF, [VF, VF, ir.MetaDataType(), ir.MetaDataType()]),
        f"llvm.experimental.constrained.{op}.v{LANES}f32")
    return builder.call(fn, [a, b, ir.MetaDataString(builder.module, "round.tonearest"),
                             ir.MetaDataString(builder.module, "fpexcept.ignore")])


def mul(builder, a, b):
    """a * b (VF), rounded on its own (the tile kernels' scale products, which must not fuse into the FMA after)."""
    return constrained(builder, "fmul", a, b)
