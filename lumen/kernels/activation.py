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
Raw kernels end in `_kernel` (serial) or `_kernel_par` (parallel over rows); the wrappers validate and pick.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.core.errors import TypingError
from numba.extending import overload

from .fp import exp_f32
from .checks import as_f32, check
from .policy import parallel_rows



@njit(cache=True, inline="always")
def silu(x):
    """x * sigmoid(x), float32."""
    return x / (np.float32(1.0) + exp_f32(-x))


@njit(cache=True, inline="always")
def gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = x * sigmoid(2u), float32."""
    u = np.float32(0.7978845608028654) * x * (np.float32(1.0) + np.float32(0.044715) * x * x)
    return x / (np.float32(1.0) + exp_f32(np.float32(-2.0) * u))


@njit(cache=True, error_model="numpy")
def _swiglu_row(out, gate, up, r):
    """Row r of out (N, n_ff) = silu(gate[r]) * up[r]. Rows are indexed, not sliced (see norm._rmsnorm_row).
    In place (out is gate or up) the loop names one array: with two names LLVM's runtime overlap check sees
    out == gate and falls back to scalar code, measured 5x slower (64 x 1536: 388 against 72 us)."""
    n = gate.shape[1]
    if out.ctypes.data == gate.ctypes.data:
        for i in range(n):
            gate[r, i] = silu(gate[r, i]) * up[r, i]
    elif out.ctypes.data == up.ctypes.data:
        for i in range(n):
            up[r, i] = silu(gate[r, i]) * up[r, i]
    else:
        for i in range(n):
            out[r, i] = silu(gate[r, i]) * up[r, i]


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


@njit(cache=True, error_model="numpy")
def _geglu_row(out, gate, up, r):
    """Row r of out (N, n_ff) = gelu_llama(gate[r]) * up[r]; in place as _swiglu_row."""
    n = gate.shape[1]
    if out.ctypes.data == gate.ctypes.data:
        for i in range(n):
            gate[r, i] = gelu_llama(gate[r, i]) * up[r, i]
    elif out.ctypes.data == up.ctypes.data:
        for i in range(n):
            up[r, i] = gelu_llama(gate[r, i]) * up[r, i]
    else:
        for i in range(n):
            out[r, i] = gelu_llama(gate[r, i]) * up[r, i]


@njit(cache=True)
def _add_row(x, y, r):
    """Row r of x (N, dim) += y[r]."""
    for i in range(x.shape[1]):
        x[r, i] += y[r, i]


@njit(cache=True)  # serial: below policy.PAR_ROWS rows a parallel region costs more
def swiglu_kernel(out, gate, up):
    """out (N, n_ff) = silu(gate (N, n_ff)) * up (N, n_ff). out may be gate or up."""
    for r in range(gate.shape[0]):
        _swiglu_row(out, gate, up, r)


@njit(cache=True, parallel=True)  # parallel over rows: prefill
def swiglu_kernel_par(out, gate, up):
    """out (N, n_ff) = silu(gate) * up, rows split across threads. out may be gate or up."""
    for r in prange(gate.shape[0]):
        _swiglu_row(out, gate, up, np.int64(r))


@njit(cache=True)  # serial: see swiglu_kernel
def geglu_kernel(out, gate, up):
    """out (N, n_ff) = gelu_tanh(gate (N, n_ff)) * up (N, n_ff). out may be gate or up."""
    for r in range(gate.shape[0]):
        _geglu_row(out, gate, up, r)


@njit(cache=True, parallel=True)  # parallel over rows: prefill
def geglu_kernel_par(out, gate, up):
    """out (N, n_ff) = gelu_tanh(gate) * up, rows split across threads. out may be gate or up."""
    for r in prange(gate.shape[0]):
        _geglu_row(out, gate, up, np.int64(r))


@njit(cache=True)  # serial: memory-bound; below policy.PAR_ROWS rows a parallel region costs more
def add_kernel(x, y):
    """x (N, dim) += y (N, dim)."""
    for r in range(x.shape[0]):
        _add_row(x, y, r)


@njit(cache=True, parallel=True)  # parallel over rows: prefill
def add_kernel_par(x, y):
    """x (N, dim) += y (N, dim), rows split across threads."""
    for r in prange(x.shape[0]):
        _add_row(x, y, np.int64(r))


def gated(kinds, gelu, par, out, gate, up):
    """out = act(gate) * up with the model's gated activation (gelu: geglu, else swiglu), by the row-parallel kernel
    when par; only the activations in the kinds (lumen.kernels.kinds) are compiled; through its address in an
    entry table. Compiled code only."""
    raise NotImplementedError("gated runs in compiled code only")


@njit(cache=True)
def _swiglu(par, out, gate, up):
    if par:
        swiglu_kernel_par(out, gate, up)
    else:
        swiglu_kernel(out, gate, up)


@njit(cache=True)
def _geglu(par, out, gate, up):
    if par:
        geglu_kernel_par(out, gate, up)
    else:
        geglu_kernel(out, gate, up)


@overload(gated)
def _gated(kinds, gelu, par, out, gate, up):
    from .kinds import ACT, GELU, SILU, call, is_table, same_abi, sets, switch
    if is_table(kinds):                     # the entry table (lumen.kernels.entries): through its address
        if not same_abi((gelu, par, out, gate, up), act_signature(kinds)[:-1]):
            raise TypingError(f"the activation entries are compiled for {act_signature(kinds)[:-1]}, not for "
                              f"{(gelu, par, out, gate, up)}")
        return lambda kinds, gelu, par, out, gate, up: call(kinds[ACT + (GELU if gelu else SILU)],
                                                            (gelu, par, out, gate, up, kinds))
    act = switch(tuple((a, {GELU: _geglu, SILU: _swiglu}[a]) for a in sets(kinds)[2]), 4)

    def impl(kinds, gelu, par, out, gate, up):
        act(GELU if gelu else SILU, par, out, gate, up)
    return impl


@njit(cache=True)
def gated_entry(gelu, par, out, gate, up, kinds):
    """gated with the kinds last: what an entry table calls (lumen.kernels.entries)."""
    gated(kinds, gelu, par, out, gate, up)


def act_signature(kinds_type) -> tuple:
    """The Numba types gated_entry is compiled for in an entry table: the forward pass's FFN rows, with a kinds
    value of one activation."""
    f32_2 = types.Array(types.float32, 2, "C")
    return (types.boolean, types.boolean, f32_2, f32_2, f32_2, kinds_type)


def _check_gated(out, gate, up) -> None:
    as_f32("gate", gate, 2)
    for name, a in (("up", up), ("out", out)):
        as_f32(name, a, 2)
        check(a.shape == gate.shape, f"{name} shape {a.shape} != gate shape {gate.shape}")
    for name, a in (("gate", gate), ("up", up)):
        check(out.ctypes.data == a.ctypes.data or not np.shares_memory(out, a),
              f"out partly overlaps {name}: it must be {name} itself or separate")


def swiglu(out: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """out (N, n_ff) = silu(gate) * up; out may be gate or up. Returns out."""
    _check_gated(out, gate, up)
    (swiglu_kernel_par if parallel_rows(gate.shape[0]) else swiglu_kernel)(out, gate, up)
    return out


def geglu(out: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """out (N, n_ff) = gelu_tanh(gate) * up; out may be gate or up. Returns out."""
    _check_gated(out, gate, up)
    (geglu_kernel_par if parallel_rows(gate.shape[0]) else geglu_kernel)(out, gate, up)
    return out


def add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x (N, dim) += y (N, dim). Returns x."""
    as_f32("x", x, 2)
    as_f32("y", y, 2)
    check(x.shape == y.shape, f"y shape {y.shape} != x shape {x.shape}")
    (add_kernel_par if parallel_rows(x.shape[0]) else add_kernel)(x, y)
    return x
