"""The dispatch policy, in one place: when an op runs its parallel kernel and when attention splits a token's
keys over the threads. The forward pass, the kernel wrappers, the tests and the benchmark gates all ask here,
so what is timed is what runs. Every choice here is about speed only: the serial and parallel kernels of an op
give the same bits (lumen/kernels/fp.py, lumen/kernels/attention.py).
"""
from __future__ import annotations

from numba import njit

from ..format.quants import QT
from .fp import CHUNK

# Norms, RoPE, activations and residual adds take their parallel kernel from this many rows. Measured, 2 threads,
# min of short batches: rmsnorm 16 x 576 values 1.7 us serial / 2.2 us parallel, 32 x 576 3.6 / 2.8; swiglu
# 8 x 1536 4.7 / 3.8 (1 x 1536: 0.8 / 1.9); geglu 8 x 2048 7.3 / 5.1; rope (N, 4, 256): N=8 2.2 / 2.3.
PAR_ROWS = 8

# The activations of a matmul are rounded (lumen.kernels.matmul.quantize_x) with the rows spread over the threads
# from this many values. Measured on a 2-vCPU AMD EPYC (Zen 5), 2 threads, medians of 200 calls, us serial /
# parallel: Q8 blocks (Q8_0/Q8_1 activations), 576 columns: 16 rows 2.4 / 3.1, 32 rows 4.5 / 4.4, 256 rows
# 33 / 18; 1536 columns: 8 rows 3.1 / 3.0, 16 rows 5.8 / 5.2, 256 rows 86 / 49; Q8_K, 1536 columns: 8 rows
# 3.7 / 3.5, 16 rows 7.0 / 5.4, 256 rows 111 / 79-100.
PAR_QUANT_VALUES = 16384

# From this many rows a matmul of the Q5 or Q6 family (Q5_0, Q5_1, Q5_K, Q6_K), and from UNPACK_ROWS_Q4 rows one of
# the Q4 family (Q4_0, Q4_1, Q4_K), unpacks each weight tile once into a byte per column and runs its passes on that
# (lumen.kernels.matmul.tiles); below, and for the Q8 family, each pass of NR rows unpacks as it goes. Measured on a
# 2-vCPU AMD EPYC (Zen 5), one thread, a 512 x 2048 matrix in cache, the two paths alternated 9 times in one
# process (medians), unpacked first against as it goes, at N = 64 / 128 / 256: Q5_0 1.00 / 1.13 / 1.15x, Q6_K
# 1.15 / 1.35 / 1.44x; Q4_0 0.89 / 0.96 / 1.00x, Q4_1 0.90 / 1.00 / 1.12x, Q4_K 0.90 / 1.03 / 1.02x. On a 2-vCPU
# AMD EPYC (Zen 4), 2026-12-03, the same in cache: Q4_0 0.94 / 1.01 / 1.01x, Q4_1 0.94 / 1.02 / 1.01x, Q4_K 0.98 /
# 1.02 / 1.04x; but in the forward pass, where each tile comes from memory and the activations pass through L1
# beside it, SmolLM2's (Q4_1) pp512 read 1.04x, 1.05x and 1.11x (8-10 alternated pairs in one process, medians;
# the runner's unpack scratch swapped for an empty one, which turns the path off), on Zen 5 1.02x. The Q4 family's
# unpacking is an and and a shift, so it waits for 128 rows, where neither CPU reads it slower.
UNPACK_ROWS = 64
UNPACK_ROWS_Q4 = 128
_Q4_FAMILY = (int(QT.Q4_0), int(QT.Q4_1), int(QT.Q4_K))
UNPACKED = (int(QT.Q5_0), int(QT.Q5_1), int(QT.Q5_K), int(QT.Q6_K)) + _Q4_FAMILY

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


@njit(cache=True, inline="always")
def parallel_quantize(n_rows, n_in):
    """Whether a matmul's activations (n_rows, n_in) are rounded by the parallel kernel."""
    return n_rows > 1 and n_rows * n_in >= PAR_QUANT_VALUES


@njit(cache=True, inline="always")
def unpack_min_rows(qt):
    """The rows from which a matmul by a matrix of GGML type qt (one of UNPACKED) unpacks each tile once first."""
    return UNPACK_ROWS_Q4 if qt in _Q4_FAMILY else UNPACK_ROWS


@njit(cache=True, inline="always")
def unpack_rows(n_rows, qt):
    """Whether a matmul of n_rows activation rows by a matrix of GGML type qt unpacks each tile once first."""
    return qt in UNPACKED and n_rows >= unpack_min_rows(qt)
