"""Which kernels a forward pass needs, as a compile-time value: the weight types of its matrices, the type of its
token embedding, its gated activation.

Numba compiles every branch of a function whatever the data. The forward pass used to dispatch on runtime type
ids, so it compiled the tile kernels of all 8 quantized types (at 2 row counts), the row dequantizers of all 11
types and both activations, for every model; each compiled function is optimised again inside every caller that
links it (numba.core.codegen: a library's final module holds its callees), so a cold start paid for them several
times over. The kinds travel in the Weights bundle, and their Numba type carries the sets, so the dispatchers
(lumen.kernels.matmul.tile_rows, lumen.kernels.dequant.dequant_row, lumen.kernels.activation.gated) build, with
`switch`, code for what the model has and nothing else; the forward pass is compiled (and cached) once per set.

The value is a zero-length array whose structured dtype names the kinds (fields m<type>, e<type>, a<act>): Numba's
dispatcher types arrays in its C fast path, so the bundle costs nothing per call (a Python object of a custom type
sent it down the slow path: 37 us per call instead of 1, measured on a small NamedTuple, 320-410 us per decode
step on the real bundles).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit

from ..format.quants import QT

QUANTIZED = tuple(sorted(int(q) for q in (QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K,
                                          QT.Q8_0)))
FLOATS = tuple(sorted(int(q) for q in (QT.F32, QT.F16, QT.BF16)))
SILU, GELU = 0, 1
ACTS = (SILU, GELU)


def kinds(mats=QUANTIZED + FLOATS, embd=QUANTIZED + FLOATS, acts=ACTS) -> np.ndarray:
    """mats: the GGML types of the packed matrices; embd: the types the embedding lookup dequantizes; acts: the
    gated activations (SILU, GELU). The defaults hold everything (one compiled variant for any model: the kernels'
    public entry points use it)."""
    names = ([f"m{int(q)}" for q in sorted({int(q) for q in mats})]
             + [f"e{int(q)}" for q in sorted({int(q) for q in embd})]
             + [f"a{int(a)}" for a in sorted({int(a) for a in acts})])
    return np.zeros(0, dtype=np.dtype([(n, np.uint8) for n in names]))


def sets(kinds_type) -> tuple[tuple, tuple, tuple]:
    """(mats, embd, acts) of a kinds value's Numba type (at compile time, in an overload)."""
    names = list(kinds_type.dtype.fields)
    pick = lambda p: tuple(sorted(int(n[1:]) for n in names if n[0] == p))  # noqa: E731
    return pick("m"), pick("e"), pick("a")


ALL = kinds()


@functools.lru_cache(maxsize=None)
def switch(cases: tuple, n_args: int):
    """The one way the kernels dispatch on a type: cases ((key, fn), ...) -> a compiled
    f(key, a0, ..., a<n_args - 1>) that calls fn(a0, ...) of the first case whose key == key, the last case taking
    every other key (the loader checked it). Built at compile time, inside an overload, from the kinds' cases
    only, so nothing else is compiled. The if-chain is generated source, inlined into its caller at Numba IR
    level, so the caller's reference counting is the same as if it called the kernel itself. (A chain of compiled
    functions taking *args compiled to the same vector code but put 26 atomic reference count increments into
    lumen.kernels.matmul.tiles_1, the decode loop, against 0 with this; counted in its LLVM IR.)"""
    args = ", ".join(f"a{i}" for i in range(n_args))
    lines = [f"def switch_(key, {args}):"]
    if len(cases) == 1:
        lines.append(f"    f0({args})")
    else:
        for j, (key, _) in enumerate(cases):
            head = "if" if j == 0 else "elif" if j < len(cases) - 1 else "else"
            lines.append(f"    {head}{f' key == {int(key)}' if head != 'else' else ''}:\n        f{j}({args})")
    ns = {f"f{j}": fn for j, (_, fn) in enumerate(cases)}
    exec("\n".join(lines), ns)
    return njit(inline="always")(ns["switch_"])
