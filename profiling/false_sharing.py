"""Do two threads slow each other down by writing scratch in one cache line?

    python profiling/false_sharing.py [--repeats 5] [--steps 20000]

Each thread runs an int16-lane tile kernel (the Q5 kernel Lumen used before lumen.kernels.simd: its
accumulators are stored on every step) on its own weights and activations; only the layout of the per-thread
scratch differs:
- "numpy": scratch (threads, ...) with the base 16 bytes past a line, as numpy's allocator gives, so the end
  of thread 0's block and the start of thread 1's share a 64-byte line;
- "per_thread": lumen.kernels.scratch.per_thread, every block on its own lines.
Figures are G MAC/s summed over threads, medians of --repeats, layouts interleaved.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
from numba import njit, prange

from lumen.kernels.matmul import R
from lumen.kernels.scratch import LINE, per_thread
from verdict import count, verdict


@njit(cache=True)
def tile_i8s_mv(facc, acc, q, s, o, xq, xd, xs):
    """facc (R,) = tile (G,32,R) int8 with |q| <= 16 . xq; acc (2,R) i16 scratch, stored on every step."""
    G = q.shape[0]
    a0 = acc[0]
    a1 = acc[1]
    for r in range(R):
        facc[r] = 0.0
    for g in range(G):
        for r in range(R):
            a0[r] = 0
            a1[r] = 0
        for j in range(16):
            xl = np.int16(xq[32 * g + j])
            xh = np.int16(xq[32 * g + j + 16])
            for r in range(R):
                a0[r] = np.int16(a0[r] + np.int16(q[g, j, r]) * xl)
                a1[r] = np.int16(a1[r] + np.int16(q[g, j + 16, r]) * xh)
        sd = xd[g]
        for r in range(R):
            facc[r] += s[g, 0, r] * sd * np.float32(np.int32(a0[r]) + np.int32(a1[r]))


@njit(parallel=True, cache=True)
def _run(steps, facc, acc, q, s, o, xq, xd, xs):
    for c in prange(facc.shape[0]):
        for _ in range(steps):
            tile_i8s_mv(facc[c], acc[c], q[c], s, o, xq[c], xd[c], xs[c])


def misaligned(shape, dtype, by=16):
    """A zeroed C-contiguous array whose base is `by` bytes past a cache line."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(n + 2 * LINE, np.uint8)
    off = (-raw.ctypes.data) % LINE + by
    return raw[off:off + n].view(dtype).reshape(shape)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=count, default=5)
    ap.add_argument("--steps", type=count, default=20000)
    a = ap.parse_args(argv)
    G, nt = 20, numba.config.NUMBA_NUM_THREADS           # a 640-column tile, as Gemma's q/gate/up
    rng = np.random.default_rng(0)
    q = rng.integers(-16, 16, (nt, G, 32, R)).astype(np.int8)
    s = rng.random((G, 1, R)).astype(np.float32)
    o = np.zeros((0, R), np.float32)
    xq = rng.integers(-127, 128, (nt, 32 * G)).astype(np.int8)
    xd = rng.random((nt, G)).astype(np.float32)
    xs = rng.random((nt, G, 2)).astype(np.float32)
    layouts = {"numpy": misaligned, "per_thread": per_thread}
    res = {(name, th): [] for name in layouts for th in range(1, nt + 1)}
    for _ in range(a.repeats):
        for th in range(1, nt + 1):
            numba.set_num_threads(th)
            for name, alloc in layouts.items():
                facc, acc = alloc((th, R), np.float32), alloc((th, 2, R), np.int16)
                _run(1, facc, acc, q, s, o, xq, xd, xs)
                t0 = time.perf_counter()
                _run(a.steps, facc, acc, q, s, o, xq, xd, xs)
                res[name, th].append(th * a.steps * G * 32 * R / (time.perf_counter() - t0) / 1e9)
    for (name, th), v in res.items():
        print(f"{name:10s} {th} thread(s): {statistics.median(v):6.1f} G MAC/s")
    if nt >= 2:
        bad = statistics.median(res["numpy", 2]) / statistics.median(res["numpy", 1])
        good = statistics.median(res["per_thread", 2]) / statistics.median(res["per_thread", 1])
        verdict(f"2 threads give {bad:.2f}x the 1-thread rate with shared-line scratch, {good:.2f}x with "
                f"per-thread lines (medians of {a.repeats})")


if __name__ == "__main__":
    main()
