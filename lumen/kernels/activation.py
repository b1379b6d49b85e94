"""Gated activations and the residual add.

    swiglu: out = silu(gate) * up,       silu(x) = x / (1 + exp(-x))                       (llama, qwen2)
    geglu:  out = gelu_tanh(gate) * up,  gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (gemma3)
    add:    x += y                                                                          (residual)

gelu_tanh is evaluated as x * sigmoid(2u), the same function as 0.5 x (1 + tanh(u)), because tanhf does not
vectorize in Numba (measured 17 ns/element with tanhf, 0.55 with this form). The GeGLU kernels follow llama.cpp's
CPU build (GGML_GELU_FP16) rather than the formula: for -10 < x < 10 the input is rounded to fp16 and the result
is the fp16-rounded gelu of that (llama.cpp reads it from an fp16 table), gelu(x) = 0 below -10 and x above 10
(`gelu_llama`). The formula itself is `gelu_tanh`.

exp is lumen.kernels.fp.exp_f32, a vectorizable float32 exp written with explicit fma (the libm expf call blocks
SIMD). No fastmath anywhere: each value is rounded the same way in every caller (lumen/kernels/fp.py).
`swiglu_row`, `geglu_row` and `add_row` are row functions (lumen.kernels.rows: one signature for every row-wise op,
run through one loop and one parallel region); the wrappers validate, then run them serially or in parallel by
size. A model's entry table (lumen.kernels.entries) holds the row function of its activation (ACT + SILU or GELU).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .fp import exp_f32
from .checks import as_f32, as_out, check
from .jit import compiled_only
from .kinds import GELU, SILU
from .policy import parallel_rows
from .rows import rows



@njit(cache=True, inline="always")
def silu(x):
    """x * sigmoid(x), float32."""
    return x / (np.float32(1.0) + exp_f32(-x))


@njit(cache=True, inline="always")
def gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = x * sigmoid(2u), float32."""
    u = np.float32(0.7978845608028654) * x * (np.float32(1.0) + np.float32(0.044715) * x * x)
    return x / (np.float32(1.0) + exp_f32(np.float32(-2.0) * u))


@compiled_only(c_wrapper=True, error_model="numpy")
def swiglu_row(r, o, a, b, v, p, f, i):
    """Row r of o (N, n_ff) = silu(a[r]) * b[r] (a the gate, b the up rows); o may be a or b. A row function
    (lumen.kernels.rows). Rows are indexed, not sliced (see norm.rmsnorm_row). In place the loop names one
    array: with two names LLVM's runtime overlap check sees o == a and falls back to scalar code, measured 5x
    slower (64 x 1536: 388 against 72 us)."""
    n = a.shape[1]
    if o.ctypes.data == a.ctypes.data:
        for j in range(n):
            a[r, j] = silu(a[r, j]) * b[r, j]
    elif o.ctypes.data == b.ctypes.data:
        for j in range(n):
            b[r, j] = silu(a[r, j]) * b[r, j]
    else:
        for j in range(n):
            o[r, j] = silu(a[r, j]) * b[r, j]


@njit(cache=True, inline="always")
def round_f16_bits(x):
    """float32 x rounded to fp16 precision (ties to even on the 13 dropped mantissa bits; fp16 normal range)."""
    b = np.float32(x).view(np.uint32)
    b = np.uint32((b + np.uint32(0x0FFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000))
    return b.view(np.float32)


@njit(cache=True, inline="always")
def gelu_llama(x):
    """llama.cpp's CPU gelu: fp16-rounded gelu_tanh of the fp16-rounded input inside (-10, 10), 0 / x outside."""
    if x <= np.float32(-10.0):
        return np.float32(0.0)
    if x >= np.float32(10.0):
        return x
    return round_f16_bits(gelu_tanh(round_f16_bits(x)))


@compiled_only(c_wrapper=True, error_model="numpy")
def geglu_row(r, o, a, b, v, p, f, i):
    """Row r of o (N, n_ff) = gelu_llama(a[r]) * b[r]; a row function, in place as swiglu_row."""
    n = a.shape[1]
    if o.ctypes.data == a.ctypes.data:
        for j in range(n):
            a[r, j] = gelu_llama(a[r, j]) * b[r, j]
    elif o.ctypes.data == b.ctypes.data:
        for j in range(n):
            b[r, j] = gelu_llama(a[r, j]) * b[r, j]
    else:
        for j in range(n):
            o[r, j] = gelu_llama(a[r, j]) * b[r, j]


@compiled_only(c_wrapper=True)
def add_row(r, o, a, b, v, p, f, i):
    """Row r of o (N, dim) += a[r]; a row function."""
    for j in range(o.shape[1]):
        o[r, j] += a[r, j]


GATED = {SILU: swiglu_row, GELU: geglu_row}      # the row function of each gated activation (lumen.kernels.kinds)


def _check_gated(out, gate, up) -> None:
    as_f32("gate", gate, 2)
    for name, a in (("up", up), ("out", out)):
        (as_out if name == "out" else as_f32)(name, a, 2)
        check(a.shape == gate.shape, f"{name} shape {a.shape} != gate shape {gate.shape}")
    for name, a in (("gate", gate), ("up", up)):
        check(out.ctypes.data == a.ctypes.data or not np.shares_memory(out, a),
              f"out partly overlaps {name}: it must be {name} itself or separate")


def swiglu(out: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """out (N, n_ff) = silu(gate) * up; out may be gate or up. Returns out."""
    _check_gated(out, gate, up)
    rows(swiglu_row, gate.shape[0], parallel_rows(gate.shape[0]), out, gate, up)
    return out


def geglu(out: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """out (N, n_ff) = gelu_tanh(gate) * up; out may be gate or up. Returns out."""
    _check_gated(out, gate, up)
    rows(geglu_row, gate.shape[0], parallel_rows(gate.shape[0]), out, gate, up)
    return out


def add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x (N, dim) += y (N, dim). Returns x."""
    as_out("x", x, 2)
    as_f32("y", y, 2)
    check(x.shape == y.shape, f"y shape {y.shape} != x shape {x.shape}")
    rows(add_row, x.shape[0], parallel_rows(x.shape[0]), x, y)
    return x
