"""Straightforward numpy float64 references for the kernels in this package: the test oracle.

Written for clarity, not speed: no tiling, no online softmax, exact angles. Each returns a new float64 array.
"""
from __future__ import annotations

import math

import numpy as np


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (..., dim) / sqrt(mean(x^2) + eps) * w (dim,), over the last axis (per-head when x is (N, H, hd))."""
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def rope_ref(x: np.ndarray, positions: np.ndarray, base: float, n_rot: int, neox: bool,
             freq_scale: float = 1.0, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """x (N, H, hd) rotated with exact angles theta_i = pos * base^(-2i/n_rot) / factor_i * freq_scale."""
    out = x.astype(np.float64)
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    inv = base ** (-2.0 * i / n_rot) * freq_scale
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64)
    theta = positions.astype(np.float64)[:, None] * inv[None, :]        # (N, half)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]          # (N, 1, half)
    if neox:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = 2 * np.arange(half), 2 * np.arange(half) + 1
    x0, x1 = out[..., i0].copy(), out[..., i1].copy()
    out[..., i0] = x0 * c - x1 * s
    out[..., i1] = x0 * s + x1 * c
    return out


def silu_ref(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / (1.0 + np.exp(-x))


def gelu_tanh_ref(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def swiglu_ref(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return silu_ref(gate) * up.astype(np.float64)


def gelu_llama_ref(x: np.ndarray) -> np.ndarray:
    """llama.cpp's CPU gelu (GGML_GELU_FP16): fp16 table of gelu at fp16 inputs inside (-10, 10), 0 / x outside."""
    x = np.asarray(x, np.float32)
    x16 = x.astype(np.float16).astype(np.float64)
    g = gelu_tanh_ref(x16).astype(np.float16).astype(np.float64)
    return np.where(x <= -10, 0.0, np.where(x >= 10, x.astype(np.float64), g))


def geglu_ref(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gelu_llama_ref(gate) * up.astype(np.float64)


def attention_ref(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos0: int, scale: float,
                  window: int = 0) -> np.ndarray:
    """(N, H, hd_v): full softmax over the masked score matrix, per head.

    q (N, H, hd) at positions pos0 .. pos0+N-1; k_cache (n_kv, ctx, hd), v_cache (n_kv, ctx, hd_v). Head h uses
    kv head h // (H // n_kv). Key j is visible from position p when j <= p and (window == 0 or p - j < window).
    """
    N, H, _ = q.shape
    n_kv = k_cache.shape[0]
    group = H // n_kv
    n_keys = pos0 + N
    p = pos0 + np.arange(N)[:, None]                                   # (N, 1) query positions
    j = np.arange(n_keys)[None, :]                                     # (1, n_keys) key positions
    visible = j <= p
    if window > 0:
        visible &= (p - j) < window
    out = np.empty((N, H, v_cache.shape[2]))
    for h in range(H):
        k = k_cache[h // group, :n_keys].astype(np.float64)           # (n_keys, hd)
        v = v_cache[h // group, :n_keys].astype(np.float64)           # (n_keys, hd_v)
        scores = q[:, h].astype(np.float64) @ k.T * scale             # (N, n_keys)
        scores = np.where(visible, scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        out[:, h] = weights @ v
    return out
