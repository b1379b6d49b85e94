"""How a parallel region's work reaches its threads, and the threads themselves.

A parallel region ends when its last thread does. With a static split (each thread a fixed share), a thread the
OS deschedules for a moment holds the region back by its whole share. llama.cpp hands out matmul chunks from one
atomic counter, so whoever runs takes the next chunk. Here each worker owns a contiguous share cut into
CHUNKS_PER_SHARE chunks and claims them from the front (`claim`: one atomic add on its own cache line); a worker
with none left steals the others' from the back. Which thread computes a chunk never changes what it computes,
so the outputs do not depend on the distribution.

Measured, 2-vCPU AMD EPYC (Zen 5), SmolLM2 decode, 2 threads, tok/s: one shared counter with 1 / 2 / 4 / 8 chunks
per worker 303 / 289 / 255 / 251 against 304 for the static split (a locked add drains the stream's loads in
flight at every chunk boundary); per-share words with 1 / 4 / 16 chunks per share 326 / 316 / 301 against 340;
so 2 chunks per share. Alone and beside a 1 ms sleeping loop the split makes no difference within noise
(profiling/shared_machine.py: 307.8 / 309.3 against 313.6 / 314.6); beside a busy process it does not save 2
threads (48.7 against 38.7), which is the thread governor's job (lumen.engine.threads).

Also here: `compute_thread_ids` (the OS ids of the threads a caller's regions run on, for the governor),
`release_threads` (ending a thread's OpenMP pool) and `numba_threads` (a thread count for a block).
"""
from __future__ import annotations

import ctypes
import sys
from contextlib import contextmanager

import numba

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .scratch import per_thread


@intrinsic
def fetch_add(typingctx, arr, i, v):
    """old = arr[i]; arr[i] += v, atomically (sequentially consistent); returns old. arr: 1-d int64."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None
    sig = types.int64(arr, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(a.data, [args[1]])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")
    return sig, codegen


STATIC = 1              # work[0] = STATIC: each worker its own share only (the static split, to measure against)
CHUNKS_PER_SHARE = 2    # work[1]: chunks a share is cut into


def counters(workers: int, static: bool = False) -> np.ndarray:
    """The work words of a region of up to `workers` workers, each on a cache line of its own
    (lumen.kernels.scratch): line 0 holds the switches (work[0] = STATIC for the static split, work[1] the
    chunks per share), line w + 1 worker w's share (claims from the front in its low 32 bits, steals from the
    back in its high 32 bits)."""
    w = per_thread((8 * (workers + 1),), np.int64)
    w[0] = STATIC if static else 0
    w[1] = CHUNKS_PER_SHARE
    return w


_LOW = (1 << 32) - 1


@njit(cache=True, inline="always")
def claim(work, i, n_chunks, own):
    """The next chunk (0 .. n_chunks-1) of the share whose word is work[i], or -1 when none is left: its owner
    (own) takes chunks from the front, any other worker steals from the back. One atomic add per claim on one
    word that holds both counts, so the owner and a thief never take the same chunk; the owner's adds stay in its
    own cache line until somebody steals."""
    old = fetch_add(work, i, np.int64(1) if own else np.int64(1) << np.int64(32))
    a, b = old & _LOW, old >> np.int64(32)
    if a + b >= n_chunks:
        return np.int64(-1)
    return a if own else n_chunks - 1 - b


@intrinsic
def gettid(typingctx):
    """The calling OS thread's id (Linux's gettid; a symbol the JIT resolves in the C library, so the kernels
    that call it can be cached)."""
    sig = types.int64()

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "gettid")
        return builder.sext(builder.call(fn, []), ir.IntType(64))
    return sig, codegen


@njit(parallel=True, cache=True, no_cfunc_wrapper=True)
def _tids(out):
    for i in prange(out.shape[0]):
        out[i] = gettid()


@contextmanager
def numba_threads(n: int):
    """Numba's thread count of the calling thread is n for the block, then what it was."""
    before = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def compute_thread_ids(n: int) -> list[int]:
    """The OS thread ids of the threads that run the calling thread's parallel regions at n threads, the caller's
    included (Linux only, else []). Numba's OpenMP pool belongs to the thread that starts a region."""
    if not sys.platform.startswith("linux") or n < 1:
        return []
    out = np.zeros(n, np.int64)
    _tids(out)
    return sorted(set(int(t) for t in out if t > 0))


def _libgomp():
    """The libgomp that Numba's OpenMP threading layer loaded into this process, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for p in sorted(paths):
        try:
            return ctypes.CDLL(p)
        except OSError:
            pass
    return None


def release_threads() -> bool:
    """End the calling thread's OpenMP worker threads (libgomp's omp_pause_resource_all; they are made again if
    this thread starts another parallel region). Returns whether it did.

    Why: libgomp spins a waiting worker GOMP_SPINCOUNT times before it sleeps, but only while it manages no more
    threads than there are CPUs; past that it spins 100 times (1000 with OMP_WAIT_POLICY=active), so nearly every
    one of a step's ~150 barriers puts a thread to sleep and wakes it again. Every thread that has run a parallel
    region keeps a pool of workers, so a server that warmed up on its main thread and steps on an engine thread
    manages 4 threads on 2 CPUs. Measured, 2-vCPU AMD EPYC (Zen 5), SmolLM2 decode, 2 threads, OMP_WAIT_POLICY
    unset: 330 tok/s on the main thread alone; 186 tok/s on a second thread once the main thread has a pool; in
    the server 220 context switches per step and TPOT 10 ms against 4 ms with one thread."""
    from numba.np.ufunc import parallel
    if parallel._threading_layer != "omp":
        return False
    lib = _libgomp()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return False
    lib.omp_pause_resource_all.restype = ctypes.c_int
    lib.omp_pause_resource_all.argtypes = (ctypes.c_int,)
    return lib.omp_pause_resource_all(2) == 0          # omp_pause_hard
