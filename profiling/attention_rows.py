"""How fast is attention for many rows: the chunk kernel alone, one layer in cache, a step's layers from memory?

    python profiling/attention_rows.py [--quick] [--heads 9] [--kv-heads 3] [--head-dim 64] [--ns 1,8,16]
                                       [--context 192] [--layers 30]

Three levels, SmolLM2's shapes by default (9 query heads, 3 kv heads, head_dim 64), random f16 keys and values:
1. lumen.kernels.fp.attn_chunk_R alone, one thread, one chunk's keys in L1: GFLOP/s (4 flops per row, key and
   dim) against one core's f32 FMA roof (lumen.machine).
2. attention_kernel for N decode tokens of N sequences at --context keys each, one thread, one layer's cache in
   cache, called from compiled code (no dispatch): us per call.
3. --layers layers' caches in turn, as a decode step reads them (more than the L3 at the default sizes), on all
   threads, each sequence's blocks scattered in the pool as after long serving (--in-order: in order): ms per
   pass and the KV bytes' rate against the memory roof.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit

from lumen.kernels import fp
from lumen.kernels.attention import Paged, attention_kernel, attention_scratch, lane_address
from lumen.kernels.fp import BLOCK, CHUNK
from lumen.machine import limits
from lumen.profile.report import roofs
from verdict import count, list_of, verdict


def best_of(fn, reps: int, rounds: int = 5) -> float:
    """Seconds per call, the best round of `rounds` rounds of `reps` calls (fn(reps) runs them)."""
    fn(2)
    best = 1e9
    for _ in range(rounds):
        c = time.perf_counter()
        fn(reps)
        best = min(best, (time.perf_counter() - c) / reps)
    return best


def chunk_loop(R: int):
    """A compiled loop of n calls of attn_chunk_R on one chunk of keys 0 .. keys-1 of a one-kv-head cache."""
    f = getattr(fp, f"attn_chunk_{R}")

    @njit
    def loop(n, o, st, q, k, v, bt, hd, keys):
        for _ in range(n):
            f(o, 0, st, 0, q, 0, k, v, bt, 0, hd * BLOCK, 0, BLOCK * hd, 0, hd, hd, np.float32(0.125), 0, keys)
    return loop


@njit
def _layer_loop(n, out, q, kv, pos, seqs, scr, lane):
    for _ in range(n):
        attention_kernel(out, q, kv, pos, seqs, 0, np.float32(0.125), scr, False, lane)


def caches(rng, L, N, ctx, KVH, hd, in_order=False):
    """L layers' Paged caches of N sequences x ctx keys, the blocks scattered in the pool (or in order)."""
    nb = -(-ctx // BLOCK)
    out = []
    for _ in range(L):
        k = (rng.standard_normal((N * nb, KVH, hd, BLOCK)) * 0.5).astype(np.float16).view(np.uint16)
        v = (rng.standard_normal((N * nb, KVH, BLOCK, hd)) * 0.5).astype(np.float16).view(np.uint16)
        order = np.arange(N * nb) if in_order else rng.permutation(N * nb)
        out.append(Paged(k, v, order.reshape(N, nb).astype(np.int64)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=count, default=9)
    ap.add_argument("--kv-heads", type=count, default=3)
    ap.add_argument("--head-dim", type=count, default=64)
    ap.add_argument("--ns", type=list_of(count), default="1,8,16")
    ap.add_argument("--context", type=count, default=192)
    ap.add_argument("--layers", type=count, default=30)
    ap.add_argument("--in-order", action="store_true", help="level 3: each sequence's blocks in order, not scattered")
    ap.add_argument("--quick", action="store_true", help="N = 1, 2; 40 keys; 2 layers (for tests)")
    a = ap.parse_args(argv)
    if a.heads % a.kv_heads:
        ap.error(f"--heads must be a multiple of --kv-heads (each kv head serves a group), got {a.heads} and "
                 f"{a.kv_heads}")
    H, KVH, hd = a.heads, a.kv_heads, a.head_dim
    ns = [1, 2] if a.quick else a.ns
    ctx, L = (40, 2) if a.quick else (a.context, a.layers)
    reps = 20 if a.quick else 2000
    rng = np.random.default_rng(0)
    lim = limits()
    th = numba.get_num_threads()
    fma1 = roofs(lim, 1)["fma_gflops"]
    numba.set_num_threads(1)

    G = H // KVH
    R = min(G, fp.MAX_ROWS)
    kv1 = caches(rng, 1, 1, CHUNK, 1, hd)[0]
    q = rng.standard_normal((R, hd)).astype(np.float32)
    o, st = np.zeros((R, hd), np.float32), np.zeros((R, fp.ST), np.float32)
    loop = chunk_loop(R)
    t = best_of(lambda n: loop(n, o, st, q, kv1.k, kv1.v, kv1.tables, hd, CHUNK), reps)
    kern = 4 * R * CHUNK * hd / t / 1e9
    print(f"1. attn_chunk_{R}, {CHUNK} keys, head_dim {hd}, 1 thread: {t * 1e9:.0f} ns, {kern:.0f} GFLOP/s "
          f"({100 * kern / fma1:.0f}% of one core's FMA roof, {fma1:.0f})")

    print(f"2. attention_kernel, 1 thread, one layer in cache, {ctx} keys per token:")
    for N in ns:
        kv = caches(rng, 1, N, ctx, KVH, hd)[0]
        qn = rng.standard_normal((N, H, hd)).astype(np.float32)
        out = np.zeros((N, H, hd), np.float32)
        pos, seqs = np.full(N, ctx - 1, np.int64), np.arange(N, dtype=np.int64)
        scr = attention_scratch(H, hd, ctx + BLOCK, 1)
        t = best_of(lambda n: _layer_loop(n, out, qn, kv, pos, seqs, scr, lane_address()), max(2, reps // (10 * N)))
        print(f"   N={N:>3}: {t * 1e6:8.1f} us, {4 * N * H * ctx * hd / t / 1e9:6.1f} GFLOP/s")

    numba.set_num_threads(th)
    N = ns[-1]
    cs = caches(rng, L, N, ctx, KVH, hd, a.in_order)
    qn = rng.standard_normal((N, H, hd)).astype(np.float32)
    out = np.zeros((N, H, hd), np.float32)
    pos, seqs = np.full(N, ctx - 1, np.int64), np.arange(N, dtype=np.int64)
    scr = attention_scratch(H, hd, ctx + BLOCK, th)

    def one_pass(n):
        for _ in range(n):
            for kv in cs:
                _layer_loop(1, out, qn, kv, pos, seqs, scr, lane_address())
    t = best_of(one_pass, 3 if a.quick else 10)
    mb = L * N * (-(-ctx // BLOCK)) * BLOCK * KVH * hd * 2 * 2 / 1e6
    bw = roofs(lim, th)["bw_gbps"]
    order = "in order" if a.in_order else "scattered"
    print(f"3. {L} layers' caches in turn ({order} blocks), N={N}, {th} threads: {t * 1e3:.2f} ms per pass, "
          f"KV {mb:.1f} MB, "
          f"{mb / t / 1e3:.1f} GB/s (memory roof {bw:.1f})")
    verdict(f"the chunk kernel runs at {100 * kern / fma1:.0f}% of one core's FMA roof; a step's attention at "
            f"N={N} reads its KV at {100 * mb / t / 1e3 / bw:.0f}% of the memory roof")


if __name__ == "__main__":
    main()
