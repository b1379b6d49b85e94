"""Rotary position embedding, applied in place to (N, n_heads, head_dim) rows, one position per token.

Two layouts (llama.cpp's rope modes):
    NORMAL (llama):        rotate pairs (2i, 2i+1)
    NEOX (qwen2, gemma3):  rotate pairs (i, i + n_rot/2)
with theta_i = pos * base^(-2i/n_rot) / factor_i * freq_scale, for i < n_rot/2. Dimensions >= n_rot pass through.
Rotation: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos).

The cos/sin table is built once per model by `rope_cache` and reproduces ggml's float32 arithmetic (ggml-cpu
ops.cpp, ggml_rope_cache_init): theta starts at (float)pos and is multiplied by theta_scale = powf(base, -2/n_rot)
once per pair in float32, then divided by the frequency factor and multiplied by freq_scale in float32. At far
positions the float32 angle differs from the exact one by up to ~1e-3 rad (pos 30000); matching llama.cpp is the
point, so that error is kept on purpose.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .checks import as_f32, as_out, check
from .jit import compiled_only
from .policy import parallel_rows
from .rows import rows



def rope_cache(base: float, n_rot: int, max_pos: int, freq_scale: float = 1.0,
               freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables, each (max_pos, n_rot // 2) float32, for positions 0 .. max_pos-1.

    freq_factors (n_rot // 2,): llama3's `rope_freqs` tensor, dividing each pair's angle. freq_scale: linear
    scaling (1 / factor). Arithmetic as ggml (module docstring).
    """
    check(n_rot > 0 and n_rot % 2 == 0, f"n_rot {n_rot} must be positive and even")
    check(max_pos > 0, f"max_pos {max_pos} must be positive")
    check(max_pos <= 1 << 24, f"max_pos {max_pos} is beyond exact float32 positions")
    check(base > 0 and freq_scale > 0, f"base {base} and freq_scale {freq_scale} must be positive")
    half = n_rot // 2
    if freq_factors is not None:
        freq_factors = np.asarray(freq_factors)
        check(freq_factors.dtype == np.float32 and freq_factors.shape == (half,),
              f"freq_factors must be float32 of shape ({half},), got {freq_factors.dtype} {freq_factors.shape}")
        check(bool(np.all(freq_factors > 0)), "freq_factors must be positive")
    theta_scale = np.float32(base) ** (np.float32(-2.0) / np.float32(n_rot))  # powf(base, -2.0f/n_dims)
    theta = np.arange(max_pos, dtype=np.float32)                              # theta_base = (float)p
    fs = np.float32(freq_scale)
    cos = np.empty((max_pos, half), np.float32)
    sin = np.empty((max_pos, half), np.float32)
    for i in range(half):
        th = theta if freq_factors is None else theta / freq_factors[i]         # theta / ff, float32
        th = (fs * th).astype(np.float64)                                       # freq_scale * theta, float32
        cos[:, i] = np.cos(th)                                                  # correctly rounded cosf(theta)
        sin[:, i] = np.sin(th)
        theta = theta * theta_scale                                             # theta *= theta_scale, float32
    return cos, sin


@compiled_only
def _rope_token(x, t, cos, sin, p, neox):
    """Rotate every head of token t of x (N, n_heads, head_dim) in place by the angles of position p (row p of
    cos, sin (max_pos, n_rot/2)). Indexes, not row views: a view costs an atomic incref/decref pair, and dropping
    them made this kernel 5x faster (N=512 x 9 x 64: 167 -> 33 us serial)."""
    half = cos.shape[1]
    for h in range(x.shape[1]):
        if neox:
            for i in range(half):
                x0 = x[t, h, i]
                x1 = x[t, h, i + half]
                x[t, h, i] = x0 * cos[p, i] - x1 * sin[p, i]
                x[t, h, i + half] = x0 * sin[p, i] + x1 * cos[p, i]
        else:
            for i in range(half):
                x0 = x[t, h, 2 * i]
                x1 = x[t, h, 2 * i + 1]
                x[t, h, 2 * i] = x0 * cos[p, i] - x1 * sin[p, i]
                x[t, h, 2 * i + 1] = x0 * sin[p, i] + x1 * cos[p, i]


@compiled_only(c_wrapper=True)
def rope_row(r, o, a, b, v, p, f, i):
    """Rotate every head of token r of o (N, n_heads * head_dim) in place by the angles of position p[r] (tables
    a = cos, b = sin (max_pos, n_rot/2)); i = head_dim << 1 | neox (`rope_flags`). A row function
    (lumen.kernels.rows). (The heads as a third axis: indexed over two, the loop ran 2x slower.)"""
    hd = i >> 1
    x = o.reshape((o.shape[0], o.shape[1] // hd, hd))
    _rope_token(x, r, a, b, p[r], (i & 1) == 1)


@njit(cache=True, inline="always")
def rope_flags(head_dim, neox):
    """rope_row's i for heads of head_dim values, NEOX pairs when neox."""
    return np.int64(head_dim) << np.int64(1) | np.int64(1 if neox else 0)


def rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """Rotate x (N, n_heads, head_dim) in place at positions (N,) ints; cos, sin (max_pos, n_rot/2) from
    rope_cache; neox selects pairs (i, i + n_rot/2), else (2i, 2i+1). Returns x."""
    as_out("x", x, 3)
    as_f32("cos", cos, 2)
    as_f32("sin", sin, 2)
    check(cos.shape == sin.shape, f"cos shape {cos.shape} != sin shape {sin.shape}")
    check(2 * cos.shape[1] <= x.shape[2], f"n_rot {2 * cos.shape[1]} > head_dim {x.shape[2]}")
    check(isinstance(positions, np.ndarray) and positions.dtype.kind in "iu" and positions.ndim == 1,
          "positions must be a 1-D integer numpy array")
    check(positions.shape[0] == x.shape[0], f"{positions.shape[0]} positions for {x.shape[0]} tokens")
    if positions.size:
        lo, hi = int(positions.min()), int(positions.max())
        check(lo >= 0 and hi < cos.shape[0], f"positions {lo}..{hi} outside the table's 0..{cos.shape[0] - 1}")
    N, H, hd = x.shape
    rows(rope_row, N, parallel_rows(N), x.reshape(N, H * hd), cos, sin, p=np.ascontiguousarray(positions, np.int64),
         i=rope_flags(hd, bool(neox)))
    return x
