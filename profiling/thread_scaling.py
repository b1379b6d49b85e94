"""How much does each op speed up from 1 to 2 threads, in decode and in prefill?

    python profiling/thread_scaling.py [--quick] [--model smollm2-135m] [--repeats 5]

Per repeat and thread count (a model loaded with each count, interleaved): a profiled prefill of --prompt tokens, then
--gen decode steps. Per op: median over repeats of its seconds per step; speed-up = 1-thread / 2-thread time.
"""
from __future__ import annotations

import argparse
import statistics

import numba
import numpy as np

import lumen
from verdict import count, one_line_errors, verdict


def profiled_run(model, ids, gen: int) -> dict:
    """{phase: {op: seconds per step}, (phase, 'step'): wall seconds per step} of one prefill + gen decodes."""
    model.reset()
    with lumen.profile() as prof:
        model.prefill(ids)
        for _ in range(gen):
            model.decode(1)
    out = {}
    for ph in ("prefill", "decode"):
        steps = [s for s in prof.steps if s.phase == ph]
        out[ph] = {op: a.seconds / len(steps) for op, a in prof.by_op(ph).items()}
        out[ph]["(step)"] = sum(s.wall_s for s in steps) / len(steps)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--prompt", type=count, default=128)
    ap.add_argument("--gen", type=count, default=32)
    ap.add_argument("--repeats", type=count, default=5)
    ap.add_argument("--quick", action="store_true", help="8-token prompt, 4 decode steps, 1 repeat (for tests)")
    a = ap.parse_args(argv)
    prompt, gen, repeats = (8, 4, 1) if a.quick else (a.prompt, a.gen, a.repeats)
    hi = numba.config.NUMBA_NUM_THREADS
    runs: dict[int, list] = {1: [], hi: []}
    with one_line_errors():
        models = {t: lumen.load(a.model, ctx=prompt + gen + 1, threads=t, adaptive_threads=False) for t in runs}
    ids = np.random.default_rng(0).integers(0, models[1].config.n_vocab, prompt)
    for r in range(repeats + 1):
        for t in runs:  # interleaved; the first round is warm-up. (A model's steps run on its own thread count.)
            res = profiled_run(models[t], ids, gen)
            if r:
                runs[t].append(res)
    speed = {}
    for ph in ("prefill", "decode"):
        print(f"\n{ph} ({prompt if ph == 'prefill' else 1} tokens/step): us per step, 1 vs {hi} threads")
        print(f"{'op':>14} {'1 thread':>10} {f'{hi} threads':>10} {'speed-up':>8}")
        med = {t: {op: statistics.median(x[ph][op] for x in runs[t]) for op in runs[t][0][ph]} for t in runs}
        for op in sorted(med[1], key=lambda o: -med[1][o]):
            s = med[1][op] / med[hi][op] if med[hi][op] > 0 else float("nan")
            print(f"{op:>14} {med[1][op] * 1e6:>10.1f} {med[hi][op] * 1e6:>10.1f} {s:>7.2f}x")
        speed[ph] = med[1]["(step)"] / med[hi]["(step)"]
    verdict(f"{hi} threads speed up a decode step {speed['decode']:.2f}x and a {prompt}-token prefill "
            f"{speed['prefill']:.2f}x over 1 thread (medians of {repeats}, interleaved) -> "
            f"{'scales' if min(speed.values()) > 0.8 * hi else 'scales sub-linearly'}")


if __name__ == "__main__":
    main()
