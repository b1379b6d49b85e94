"""How well does the measured cost model predict the steps of a workload it was not fitted to?

    python profiling/cost_model_accuracy.py [--quick] [--model smollm2-135m] [--requests 48]

The engine calibrates its cost model on the grid of step shapes (lumen/engine/costs/steps.py), then runs a held-out
workload (requests of lumen/bench/data/prompts.json arriving all at once, budget 512: prefill chunks, mixed and
pure decode steps); each step's measured time is compared with the prediction the model made before the step
(drift correction included, refits off so the model stays the calibrated one). Reports the median and p90
absolute relative error, by kind of step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import lumen
from lumen import Engine, SamplingParams
from lumen.bench.offline import workload
from verdict import count, one_line_errors, thread_count, verdict


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--requests", type=count, default=48)
    ap.add_argument("--quick", action="store_true", help="6 requests, the tiny calibration grid (for tests)")
    a = ap.parse_args(argv)
    n = 6 if a.quick else a.requests
    with one_line_errors():
        model = lumen.load(a.model, ctx=64, threads=a.threads)
    eng = Engine(model, max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=512, kv_cache_mb=256,
                 scheduler="measured", cost_grid="tiny" if a.quick else "full")
    cm = eng.cost_model
    cm.REFIT = 10 ** 9                                     # keep the calibrated fit: this measures it
    for prompt, k in workload(n):
        eng.add_request(prompt, SamplingParams(max_tokens=min(k, 48) if a.quick else k, temperature=0))
    errs: dict[str, list] = {"decode": [], "prefill": [], "mixed": []}
    while eng.has_unfinished():
        seen = len(cm.recent)
        t = time.perf_counter()
        eng.step()
        if len(cm.recent) > seen:
            T, S, K, wall = cm.recent[-1]
            pred = cm.fit.predict(T, S, K) * cm.drift      # what it predicted (drift as it stood before)
            kind = "decode" if T == S else "prefill" if S == 1 else "mixed"
            errs[kind].append(abs(pred / wall - 1))
    allerr = sorted(e for v in errs.values() for e in v)
    p90 = allerr[int(0.9 * (len(allerr) - 1))]
    med = statistics.median(allerr)
    for kind, v in errs.items():
        if v:
            print(f"{kind:8} {len(v):4} steps: median error {100 * statistics.median(v):5.1f}%")
    print(f"fit: {cm.fit.describe()}")
    verdict(f"the cost model predicts {len(allerr)} held-out steps within {100 * med:.1f}% median absolute "
            f"error (p90 {100 * p90:.1f}%) -> {'within' if med <= 0.15 else 'outside'} the 15% target")


if __name__ == "__main__":
    main()
