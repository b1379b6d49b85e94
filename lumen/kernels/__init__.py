"""Numba kernels. Nothing here imports a model: kernels take arrays, write into an output argument, never allocate.

The threading layer is launched here, before any kernel runs. Numba (0.68) launches it when it compiles a
function with parallel regions, or loads one from its cache that records them; but a function compiled in a process
that loaded its parallel callee from the cache (rather than compiling it) does not record them, and a later process
that loads that function and calls it segfaults in the callee's parallel region. The order of compiles decides
whether a cache holds such an entry: two test processes sharing one cache made one (prepare_x, which calls
quantize_x_par; tests/engine/test_threads.py re-creates it).

Numba's compile cache is locked here too, before any kernel compiles or loads (lumen.paths.lock_compile_cache).
"""
import numba

from ..paths import lock_compile_cache

lock_compile_cache()
numba.get_num_threads()          # launches the threading layer (numba.np.ufunc.parallel._launch_threads)
