"""The dispatch policy, in one place: when an op runs its parallel kernel and when attention splits a token's
keys over the threads. The forward pass, the kernel wrappers, the tests and the benchmark gates all ask here,
so what is timed is what runs. Every choice here is about speed only: the serial and parallel kernels of an op
give the same bits (lumen/kernels/fp.py, lumen/kernels/attention.py).
"""
from __future__ import annotations

from numba import njit

from .fp import CHUNK

# Norms, RoPE, activations and residual adds take their parallel kernel from this many rows. Measured, 2 threads,
# min of short batches: rmsnorm 16 x 576 values 1.7 us serial / 2.2 us parallel, 32 x 576 3.6 / 2.8; swiglu
# 8 x 1536 4.7 / 3.8 (1 x 1536: 0.8 / 1.9); geglu 8 x 2048 7.3 / 5.1; rope (N, 4, 256): N=8 2.2 / 2.3.
PAR_ROWS = 8

# A lone decode token spreads its attention chunks over the threads (split-K) once it has more than one chunk.
SPLIT_K_MIN_KEYS = CHUNK + 1


@njit(cache=True, inline="always")
def parallel_rows(n_rows):
    """Whether the row-wise ops of a step of n_rows rows run their parallel kernels."""
    return n_rows >= PAR_ROWS


@njit(cache=True, inline="always")
def split_attention(n_tokens, n_keys):
    """Whether attention runs split-K: one token whose key range spans more than one chunk."""
    return n_tokens == 1 and n_keys >= SPLIT_K_MIN_KEYS
