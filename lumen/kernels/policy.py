"""The dispatch policy, in one place: when an op runs its parallel kernel and when attention splits a token's
keys over the threads. The forward pass, the kernel wrappers, the tests and the benchmark gates all ask here,
so what is timed is what runs. Every choice here is about speed only: the serial and parallel kernels of an op
give the same bits (lumen/kernels/fp.py, lumen/kernels/attention.py).
"""
from __future__ import annotations

from numba import njit

from ..format.quants import QT
from .fp import CHUNK

# Norms, RoPE, activations and residual adds take their parallel kernel from this many rows: below it, a parallel
# region's fork and join cost more than the rows' work.
PAR_ROWS = 8

# The activations of a matmul are rounded (lumen.kernels.matmul.quantize_x) with the rows spread over the threads
# from this many values, where the parallel rounding starts to beat the serial one (about 16 rows of 1024).
PAR_QUANT_VALUES = 16384

# From this many rows a matmul of the Q5 or Q6 family (Q5_0, Q5_1, Q5_K, Q6_K), and from UNPACK_ROWS_Q4 rows one of
# the Q4 family (Q4_0, Q4_1, Q4_K), unpacks each weight tile once into a byte per column and runs its passes on that
# (lumen.kernels.matmul.tiles); below, and for the Q8 family, each pass of NR rows unpacks as it goes. Unpacking
# first pays once a tile serves enough passes to amortise it: from 64 rows for the Q5 and Q6 families (their fifth
# bit or top two bits are 3-4 operations per quad), from 128 for the Q4 family (an and and a shift), where no CPU
# measured reads it slower.
UNPACK_ROWS = 64
UNPACK_ROWS_Q4 = 128
_Q4_FAMILY = (int(QT.Q4_0), int(QT.Q4_1), int(QT.Q4_K))
UNPACKED = (int(QT.Q5_0), int(QT.Q5_1), int(QT.Q5_K), int(QT.Q6_K)) + _Q4_FAMILY

# A matmul of 3 activation rows runs them as one pass of NR = 4 rows over activations padded with a zero row
# (lumen.kernels.matmul.tiles) when its matrix has at least PAD_MIN_IN columns; otherwise as a two-row pass and a
# row alone (2 rows: the two-row pass, lumen.kernels.simd.NR2). A forward pass at a 300-token context, medians of 9,
# 2-vCPU EPYC Zen 5, 3 rows against a 1-row step:
# Qwen2.5-Coder-1.5B 1.31x, 1.15x, 1.17x one row at a time, 1.12x, 1.09x, 1.10x padded (4 rows: 1.05-1.12x); with
# every matrix padded SmolLM2's (576 columns: small tiles) went 1.27x -> 1.33x, so its narrow matrices are not,
# and 2 rows padded were no faster on any model (1.5B 1.07x -> 1.07x, SmolLM2 1.13x -> 1.31x).
PAD_ROWS = 3
PAD_MIN_IN = 1024


@njit(cache=True, inline="always")
def pad_rows(n_rows, n_in):
    """Whether a matmul of n_rows activation rows by a matrix of n_in columns runs them as one padded NR-row pass."""
    return n_rows == PAD_ROWS and n_in >= PAD_MIN_IN


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
