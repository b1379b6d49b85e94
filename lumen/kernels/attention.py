"""Causal multi-head attention over a per-layer KV cache, with online softmax (FlashAttention style).

Layout:
    k_cache (n_kv_heads, max_ctx, head_dim), v_cache (n_kv_heads, max_ctx, head_dim_v)   float32, one layer
    q (N, n_heads, head_dim): tokens at positions pos0 .. pos0+N-1; the cache already holds keys 0 .. pos0+N-1
    out (N, n_heads, head_dim_v)

Query head h reads kv head h // (n_heads // n_kv_heads) (GQA; MQA when n_kv_heads == 1). The query at position p
sees keys j <= p, and with a sliding window only keys with p - j < window (llama.cpp's standard SWA; window 0 =
none). Scores are q.k * scale.

The score row is never materialised: keys are visited in tiles of TILE positions, keeping per query row a running
max m, running sum l and an unnormalised output o, rescaled by exp(m_old - m_new) when the max grows. All query
heads of one kv head are processed together, so each K/V row is read once per group, not once per head.

Two raw kernels:
    attention_kernel         prefill, parallel: work items (token, kv head) dealt round-robin to lanes, which
                             balances the causal work (later tokens see more keys)
    attention_decode_kernel  N == 1: split-K, each lane takes a slice of the key range for every kv head, then
                             the per-lane (m, l, o) are merged; serial below SPLIT_MIN_KEYS keys
Scratch (per lane; from `attention_scratch`): s (lanes, n_heads, TILE) scores, o (lanes, n_heads, head_dim_v) and
ml (lanes, n_heads, ML) partial results. The number of lanes is s.shape[0].
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from .activation import fast_exp
from .norm import as_f32, check
from .scratch import per_thread

ML = 16               # floats per head in the ml scratch (2 used)
TILE = 32             # keys per tile; 16, 32, 64, 128 measured within noise of each other (serial, 1024 keys)
NEG = np.float32(-1e30)  # "minus infinity" for the running max; finite, because fastmath assumes no infinities
SPLIT_MIN_KEYS = 80   # decode: shorter key ranges run serially; crossover measured between 64 and 96 keys


def attention_scratch(n_heads: int, head_dim_v: int, n_lanes: int | None = None):
    """Scratch for the attention kernels: s (lanes, n_heads, TILE), o (lanes, n_heads, head_dim_v),
    ml (lanes, n_heads, ML) float32 (the running max and sum in [..., 0:2]; ML = 16 pads a head's state to a
    cache line). Lanes default to numba's thread count; each lane's block starts on its own cache line
    (lumen.kernels.scratch: lanes sharing a line ran at half speed)."""
    lanes = numba.get_num_threads() if n_lanes is None else n_lanes
    check(lanes >= 1, f"n_lanes {lanes} must be at least 1")
    return (per_thread((lanes, n_heads, TILE), np.float32), per_thread((lanes, n_heads, head_dim_v), np.float32),
            per_thread((lanes, n_heads, ML), np.float32))


@njit(fastmath=True, cache=True)
def _dot(a, i, b, j):
    """a[i] . b[j] for 2-D a, b (rows indexed, not sliced: a row view costs an atomic incref/decref pair)."""
    acc = np.float32(0.0)
    for d in range(a.shape[1]):
        acc += a[i, d] * b[j, d]
    return acc


@njit(fastmath=True, cache=True)
def _axpy(y, i, a, x, j):
    """y[i] += a * x[j] for 2-D y, x."""
    for d in range(y.shape[1]):
        y[i, d] += a * x[j, d]


@njit(fastmath=True, cache=True)
def _axpy4(y, i, a0, a1, a2, a3, x, j):
    """y[i] += a0 x[j] + a1 x[j+1] + a2 x[j+2] + a3 x[j+3] for 2-D y, x: one load/store of y per 4 rows of x."""
    for d in range(y.shape[1]):
        y[i, d] += a0 * x[j, d] + a1 * x[j + 1, d] + a2 * x[j + 2, d] + a3 * x[j + 3, d]


@njit(fastmath=True, cache=True)
def _attend(o, ml, s, q, k, v, j0, j1, scale):
    """Continue the online softmax of the R query rows q (R, head_dim) over keys j0 .. j1-1 of k (ctx, head_dim),
    v (ctx, head_dim_v): o (R, head_dim_v) unnormalised output, ml (R, 2) running (max, sum), s (R, TILE) scratch."""
    R = q.shape[0]
    for t0 in range(j0, j1, TILE):
        T = min(TILE, j1 - t0)
        for jj in range(T):                      # scores: each key row once for all R query rows
            for r in range(R):
                s[r, jj] = _dot(q, r, k, t0 + jj) * scale
        for r in range(R):                       # running max; rescale o and l when it grows
            m_old = ml[r, 0]
            m = m_old
            for jj in range(T):
                m = max(m, s[r, jj])
            if m > m_old:
                alpha = fast_exp(m_old - m)
                ml[r, 1] *= alpha
                for d in range(o.shape[1]):
                    o[r, d] *= alpha
                ml[r, 0] = m
            l = np.float32(0.0)
            for jj in range(T):
                pj = fast_exp(s[r, jj] - m)
                s[r, jj] = pj
                l += pj
            ml[r, 1] += l
        T4 = T - T % 4
        for jj in range(0, T4, 4):               # o += p v: 4 value rows at a time, each once for all R rows
            for r in range(R):
                _axpy4(o, r, s[r, jj], s[r, jj + 1], s[r, jj + 2], s[r, jj + 3], v, t0 + jj)
        for jj in range(T4, T):
            for r in range(R):
                _axpy(o, r, s[r, jj], v, t0 + jj)


@njit(fastmath=True, cache=True)
def _start(o, ml):
    """Reset an accumulator o (R, head_dim_v) and its state ml (R, 2)."""
    for r in range(o.shape[0]):
        ml[r, 0] = NEG
        ml[r, 1] = 0.0
        for d in range(o.shape[1]):
            o[r, d] = 0.0


@njit(fastmath=True, cache=True, error_model="numpy")
def _finish(out, o, ml):
    """out (R, head_dim_v) = o / l."""
    for r in range(o.shape[0]):
        inv = np.float32(1.0) / ml[r, 1]
        for d in range(o.shape[1]):
            out[r, d] = o[r, d] * inv


@njit(fastmath=True, cache=True)
def _key_range(p, window):
    """Keys visible from the query at position p: j0 .. p (inclusive), p - j < window when window > 0."""
    j0 = 0
    if window > 0 and p - window + 1 > 0:
        j0 = p - window + 1
    return j0, p + 1


@njit(fastmath=True, cache=True, parallel=True)  # parallel over (token, kv head) items: prefill
def attention_kernel(out, q, k_cache, v_cache, pos0, scale, window, s, o, ml):
    """out (N, n_heads, hd_v) = softmax(q (N, n_heads, hd) . K^T * scale, causal/window masked) V, from
    k_cache (n_kv, max_ctx, hd), v_cache (n_kv, max_ctx, hd_v) at positions pos0 + t; scratch s, o, ml per lane."""
    N, H = q.shape[0], q.shape[1]
    KVH = k_cache.shape[0]
    G = H // KVH
    lanes = s.shape[0]
    n_items = N * KVH
    for lane in prange(lanes):
        for item in range(lane, n_items, lanes):  # round-robin: later tokens (more keys) spread over lanes
            t = item // KVH
            g = item - t * KVH
            j0, j1 = _key_range(pos0 + t, window)
            acc = o[lane, :G]
            st = ml[lane, :G]
            _start(acc, st)
            _attend(acc, st, s[lane, :G], q[t, g * G:(g + 1) * G], k_cache[g], v_cache[g], j0, j1, scale)
            _finish(out[t, g * G:(g + 1) * G], acc, st)


@njit(fastmath=True, cache=True, parallel=True)  # split-K over lanes: decode has only n_heads rows of work
def attention_decode_kernel(out, q, k_cache, v_cache, pos0, scale, window, s, o, ml):
    """Same contract as attention_kernel for N == 1: each lane takes a slice of the key range for all heads,
    then the lanes' (m, l, o) are merged into out (1, n_heads, hd_v)."""
    H = q.shape[1]
    KVH = k_cache.shape[0]
    G = H // KVH
    lanes = s.shape[0]
    j0, j1 = _key_range(pos0, window)
    if lanes == 1 or j1 - j0 < SPLIT_MIN_KEYS:   # short range: one lane, serial, no parallel region
        _start(o[0], ml[0])
        for g in range(KVH):
            h0 = g * G
            _attend(o[0, h0:h0 + G], ml[0, h0:h0 + G], s[0, h0:h0 + G], q[0, h0:h0 + G],
                    k_cache[g], v_cache[g], j0, j1, scale)
        _finish(out[0], o[0], ml[0])
        return
    per = (j1 - j0 + lanes - 1) // lanes
    per = (per + TILE - 1) // TILE * TILE        # whole tiles per lane
    for lane in prange(lanes):
        a = min(j0 + lane * per, j1)
        b = min(a + per, j1)
        _start(o[lane], ml[lane])
        for g in range(KVH):
            h0 = g * G
            _attend(o[lane, h0:h0 + G], ml[lane, h0:h0 + G], s[lane, h0:h0 + G], q[0, h0:h0 + G],
                    k_cache[g], v_cache[g], a, b, scale)
    _merge(out[0], o, ml)


