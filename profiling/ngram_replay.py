"""Is n-gram speculation limited by the drafter or by what the model copies? Replay greedy outputs through it.

    python profiling/ngram_replay.py [--quick] [-m smollm2-135m] [--kinds code,extract,summarize,chat]
                                     [--prompts-per-kind 6] [-n 160] [--row-cost 0.15] [--sizes 1-4,1-8,2-6]

Greedy speculation is exact: the output is the plain greedy output whatever is drafted. So each committed prompt
(lumen/bench/data/prompts.json) is decoded once without speculation, and its output replayed step by step through
the engine's own n-gram drafter (lumen.engine.speculative: the same match, proposal, adaptive k and acceptance
bookkeeping) for each range of n-gram sizes in --sizes, without the model. A step with k drafted tokens is
modelled as costing 1 + row_cost x k one-row steps (`spec_verify_cost.py` measures a 5-row step: 1.45-1.7x, so
row_cost 0.11-0.18). Per kind and size range: the modelled speed-up over plain decode, the tokens per step, and
the share of steps where nothing matched. The first size range is the engine's default.
"""
from __future__ import annotations

import argparse
import statistics

from lumen import Engine, SamplingParams
from lumen.bench.spec import prompts
from lumen.engine.speculative.drafters import NgramDrafter, SpecState
from lumen.engine.speculative.speculator import choose_k, skipped, update_alpha
from verdict import count, list_of, non_negative, one_line_errors, verdict

K_MAX = 5


class _Seq:
    def __init__(self):
        self.spec, self.tokens = SpecState(), []


def replay(prompt: list, out: list, drafter: NgramDrafter, row_cost: float) -> tuple[float, float, float]:
    """(modelled speed-up, tokens per step, share of steps without a match) of speculating on this output."""
    seq, cost = _Seq(), lambda k: 1.0 + row_cost * k
    i, total, steps, unmatched = 1, 1.0, 1, 0               # the first token comes from the prefill
    while i < len(out):
        seq.tokens = prompt + out[:i]
        n, k, acc = drafter.match(seq.spec, seq.tokens), 0, 0
        room = min(K_MAX, len(out) - i - 1)
        if n is None:
            unmatched += 1
        elif room > 0:
            k = choose_k(seq.spec.alpha_of(n), room, cost)
            if k == 0:
                skipped(seq.spec, n)
        d = drafter.propose([(seq, k)]).get(seq) if k else None
        k = 0 if d is None else k
        if k:
            while acc < len(d.tokens) and d.tokens[acc] == out[i + acc]:
                acc += 1
            update_alpha(seq.spec, len(d.tokens), acc, n=d.n)
            k = len(d.tokens)
        total += cost(k)
        steps += 1
        i += acc + 1
    return len(out) / total, len(out) / steps, unmatched / max(1, steps - 1)


def size_range(text: str) -> str:
    """argparse type: an n-gram size range 'lo-hi', as NgramDrafter takes it (1 <= lo <= hi <= 16)."""
    lo, _, hi = text.partition("-")
    try:
        NgramDrafter(int(lo), int(hi))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected lo-hi with 1 <= lo <= hi <= 16, got {text!r}") from None
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--kinds", default="code,extract,summarize,chat")
    ap.add_argument("--prompts-per-kind", type=count, default=6)
    ap.add_argument("-n", type=count, default=160, help="tokens generated per prompt (EOS ignored)")
    ap.add_argument("--row-cost", type=non_negative, default=0.15, help="a drafted row's cost, in one-row steps")
    ap.add_argument("--sizes", type=list_of(size_range), default="1-4,1-6,1-8,2-4,2-6,3-8",
                    help="n-gram size ranges, the default first")
    ap.add_argument("--quick", action="store_true", help="one code prompt, 16 tokens, two size ranges (tests)")
    a = ap.parse_args(argv)
    kinds, per, n, sizes = a.kinds.split(","), a.prompts_per_kind, a.n, a.sizes
    if a.quick:
        kinds, per, n, sizes = ["code"], 1, 16, sizes[:2]
    drafters = {s: NgramDrafter(*(int(x) for x in s.split("-"))) for s in sizes}
    items = prompts(kinds, per)                               # (a kind with no prompts: one line, before the load)
    with one_line_errors():
        eng = Engine(a.model, max_num_seqs=1)
    outs: dict = {}
    for item in items:
        eng.add_request(item["prompt"], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        done = [o for _ in iter(eng.has_unfinished, False) for o in eng.step() if o.finished]
        outs.setdefault(item["kind"], []).append((list(done[0].prompt_token_ids), list(done[0].token_ids)))
    print(f"{a.model}, {per} prompts per kind, {n} greedy tokens each, a drafted row costs {a.row_cost} of a step; "
          f"medians over prompts")
    print(f"{'kind':>10} {'sizes':>6} {'speed-up':>9} {'tok/step':>9} {'no match':>9}")
    found = []
    for kind, items in outs.items():
        best = None
        for s, d in drafters.items():
            r = [replay(p, o, d, a.row_cost) for p, o in items]
            up, tps, um = (statistics.median(x[j] for x in r) for j in range(3))
            print(f"{kind:>10} {s:>6} {up:8.2f}x {tps:9.2f} {100 * um:8.0f}%")
            if s == sizes[0]:
                base = (up, tps, um)
            if best is None or up > best[1]:
                best = (s, up)
        found.append(f"{kind} {base[0]:.2f}x at {base[1]:.2f} tokens a step, no match on {100 * base[2]:.0f}% of "
                       f"steps (best sizes {best[0]}: {best[1]:.2f}x)")
    verdict(f"n-gram speculation replayed on greedy outputs, sizes {sizes[0]}: {'; '.join(found)}")


if __name__ == "__main__":
    main()
