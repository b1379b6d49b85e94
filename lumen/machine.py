"""This machine's limits, measured once with Numba kernels and cached: the ceilings of the roofline.

    from lumen.machine import limits
    limits()   # {'bw_1t_gbps', 'bw_gbps', 'fma_gflops', 'int_dot_gops', 'threads', 'cpu', 'cores', ...}

- bw_1t_gbps / bw_gbps: memory read bandwidth, one thread / all threads: a vectorized f32 sum streaming a ~1 GB
  array (best of several passes).
- fma_gflops: f32 FMA throughput on all threads: 128 independent accumulators per thread (16 ymm registers, enough
  to cover the FMA latency on both pipes), 2 FLOP per multiply-add.
- int_dot_gops: int16 x int16 dot products summed into int32 lanes (the narrowing of KERNELS.md that gets
  vpmaddwd), L1-resident, all threads, 2 ops per multiply-add (the unit the profiler counts matmul work in).

These are what Numba code reaches here, not the vendor's peak. The result is cached as JSON in
`$LUMEN_HOME/machine.json` and is reused only on the same CPU model string and core count.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np
from numba import njit

from .errors import LumenError
from .model.store import lumen_home

VERSION = 1  # bump when a kernel below changes what it measures
FMA_W = 128  # accumulators per thread (f32)
DOT_N = 512  # int16 elements per dot product (2 KB per operand: L1)


# ---- kernels ----
@njit(fastmath=True, cache=True, nogil=True)
def sum_kernel(a):
    """sum of a (n,) f32: a streaming read (fastmath lets LLVM split the sum over vector accumulators)."""
    s = np.float32(0)
    for i in range(a.size):
        s += a[i]
    return s


@njit(fastmath=True, cache=True, nogil=True)
def fma_kernel(n, m, c):
    """n rounds of acc = acc * m + c over FMA_W independent f32 accumulators; returns their sum."""
    acc = np.zeros(FMA_W, np.float32)
    for j in range(FMA_W):
        acc[j] = j * np.float32(1e-3)
    for _ in range(n):
        for j in range(FMA_W):
            acc[j] = acc[j] * m + c
    return acc.sum()


@njit(fastmath=True, cache=True, nogil=True)
def dot_kernel(a, b, n):
    """n dot products of a (k,) and b (k,) int16 into int32 (each step narrowed to int32, so LLVM emits
    vpmaddwd rather than 64-bit lanes)."""
    t = np.int32(0)
    for _ in range(n):
        s = np.int32(0)
        for i in range(a.size):
            s = np.int32(s + np.int32(a[i]) * np.int32(b[i]))
        t = np.int32(t + s)
    return t


# ---- measuring ----
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _best(fn, reps: int) -> float:
    """Shortest wall time of `reps` calls."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _on_threads(calls: list) -> None:
    """Run the zero-argument callables at once, one Python thread each (the kernels release the GIL), so each
    thread runs exactly the single-thread kernel's code."""
    ts = [threading.Thread(target=f) for f in calls]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def measure(bw_bytes: int = 1 << 30, reps: int = 5, fma_rounds: int = 4_000_000, dot_rounds: int = 200_000,
            threads: int | None = None) -> dict:
    """Measure the limits now: about 10 s at the default sizes (a quiet machine); smaller sizes for tests."""
    threads = threads or os.cpu_count() or 1
    out = {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads, "version": VERSION}
    a = np.ones(max(bw_bytes // 4, 1024 * threads), np.float32)  # (n,) f32; allocating faults the pages in
    step = (a.size + threads - 1) // threads
    parts = [a[i * step:(i + 1) * step] for i in range(threads)]
    m, c = np.float32(0.999), np.float32(1e-3)
    x = (np.arange(threads * DOT_N) % 7 - 3).astype(np.int16).reshape(threads, DOT_N)  # (threads, DOT_N)
    y = (np.arange(threads * DOT_N) % 5 - 2).astype(np.int16).reshape(threads, DOT_N)
    sum_kernel(a[:1024]), fma_kernel(1, m, c), dot_kernel(x[0], y[0], 1)  # compile (or load) outside the timing

    out["bw_1t_gbps"] = a.nbytes / _best(lambda: sum_kernel(a), reps) / 1e9
    out["bw_gbps"] = a.nbytes / _best(lambda: _on_threads([lambda p=p: sum_kernel(p) for p in parts]), reps) / 1e9
    del a, parts
    flops = 2 * FMA_W * fma_rounds
    out["fma_1t_gflops"] = flops / _best(lambda: fma_kernel(fma_rounds, m, c), reps) / 1e9
    out["fma_gflops"] = flops * threads / _best(
        lambda: _on_threads([lambda: fma_kernel(fma_rounds, m, c)] * threads), reps) / 1e9
    ops = 2 * DOT_N * dot_rounds
    out["int_dot_1t_gops"] = ops / _best(lambda: dot_kernel(x[0], y[0], dot_rounds), reps) / 1e9
    out["int_dot_gops"] = ops * threads / _best(
        lambda: _on_threads([lambda t=t: dot_kernel(x[t], y[t], dot_rounds) for t in range(threads)]), reps) / 1e9
    out["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return out


def cache_path() -> Path:
    return lumen_home() / "machine.json"


def _valid(d: dict) -> bool:
    keys = ("bw_1t_gbps", "bw_gbps", "fma_gflops", "int_dot_gops", "threads", "cpu")
    return (isinstance(d, dict) and all(k in d for k in keys) and d.get("cpu") == cpu_model()
            and d.get("cores") == os.cpu_count() and d.get("version") == VERSION)


def limits(measure_if_missing: bool = True, remeasure: bool = False) -> dict:
    """The cached limits of this machine; measured (and cached) when the cache is missing, stale or corrupt."""
    path = cache_path()
    if not remeasure:
        try:
            d = json.loads(path.read_text())
            if _valid(d):
                return d
            why = "was measured on another CPU or thread count"
        except FileNotFoundError:
            why = "is missing"
        except (OSError, ValueError):
            why = "is unreadable"
        if not measure_if_missing:
            raise LumenError(f"the machine limits cache {path} {why}; run `python -m lumen.profile --machine`")
        print(f"note: the machine limits cache {path} {why}; measuring this machine (about 10 s)...",
              file=sys.stderr, flush=True)
    d = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(d, indent=1))
    except OSError as e:
        print(f"warning: could not cache the machine limits in {path}: {e.strerror}", file=sys.stderr)
    return d
