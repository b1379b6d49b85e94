"""How does a decode step's time grow with the number of sequences decoding together, and where does batched
decode turn compute-bound?

    python profiling/batch_decode_scaling.py [--quick] [--model smollm2-135m] [--context 128] [--steps 24]

Per batch size B: B sequences of --context prompt tokens prefilled, then --steps engine steps that each decode one
token of every sequence (greedy, EOS ignored); step time = median over the steps, aggregate t/s = B / step time.
A step reads the weights once whatever B is; each extra sequence adds its compute and its KV reads. The step
turns compute-bound where doubling B nearly doubles the step time (the marginal cost of a sequence reaches
70% of the step time per sequence at B = 1's cost ... measured: the first B where step(2B) / step(B) > 1.7).
Sizes are interleaved within each repeat; medians.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

import lumen
from lumen import Engine, SamplingParams
from token_ids import random_ids
from verdict import count, one_line_errors, thread_count, verdict


def decode_steps(engine, B: int, context: int, steps: int, rng) -> list[float]:
    """Step times (s) of `steps` decode steps of B sequences at about `context` keys."""
    p = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for _ in range(B):
        engine.add_request(random_ids(rng, context, engine).tolist(), p)
    while engine.num_waiting or any(s.num_computed < len(s.prompt_ids) for s in engine.scheduler.running):
        engine.step()                                   # the prefills (and possibly a first decode)
    times = []
    import time
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        if len(outs) == B:
            times.append(time.perf_counter() - t)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--context", type=count, default=128)
    ap.add_argument("--steps", type=count, default=24)
    ap.add_argument("--repeats", type=count, default=3)
    ap.add_argument("--quick", action="store_true", help="sizes 1, 2, 4, 2 repeats, 6 steps (for tests)")
    a = ap.parse_args(argv)
    sizes = [1, 2, 4] if a.quick else [1, 2, 4, 8, 16, 32]
    steps, repeats = (6, 2) if a.quick else (a.steps, a.repeats)
    with one_line_errors():
        model = lumen.load(a.model, ctx=64, threads=a.threads)
    engine = Engine(model, max_model_len=a.context + steps + 2, max_num_seqs=max(sizes),
                    max_num_batched_tokens=max(512, a.context), enable_prefix_caching=False,
                    kv_cache_mb=max(sizes) * (a.context + steps + 18) * model.runner.kv_bytes_per_block / 16 / 2 ** 20)
    rng = np.random.default_rng(0)
    decode_steps(engine, 2, a.context, 2, rng)           # warm-up
    got = {B: [] for B in sizes}
    for _ in range(repeats):
        for B in sizes:
            got[B] += decode_steps(engine, B, a.context, steps, rng)
    step = {B: statistics.median(got[B]) for B in sizes}
    print(f"{'B':>3} {'step ms':>8} {'agg t/s':>8} {'vs B=1':>7} {'ms/seq':>7}")
    for B in sizes:
        print(f"{B:>3} {step[B] * 1e3:>8.2f} {B / step[B]:>8.1f} {B / step[B] / (1 / step[1]):>6.2f}x "
              f"{step[B] / B * 1e3:>7.2f}")
    turn = next((B for B in sizes if 2 * B in step and step[2 * B] / step[B] > 1.7), None)
    best = max(sizes, key=lambda B: B / step[B])
    where = f"turns compute-bound at B = {turn} (step({2 * turn}) / step({turn}) = {step[2 * turn] / step[turn]:.2f})" \
        if turn else "stays below compute-bound over the sizes measured"
    verdict(f"a decode step takes {step[sizes[0]] * 1e3:.1f} ms at B = {sizes[0]} and "
            f"{step[sizes[-1]] * 1e3:.1f} ms at B = {sizes[-1]}; aggregate {best / step[best]:.0f} t/s at best (B = "
            f"{best}, {best / step[best] * step[1]:.2f}x B = 1); {where} (context {a.context}, medians of "
            f"{repeats} x {steps} steps)")


if __name__ == "__main__":
    main()
