"""How many tokens each step may take, from what steps cost here: the paced default and the measured scheduler.

A fixed token budget (vLLM's max_num_batched_tokens, scheduler="fcfs") is right for one machine, model and load at
best. PacedBudget (scheduler="paced", the default) keeps the running streams' steps near a decode step's time, from
the step times the engine measures as it runs (see the class). MeasuredBudget (scheduler="measured") asks a fitted
cost model (lumen.engine.costs.steps) what each candidate step would cost and decides:

with SLO targets (slo_ttft_s, slo_tpot_s): the decodes that run this step each have a budget: the longest step
    that keeps their mean time per output token within slo_tpot (their tokens so far times the target, minus the
    time since their first token); the step may take as long as the tightest of those (never less than one
    target TPOT). Prefill tokens (running prefills first, then the waiting requests) ride along in the largest
    chunk whose predicted step time fits that limit. When nothing is decoding, or the oldest waiting request
    would miss its TTFT at that pace while it still can make it, the chunk grows to what its deadline needs.
    A request that cannot make its TTFT any more does not set the pace. Admission: no more requests run at once
    than can decode together within the TPOT target (predicted), so a load beyond what meets the targets waits
    in the queue instead of making every running request miss them.
without targets: the most tokens per second a step can do: the largest chunk (up to max_num_batched_tokens).

Every decision is kept (`Decision`) with the predicted cost, the alternative it rejected and why, and, after the
step, the measured cost: `Engine(explain=True)` / `lumen.serve --explain` logs them one line per step.
"""
from __future__ import annotations

from dataclasses import dataclass

CHUNKS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


@dataclass
class Decision:
    decodes: int
    budget: int                  # tokens this step may take
    predicted_s: float
    limit_s: float | None        # the decodes' step-time limit (None: no target or no decodes)
    rejected: str                # the alternative turned down, and why
    measured_s: float | None = None
    max_running: int | None = None   # admit no request past this many running (None: max_num_seqs)

    def line(self, step: int) -> str:
        meas = "" if self.measured_s is None else f", measured {self.measured_s * 1e3:.1f} ms"
        lim = "" if self.limit_s is None else f" (limit {self.limit_s * 1e3:.1f} ms)"
        cap = "" if self.max_running is None else f", at most {self.max_running} running"
        return (f"step {step}: {self.decodes} decodes, budget {self.budget} tokens{cap} -> predicted "
                f"{self.predicted_s * 1e3:.1f} ms{lim}{meas}; rejected {self.rejected}")


