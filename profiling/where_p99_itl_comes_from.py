"""Where does the p99 inter-token latency come from when requests keep arriving?

    python profiling/where_p99_itl_comes_from.py [--quick] [--model smollm2-135m] [--rate 4] [--requests 48]

Requests of lumen/bench/data/prompts.json arrive at Poisson times (in-process, no HTTP) into an engine with the
default fixed budget (512 tokens); the engine runs inside lumen.profile(), and the serving profile
(lumen/profile/serving.py) splits every ITL into the steps' parts. The p99 ITLs are then compared with the
p50 ones: which part grows.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import lumen
from lumen import Engine, SamplingParams
from lumen.bench.offline import workload
from lumen.profile import serving
from verdict import count, one_line_errors, positive, thread_count, verdict


def run_poisson(eng, reqs, rate: float, seed: int = 0) -> list:
    """Add each request at its Poisson arrival time (stepping the engine meanwhile); the final outputs."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(reqs)))
    t0, i, done = time.perf_counter(), 0, []
    while i < len(reqs) or eng.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(reqs) and arrivals[i] <= now:
            prompt, n = reqs[i]
            eng.add_request(prompt, SamplingParams(max_tokens=n, temperature=0))
            i += 1
        if eng.has_unfinished():
            done += [o for o in eng.step() if o.finished]
        elif i < len(reqs):
            time.sleep(min(0.01, arrivals[i] - now))
    return done


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--rate", type=positive, default=4.0, help="requests per second")
    ap.add_argument("--requests", type=count, default=48)
    ap.add_argument("--budget", type=count, default=512)
    ap.add_argument("--quick", action="store_true", help="8 short requests (for tests)")
    a = ap.parse_args(argv)
    n = 8 if a.quick else a.requests
    with one_line_errors():
        model = lumen.load(a.model, ctx=64, threads=a.threads)
    eng = Engine(model, max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=a.budget, kv_cache_mb=256)
    reqs = [(p, min(k, 24) if a.quick else k) for p, k in workload(n)]
    eng.generate(["warm up"], SamplingParams(max_tokens=2))
    with lumen.profile() as prof:
        outs = run_poisson(eng, reqs, a.rate)
    rep = serving.report(prof, [serving.trace_of(o) for o in outs])
    serving.print_report(rep)
    p50, p99 = rep["itl_p50_parts"], rep["itl_p99_parts"]
    grow = max(serving.PARTS, key=lambda k: p99[k] * rep["itl_p99_s"] - p50[k] * rep["itl_p50_s"])
    extra = p99[grow] * rep["itl_p99_s"] - p50[grow] * rep["itl_p50_s"]
    verdict(f"ITL p99 {rep['itl_p99_s'] * 1e3:.0f} ms vs p50 {rep['itl_p50_s'] * 1e3:.0f} ms; "
            f"'{grow}' adds {extra * 1e3:.0f} ms of the difference ({100 * p99[grow]:.0f}% of a p99 gap, "
            f"{100 * p50[grow]:.0f}% of a p50 one) at {a.rate} req/s, budget {a.budget}; coverage min "
            f"{100 * rep['coverage_min']:.1f}%")


if __name__ == "__main__":
    main()
