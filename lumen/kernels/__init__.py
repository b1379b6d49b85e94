"""Numba kernels. Nothing here imports a model: kernels take arrays, write into an output argument, never allocate."""
