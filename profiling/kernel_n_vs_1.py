"""Does one N=32 batched matmul beat 32 matvecs for the same work, at every real matmul shape of the model?

    python profiling/kernel_n_vs_1.py [--quick] [--model smollm2-135m] [--repeats 7]

Per shape (q, k, v, o, gate, up, down of block 0, and the output head): the weight packed once with
`prepare`, then `matmul_batched` on (32, n_in) against 32 `matvec` calls on its rows, interleaved, medians.
Run at 1 thread (the kernels alone) and at all threads (each matvec call also opens a parallel region).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from lumen.format.gguf import GGUFFile
from lumen.kernels.matmul import matmul_batched, matvec, prepare
from lumen.model.store import resolve
from verdict import count, one_line_errors, verdict

SHAPES = {"q": "blk.0.attn_q.weight", "k": "blk.0.attn_k.weight", "v": "blk.0.attn_v.weight",
          "o": "blk.0.attn_output.weight", "gate": "blk.0.ffn_gate.weight", "up": "blk.0.ffn_up.weight",
          "down": "blk.0.ffn_down.weight", "output": "output.weight"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--n", type=count, default=32)
    ap.add_argument("--repeats", type=count, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats, the head skipped (for tests)")
    a = ap.parse_args(argv)
    repeats, N = (3 if a.quick else a.repeats), a.n
    with one_line_errors():
        g = GGUFFile(resolve(a.model))
    names = dict(SHAPES)
    if "output.weight" not in g.tensors:
        names["output"] = "token_embd.weight"  # tied embeddings: the head is the embedding matrix
    if a.quick:
        names.pop("output")
    ratios = {}
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        print(f"threads={threads}")
        ratios[threads] = measure(g, names, N, repeats)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    txt = ", ".join(f"{r:.2f}x at {t} thread{'s' if t > 1 else ''}" for t, r in ratios.items())
    worst = min(ratios.values())
    verdict(f"one N={N} batched call vs {N} matvecs over {len(names)} shapes: {txt} (sum of per-shape "
            f"medians of {repeats}, interleaved) -> {'batching pays' if worst > 1.2 else 'batching barely pays'}")


def measure(g, names: dict, N: int, repeats: int) -> float:
    """Print per-shape medians of one N-row batched call and N matvec calls; return their overall ratio."""
    rng = np.random.default_rng(0)
    print(f"{'op':>6} {'d_out x n_in':>13} {'type':>5} {'1 x N=' + str(N) + ' ms':>11} {str(N) + ' x N=1 ms':>11} "
          f"{'speed-up':>8}")
    tot_b = tot_1 = 0.0
    for op, name in names.items():
        t = g.tensors[name]
        w = prepare(t.data, t.qtype)  # (d_out, n_in) packed once
        x = rng.standard_normal((N, w.n_in)).astype(np.float32)  # (N, n_in)
        out_b = np.empty((N, w.d_out), np.float32)
        out_1 = np.empty((N, w.d_out), np.float32)
        rows = [(x[i:i + 1], out_1[i:i + 1]) for i in range(N)]
        matmul_batched(out_b, x, w, t.qtype)  # warm-up (compile / load from cache)
        for xi, oi in rows:
            matvec(oi, xi, w, t.qtype)
        tb, t1 = [], []
        for _ in range(repeats):  # interleaved
            c = time.perf_counter()
            matmul_batched(out_b, x, w, t.qtype)
            tb.append(time.perf_counter() - c)
            c = time.perf_counter()
            for xi, oi in rows:
                matvec(oi, xi, w, t.qtype)
            t1.append(time.perf_counter() - c)
        assert np.array_equal(out_b, out_1), f"{op}: batched and matvec results differ"
        mb, m1 = statistics.median(tb), statistics.median(t1)
        tot_b, tot_1 = tot_b + mb, tot_1 + m1
        print(f"{op:>6} {w.d_out:>6} x {w.n_in:<5} {t.qtype.name:>5} {mb * 1e3:>11.3f} {m1 * 1e3:>11.3f} "
              f"{m1 / mb:>7.2f}x")
    return tot_1 / tot_b

if __name__ == "__main__":
    main()
