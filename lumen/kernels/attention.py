"""Causal multi-head attention over a paged KV cache, with online softmax, in an order fixed by the token alone.

Layout (one layer):
    k_pool (n_blocks, n_kv, head_dim, BLOCK) u16    f16 bits, keys transposed inside a block (lanes = keys)
    v_pool (n_blocks, n_kv, BLOCK, head_dim_v) u16  f16 bits
    block_tables (S, max_blocks) i8                 sequence s's key j lives in block block_tables[s, j // BLOCK],
                                                    slot j % BLOCK
    q (N, n_heads, head_dim) f32, positions (N,), seqs (N,): token t is at position positions[t] of sequence
    seqs[t]; its keys 0 .. positions[t] are in the cache (kv_store_kernel wrote this step's keys first)
    out (N, n_heads, head_dim_v) f32

Query head h reads kv head h // (n_heads // n_kv_heads) (GQA; MQA when n_kv == 1). The query at position p sees
keys j <= p, and with a sliding window only keys with p - j < window (window 0 = none). Scores are q.k * scale.

Batch invariance. A token's result depends on its own context only, never on the step's other tokens or on the
thread count: its keys are cut into CHUNKs at fixed absolute positions (0, CHUNK, 2 CHUNK, ...); each chunk's
softmax is computed whole, starting from nothing: its scores, their max, the exponentials, and the output block
by block in key order (lumen.kernels.fp.attn_chunk_R spells out every sum); the chunks' partial results are then
merged in chunk order by one function (`_merge`). Prefill and batched steps run a token's chunks one after
another on one thread; a lone decode token may hand its chunks to all threads and merge afterwards (split);
`attention_kernel` does both, with the same bits.

The kernels take the layer's cache as a Paged (k_pool, v_pool, block_tables) and their scratch as an AttnScratch
(per lane, from `attention_scratch`): o, ro (lanes, n_heads, head_dim_v) chunk and running outputs,
st (lanes, n_heads, ST) chunk state (max, 16 lane sums), rm (lanes, n_heads, 2) running (max, sum); the split
kernel's partial results po (n_chunks, n_heads, head_dim_v), pm (n_chunks, n_heads, 2).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .fp import BLOCK, CHUNK, MAX_ROWS, ST, attn_chunk_1, attn_chunk_2, attn_chunk_3, attn_chunk_4, exp_f32, f16_bits
from .checks import as_f32, check
from .jit import compiled_only
from .kinds import ATTN, ATTN_LANE, address, call, call_borrowed, require_abi
from .policy import split_attention
from .scratch import per_thread

NEG = np.float32(-np.inf)


class AttnScratch(NamedTuple):
    """The attention kernels' scratch (module doc), from `attention_scratch`."""
    o: np.ndarray      # (lanes, n_heads, head_dim_v) f32 a chunk's output
    st: np.ndarray     # (lanes, n_heads, ST) f32 a chunk's state: max, 16 lane sums
    ro: np.ndarray     # (lanes, n_heads, head_dim_v) f32 running output
    rm: np.ndarray     # (lanes, n_heads, 2) f32 running (max, sum)
    po: np.ndarray     # (n_chunks, n_heads, head_dim_v) f32 the split kernel's partial results
    pm: np.ndarray     # (n_chunks, n_heads, 2) f32


class Paged(NamedTuple):
    """One layer's paged KV cache (module doc)."""
    k: np.ndarray      # (n_blocks, n_kv, head_dim, BLOCK) u16 f16 bits
    v: np.ndarray      # (n_blocks, n_kv, BLOCK, head_dim_v) u16 f16 bits
    tables: np.ndarray  # (S, max_blocks) i8 block tables


