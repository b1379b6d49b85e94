"""A clock readable from inside Numba code: the CPU's time-stamp counter, and its rate in seconds; and the hook
through which the engine finds the profiler its ticks go to.

The forward pass writes `ticks()` into a preallocated int64 array after each op, so every op of a fused
compiled forward is timed without leaving compiled code. Reading the counter costs ~10 ns (rdtsc).

The hook: the runner and the engine record into `active()`, which is NULL (a profiler whose methods do nothing,
so callers never branch on it) unless a profile is open in this thread. lumen.profile (a floor above the engine)
opens one with `recording(profiler)`; the engine never imports lumen.profile.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

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


@njit(cache=True, no_cfunc_wrapper=True)
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


class NullProfiler:
    """What active() returns outside a profile: every recording method does nothing."""
    enabled = False
    in_step = False

    def _nothing(self, *args, **kwargs):
        return 0

    begin_step = describe = end_step = cancel_step = pause = resume = lap = add = record_forward = _nothing


class StepClock:
    """The clock a step profiler keeps (lumen.profile.Profiler, lumen.serve.ui.steps.StepRecorder): ticks while
    paused (generate yields to its consumer, the profiler does its bookkeeping) are kept out of the step's time."""
    _paused_at = 0
    _excluded = 0           # ticks paused in the open step
    _last = 0               # tick where the last recorded segment of the open step ended
    _paused = False

    def pause(self, at: int | None = None) -> None:
        """Stop the step's clock (at: the tick it stopped, default now)."""
        self._paused_at = ticks() if at is None else at
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._last = ticks()
        self._excluded += self._last - self._paused_at


NULL = NullProfiler()
_ACTIVE: ContextVar[Any] = ContextVar("lumen_profiler", default=NULL)


def active() -> Any:
    """The profiler of the innermost open profile in this thread (lumen.profile.Profiler), or NULL."""
    return _ACTIVE.get()


@contextmanager
def recording(profiler) -> Iterator[Any]:
    """Make `profiler` what active() returns in this thread for the block."""
    token = _ACTIVE.set(profiler)
    try:
        yield profiler
    finally:
        _ACTIVE.reset(token)
