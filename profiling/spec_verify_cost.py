"""What does a speculative verification step cost against a plain decode step, and where does it go?

    python profiling/spec_verify_cost.py [--quick] [--model smollm2-135m] [--prompt-id extract-066] [-n 160]
                                         [--rows 5] [--repeats 15] [--rounds 3]

Two measurements at the context of one prompt of the committed request set (lumen/bench/data/prompts.json;
extract-066 copies a passage, so most drafts are accepted):
1. The forward pass alone, at a fixed number of rows: after the prompt, a verification of --rows tokens of the
   sequence (logits for every row, as verification needs them) against a one-row decode step, both at the
   prompt's context, alternated --repeats times under lumen.profile; medians per op and of the whole call. This
   is the cost ratio the speculator weighs, free of its choice of k and of the Python around a step.
2. The engine end to end: the prompt generated greedily with and without ngram speculation of at most --rows - 1
   drafts per step, alternated --rounds times (the first round warms up and is not counted); median ms per decode
   step of each, the rows per speculative step (the speculator picks k up to that by the step costs it measures,
   so this varies), and the decoding speed-up. Speculation pays by tokens per step divided by the step's cost
   ratio.
The host's speed moves between runs minutes apart; both measurements alternate the two sides and report medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import lumen
from verdict import count, one_line_errors, thread_count, verdict

PROMPTS = Path(lumen.__file__).parent / "bench" / "data" / "prompts.json"


def forward_rows(model, ctx: list[int], rows: int, repeats: int) -> tuple[dict, dict, float, float]:
    """({op: median ms} of a 1-row step, the same of a `rows`-row verification, median ms of each call) at the
    context ctx, the two alternated `repeats` times after one warm-up of each; the calls' wall times from a pass
    without the profiler (its bookkeeping runs inside the call), the ops from a pass under it."""
    model.reset()
    model.prefill(ctx)
    rng = np.random.default_rng(0)
    ops: dict = {1: {}, rows: {}}
    wall: dict = {1: [], rows: []}

    def call(n: int) -> float:
        ids = np.ascontiguousarray(rng.integers(0, model.config.n_vocab, n), dtype=np.int64)
        model.n_past = len(ctx)                          # the same position every time: nothing accumulates
        t0 = time.perf_counter()
        if n == 1:
            model.decode(int(ids[0]))
        else:
            model.prefill(ids, all_logits=True)          # logits for every row, as verification takes them
        return (time.perf_counter() - t0) * 1e3

    for rep in range(repeats + 1):
        for n in ((1, rows) if rep % 2 else (rows, 1)):
            dt = call(n)
            if rep:
                wall[n].append(dt)
    for rep in range(repeats + 1):
        for n in ((1, rows) if rep % 2 else (rows, 1)):
            with lumen.profile() as prof:
                call(n)
            if rep:
                for op, a in prof.by_op().items():
                    ops[n].setdefault(op, []).append(a.seconds * 1e3)
    model.reset()
    med = {n: {op: statistics.median(v) for op, v in ops[n].items()} for n in ops}
    return med[1], med[rows], statistics.median(wall[1]), statistics.median(wall[rows])


def run(model, prompt: str, n: int, spec: str | None) -> tuple[int, float, float, dict]:
    """(steps, rows per step, ms per step, {op: ms per step}) of the generation's decode steps."""
    with lumen.profile() as prof:
        for _ in model.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True, speculative=spec):
            pass
    steps = [s for s in prof.steps if s.phase == "decode"]          # the first token comes from the prefill
    ops = {op: a.seconds * 1e3 / len(steps) for op, a in prof.by_op("decode").items()}
    return (len(steps), sum(s.n_tokens for s in steps) / len(steps), sum(s.wall_s for s in steps) * 1e3 / len(steps),
            ops)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--prompt-id", default="extract-066")
    ap.add_argument("-n", type=count, default=160)
    ap.add_argument("--rows", type=count, default=5, help="rows of the fixed-size verification (1 + drafts)")
    ap.add_argument("--repeats", type=count, default=15, help="alternations of the forward-only measurement")
    ap.add_argument("--rounds", type=count, default=3, help="alternations of the generations (after a warm-up)")
    ap.add_argument("--quick", action="store_true", help="16 tokens, 3 repeats, 1 round (for tests)")
    a = ap.parse_args(argv)
    n, repeats, rounds = (16, 3, 1) if a.quick else (a.n, a.repeats, a.rounds)
    if a.rows < 2:
        ap.error(f"argument --rows: must be at least 2 (a row and a draft), got {a.rows}")
    items = {x["id"]: x for x in json.loads(PROMPTS.read_text())["items"]}
    if a.prompt_id not in items:
        raise SystemExit(f"error: no prompt {a.prompt_id!r} in {PROMPTS}")
    prompt = items[a.prompt_id]["prompt"]
    with one_line_errors():
        model = lumen.load(a.model, threads=a.threads)
    model.speculation(num_speculative_tokens=a.rows - 1)        # a speculative step: at most --rows rows
    ctx = model.tokenize(prompt)
    if len(ctx) + max(n, a.rows) > model.n_ctx:
        raise SystemExit(f"error: the prompt ({len(ctx)} tokens) leaves no room for {max(n, a.rows)} more")

    o1, ok, w1, wk = forward_rows(model, ctx, a.rows, repeats)
    print(f"1. the forward pass at context {len(ctx)}: one row against {a.rows} rows, medians of {repeats}")
    print(f"{'op':>14} {'1 row ms':>9} {f'{a.rows} rows':>8} {'ratio':>6}")
    for op in sorted(ok, key=lambda k: -ok[k])[:8]:
        print(f"{op:>14} {o1.get(op, 0.0):9.3f} {ok[op]:8.3f} {ok[op] / max(o1.get(op, 0.0), 1e-9):6.2f}")
    print(f"{'call':>14} {w1:9.3f} {wk:8.3f} {wk / w1:6.2f}")

    res = {None: [], "ngram": []}
    for r in range(rounds + 1):                                  # round 0 warms up (and lets k settle)
        for spec in ((None, "ngram") if r % 2 else ("ngram", None)):
            got = run(model, prompt, n, spec)
            if r:
                res[spec].append(got)
    steps0 = statistics.median(x[0] for x in res[None])
    t0 = statistics.median(x[2] for x in res[None])
    steps1 = statistics.median(x[0] for x in res["ngram"])
    t1 = statistics.median(x[2] for x in res["ngram"])
    rows = statistics.median(x[1] for x in res["ngram"])
    o0 = {op: statistics.median(x[3].get(op, 0.0) for x in res[None]) for op in res[None][0][3]}
    os_ = {op: statistics.median(x[3].get(op, 0.0) for x in res["ngram"]) for op in res["ngram"][0][3]}
    print(f"2. generating {n} tokens, plain against ngram speculation, medians of {rounds} alternated rounds")
    print(f"{'op':>14} {'plain ms':>9} {'spec ms':>8} {'ratio':>6}")
    for op in sorted(os_, key=lambda k: -os_[k])[:8]:
        print(f"{op:>14} {o0.get(op, 0.0):9.3f} {os_[op]:8.3f} {os_[op] / max(o0.get(op, 0.0), 1e-9):6.1f}")
    verdict(f"a {a.rows}-row verification costs {wk / w1:.2f}x a one-row step in the forward pass ({wk:.2f} "
            f"vs {w1:.2f} ms, context {len(ctx)}); in generation a speculative step of {rows:.2f} rows costs "
            f"{t1 / t0:.2f}x a plain step ({t1:.2f} vs {t0:.2f} ms), {steps0:.0f} plain steps against {steps1:.0f}: "
            f"{steps0 * t0 / (steps1 * t1):.2f}x faster decoding")


if __name__ == "__main__":
    main()
