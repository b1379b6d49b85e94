"""Numba kernels. Nothing here imports a model: kernels take arrays, write into an output argument, never allocate.

The threading layer is launched here, before any kernel runs. Numba (0.68) launches it when it compiles a
function with parallel regions, or loads one from its cache that records them; but a function compiled in a process
that loaded its parallel callee from the cache (rather than compiling it) does not record them, and a later process
that loads that function and calls it segfaults in the callee's parallel region. The order of compiles decides
whether a cache holds such an entry: two test processes sharing one cache made one (prepare_x, which called
its parallel region; tests/engine/test_threads.py re-creates it).

Numba's compile cache is locked here too, before any kernel compiles or loads (lumen.paths.lock_compile_cache),
and every compiled function gets a random id, so that cached code from two processes never shares a symbol
(lumen.paths.unique_symbols); loading a function from it no longer sets up all of Numba's implementations first
(lumen.paths.load_without_refresh).

On a target without F16C (NUMBA_CPU_NAME=generic or x86-64-v2: a compile cache for any x86-64) LLVM turns the
kernels' half-precision conversions into calls to __extendhfsf2 and __truncsfhf2, which its JIT looks up in the
process: "LLVM ERROR: Symbol not found" aborted it. libgcc_s (GCC 12 or later) has them, so it is loaded here for
the JIT to find (the IEEE conversions, rounding to nearest even as F16C does: the same bits).
"""
import numba

from ..paths import load_without_refresh, lock_compile_cache, unique_symbols

lock_compile_cache()
unique_symbols()
load_without_refresh()
try:
    import llvmlite.binding
    llvmlite.binding.load_library_permanently("libgcc_s.so.1")
except RuntimeError:             # not there (not Linux, or no GCC runtime): a target with F16C needs none of it
    pass
numba.get_num_threads()          # launches the threading layer (numba.np.ufunc.parallel._launch_threads)
