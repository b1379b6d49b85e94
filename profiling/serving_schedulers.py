"""The server's default scheduler against the alternatives, under the load users bring: streamed requests at a
fixed concurrency, each configuration its own lumen.serve, the same prompts to each.

    python profiling/serving_schedulers.py [--model qwen2.5-coder-1.5b] [--concurrency 16] [--requests 32]
        [--mix chat] [--output-len 64] [--input-len N] [-r 1] [--slo-tpot-ms 100 --slo-ttft-ms 5000] [--quick]

Configurations (lumen.serve flags): the default (paced, pace 1.5), pace 3, a fixed budget of 512 tokens (the
former default) and of 64, and the measured-cost scheduler with SLO targets. Per configuration: output tok/s,
TTFT p50/p99, ITL p50/p99 (lumen.bench serve's client, EOS ignored). With -r > 1 the configurations are
interleaved per repetition (every server stays up) and medians are reported. The VERDICT compares the default
with the best alternative on ITL p99 and on throughput.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lumen.bench import launch                                            # noqa: E402
from lumen.bench.serve import Load, all_prompts, medians, per_level, run_load   # noqa: E402
from verdict import checked_model, count, positive, thread_count, verdict  # noqa: E402


def configs(tpot_ms: float, ttft_ms: float) -> dict[str, list[str]]:
    return {"default (paced 1.5)": [],
            "paced, --pace 3": ["--pace", "3"],
            "fcfs, budget 512": ["--scheduler", "fcfs"],
            "fcfs, budget 64": ["--scheduler", "fcfs", "--max-num-batched-tokens", "64"],
            f"measured, SLO {tpot_ms:g}/{ttft_ms:g} ms": ["--scheduler", "measured", "--slo-tpot-ms", f"{tpot_ms:g}",
                                                         "--slo-ttft-ms", f"{ttft_ms:g}"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default=None, help="default qwen2.5-coder-1.5b (--quick: smollm2-135m)")
    ap.add_argument("--threads", type=thread_count, default=2)
    ap.add_argument("--concurrency", type=count, default=16)
    ap.add_argument("--requests", type=count, default=32)
    ap.add_argument("--mix", default="chat", choices=["chat", "long"])
    ap.add_argument("--input-len", type=count, default=None, help="every prompt this many tokens (default: the mix's)")
    ap.add_argument("--output-len", type=count, default=64)
    ap.add_argument("-r", "--repetitions", type=count, default=1)
    ap.add_argument("--slo-tpot-ms", type=positive, default=100.0)
    ap.add_argument("--slo-ttft-ms", type=positive, default=5000.0)
    ap.add_argument("--quick", action="store_true", help="two configurations, 4 requests of 8 tokens (for tests)")
    a = ap.parse_args(argv)
    a.model = a.model or ("smollm2-135m" if a.quick else "qwen2.5-coder-1.5b")
    confs = configs(a.slo_tpot_ms, a.slo_ttft_ms)
    if a.quick:
        confs = dict(list(confs.items())[:1] + list(confs.items())[2:3])
        a.requests, a.output_len, a.concurrency = 4, 8, 2
    path = checked_model(a.model)                               # before any server starts, not in its log
    load = Load(mix=a.mix, input_len=a.input_len, output_len=a.output_len, ignore_eos=True)
    loads = per_level(load, [a.concurrency], a.requests)
    runs: dict[str, list] = {name: [] for name in confs}
    print(f"{a.model}: mix {a.mix}{f', input {a.input_len}' if a.input_len else ''}, output {a.output_len}, "
          f"concurrency {a.concurrency}, {a.requests} requests, {a.threads} threads, {a.repetitions} rep(s)",
          flush=True)
    with launch.Servers() as started:
        servers = {name: started.start(launch.Server(name, launch.lumen_serve_args(
            path, a.threads, [*flags, "--shutdown-timeout", "5"]))) for name, flags in confs.items()}
        first = next(iter(servers.values()))
        prompts = all_prompts(loads, a.repetitions, first.url)
        for r in range(a.repetitions):
            for name, srv in servers.items():
                reqs = prompts[a.concurrency, r, "none"]
                res = run_load(replace(loads[a.concurrency], url=srv.url, label=name), reqs)
                runs[name].append(res)
                print(f"  rep {r + 1}: {name}: {res['output_throughput']:.1f} tok/s, ITL p99 "
                      f"{res['itl_ms']['p99']:.0f} ms", file=sys.stderr, flush=True)
    table = {name: medians(rs) for name, rs in runs.items()}
    cols = ("output tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
    print(f"| configuration | {' | '.join(cols)} | failed |")
    print("|---|" + "---|" * (len(cols) + 1))
    for name, m in table.items():
        print(f"| {name} | " + " | ".join(f"{m[c]:.1f}" if c == "output tok/s" else f"{m[c]:.0f}" for c in cols)
              + f" | {m['failed']} |")
    default = next(iter(table))
    d, others = table[default], {k: v for k, v in table.items() if k != default}
    best_itl = min(others, key=lambda k: others[k]["ITL p99"])
    best_tps = max(others, key=lambda k: others[k]["output tok/s"])
    verdict(f"{a.model}, concurrency {a.concurrency}: the default's ITL p99 is {d['ITL p99']:.0f} ms against "
            f"{others[best_itl]['ITL p99']:.0f} ms for the best alternative ({best_itl}); its throughput "
            f"{d['output tok/s']:.1f} tok/s is {d['output tok/s'] / others[best_tps]['output tok/s']:.2f}x the "
            f"best alternative's ({best_tps}); TTFT p50 {d['TTFT p50']:.0f} ms")


if __name__ == "__main__":
    main()
