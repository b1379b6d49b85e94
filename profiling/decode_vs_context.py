"""How does a decode step's time grow with the context length, and how much of that is attention's KV reads?

    python profiling/decode_vs_context.py [--quick] [--model smollm2-135m] [--repeats 7]

The KV cache is filled once by a prefill of the longest context; a decode at context C then starts from
`model.n_past = C` (the cache below C holds that prefill's keys and values), so the contexts can be
interleaved. Per C: median over repeats of the profiled step wall time and of its attention op (seconds, bytes).
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

import lumen
from token_ids import random_ids
from verdict import count, one_line_errors, thread_count, verdict


def decode_at(model, ctx: int) -> tuple[float, float, int]:
    """(step wall s, attention s, attention bytes) of one profiled decode at context ctx."""
    model.n_past = ctx
    with lumen.profile() as prof:
        model.decode(1)
    att = prof.by_op("decode")["attention"]
    return prof.steps[0].wall_s, att.seconds, att.bytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--repeats", type=count, default=7)
    ap.add_argument("--quick", action="store_true", help="contexts 16 and 128, 2 repeats (for tests)")
    a = ap.parse_args(argv)
    contexts = [16, 128] if a.quick else [16, 64, 128, 256, 512, 1024, 2047]
    repeats = 2 if a.quick else a.repeats
    with one_line_errors():
        model = lumen.load(a.model, ctx=max(contexts) + 1, threads=a.threads)
    model.warmup()
    model.prefill(random_ids(np.random.default_rng(0), max(contexts), model, low=0))  # fills the cache
    got: dict[int, list] = {c: [] for c in contexts}
    for r in range(repeats + 1):
        for c in contexts:  # interleaved; round 0 is warm-up
            res = decode_at(model, c)
            if r:
                got[c].append(res)
    wb = model.weights.decode_bytes
    print(f"{'context':>7} {'step ms':>8} {'attn ms':>8} {'attn %':>7} {'KV MB read':>10} {'attn GB/s':>9}")
    med = {}
    for c in contexts:
        step, att = (statistics.median(x[i] for x in got[c]) for i in (0, 1))
        nb = got[c][0][2]
        med[c] = (step, att, nb)
        print(f"{c:>7} {step * 1e3:>8.2f} {att * 1e3:>8.2f} {100 * att / step:>7.1f} {nb / 1e6:>10.2f} "
              f"{nb / att / 1e9 if att else 0:>9.1f}")
    lo, hi = contexts[0], contexts[-1]
    print(f"weights read per step: {wb / 1e6:.1f} MB")
    verdict(f"a decode step takes {med[hi][0] * 1e3:.1f} ms at context {hi} vs {med[lo][0] * 1e3:.1f} ms at "
            f"{lo} ({med[hi][0] / med[lo][0]:.2f}x); attention goes from {100 * med[lo][1] / med[lo][0]:.1f}% to "
            f"{100 * med[hi][1] / med[hi][0]:.1f}% of the step, reading {med[hi][2] / 1e6:.1f} MB of KV "
            f"({100 * med[hi][2] / wb:.0f}% of the weight bytes) at {hi} (medians of {repeats})")


if __name__ == "__main__":
    main()
