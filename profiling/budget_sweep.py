"""Goodput against the token budget: fixed budgets from 64 to 4096, and the measured-cost scheduler.

    python profiling/budget_sweep.py [--quick] [--model smollm2-135m] [--rates 2,4,8] [--requests 64]

Per arrival rate (Poisson, in-process) and per scheduler: the same requests (lumen/bench/data/prompts.json)
run through an engine; goodput = requests per second whose TTFT and mean TPOT both meet the SLOs (TPOT target
2x the single-stream TPOT measured first, TTFT target 2 s). Interleaved: each rate runs
every scheduler before the next rate.
"""
from __future__ import annotations

import argparse
import time

import lumen
from lumen import Engine, SamplingParams
from lumen.bench.offline import workload
from where_p99_itl_comes_from import run_poisson
from verdict import count, list_of, one_line_errors, positive, thread_count, verdict


def single_tpot(model) -> float:
    out = model.engine.generate([list(range(100, 164))], SamplingParams(max_tokens=33, temperature=0,
                                                                       ignore_eos=True))[0]
    return out.metrics.tpot_s


def goodput(outs, ttft_s, tpot_s, wall) -> tuple[float, float]:
    ok = sum(1 for o in outs if o.metrics.ttft_s is not None and o.metrics.ttft_s <= ttft_s
             and (o.metrics.tpot_s or 0.0) <= tpot_s)
    return ok / wall, ok / max(1, len(outs))


def summary(res: dict, rates: list[float], budgets: list[int]) -> str:
    """The verdict from res[rate][scheduler] = (goodput req/s, share meeting both SLOs): the measured scheduler
    against the best fixed budget at the first rate where none meets both SLOs for 90% of requests. Where no fixed
    budget had any goodput there is no ratio: the measured one's goodput is said instead."""
    crit = next((r for r in rates if max(res[r][b][1] for b in budgets) < 0.9), rates[-1])
    best = max(budgets, key=lambda b: res[crit][b][0])
    m, f = res[crit]["measured"][0], res[crit][best][0]
    against = (f"{m / f:.2f}x the best fixed budget's ({best})" if f > 0 else
               f"{m:.2f} req/s where no fixed budget met both SLOs for any request")
    ratios = [res[r]["measured"][0] / fb for r in rates if (fb := max(res[r][b][0] for b in budgets)) > 0]
    worst = (f"at worst {min(ratios):.2f}x over the {len(ratios)} rates where a fixed budget had any goodput"
             if ratios else "no fixed budget had any goodput")
    return (f"at {crit} req/s (where the best fixed budget first meets both SLOs for < 90% of requests) the "
            f"measured-cost scheduler's goodput is {against}; {worst}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--rates", type=list_of(positive), default="1,2,4,6,8,12", help="requests per second")
    ap.add_argument("--requests", type=count, default=64)
    ap.add_argument("--ttft", type=positive, default=2.0, help="the TTFT SLO, seconds")
    ap.add_argument("--quick", action="store_true", help="one rate, 6 requests, budgets 64 and 512 (for tests)")
    a = ap.parse_args(argv)
    rates = [4.0] if a.quick else a.rates
    n = 6 if a.quick else a.requests
    budgets = [64, 512] if a.quick else [64, 128, 256, 512, 1024, 2048, 4096]
    with one_line_errors():
        model = lumen.load(a.model, ctx=2048, threads=a.threads)
    tpot = 2 * single_tpot(model)
    reqs = [(p, min(k, 16) if a.quick else k) for p, k in workload(n)]
    kw = dict(max_model_len=2048, max_num_seqs=16, kv_cache_mb=256)
    measured = Engine(model, max_num_batched_tokens=max(budgets), scheduler="measured", slo_ttft_s=a.ttft,
                      slo_tpot_s=tpot, cost_grid="tiny" if a.quick else "full", **kw)
    fixed = {b: Engine(model, max_num_batched_tokens=b, **kw) for b in budgets}
    print(f"SLOs: TTFT {a.ttft:.1f} s, TPOT {tpot * 1e3:.1f} ms (2x single stream)")
    print(f"{'rate':>5} " + " ".join(f"{b:>7}" for b in budgets) + f" {'measured':>9}   (goodput, req/s)")
    res = {}
    for rate in rates:
        row = {}
        for name, eng in [*fixed.items(), ("measured", measured)]:
            t0 = time.perf_counter()
            outs = run_poisson(eng, reqs, rate)
            row[name] = goodput(outs, a.ttft, tpot, time.perf_counter() - t0)
        res[rate] = row
        print(f"{rate:>5.1f} " + " ".join(f"{row[b][0]:>7.2f}" for b in budgets) + f" {row['measured'][0]:>9.2f}")
    verdict(summary(res, rates, budgets))


if __name__ == "__main__":
    main()
