"""How long do running decodes stall while a long prompt prefills, with chunked prefill at each token budget?

    python profiling/chunked_prefill_itl.py [--quick] [--model smollm2-135m] [--prompt 2048] [--decodes 4]

Per budget (and once without chunking, the whole prompt in one step): --decodes requests are decoding when a
--prompt-token request arrives; recorded are the decodes' inter-token latencies from its arrival until its first
token (worst and median), and the duration of the steps that carried its chunks (median and longest: a later
chunk attends to more keys, so it costs more). Without chunking, those decodes wait for the whole prefill.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import lumen
from lumen import Engine, SamplingParams
from token_ids import random_ids
from verdict import count, one_line_errors, thread_count, verdict


def one(model, budget: int, chunked: bool, n_prompt: int, n_dec: int, rng) -> dict:
    eng = Engine(model, max_model_len=n_prompt + 64, max_num_seqs=n_dec + 1, max_num_batched_tokens=budget,
                 enable_chunked_prefill=chunked, enable_prefix_caching=False,
                 kv_cache_mb=(n_dec + 1) * (n_prompt + 80) * model.runner.kv_bytes_per_block / 16 / 2 ** 20)
    dec = [eng.add_request(random_ids(rng, 32, model).tolist(),
                           SamplingParams(max_tokens=n_prompt, temperature=0, ignore_eos=True)) for _ in range(n_dec)]
    for _ in range(3):                                        # the decodes are running
        eng.step()
    big = eng.add_request(random_ids(rng, n_prompt, model).tolist(),
                          SamplingParams(max_tokens=1, temperature=0))
    last = {r: time.perf_counter() for r in dec}
    itl, steps = [], []
    done = False
    while not done:
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        steps.append(t1 - t0)
        for o in outs:
            if o.request_id in last:
                itl.append(t1 - last[o.request_id])
                last[o.request_id] = t1
            done |= o.request_id == big
    for r in dec:
        eng.abort(r)
    return {"worst_itl": max(itl), "median_itl": statistics.median(itl), "step": statistics.median(steps),
            "longest_step": max(steps), "prefill_s": sum(steps)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--prompt", type=count, default=2048)
    ap.add_argument("--decodes", type=count, default=4)
    ap.add_argument("--repeats", type=count, default=3)
    ap.add_argument("--quick", action="store_true", help="a 256-token prompt, budgets 64 and 128 (for tests)")
    a = ap.parse_args(argv)
    n_prompt, budgets, repeats = (256, [64, 128], 1) if a.quick else (a.prompt, [64, 128, 256, 512, 1024, 2048],
                                                                       a.repeats)
    with one_line_errors():
        model = lumen.load(a.model, ctx=64, threads=a.threads)
    rng = np.random.default_rng(0)
    one(model, 64, True, 64, 1, rng)                          # warm-up
    cases = [(b, True) for b in budgets] + [(n_prompt + a.decodes, False)]
    got = {c: [] for c in cases}
    for _ in range(repeats):
        for c in cases:
            got[c].append(one(model, c[0], c[1], n_prompt, a.decodes, rng))
    med = {c: {k: statistics.median(r[k] for r in got[c]) for k in got[c][0]} for c in cases}
    print(f"{'budget':>10} {'step ms':>8} {'longest':>8} {'worst ITL ms':>12} {'median ITL ms':>13} "
          f"{'worst/step':>10} {'worst/longest':>13} {'prefill s':>9}")
    for (b, ch), m in med.items():
        name = str(b) if ch else "unchunked"
        print(f"{name:>10} {m['step'] * 1e3:>8.1f} {m['longest_step'] * 1e3:>8.1f} {m['worst_itl'] * 1e3:>12.1f} "
              f"{m['median_itl'] * 1e3:>13.1f} {m['worst_itl'] / m['step']:>10.2f} "
              f"{m['worst_itl'] / m['longest_step']:>13.2f} {m['prefill_s']:>9.2f}")
    ref = 256 if 256 in budgets else budgets[-1]
    m, u = med[(ref, True)], med[(n_prompt + a.decodes, False)]
    verdict(f"at budget {ref} the decodes' worst ITL while a {n_prompt}-token prompt prefills is "
            f"{m['worst_itl'] * 1e3:.0f} ms = {m['worst_itl'] / m['step']:.2f}x the median budget-{ref} step "
            f"({m['step'] * 1e3:.0f} ms), {m['worst_itl'] / m['longest_step']:.2f}x the longest (the last chunk, "
            f"{m['longest_step'] * 1e3:.0f} ms); unchunked they stall {u['worst_itl']:.2f} s (medians of {repeats})")


if __name__ == "__main__":
    main()
