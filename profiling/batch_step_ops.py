"""Which ops grow when a decode step carries 8 sequences instead of 1?

    python profiling/batch_step_ops.py [--quick] [--model smollm2-135m] [--batch 8] [--context 128] [--tokens 40]

An engine with --batch sequences of --context random prompt tokens decoding together, and the same with one
sequence, each profiled op by op (lumen.profile) over --tokens decode steps; interleaved twice, the second round
reported. Per op: ms per step at B = 1 and B = --batch and their ratio; then the glue (scheduling, Python,
sampling, detokenizing) as a share of the step. The weights are read once per step whatever B is, so an op that
grows with B grows by its compute per row.
"""
from __future__ import annotations

import argparse

import numpy as np

import lumen
from lumen import Engine, SamplingParams
from token_ids import random_ids
from verdict import count, one_line_errors, thread_count, verdict

GLUE = ("schedule", "prepare", "dispatch", "return", "sample", "detokenize", "unattributed")


def profile_steps(eng, B: int, context: int, tokens: int, rng) -> tuple[float, dict]:
    """(ms per decode step, {op: ms per step}) over the decode steps of B sequences."""
    p = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for _ in range(B):
        eng.add_request(random_ids(rng, context, eng).tolist(), p)
    while eng.num_waiting or any(s.num_computed < len(s.prompt_ids) for s in eng.scheduler.running):
        eng.step()
    with lumen.profile() as prof:
        while eng.has_unfinished():
            eng.step()
    steps = [s for s in prof.steps if s.phase == "decode"]          # all B sequences decode in every one
    assert all(s.n_seqs == B for s in steps), "a decode step with another batch size"
    ops = {op: a.seconds * 1e3 / len(steps) for op, a in prof.by_op("decode").items()}
    return sum(s.wall_s for s in steps) * 1e3 / len(steps), ops


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--batch", type=count, default=8)
    ap.add_argument("--context", type=count, default=128)
    ap.add_argument("--tokens", type=count, default=40)
    ap.add_argument("--quick", action="store_true", help="batch 2, 16-token prompts, 6 tokens (for tests)")
    a = ap.parse_args(argv)
    B, context, tokens = (2, 16, 6) if a.quick else (a.batch, a.context, a.tokens)
    with one_line_errors():
        eng = Engine(a.model, threads=a.threads, max_num_seqs=max(B, 2),
                     max_num_batched_tokens=max(B * context, 64), kv_cache_mb=max(16, B * (context + tokens) * 0.2))
    rng = np.random.default_rng(0)
    res = {}
    for _ in range(2):                                          # interleaved; the second round is reported
        for b in (1, B):
            res[b] = profile_steps(eng, b, context, tokens, rng)
    (s1, o1), (sb, ob) = res[1], res[B]
    print(f"{'op':>14} {'B=1 ms':>8} {f'B={B} ms':>8} {'ratio':>6}")
    for op in sorted(ob, key=lambda k: -ob[k]):
        if op not in GLUE and ob[op] > 0.01 * sb:
            print(f"{op:>14} {o1.get(op, 0.0):8.3f} {ob[op]:8.3f} {ob[op] / max(o1.get(op, 0.0), 1e-9):6.1f}")
    glue = sum(ob.get(k, 0.0) for k in GLUE)
    top = max((op for op in ob if op not in GLUE), key=lambda k: ob[k] - o1.get(k, 0.0))
    print(f"{'step':>14} {s1:8.3f} {sb:8.3f} {sb / s1:6.1f}")
    verdict(f"{B} sequences take {sb / s1:.2f}x one sequence's decode step ({sb:.2f} vs {s1:.2f} ms: "
            f"{B * s1 / sb:.2f}x the tokens per second); {top} grows the most ({o1.get(top, 0.0):.2f} -> "
            f"{ob[top]:.2f} ms); glue {100 * glue / sb:.1f}% of the step")


if __name__ == "__main__":
    main()
