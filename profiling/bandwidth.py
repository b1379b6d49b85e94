"""How close does decode come to this machine's memory bandwidth?

    python profiling/bandwidth.py [--quick] [--model smollm2-135m] [--gen 64]

Achieved decode GB/s = bytes the profiler's records attribute to one decode step (weights, KV, activations) /
the step's wall time, median over the decode steps of one run; against the machine's measured read bandwidth
(lumen.machine.limits(); a numpy sum over 512 MB when that module is missing).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import lumen
from verdict import count, one_line_errors, thread_count, verdict

MATMULS = ("qkv", "o", "gate_up", "down", "output")   # lumen.model.forward.OPS (q/k/v, gate/up fused)


def machine_bandwidth(threads: int) -> tuple[float, str]:
    """(read GB/s at this thread count: 1 or all, where the number comes from)."""
    try:
        from lumen.machine import limits
        key = "bw_1t_gbps" if threads == 1 else "bw_gbps"
        return limits(measure_if_missing=True)[key], f"lumen.machine.limits()[{key!r}]"
    except ImportError:
        a = np.ones(512 << 20 >> 3)  # 512 MB of float64
        best = min(_timed(a.sum) for _ in range(5))
        return a.nbytes / best / 1e9, "numpy sum over 512 MB, 1 thread (lumen.machine not available)"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--gen", type=count, default=64)
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--quick", action="store_true", help="8 decode steps (for tests)")
    a = ap.parse_args(argv)
    gen = 8 if a.quick else a.gen
    with one_line_errors():
        model = lumen.load(a.model, ctx=gen + 16, threads=a.threads)
    bw, source = machine_bandwidth(model.threads)
    model.warmup()
    model.prefill(np.arange(1, 9))
    with lumen.profile() as prof:
        for _ in range(gen):
            model.decode(1)
    step_b: dict[int, int] = {}
    mat_b = mat_s = 0.0
    for r in prof.records:
        step_b[r.step] = step_b.get(r.step, 0) + r.bytes
        if r.op in MATMULS:
            mat_b, mat_s = mat_b + r.bytes, mat_s + r.seconds
    per_step = [step_b[s.step] / s.wall_s / 1e9 for s in prof.steps]
    achieved = statistics.median(per_step)
    wall = statistics.median(s.wall_s for s in prof.steps)
    print(f"decode step: {wall * 1e3:.2f} ms median of {gen} ({1 / wall:.0f} tok/s), "
          f"{statistics.median(step_b.values()) / 1e6:.1f} MB per step "
          f"(weights alone {model.weights.decode_bytes / 1e6:.1f} MB)")
    print(f"achieved: {achieved:.2f} GB/s per step (min {min(per_step):.2f}, max {max(per_step):.2f}); "
          f"matmul ops alone {mat_b / mat_s / 1e9:.2f} GB/s")
    print(f"machine: {bw:.2f} GB/s from {source}; {model.threads} threads")
    verdict(f"decode reaches {achieved:.1f} GB/s = {100 * achieved / bw:.0f}% of the measured {bw:.1f} GB/s "
            f"({1 / wall:.0f} tok/s, median of {gen} steps) -> "
            f"{'bandwidth-bound' if achieved > 0.6 * bw else 'not bandwidth-bound: time goes to compute or overhead'}")


if __name__ == "__main__":
    main()
