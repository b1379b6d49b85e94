"""What does a speculative verification step cost against a plain decode step, and where does it go?

    python profiling/spec_verify_cost.py [--quick] [--model smollm2-135m] [--prompt-id extract-066] [-n 160]

The same prompt of the committed request set (lumen/bench/data/prompts.json; extract-066 copies a passage, so
most drafts are accepted) generated greedily with and without ngram speculation, each under lumen.profile,
interleaved twice (the second round reported). Per op: ms per step plain and speculative; the rows per
speculative step; and what a speculative step costs relative to a plain one. Speculation pays by tokens per step
divided by that cost ratio.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lumen

PROMPTS = Path(lumen.__file__).parent / "bench" / "data" / "prompts.json"


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
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt-id", default="extract-066")
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("--quick", action="store_true", help="16 tokens (for tests)")
    a = ap.parse_args(argv)
    n = 16 if a.quick else a.n
    items = {x["id"]: x for x in json.loads(PROMPTS.read_text())["items"]}
    if a.prompt_id not in items:
        raise SystemExit(f"error: no prompt {a.prompt_id!r} in {PROMPTS}")
    model = lumen.load(a.model, threads=a.threads)
    for _ in range(2):                                          # interleaved; the second round is reported
        plain = run(model, items[a.prompt_id]["prompt"], n, None)
        spec = run(model, items[a.prompt_id]["prompt"], n, "ngram")
    (n0, _, t0, o0), (n1, rows, t1, o1) = plain, spec
    print(f"{'op':>14} {'plain ms':>9} {'spec ms':>8} {'ratio':>6}")
    for op in sorted(o1, key=lambda k: -o1[k])[:8]:
        print(f"{op:>14} {o0.get(op, 0.0):9.3f} {o1[op]:8.3f} {o1[op] / max(o0.get(op, 0.0), 1e-9):6.1f}")
    print(f"VERDICT: a speculative step of {rows:.2f} rows costs {t1 / t0:.2f}x a plain step ({t1:.2f} vs {t0:.2f} "
          f"ms); {n0} plain steps against {n1}: {n0 * t0 / (n1 * t1):.2f}x faster decoding [load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores]")


if __name__ == "__main__":
    main()