class MeasuredBudget:
    def __init__(self, cost_model, *, max_tokens: int, slo_ttft_s: float | None = None,
                 slo_tpot_s: float | None = None):
        """cost_model: what predicts a step's seconds from its shape (lumen.engine.costs.steps.CostModel)."""
        self.cost_model = cost_model
        self.max_tokens = max_tokens
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s

    def decide(self, scheduler, now: float) -> Decision:
        running = scheduler.running
        decoding = [s for s in running if s.num_tokens - s.num_computed == 1]
        D = len(decoding)
        K_d = sum(s.num_tokens for s in decoding)
        S = min(len(running) + len(scheduler.waiting), scheduler.max_num_seqs)
        prefill_left = sum(s.num_tokens - s.num_computed for s in running if s.num_tokens - s.num_computed > 1)
        prefill_left += sum(s.num_tokens for s in scheduler.waiting)
        room = max(0, self.max_tokens - D)
        most = min(room, prefill_left)
        cands = [0] + [c for c in CHUNKS if c < most] + ([most] if most > 0 else [])
        cost = lambda c: self.cost_model.predict(D + c, S, K_d + c * (c + 1) // 2)  # noqa: E731 (chunk at its start)
        if self.slo_tpot_s is None and self.slo_ttft_s is None or prefill_left == 0:
            c = cands[-1]
            return Decision(D, D + c, cost(c), None, "nothing: no target, the most tokens per step" if prefill_left
                            else "nothing: no prefill waiting")
        limit = cap = None
        if self.slo_tpot_s is not None:
            k_avg = K_d / D if D else 0.0
            cap = 1                               # the most sequences that decode together within the target
            while cap < scheduler.max_num_seqs and self.cost_model.predict(cap + 1, cap + 1, k_avg * (cap + 1)) \
                    <= self.slo_tpot_s:
                cap += 1
        if D and self.slo_tpot_s is not None:
            budgets = [self.slo_tpot_s * max(1, len(s.output_ids))
                       - (0.0 if s.metrics.first_token is None else now - s.metrics.first_token) for s in decoding]
            limit = max(self.slo_tpot_s, min(budgets))
        fits = [c for c in cands if limit is None or cost(c) <= limit] or [0]
        c = fits[-1]                              # cands ascend, cost grows with c
        why = "nothing larger" if c == cands[-1] else \
            f"chunk {cands[cands.index(c) + 1]} (predicted {cost(cands[cands.index(c) + 1]) * 1e3:.1f} ms > limit)"
        urgent = self._urgent(scheduler, now) if self.slo_ttft_s is not None else None
        if urgent is not None and c < cands[-1]:
            need, left = urgent                   # prefill tokens before its first token, seconds to its deadline
            steps = -(-need // max(c, 1)) if c else float("inf")
            if steps * cost(c) > left:            # at this pace it misses its TTFT: the smallest chunk that makes it
                for c2 in cands:
                    if c2 > c and -(-need // c2) * cost(c2) <= left:
                        why = f"chunk {c} (the oldest waiting request would miss its TTFT)"
                        c = c2
                        break
        return Decision(D, D + c, cost(c), limit, why, max_running=cap)

    def _urgent(self, scheduler, now: float):
        """(prefill tokens left, seconds to its TTFT deadline) of the oldest request still able to make it."""
        cands = [s for s in scheduler.running if s.metrics.first_token is None] + list(scheduler.waiting)
        cands.sort(key=lambda s: s.metrics.arrival)
        for s in cands:
            left = s.metrics.arrival + self.slo_ttft_s - now
            need = s.num_tokens - s.num_computed
            if left > self.cost_model.predict(min(need, self.max_tokens), 1, need):
                return need, left
        return None


class PacedBudget:
    """The default: keep every running stream's step near a decode step's time, and spread prompts over steps.

    A prompt chunk rides along with the running decodes only as far as the step's predicted time stays within `pace`
    times (or SLACK_S more than, whichever is more) what a step of those decodes alone costs (StepCosts: every
    step's wall time by token count, as measured while serving) at the concurrency about to run (the decodes plus
    the prompts in flight and queued, up to max_num_seqs); at least MIN_CHUNK tokens a step, so a new request always
    gets going, and the whole budget (max_num_batched_tokens) when nothing decodes. So a long prompt costs the
    streams a bounded slowdown per token for more steps, instead of one stall as long as its prefill. Before step
    times are known for the sizes it needs, it takes MIN_CHUNK (the steps that follow measure the rest)."""
    MIN_CHUNK = 16
    SLACK_S = 0.02      # a step may always take this much longer than the decodes alone: on a small model, where a
    #                     decode step is a few ms, pace x that would cut prompts into chunks whose per-step cost
    #                     (scheduling, sampling) outweighs them; 20 ms more per token is not a stall anyone sees

    def __init__(self, costs, *, max_tokens: int, pace: float = 1.5):
        """costs: the engine's StepCosts (lumen.engine.costs.steps)."""
        self.costs, self.max_tokens, self.pace = costs, max_tokens, pace

    def decide(self, scheduler, now: float) -> Decision:
        running = scheduler.running
        D = sum(1 for s in running if s.num_tokens - s.num_computed == 1)
        prefill_left = sum(s.num_tokens - s.num_computed for s in running if s.num_tokens - s.num_computed > 1)
        prefill_left += sum(s.num_tokens for s in scheduler.waiting)
        if D == 0 or prefill_left == 0:
            why = "nothing: no decode to pace" if prefill_left else "nothing: no prefill waiting"
            return Decision(D, self.max_tokens, self.costs.predict(self.max_tokens) or 0.0, None, why)
        room = max(0, self.max_tokens - D)
        smallest = min(self.MIN_CHUNK, room)
        # the decodes the server is about to run: those running now and every prompt in flight or queued (they
        # decode once prefilled), up to max_num_seqs; pacing by the few running at a wave's start would keep the
        # chunks at the minimum, the queue long and the batch small
        soon = min(scheduler.max_num_seqs, D + sum(1 for s in running if s.num_tokens - s.num_computed > 1)
                   + len(scheduler.waiting))
        alone = self.costs.at_most(soon)        # one slow small step must not widen the limit for every step
        if alone is None:
            return Decision(D, D + smallest, 0.0, None, "larger chunks: no step time measured yet")
        limit = max(self.pace * alone, alone + self.SLACK_S)
        most = min(room, prefill_left)
        c, why = smallest, "nothing larger"
        for cand in [x for x in CHUNKS if smallest < x < most] + ([most] if most > smallest else []):
            p = self.costs.at_least(D + cand)
            if p is None or p > limit:
                why = f"chunk {cand} " + ("(not measured)" if p is None else f"(predicted {p * 1e3:.1f} ms > limit)")
                break
            c = cand
        return Decision(D, D + c, self.costs.at_least(D + c) or 0.0, limit, why)