def attention_scratch(n_heads: int, head_dim_v: int, max_ctx: int, n_lanes: int | None = None) -> AttnScratch:
    """The AttnScratch of the attention kernels (module doc); lanes default to numba's thread count, each lane's
    block on its own cache lines (lumen.kernels.scratch)."""
    lanes = numba.get_num_threads() if n_lanes is None else n_lanes
    check(lanes >= 1, f"n_lanes {lanes} must be at least 1")
    n_chunks = max(1, -(-max_ctx // CHUNK))
    return AttnScratch(per_thread((lanes, n_heads, head_dim_v), np.float32),
                       per_thread((lanes, n_heads, ST), np.float32),
                       per_thread((lanes, n_heads, head_dim_v), np.float32), per_thread((lanes, n_heads, 2), np.float32),
                       np.zeros((n_chunks, n_heads, head_dim_v), np.float32), np.zeros((n_chunks, n_heads, 2), np.float32))


@compiled_only
def key_range(p, window):
    """Keys visible from the query at position p: j0 .. p (inclusive), p - j < window when window > 0."""
    j0 = 0
    if window > 0 and p - window + 1 > 0:
        j0 = p - window + 1
    return j0, p + 1


@njit(cache=True, inline="always")
def _chunk(o, st, lane, h0, G, q, t, k_pool, v_pool, bt, s, g, a, b, scale):
    """The softmax of query rows h0 .. h0+G-1 of token t over keys a .. b-1 (inside one chunk), from nothing:
    st[lane, h] = (max, 16 lane sums), o[lane, h] = unnormalised output. _chunk takes arrays, not the Paged /
    AttnScratch bundles, and its rows: reading a bundle's fields here put 8 atomic reference count increments into
    its compiled code (0 without), and computing G = n_heads // n_kv here 6 (the division's error branch defeats
    Numba's reference count pruning): updates on arrays both threads share, once per chunk (LLVM IR, counted). It
    and the other helpers are inlined (inline="always"): as calls, a (token, kv head) item of 16 keys took 580 ns
    on one thread, 292 inlined, of which the chunk kernel is 95 (profiling/attention_rows.py's shapes)."""
    hd, hdv = q.shape[2], v_pool.shape[3]
    KVH, H = k_pool.shape[1], q.shape[1]
    kb, kg = KVH * hd * BLOCK, g * hd * BLOCK
    vb, vg = KVH * BLOCK * hdv, g * BLOCK * hdv
    bo = s * bt.shape[1]
    r = h0
    while r < h0 + G:                            # the group's rows, up to MAX_ROWS per call
        n = min(MAX_ROWS, h0 + G - r)
        oo, so, qo = (lane * H + r) * hdv, (lane * H + r) * ST, (t * H + r) * hd
        if n == 4:
            attn_chunk_4(o, oo, st, so, q, qo, k_pool, v_pool, bt, bo, kb, kg, vb, vg, hd, hdv, scale, a, b)
        elif n == 3:
            attn_chunk_3(o, oo, st, so, q, qo, k_pool, v_pool, bt, bo, kb, kg, vb, vg, hd, hdv, scale, a, b)
        elif n == 2:
            attn_chunk_2(o, oo, st, so, q, qo, k_pool, v_pool, bt, bo, kb, kg, vb, vg, hd, hdv, scale, a, b)
        else:
            attn_chunk_1(o, oo, st, so, q, qo, k_pool, v_pool, bt, bo, kb, kg, vb, vg, hd, hdv, scale, a, b)
        r += n


@njit(cache=True, inline="always")
def _lane_total(st, lane, r):
    """The sum of a row's 16 lane sums in the halving tree of fp._hsum: (i, i+8), (i, i+4), (i, i+2), (i, i+1).
    Consumes the lane sums."""
    w = 8
    while w >= 1:
        for i in range(w):
            st[lane, r, 1 + i] = st[lane, r, 1 + i] + st[lane, r, 1 + i + w]
        w //= 2
    return st[lane, r, 1]


@njit(cache=True, inline="always")
def _merge(ro, rm, i, r, o, k, r1, m1, l1):
    """Fold the partial result (max m1, sum l1, output o[k, r1]) into the running result (rm[i, r], ro[i, r]):
    the one place where chunks meet, so every path merges with the same arithmetic. Empty running: a copy."""
    hdv = ro.shape[2]
    M = rm[i, r, 0]
    if M == NEG:
        rm[i, r, 0] = m1
        rm[i, r, 1] = l1
        for d in range(hdv):
            ro[i, r, d] = o[k, r1, d]
        return
    Mn = max(M, m1)
    ea = exp_f32(M - Mn)
    eb = exp_f32(m1 - Mn)
    rm[i, r, 0] = Mn
    rm[i, r, 1] = rm[i, r, 1] * ea + l1 * eb
    for d in range(hdv):
        ro[i, r, d] = ro[i, r, d] * ea + o[k, r1, d] * eb


@njit(cache=True, inline="always")
def _finish(out, t, h0, G, ro, rm, i):
    """out[t, h] = ro[i, h] / sum for the rows h0 .. h0+G-1."""
    for h in range(h0, h0 + G):
        inv = np.float32(1.0) / rm[i, h, 1]
        for d in range(out.shape[2]):
            out[t, h, d] = ro[i, h, d] * inv


@compiled_only(c_wrapper=True)
def attention_lane(lane, out, q, k_pool, v_pool, bt, positions, seqs, window, scale, o, st, ro, rm, po, pm, split):
    """Lane `lane`'s share of attention_kernel's work items (its docstring): the items lane, lane + lanes, ...
    (lanes = o.shape[0]), on that lane's scratch. A function of its own, which attention_kernel's parallel region
    calls through its address (lumen.kernels.kinds.call): a region's body is compiled four times over (Numba's
    gufunc, its two wrappers and the kernel that starts it each optimize and generate the code they link), so as
    the region's body this compiled 4.6 s of a first run and as a callee about a third of that."""
    N, H = q.shape[0], q.shape[1]
    KVH = k_pool.shape[1]
    G = H // KVH
    lanes = o.shape[0]
    j0s, j1s = key_range(positions[0], window)    # split: the one token's keys, in chunks c0 .. c0 + nc - 1
    c0 = j0s // CHUNK
    nc = (j1s - 1) // CHUNK + 1 - c0
    n_items = KVH * nc if split else N * KVH
    for item in range(lane, n_items, lanes):
        if split:
            t, g = np.int64(0), item // nc
            j0, j1 = j0s, j1s
            ca = c0 + item - g * nc
            cb = ca + 1
        else:
            t = item // KVH
            g = item - t * KVH
            j0, j1 = key_range(positions[t], window)
            ca, cb = j0 // CHUNK, (j1 - 1) // CHUNK + 1
            for h in range(g * G, g * G + G):
                rm[lane, h, 0] = NEG
                rm[lane, h, 1] = 0.0
        for c in range(ca, cb):
            _chunk(o, st, lane, g * G, G, q, t, k_pool, v_pool, bt, seqs[t], g, max(j0, c * CHUNK),
                   min(j1, (c + 1) * CHUNK), scale)
            for h in range(g * G, g * G + G):
                l1 = _lane_total(st, lane, h)
                if split:
                    pm[c - c0, h, 0] = st[lane, h, 0]
                    pm[c - c0, h, 1] = l1
                    for d in range(po.shape[2]):
                        po[c - c0, h, d] = o[lane, h, d]
                else:
                    _merge(ro, rm, lane, h, o, lane, h, st[lane, h, 0], l1)
        if not split:
            _finish(out, t, g * G, G, ro, rm, lane)


def lane_signature() -> tuple:
    """The Numba types attention_kernel calls attention_lane with (at attention_signature's types)."""
    out, q, kv, positions, seqs, window, scale, scr, split = attention_signature()[:-1]
    return (types.int64, out, q, *kv.types, positions, seqs, window, scale, *scr.types, split)


def run_lane(addr, lane, out, q, k_pool, v_pool, bt, positions, seqs, window, scale, o, st, ro, rm, po, pm, split):
    """attention_lane(lane, ...) called through its address. Compiled code only."""
    raise NotImplementedError("run_lane runs in compiled code only")


@overload(run_lane, inline="always")
def _run_lane(addr, lane, out, q, k_pool, v_pool, bt, positions, seqs, window, scale, o, st, ro, rm, po, pm, split):
    require_abi("attention_lane", (lane, out, q, k_pool, v_pool, bt, positions, seqs, window, scale, o, st, ro, rm,
                                   po, pm, split), lane_signature())

    def impl(addr, lane, out, q, k_pool, v_pool, bt, positions, seqs, window, scale, o, st, ro, rm, po, pm, split):
        call_borrowed(addr, (lane, out, q, k_pool, v_pool, bt, positions, seqs, window, scale, o, st, ro, rm, po, pm,
                             split))
    return impl


@njit(cache=True, parallel=True)
def attention_kernel(out, q, kv, positions, seqs, window, scale, scr, split, lane_fn):
    """out (N, n_heads, hd_v) = softmax(q . K^T * scale, causal/window masked) V for every token (module doc) over
    the layer's cache kv (Paged), scr an AttnScratch; lane_fn the address of attention_lane (`lane_address`), which
    each lane runs. Not split (prefill and batched steps): the work items (token, kv head) are dealt round-robin
    to the lanes (later tokens see more keys), each runs its token's chunks in order and merges them as it goes.
    split (one decode token, row 0, has only n_kv items): the items are (kv head, chunk), each writes its partial
    result to scr.po/pm, then one thread merges every row's chunks in chunk order with _merge; the same bits. One
    kernel with one call site of the chunk kernels, not two kernels: each site compiles its own copy of the four
    attn_chunk_R (a first run compiled 3.8 s for the second)."""
    o, st, ro, rm, po, pm = scr
    k_pool, v_pool, bt = kv
    H = q.shape[1]
    for lane_ in prange(o.shape[0]):
        run_lane(lane_fn, np.int64(lane_), out, q, k_pool, v_pool, bt, positions, seqs, window, scale, o, st, ro,
                 rm, po, pm, split)    # (lane an int64: prange counts in uint64)
    if split:
        j0s, j1s = key_range(positions[0], window)
        nc = (j1s - 1) // CHUNK + 1 - j0s // CHUNK
        zero = np.int64(0)                       # (not a literal: one signature for the callees)
        for h in range(H):
            rm[0, h, 0] = NEG
            rm[0, h, 1] = 0.0
            for c in range(nc):
                _merge(ro, rm, zero, h, po, c, h, pm[c, h, 0], pm[c, h, 1])
        _finish(out, zero, zero, H, ro, rm, zero)


def attention_args() -> tuple:
    """Arguments of the types the forward pass gives run_attention (of no use but their types): attention_kernel's
    entry in the table (lumen.kernels.entries) is compiled for them and lane_fn, an int64."""
    def z(dtype, ndim):
        return np.zeros((1,) * ndim, dtype)
    scr = AttnScratch(*(z(np.float32, 3) for _ in range(6)))
    return (z(np.float32, 3), z(np.float32, 3), Paged(z(np.uint16, 4), z(np.uint16, 4), z(np.int64, 2)),
            z(np.int64, 1), z(np.int64, 1), np.int64(0), np.float32(0), scr, False)


def attention_signature() -> tuple:
    return tuple(attention_kernel.typeof_pyval(a) for a in attention_args()) + (types.int64,)


@functools.lru_cache(maxsize=None)
def lane_address() -> int:
    """The address of attention_lane compiled for lane_signature() (compiled now, or loaded from the cache)."""
    return address(attention_lane, lane_signature(), "attention")


def run_attention(table, out, q, kv, positions, seqs, window, scale, scr, split):
    """attention_kernel(out, q, kv, positions, seqs, window, scale, scr, split, lane_fn) called through the entry
    table (lumen.kernels.entries), lane_fn from it too, so a caller does not link it. Compiled code only."""
    raise NotImplementedError("run_attention runs in compiled code only")


@overload(run_attention, inline="always")
def _run_attention(table, out, q, kv, positions, seqs, window, scale, scr, split):
    require_abi("the attention entry", (out, q, kv, positions, seqs, window, scale, scr, split),
                attention_signature()[:-1])

    def impl(table, out, q, kv, positions, seqs, window, scale, scr, split):
        call(table[ATTN], (out, q, kv, positions, seqs, window, scale, scr, split, table[ATTN_LANE]))
    return impl


@njit(cache=True, no_cfunc_wrapper=True)  # serial: a copy of N * n_kv * (head_dim + head_dim_v) values
def kv_store_kernel(k_pool, v_pool, k, v, slots):
    """Write k (N, n_kv, hd), v (N, n_kv, hd_v) as f16 into the pools at slots (N,) = block * BLOCK + offset."""
    for t in range(k.shape[0]):
        blk = slots[t] // BLOCK
        j = slots[t] - blk * BLOCK
        for g in range(k.shape[1]):
            for d in range(k.shape[2]):
                k_pool[blk, g, d, j] = f16_bits(k[t, g, d])
            for d in range(v.shape[2]):
                v_pool[blk, g, j, d] = f16_bits(v[t, g, d])


# ---------------------------------------------------------------- Python entries: validate, then call

def kv_pools(n_blocks: int, n_kv: int, head_dim: int, head_dim_v: int) -> tuple[np.ndarray, np.ndarray]:
    """Empty pools for one layer: k (n_blocks, n_kv, head_dim, BLOCK), v (n_blocks, n_kv, BLOCK, head_dim_v) u16."""
    return (np.zeros((n_blocks, n_kv, head_dim, BLOCK), np.uint16),
            np.zeros((n_blocks, n_kv, BLOCK, head_dim_v), np.uint16))


def _check_pools(k_pool, v_pool):
    for name, a in (("k_pool", k_pool), ("v_pool", v_pool)):
        check(isinstance(a, np.ndarray) and a.dtype == np.uint16 and a.ndim == 4 and a.flags.c_contiguous,
              f"{name} must be a C-contiguous 4-D uint16 array (f16 bits), got "
              f"{getattr(a, 'dtype', type(a))} {getattr(a, 'shape', '')}")
    check(k_pool.shape[3] == BLOCK and v_pool.shape[2] == BLOCK and k_pool.shape[:2] == v_pool.shape[:2],
          f"k_pool {k_pool.shape} and v_pool {v_pool.shape} are not (n_blocks, n_kv, hd, {BLOCK}) and "
          f"(n_blocks, n_kv, {BLOCK}, hd_v)")
    check(k_pool.shape[2] % 4 == 0 and v_pool.shape[3] % 16 == 0,
          f"head sizes {k_pool.shape[2]}, {v_pool.shape[3]} must be multiples of 4 and 16")


def _check_slots(name, a, n, upper):
    check(isinstance(a, np.ndarray) and a.dtype == np.int64 and a.shape == (n,) and a.flags.c_contiguous,
          f"{name} must be an int64 array of shape ({n},)")
    check(n == 0 or (int(a.min()) >= 0 and int(a.max()) < upper), f"{name} must lie in 0 .. {upper - 1}")


def kv_store(k_pool: np.ndarray, v_pool: np.ndarray, k: np.ndarray, v: np.ndarray, slots) -> None:
    """Write k (N, n_kv, hd), v (N, n_kv, hd_v) f32 into the pools at slots (N,) (block * BLOCK + offset)."""
    _check_pools(k_pool, v_pool)
    as_f32("k", k, 3)
    as_f32("v", v, 3)
    n_kv = k_pool.shape[1]
    check(k.shape[1:] == (n_kv, k_pool.shape[2]), f"k shape {k.shape} does not fit k_pool {k_pool.shape}")
    check(v.shape == (k.shape[0], n_kv, v_pool.shape[3]), f"v shape {v.shape} does not fit v_pool {v_pool.shape}")
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    _check_slots("slots", slots, k.shape[0], k_pool.shape[0] * BLOCK)
    kv_store_kernel(k_pool, v_pool, k, v, slots)


def attention(out: np.ndarray, q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, positions, seqs,
              block_tables: np.ndarray, scale: float, window: int = 0, scratch=None, split: bool | None = None):
    """out (N, n_heads, hd_v) = causal (and sliding-window) attention of q (N, n_heads, hd), token t at
    positions[t] of sequence seqs[t], over the paged cache (module doc). scratch: from attention_scratch
    (allocated here if None). split: run one token with split-K (None: as the forward pass decides,
    lumen.kernels.policy.split_attention). Returns out."""
    _check_pools(k_pool, v_pool)
    as_f32("q", q, 3)
    as_f32("out", out, 3)
    N, H, D = q.shape
    n_blocks, n_kv, Dv = k_pool.shape[0], k_pool.shape[1], v_pool.shape[3]
    check(N >= 1, "q holds no tokens")
    check(D == k_pool.shape[2], f"q head_dim {D} != k_pool head_dim {k_pool.shape[2]}")
    check(H % n_kv == 0, f"n_heads {H} is not a multiple of n_kv_heads {n_kv}")
    check(out.shape == (N, H, Dv), f"out shape {out.shape} != {(N, H, Dv)}")
    check(not np.shares_memory(out, q), "out must not overlap q")
    check(isinstance(block_tables, np.ndarray) and block_tables.dtype == np.int64 and block_tables.ndim == 2
          and block_tables.flags.c_contiguous, "block_tables must be a C-contiguous (S, max_blocks) int64 array")
    S, max_blocks = block_tables.shape
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    seqs = np.ascontiguousarray(seqs, dtype=np.int64)
    _check_slots("positions", positions, N, max_blocks * BLOCK)
    _check_slots("seqs", seqs, N, S)
    for t in range(N):                                      # every block a token can read must exist
        used = block_tables[seqs[t], :int(positions[t]) // BLOCK + 1]
        check(used.size == 0 or (int(used.min()) >= 0 and int(used.max()) < n_blocks),
              f"token {t}: its block table points outside the pool's {n_blocks} blocks")
    check(window >= 0, f"window {window} is negative")
    if scratch is None:
        scratch = attention_scratch(H, Dv, max_blocks * BLOCK)
    scratch = AttnScratch(*scratch)
    o, st, ro, rm, po, pm = scratch
    lanes = o.shape[0]
    for name, a, shape in (("o", o, (lanes, H, Dv)), ("st", st, (lanes, H, ST)), ("ro", ro, (lanes, H, Dv)),
                           ("rm", rm, (lanes, H, 2))):
        as_f32(f"scratch {name}", a, 3)
        check(a.shape == shape, f"scratch {name} shape {a.shape} != {shape}")
    as_f32("scratch po", po, 3)
    as_f32("scratch pm", pm, 3)
    check(po.shape[1:] == (H, Dv) and pm.shape[1:] == (H, 2) and po.shape[0] == pm.shape[0]
          and po.shape[0] * CHUNK >= max_blocks * BLOCK, "scratch po/pm do not fit the block tables")
    if split is None:
        split = bool(split_attention(N, int(positions[0]) + 1))
    check(not split or N == 1, "split attention takes one token")
    attention_kernel(out, q, Paged(k_pool, v_pool, block_tables), positions, seqs, np.int64(window),
                     np.float32(scale), scratch, bool(split), lane_address())
    return out
