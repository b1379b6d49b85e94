"""Is attention a large share of prefill time, and how does that share grow with the prompt length?

    python profiling/attention_share.py [--quick] [--model smollm2-135m] [--repeats 5]

Per prompt length: a profiled prefill of a fresh sequence; attention's share = attention op seconds / the
prefill steps' wall time. Warm-up round excluded; lengths interleaved within each repeat; medians.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

import lumen
from token_ids import random_ids
from verdict import count, one_line_errors, thread_count, verdict


def attention_share(model, n_tokens: int) -> tuple[float, float]:
    """(attention share of the prefill wall time, prefill wall seconds) of one profiled prefill of n_tokens."""
    ids = random_ids(np.random.default_rng(n_tokens), n_tokens, model, low=0)
    model.reset()
    with lumen.profile() as prof:
        model.prefill(ids)
    wall = sum(s.wall_s for s in prof.steps if s.phase == "prefill")
    return prof.by_op("prefill")["attention"].seconds / wall, wall


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--repeats", type=count, default=5)
    ap.add_argument("--quick", action="store_true", help="3 lengths, 2 repeats (for tests)")
    a = ap.parse_args(argv)
    lengths = [1, 8, 32] if a.quick else [1, 8, 16, 32, 64, 128, 256, 512]
    repeats = 2 if a.quick else a.repeats
    with one_line_errors():
        model = lumen.load(a.model, ctx=max(lengths), threads=a.threads)
    model.warmup()
    for n in lengths:  # warm-up round, not measured
        attention_share(model, n)
    got: dict[int, list] = {n: [] for n in lengths}
    for _ in range(repeats):
        for n in lengths:  # interleaved: machine noise hits every length alike
            got[n].append(attention_share(model, n))
    print(f"{'tokens':>6} {'prefill ms':>10} {'tok/s':>8} {'attention %':>11}")
    share = {}
    for n in lengths:
        share[n] = statistics.median(s for s, _ in got[n])
        wall = statistics.median(w for _, w in got[n])
        print(f"{n:>6} {wall * 1e3:>10.2f} {n / wall:>8.0f} {100 * share[n]:>11.2f}")
    lo, hi = lengths[0], lengths[-1]
    conclusion = "not the bottleneck" if share[hi] < 0.2 else "a major cost"
    verdict(f"attention is {100 * share[hi]:.1f}% of prefill at {hi} tokens ({100 * share[lo]:.1f}% at {lo}, "
            f"median of {repeats}) -> {conclusion}")


if __name__ == "__main__":
    main()
