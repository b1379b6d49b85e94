"""At small N, are both threads busy in the matmuls, and how far is one core from the int8 dot roof?

    python profiling/small_n_threads.py [--quick] [--model smollm2-135m] [--ns 1,8,16] [--repeats 11]

Per op, the model's matrices of every layer (so the weights stream as in a step), packed once; matmul_kernel over
N random activation rows, called from compiled code as the forward pass calls it (q/k/v and gate/up in one
region when their activation formats agree), at 1 thread and at all threads, interleaved; medians of us per
layer call. Per op and N: the tiles of one region (a thread takes whole tiles, so the best split leaves the
busier thread ceil(T / threads) of them), the speed-up from 1 thread to all, and one thread's GOP/s against the
1-thread int8 dot roof (lumen.machine). A speed-up near the thread count with a low roof share says the kernel,
not the split, is what a small-N step waits on.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
from numba import njit
from numba.typed import List

from lumen.format.gguf import GGUFFile
from lumen.format.quants import ACT_FORMAT, QT
from lumen.kernels.kinds import ALL
from lumen.kernels.layout import R
from lumen.kernels.matmul import Acts, mat, matmul_kernel, new_acts, prepare, prepare_x, unpack_scratch
from lumen.kernels.scratch import per_thread
from lumen.kernels.work import counters
from lumen.machine import limits
from lumen.model.store import resolve
from lumen.profile.report import roofs
from verdict import count, list_of, one_line_errors, verdict

OPS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
       "down": ("ffn_down",), "output": None}


def regions(g, op: str, layers: int) -> list:
    """The op's matmul regions over the first `layers` layers: lists of Packed that share one parallel region
    (as lumen.model.forward.mm3 fuses them)."""
    if op == "output":
        name = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
        t = g.tensors[name]
        return [[prepare(t.data, t.qtype)]]
    out = []
    for layer in range(layers):
        ps = [prepare(g.tensors[f"blk.{layer}.{part}.weight"].data, g.tensors[f"blk.{layer}.{part}.weight"].qtype)
              for part in OPS[op]]
        out += [ps] if len({ACT_FORMAT[QT(p.qtype)] for p in ps}) == 1 else [[p] for p in ps]
    return out


def acts_for(x: np.ndarray, fmt: int) -> Acts:
    """x (N, n_in) rounded for activation format fmt."""
    a = new_acts(x.shape[0], x.shape[1], fmt)
    prepare_x(a, x, fmt)
    return a


@njit(cache=True)
def _calls(calls, facc, wbuf, work, kinds):
    for c in calls:
        matmul_kernel(c[0], c[1], c[2], c[3], facc, wbuf, work, kinds)


def build(regs: list, N: int, rng) -> List:
    """One matmul_kernel call per region: (outs, Mats, n, Acts), 3-tuples padded with the first."""
    calls = List()
    for ps in regs:
        acts = acts_for(rng.standard_normal((N, ps[0].n_in)).astype(np.float32), ACT_FORMAT[QT(ps[0].qtype)])
        outs = [np.zeros((N, p.d_out), np.float32) for p in ps]
        mts = [mat(p) for p in ps]
        calls.append((tuple(outs + outs[:1] * (3 - len(ps))), tuple(mts + mts[:1] * (3 - len(ps))),
                      np.int64(len(ps)), acts))
    return calls


def timed(calls, facc, wbuf, work, threads: int) -> float:
    """Seconds per call of one pass at `threads` threads, after an untimed pass (which wakes the worker threads
    that slept through the other thread count's pass: timed cold, that wake-up added 2-3 us to each of SmolLM2's
    9-tile attn_output calls)."""
    numba.set_num_threads(threads)
    _calls(calls, facc, wbuf, work, ALL)
    c = time.perf_counter()
    _calls(calls, facc, wbuf, work, ALL)
    return (time.perf_counter() - c) / len(calls)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--ns", type=list_of(count), default="1,8,16")
    ap.add_argument("--repeats", type=count, default=11)
    ap.add_argument("--quick", action="store_true", help="N = 1, 8; 2 layers, 3 repeats, no head (for tests)")
    a = ap.parse_args(argv)
    th = numba.config.NUMBA_NUM_THREADS
    ns = [1, 8] if a.quick else a.ns
    repeats = 3 if a.quick else a.repeats
    with one_line_errors():
        g = GGUFFile(resolve(a.model))
    n_layer = sum(1 for k in g.tensors if k.endswith(".attn_output.weight"))
    ops = [op for op in OPS if not (a.quick and op == "output")]
    i8 = roofs(limits(), 1)["int8_dot_gops"]
    rng = np.random.default_rng(0)
    facc = per_thread((th, R), np.float32)
    wbuf = unpack_scratch(th, max(t.shape[0] for t in g.tensors.values() if len(t.shape) == 2))
    work = counters(th)
    print(f"{a.model}: us per layer call at 1 and {th} threads (medians of {repeats}, interleaved); one thread's "
          f"GOP/s against its int8 dot roof ({i8:.0f} GOP/s)")
    print(f"{'op':>8} {'N':>3} {'tiles':>5} {'busiest':>7} {'1 thr us':>9} {f'{th} thr us':>9} {'speed-up':>8} "
          f"{'1 thr GOP/s':>11} {'roof':>5}")
    tot = {}
    for op in ops:
        regs = regions(g, op, 2 if a.quick else n_layer)
        T = sum((p.d_out + R - 1) // R for p in regs[0])
        macs = sum(p.d_out * p.n_in for p in regs[0])                 # per activation row, one region
        for N in ns:
            calls = build(regs, N, rng)
            timed(calls, facc, wbuf, work, 1)
            timed(calls, facc, wbuf, work, th)
            t = {1: [], th: []}
            for _ in range(repeats):
                for k in t:
                    t[k].append(timed(calls, facc, wbuf, work, k))
            m1, mt = statistics.median(t[1]), statistics.median(t[th])
            gops = 2 * N * macs / m1 / 1e9
            tot.setdefault(N, [0.0, 0.0])
            tot[N][0] += m1 * len(calls)
            tot[N][1] += mt * len(calls)
            busiest = -(-T // th) / (T / th)                           # whole tiles: the busier thread's excess
            print(f"{op:>8} {N:>3} {T:>5} {busiest:6.2f}x {m1 * 1e6:9.1f} {mt * 1e6:9.1f} {m1 / mt:7.2f}x "
                  f"{gops:11.0f} {100 * gops / i8:4.0f}%")
    numba.set_num_threads(th)
    txt = "; ".join(f"N={N} {v[0] * 1e3:.2f} -> {v[1] * 1e3:.2f} ms ({v[0] / v[1]:.2f}x)" for N, v in tot.items())
    verdict(f"a step's matmuls, 1 -> {th} threads: {txt}")


if __name__ == "__main__":
    main()
