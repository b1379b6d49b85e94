"""A clock readable from inside Numba code: the CPU's time-stamp counter, and its rate in seconds.

The forward pass writes `ticks()` into a preallocated int64 array after each op, so every op of a fused
compiled forward is timed without leaving compiled code. Reading the counter costs ~10 ns (rdtsc).
"""
from __future__ import annotations

import time

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _readcyclecounter(typingctx):
    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [])
        fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=fnty)
        return builder.call(fn, [])
    return types.int64(), codegen


@njit(cache=True)
def ticks():
    """The time-stamp counter (constant-rate on the CPUs Lumen targets)."""
    return _readcyclecounter()


_RATE: float | None = None


def tick_rate() -> float:
    """Ticks per second, measured once against time.perf_counter over ~50 ms."""
    global _RATE
    if _RATE is None:
        ticks()  # compile
        best = []
        for _ in range(3):
            t0, c0 = time.perf_counter(), ticks()
            time.sleep(0.015)
            t1, c1 = time.perf_counter(), ticks()
            best.append((c1 - c0) / (t1 - t0))
        best.sort()
        _RATE = best[1]
    return _RATE
