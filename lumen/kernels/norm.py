"""RMSNorm over rows, and the per-head variant (gemma3's q/k norms).

    out = x / sqrt(mean(x^2) + eps) * w

As llama.cpp's ggml_rms_norm followed by a multiply by the weight. Gemma's "(1 + w)" is already folded into the
GGUF weight by the converter (convert_hf_to_gguf: norm_shift = 1.0 for *norm.weight), so no variant is needed.

`rmsnorm_row` is the row function (lumen.kernels.rows: one signature for every row-wise op, run through one loop
and one parallel region); the wrappers (`rmsnorm`, `rmsnorm_heads`) validate shapes and dtypes, then run it
serially or in parallel by size (lumen.kernels.policy, the forward pass's own choice).
"""
from __future__ import annotations

import numpy as np

from .checks import as_f32, as_out, check
from .jit import compiled_only
from .fp import sumsq
from .policy import parallel_rows
from .rows import rows


@compiled_only(c_wrapper=True, error_model="numpy")
def rmsnorm_row(r, o, a, b, v, p, f, i):
    """Row r of o (N, dim) = a[r] / rms(a[r]) * v (dim,), eps f; o may be a (in place). A row function
    (lumen.kernels.rows). The sum of squares is lumen.kernels.fp.sumsq (an order fixed by dim alone). Rows are
    indexed, not sliced: a row view costs an atomic incref/decref pair (dropping the views made rope 5x faster)."""
    n = a.shape[1]
    ss = sumsq(a, r * n, n)
    scale = np.float32(1.0) / np.sqrt(ss / np.float32(n) + f)
    if o.ctypes.data == a.ctypes.data:           # in place: name one array, else LLVM's runtime overlap check
        for j in range(n):                       # sees o == a and falls back to scalar code
            a[r, j] = a[r, j] * scale * v[j]
    else:
        for j in range(n):
            o[r, j] = a[r, j] * scale * v[j]


def rmsnorm(out: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """out (N, dim) = x (N, dim) / sqrt(mean(x^2) + eps) * w (dim,); out may be x. Returns out."""
    as_f32("x", x, 2)
    check(out.shape == x.shape, f"out shape {out.shape} != x shape {x.shape}")
    as_out("out", out, 2)
    as_f32("w", w, 1)
    check(w.shape[0] == x.shape[1], f"w has {w.shape[0]} entries, rows have {x.shape[1]}")
    check(eps >= 0, f"eps {eps} is negative")
    check(out.ctypes.data == x.ctypes.data or not np.shares_memory(out, x), "out partly overlaps x")
    rows(rmsnorm_row, x.shape[0], parallel_rows(x.shape[0]), out, x, v=w, f=eps)
    return out


def rmsnorm_heads(out: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """out (N, n_heads, head_dim) = per-head rmsnorm of x (N, n_heads, head_dim) * w (head_dim,). Returns out."""
    as_f32("x", x, 3)
    check(out.shape == x.shape, f"out shape {out.shape} != x shape {x.shape}")
    as_out("out", out, 3)
    as_f32("w", w, 1)
    check(w.shape[0] == x.shape[2], f"w has {w.shape[0]} entries, heads have {x.shape[2]}")
    check(eps >= 0, f"eps {eps} is negative")
    check(out.ctypes.data == x.ctypes.data or not np.shares_memory(out, x), "out partly overlaps x")
    hd = x.shape[2]
    rows(rmsnorm_row, x.shape[0] * x.shape[1], parallel_rows(x.shape[0]), out.reshape(-1, hd), x.reshape(-1, hd),
         v=w, f=eps)
    return out