@njit(fastmath=True, cache=True, error_model="numpy")
def _merge(out, o, ml):
    """out (H, hd_v) = merge of the lanes' partial softmax results o (lanes, H, hd_v), ml (lanes, H, 2)."""
    lanes, H = o.shape[0], o.shape[1]
    for h in range(H):
        m = NEG
        for c in range(lanes):
            m = max(m, ml[c, h, 0])
        l = np.float32(0.0)
        for d in range(out.shape[1]):
            out[h, d] = 0.0
        for c in range(lanes):
            w = fast_exp(ml[c, h, 0] - m)        # 0 for an empty slice (m = NEG, l = 0, o = 0)
            l += w * ml[c, h, 1]
            for d in range(out.shape[1]):
                out[h, d] += w * o[c, h, d]
        inv = np.float32(1.0) / l
        for d in range(out.shape[1]):
            out[h, d] *= inv


@njit(fastmath=True, cache=True)  # serial: a copy of N * n_kv * head_dim values, memory-bound
def kv_store_kernel(k_cache, v_cache, k, v, pos0):
    """k_cache[:, pos0:pos0+N] = k (N, n_kv, hd) per kv head; same for v_cache and v (N, n_kv, hd_v)."""
    for t in range(k.shape[0]):
        for g in range(k.shape[1]):
            k_cache[g, pos0 + t, :] = k[t, g, :]
            v_cache[g, pos0 + t, :] = v[t, g, :]


