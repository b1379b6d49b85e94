"""The row-wise ops (RMSNorm, RoPE, the gated activations, the residual add) run through one loop and one parallel
region: each op is a row function of one shared signature, compiled once on its own, and called through its
address (lumen.kernels.kinds.call_borrowed).

    row_fn(r, o, a, b, v, p, f, i)    row r of o (N, n) f32 from a, b (2-d f32), v (1-d f32), p (1-d i8), f (f32),
                                      i (i8); what each reads is the row function's contract

Why: Numba optimizes and generates the code of a parallel region's body four times (its gufunc, the two wrappers
that link it, and the kernel that starts the region), and a caller links every callee's code and optimizes it
again. With a serial and a parallel kernel per op, each linked by the forward pass, a first run compiled each
op's row code about six times. Through an address it compiles once, in a small library of its own (which a
model's entry table, lumen.kernels.entries, can load or compile in another process while the forward pass
compiles), and the region here, whose body is one indirect call, once for every op. A row costs one call more:
nothing beside a row of 64 or more values.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange, types

from .jit import compiled_only
from .kinds import abi_guard, address, call_borrowed

F32_2 = types.Array(types.float32, 2, "C")
F32_1 = types.Array(types.float32, 1, "C")
I64_1 = types.Array(types.int64, 1, "C")
ROW_SIGNATURE = (types.int64, F32_2, F32_2, F32_2, F32_1, I64_1, types.float32, types.int64)
NO_V = np.zeros(0, np.float32)        # v and p of the ops that read none
NO_P = np.zeros(0, np.int64)


_row_types = abi_guard("the row functions", ROW_SIGNATURE[1:])


@compiled_only(parallel=True)
def rows_par(fn, n, o, a, b, v, p, f, i):
    """fn(r, o, a, b, v, p, f, i) for r in 0 .. n-1, the rows split across the threads."""
    for r in prange(n):
        call_borrowed(fn, (np.int64(r), o, a, b, v, p, f, i))


@njit(cache=True, no_cfunc_wrapper=True)
def run_rows(fn, par, n, o, a, b, v, p, f, i):
    """fn(r, o, a, b, v, p, f, i) for r in 0 .. n-1, fn the address of a row function (`row_address`), in
    parallel when par (lumen.kernels.policy.parallel_rows). The arguments must be of ROW_SIGNATURE's types (the
    row function is compiled for them; an array's struct is the same whatever its layout, but not its data)."""
    _row_types((o, a, b, v, p, f, i))
    if par:
        rows_par(fn, n, o, a, b, v, p, f, i)
    else:
        for r in range(n):
            call_borrowed(fn, (r, o, a, b, v, p, f, i))


@functools.lru_cache(maxsize=None)
def row_address(fn) -> int:
    """The address of row function fn compiled for ROW_SIGNATURE (compiled now, or loaded from the cache)."""
    return address(fn, ROW_SIGNATURE, "rows")


def rows(fn, n: int, par: bool, o: np.ndarray, a: np.ndarray, b: np.ndarray | None = None, v: np.ndarray = NO_V,
         p: np.ndarray = NO_P, f: float = 0.0, i: int = 0) -> None:
    """run_rows from Python, for the kernels' checked wrappers (which validated the arrays): fn a row function."""
    run_rows(row_address(fn), bool(par), np.int64(n), o, a, a if b is None else b, v, p, np.float32(f), np.int64(i))
