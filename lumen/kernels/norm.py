"""RMSNorm over rows, and the per-head variant (gemma3's q/k norms).

    out = x / sqrt(mean(x^2) + eps) * w

As llama.cpp's ggml_rms_norm followed by a multiply by the weight. Gemma's "(1 + w)" is already folded into the
GGUF weight by the converter (convert_hf_to_gguf: norm_shift = 1.0 for *norm.weight), so no variant is needed.

Raw kernels (`rmsnorm_kernel`, `rmsnorm_heads_kernel`, serial; `..._par`, parallel over rows) are callable from other
@njit code; the wrappers (`rmsnorm`, `rmsnorm_heads`) validate shapes and dtypes, then pick serial or parallel by
size (lumen.kernels.policy, the forward pass's own choice).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .checks import as_f32, check
from .fp import sumsq
from .policy import parallel_rows


@njit(cache=True, error_model="numpy")
def _rmsnorm_row(out, x, r, w, eps):
    """Row r of out (N, dim) = x[r] / rms(x[r]) * w (dim,), x C-contiguous. The sum of squares is
    lumen.kernels.fp.sumsq (an order fixed by dim alone). Rows are indexed, not sliced: a row view costs an
    atomic incref/decref pair (dropping the views made rope 5x faster)."""
    n = x.shape[1]
    ss = sumsq(x, r * n, n)
    scale = np.float32(1.0) / np.sqrt(ss / np.float32(n) + np.float32(eps))
    if out.ctypes.data == x.ctypes.data:         # in place: name one array, else LLVM's runtime overlap check
        for i in range(n):                       # sees out == x and falls back to scalar code
            x[r, i] = x[r, i] * scale * w[i]
    else:
        for i in range(n):
            out[r, i] = x[r, i] * scale * w[i]


@njit(cache=True)  # serial: below policy.PAR_ROWS rows a parallel region costs more than the work
def rmsnorm_kernel(out, x, w, eps):
    """out (N, dim) = rmsnorm(x (N, dim)) * w (dim,). out may be x (in place)."""
    for r in range(x.shape[0]):
        _rmsnorm_row(out, x, r, w, eps)


@njit(cache=True, parallel=True)  # parallel over rows: prefill
def rmsnorm_kernel_par(out, x, w, eps):
    """out (N, dim) = rmsnorm(x (N, dim)) * w (dim,), rows split across threads. out may be x."""
    for r in prange(x.shape[0]):
        _rmsnorm_row(out, x, np.int64(r), w, eps)


@njit(cache=True)  # serial: gemma decode is 4 + 1 heads of 256, well under a parallel region
def rmsnorm_heads_kernel(out, x, w, eps):
    """out (N, n_heads, head_dim) = rmsnorm of each head_dim slice of x (N, n_heads, head_dim) * w (head_dim,)."""
    rmsnorm_kernel(out.reshape((-1, out.shape[2])), x.reshape((-1, x.shape[2])), w, eps)


@njit(cache=True, parallel=True)  # parallel over (token, head) rows: prefill
def rmsnorm_heads_kernel_par(out, x, w, eps):
    """out (N, n_heads, head_dim) = per-head rmsnorm of x * w (head_dim,), rows split across threads."""
    o2 = out.reshape((-1, out.shape[2]))
    x2 = x.reshape((-1, x.shape[2]))
    for r in prange(x2.shape[0]):
        _rmsnorm_row(o2, x2, np.int64(r), w, eps)


def rmsnorm(out: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """out (N, dim) = x (N, dim) / sqrt(mean(x^2) + eps) * w (dim,); out may be x. Returns out."""
    as_f32("x", x, 2)
    check(out.shape == x.shape, f"out shape {out.shape} != x shape {x.shape}")
    as_f32("out", out, 2)
    as_f32("w", w, 1)
    check(w.shape[0] == x.shape[1], f"w has {w.shape[0]} entries, rows have {x.shape[1]}")
    check(eps >= 0, f"eps {eps} is negative")
    check(out.ctypes.data == x.ctypes.data or not np.shares_memory(out, x), "out partly overlaps x")
    if parallel_rows(x.shape[0]):
        rmsnorm_kernel_par(out, x, w, np.float32(eps))
    else:
        rmsnorm_kernel(out, x, w, np.float32(eps))
    return out


def rmsnorm_heads(out: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """out (N, n_heads, head_dim) = per-head rmsnorm of x (N, n_heads, head_dim) * w (head_dim,). Returns out."""
    as_f32("x", x, 3)
    check(out.shape == x.shape, f"out shape {out.shape} != x shape {x.shape}")
    as_f32("out", out, 3)
    as_f32("w", w, 1)
    check(w.shape[0] == x.shape[2], f"w has {w.shape[0]} entries, heads have {x.shape[2]}")
    check(eps >= 0, f"eps {eps} is negative")
    check(out.ctypes.data == x.ctypes.data or not np.shares_memory(out, x), "out partly overlaps x")
    if parallel_rows(x.shape[0]):
        rmsnorm_heads_kernel_par(out, x, w, np.float32(eps))
    else:
        rmsnorm_heads_kernel(out, x, w, np.float32(eps))
    return out