def _check_cache(k_cache, v_cache):
    as_f32("k_cache", k_cache, 3)
    as_f32("v_cache", v_cache, 3)
    check(k_cache.shape[:2] == v_cache.shape[:2],
          f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ in kv heads or context")


def kv_store(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int) -> None:
    """Write k (N, n_kv, hd), v (N, n_kv, hd_v) into the caches (n_kv, max_ctx, hd[_v]) at positions pos0 .."""
    _check_cache(k_cache, v_cache)
    as_f32("k", k, 3)
    as_f32("v", v, 3)
    n_kv, max_ctx = k_cache.shape[:2]
    check(k.shape[1:] == (n_kv, k_cache.shape[2]), f"k shape {k.shape} does not fit k_cache {k_cache.shape}")
    check(v.shape == (k.shape[0], n_kv, v_cache.shape[2]), f"v shape {v.shape} does not fit v_cache {v_cache.shape}")
    check(0 <= pos0 and pos0 + k.shape[0] <= max_ctx,
          f"positions {pos0}..{pos0 + k.shape[0] - 1} outside the cache's 0..{max_ctx - 1}")
    kv_store_kernel(k_cache, v_cache, k, v, int(pos0))


def attention(out: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos0: int,
              scale: float, window: int = 0, scratch=None) -> np.ndarray:
    """out (N, n_heads, hd_v) = causal (and sliding-window) attention of q (N, n_heads, hd) at positions
    pos0 .. pos0+N-1 over the cache. scratch: from attention_scratch (allocated here if None). Returns out."""
    _check_cache(k_cache, v_cache)
    as_f32("q", q, 3)
    as_f32("out", out, 3)
    N, H, D = q.shape
    n_kv, max_ctx, Dv = k_cache.shape[0], k_cache.shape[1], v_cache.shape[2]
    check(N >= 1, "q holds no tokens")
    check(D == k_cache.shape[2], f"q head_dim {D} != k_cache head_dim {k_cache.shape[2]}")
    check(H % n_kv == 0, f"n_heads {H} is not a multiple of n_kv_heads {n_kv}")
    check(out.shape == (N, H, Dv), f"out shape {out.shape} != {(N, H, Dv)}")
    check(0 <= pos0 and pos0 + N <= max_ctx, f"positions {pos0}..{pos0 + N - 1} outside the cache's 0..{max_ctx - 1}")
    check(window >= 0, f"window {window} is negative")
    check(not np.shares_memory(out, q), "out must not overlap q")
    if scratch is None:
        scratch = attention_scratch(H, Dv)
    s, o, ml = scratch
    lanes = s.shape[0]
    for name, a, shape in (("s", s, (lanes, H, TILE)), ("o", o, (lanes, H, Dv)), ("ml", ml, (lanes, H, ML))):
        as_f32(f"scratch {name}", a, 3)
        check(a.shape == shape, f"scratch {name} shape {a.shape} != {shape}")
    kernel = attention_decode_kernel if N == 1 else attention_kernel
    kernel(out, q, k_cache, v_cache, int(pos0), np.float32(scale), int(window), s, o, ml)
    return out
