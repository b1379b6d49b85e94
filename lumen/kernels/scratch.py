"""Per-thread scratch arrays that share no cache line between threads.

A kernel's parallel chunk c works in scratch[c]. numpy aligns a new array to 16 bytes, so the last bytes of
scratch[c] and the first of scratch[c + 1] could sit in one 64-byte line; the tile kernels store their
accumulators on every step, and two cores writing one line pass it back and forth. Measured on this 2-core
machine: a compute-bound tile kernel ran at 23 G MAC/s on 1 thread and 11.6 G MAC/s in all on 2 threads with
numpy-aligned scratch; with each thread's block on its own lines, 25.5 and 51 (profiling/false_sharing.py).
`per_thread` aligns the array to a line; a block whose size is a multiple of the line then owns its lines.
"""
from __future__ import annotations

import numpy as np

LINE = 64  # bytes per cache line (x86)


def per_thread(shape: tuple, dtype) -> np.ndarray:
    """A zeroed C-contiguous array of `shape` (threads first) starting on a cache-line boundary. Each
    scratch[c] owns its cache lines when its size in bytes is a multiple of LINE (otherwise the result is the
    same, only slower)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(n + LINE, np.uint8)
    off = (-raw.ctypes.data) % LINE
    return raw[off:off + n].view(dtype).reshape(shape)
