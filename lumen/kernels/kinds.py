"""Which kernels a forward pass needs, as a compile-time value: the weight types of its matrices, the type of its
token embedding, its gated activation.

Numba compiles every branch of a function whatever the data. The forward pass used to dispatch on runtime type
ids, so it compiled the tile kernels of all 8 quantized types (at 2 row counts), the row dequantizers of all 11
types and both activations, for every model; each compiled function is optimised again inside every caller that
links it (numba.core.codegen: a library's final module holds its callees), so a cold start paid for them several
times over. `Kinds` travels in the Weights bundle; its Numba type (`KindsType`) carries the sets, so the
dispatchers (lumen.kernels.matmul.tile_rows, lumen.kernels.dequant.embed_row, lumen.kernels.activation.gated)
generate code for what the model has and nothing else, and the forward pass is compiled (and cached) once per set.
"""
from __future__ import annotations

from numba import types
from numba.extending import NativeValue, models, register_model, typeof_impl, unbox

from ..format.quants import QT

QUANTIZED = tuple(sorted(int(q) for q in (QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K,
                                          QT.Q8_0)))
FLOATS = tuple(sorted(int(q) for q in (QT.F32, QT.F16, QT.BF16)))
SILU, GELU = 0, 1
ACTS = (SILU, GELU)


class Kinds:
    """mats: the GGML types of the packed matrices; embd: the types the embedding lookup dequantizes; acts: the
    gated activations (SILU, GELU). Each a tuple of ints; the defaults hold everything (one compiled variant for
    any model: the kernels' public entry points use it)."""

    def __init__(self, mats=QUANTIZED + FLOATS, embd=QUANTIZED + FLOATS, acts=ACTS):
        self.mats = tuple(sorted({int(q) for q in mats}))
        self.embd = tuple(sorted({int(q) for q in embd}))
        self.acts = tuple(sorted({int(a) for a in acts}))

    def __repr__(self) -> str:
        return f"Kinds(mats={self.mats}, embd={self.embd}, acts={self.acts})"


ALL = Kinds()


class KindsType(types.Type):
    """The Numba type of a Kinds value: the sets themselves (the value carries no data)."""

    def __init__(self, mats: tuple, embd: tuple, acts: tuple):
        self.mats, self.embd, self.acts = mats, embd, acts
        super().__init__(name=f"Kinds(mats={mats}, embd={embd}, acts={acts})")


@typeof_impl.register(Kinds)
def _typeof_kinds(val, c):
    return KindsType(val.mats, val.embd, val.acts)


register_model(KindsType)(models.OpaqueModel)


@unbox(KindsType)
def _unbox_kinds(typ, obj, c):
    return NativeValue(c.context.get_constant_null(typ))
