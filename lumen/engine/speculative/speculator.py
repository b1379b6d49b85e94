"""The speculator: one object that drafts before the step is scheduled and verifies after its forward pass.

    offers = speculator.propose(running, waiting)        before scheduling: drafts, {seq: most k worth running}
    plan = scheduler.schedule(budget, k_for)             the scheduler, the one owner of the step's token budget,
                                                         asks k_for(seq, room, planned) as it plans each decode
    tokens = speculator.draft_tokens(seq, k)             what the runner runs after the request's pending token
    toks, accepted = speculator.verify(seq, k, rows)     after the forward pass: the tokens it keeps
    speculator.accepted(seq, k, accepted)                the acceptance bookkeeping
    speculator.finish(seq)                               it ended: its drafts and draft-model row go

Adaptive k (`choose_k`): per request (and for the n-gram drafter per match length), an estimate of its per-token
acceptance rate alpha (accepted drafts over the drafts judged: the accepted ones and the first rejected one, each an
exponential average); the expected tokens of a step with k drafts, (1 - alpha^(k+1)) / (1 - alpha), against what the
step costs: the target's step time the engine measured for that shape, (rows, tokens + k)
(lumen.engine.costs.steps.StepCosts), plus for a draft model k of its own forward steps (measured the same way by
the draft, or until then priced by the bytes it reads against the target's) and the tokens its cache lacks, which
its first forward runs, spread over the next PAYBACK tokens (every later draft needs them); k = 0 (plain decode)
unless some k beats plain decode by MARGIN. A greedy draft-model request weighs the n-gram lookup the same way (free
drafts, their own acceptance per match length) and drafts with whichever pays more that step. `propose` drafts as
many tokens as pay in a step of the decodes ahead of the request; `k_for` prices k again at the place the scheduler
actually gives it, within the room its budget leaves, so k is always chosen against the step that runs. A sampled
request also gets the draft's token for the position after its verified ones (and for a position it samples without
drafting), which verify decides by the acceptance rule.
"""
from __future__ import annotations

import time

from ..sampling.sampler import SamplerError
from ..config import SpeculativeConfig
from ..sequence import Sequence
from ..costs.steps import StepCosts
from .drafters import PRIOR, DraftModel, NgramDrafter, SpecState
from .verify import verify

RECOVER = 0.02       # per skipped chance, an estimate judged not to pay moves this share back to PRIOR, halved for
                     # each verification in a row that accepted nothing (each way back to drafting costs a failed
                     # verification: at 0.05 n-gram drafting read 0.91-0.97x on free chat, every match length
                     # probing again every ~7 chances; at 0.02 without halving, 0.96x at 1.5B, where a 2-row step
                     # costs 1.25x a 1-row one)
EXPLORE = 2          # drafts per verification while no step cost is measured (a process's first steps): enough
                     # for the costs of 1 and 1 + EXPLORE tokens to price every k; at k_max, each run of free chat
                     # paid its first verifications of 5 wrong drafts
MARGIN = 1.03        # drafting must promise this many times plain decode's tokens per second: at the break-even
                     # the estimate's noise makes it lose (free chat 0.95x at 1.5B without it)
WEIGHT = 0.3         # an n-gram estimate's step towards each verification: a match length's drafts are few and
                     # uneven, and text turns predictable and back within a few lines
DRAFT_WEIGHT = 0.1   # the draft model's: its acceptance holds steady along a text (one pair of models), and at 0.3
                     # one rejected first draft took it from 0.7 to 0.49, below what paid at the 0.5B's cost for
                     # the 1.5B; the request's n-gram lookup then drafted, so the model was never judged again
PAYBACK = 32         # tokens a draft model's catch-up is priced over (or the request's tokens left, if fewer): the
                     # tokens its cache lacks run once and every later draft needs them; charged whole to one step,
                     # the prompt's last FOLD tokens (11 ms for the 0.5B against a 33 ms 1.5B step) kept a second
                     # request from drafting, the lag grew by a token a step, and the model never drafted again


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, costs: StepCosts, draft: DraftModel | None = None):
        self.k_max = cfg.num_speculative_tokens
        self.adaptive_k = cfg.adaptive_k
        self.ngram = NgramDrafter(cfg.ngram_min, cfg.ngram_max)
        self.draft = draft
        self.costs = costs
        self.verify_rule = verify             # (row, draft, k, key, pos, sampler) -> (tokens, accepted)
        self._drafts: dict = {}               # seq -> (its token count when drafted, k asked, Draft)
        self._step: dict = {}                 # seq -> Draft, this step's
        self._rows = 1                        # sequences in the step being planned (the shape priced)
        self._drafting = 1                    # requests the draft model drafts for in it (its rows)
        self._source: dict = {}               # seq -> "ngram" | "draft": what drafts for it this step
        self.draft_s = 0.0                    # seconds the draft model spent this step (not the target's step)

    def admit(self, seq: Sequence) -> None:
        """A new request: its speculation state (None when it does not speculate, or never could: the first token
        is a plain draw and drafts never run past max_tokens, so max_tokens 1, or 2 for a greedy request (a sampled
        one gets the draft's token for its second), leaves nothing to draft, and the draft model no prompt)."""
        if seq.params.speculative == "draft" and self.draft is None:
            raise SamplerError("speculative \"draft\" needs a draft model, and none was loaded (lumen serve "
                               "--draft-model M, or Engine(..., draft_model=M))", param="speculative")
        can = seq.max_tokens > 2 or (seq.max_tokens == 2 and not seq.chooser.sampler.greedy)
        seq.spec = SpecState() if seq.params.speculative is not None and can else None

    def finish(self, seq: Sequence) -> None:
        """seq ended (stop, length, error, abort): drop its drafts and give back its draft-model row and blocks.
        The stepping thread only (the draft model may be mid-forward for it otherwise): an abort from another
        thread is swept by the next propose, which the abort's own output brings about."""
        self._drafts.pop(seq, None)
        self._source.pop(seq, None)
        if self.draft is not None:
            self.draft.forget(seq)

    # ---- before scheduling
    def propose(self, running: list, waiting) -> dict:
        """Draft for the speculating requests that may sample next step; returns {seq: k}, the most drafted tokens
        each could run (the scheduler decides how many do: k_for). A decode is priced in a step of the decodes
        ahead of it. A preempted request recomputing its tokens gets the one token a sampled request decides by
        the acceptance rule. A request's first token is always a plain draw, as when its prompt runs whole: none
        is drafted after a prompt whose last chunk is its last token alone."""
        self.draft_s = 0.0
        for seq in [q for q in {*self._drafts, *self._source, *(self.draft.done if self.draft else ())}
                    if q.finished]:                         # aborted from another thread since the last step
            self.finish(seq)
        if not any(seq.spec is not None for seq in [*running, *waiting]):
            self._step = {}
            return {}
        want, ahead = [], 0
        self._rows = max(1, len(running))
        self._drafting = max(1, sum(1 for s in running if s.spec is not None and s.params.speculative == "draft"
                                    and s.num_tokens - s.num_computed == 1))
        self._source = {}
        for seq in running:
            left = seq.num_tokens - seq.num_computed
            k = 0
            if seq.spec is not None and left == 1 and seq.output_ids:      # (the first token: a plain draw)
                room = seq.max_tokens - len(seq.output_ids) - 1
                k = self._choose_k(seq, room, ahead) if room > 0 else 0
            if left == 1:
                ahead += 1 + k
            extra = int(seq.spec is not None and self._extra(seq))
            if k or extra:
                want.append((seq, k, k + extra))
        want += [(seq, 0, 1) for seq in waiting if seq.spec is not None and self._extra(seq)]
        self._step = self._propose([(seq, asked) for seq, _, asked in want])
        prompts = [seq for seq in [*running, *waiting] if seq.spec is not None and seq.params.speculative == "draft"
                   and seq.num_tokens - seq.num_computed > 1]
        if prompts:                                                 # their prompts, beside the target's prefill
            t0 = time.perf_counter()
            self.draft.prefill(prompts)
            self.draft_s += time.perf_counter() - t0
        return {seq: min(k, len(self._step[seq].tokens)) for seq, k, _ in want if k and seq in self._step}

    def k_for(self, seq: Sequence, offered: int, room: int, planned: int) -> int:
        """How many of its `offered` drafted tokens seq runs in the step being planned: `room` is what the budget
        leaves after its own token, `planned` the tokens planned before it. Priced as propose prices, without
        touching the request's state."""
        k_max = min(offered, room)
        if k_max <= 0:
            return 0
        return self._best_k(seq, k_max, planned, self.source(seq))[0] if self.adaptive_k else k_max

    @staticmethod
    def _extra(seq: Sequence) -> bool:
        return not seq.chooser.sampler.greedy and bool(seq.output_ids)

    def _propose(self, requests: list) -> dict:
        """{seq: Draft} for [(seq, k)], from the drafts already made for the same tokens where they suffice."""
        out, todo = {}, {"ngram": [], "draft": []}
        for seq, k in requests:
            made = self._drafts.get(seq)
            source = self.source(seq)
            if made is not None and made[0] == seq.num_tokens and made[1] >= k and made[3] == source:
                if made[2] is not None:                     # (None: the drafter had nothing for these tokens)
                    out[seq] = made[2]
            else:
                todo[source].append((seq, k))
        got = self.ngram.propose(todo["ngram"]) if todo["ngram"] else {}
        if todo["draft"]:
            t0 = time.perf_counter()
            got.update(self.draft.propose(todo["draft"]))
            self.draft_s += time.perf_counter() - t0
        for seq, k in todo["ngram"] + todo["draft"]:
            self._drafts[seq] = (seq.num_tokens, k, got.get(seq), self.source(seq))
            if seq in got:
                out[seq] = got[seq]
        return out

    def source(self, seq: Sequence) -> str:
        """What drafts for seq this step: its own drafter, or for a draft-model request the n-gram lookup when
        that was priced higher (_best_k)."""
        return self._source.get(seq, seq.params.speculative)

    def _choose_k(self, seq: Sequence, room: int, planned: int) -> int:
        """Drafted tokens for a decoding sequence: k with the most expected tokens per second of step time, by
        its acceptance rate and the measured costs (0: plain decode pays more). An estimate judged not to pay
        drifts back towards the prior (skipped): per match length for the n-gram lookup, per request for a draft
        model."""
        k_max = min(room, seq.params.num_speculative_tokens or self.k_max)
        if seq.params.speculative == "ngram" and self.ngram.match(seq.spec, seq.tokens) is None:
            return 0                                                # nothing to draft from
        if not self.adaptive_k:
            return k_max
        k, source, priced = self._best_k(seq, k_max, planned)
        self._source[seq] = source
        if k == 0:
            for n in priced:
                skipped(seq.spec, n)
        return k

    def _best_k(self, seq: Sequence, k_max: int, planned: int, source: str | None = None
                ) -> tuple[int, str, list]:
        """(the k in 0 .. k_max with the most tokens per second after `planned` tokens, the drafter it drafts
        with, the estimates it weighed: n-gram match lengths, 0 for the draft model); no side effects. A greedy
        draft-model request weighs the n-gram lookup too when it has a match (its drafts cost no model step; a
        sampled one keeps to its draft model, so its tokens do not depend on which drafted); `source` prices
        that drafter only."""
        st = seq.spec
        hybrid = seq.params.speculative == "draft" and seq.chooser.sampler.greedy
        sources = [source] if source else ["ngram", "draft"] if hybrid else [seq.params.speculative]
        base, rows = planned + 1, self._rows
        c0 = self.step_cost(base, rows)
        best, priced = (0, seq.params.speculative, 0.0), []
        for src in sources:
            if src == "ngram":
                n = self.ngram.match(st, seq.tokens)
                if n is None:
                    continue
                alpha = st.alpha_of(n)
            else:
                n, alpha = 0, st.alpha
            if c0 is None or self.costs.predict(base + k_max, rows) is None:   # nothing measured: explore
                k = 0 if st.steps % 8 == 7 and not self.costs.known(base, rows) else min(k_max, EXPLORE)
                return k, src if len(sources) == 1 else seq.params.speculative, []
            per_draft, gap = (self.draft_cost(c0), self.draft_gap(seq, c0)) if src == "draft" else (0.0, 0.0)
            share = gap / max(1, min(PAYBACK, seq.max_tokens - len(seq.output_ids)))     # of a token's catch-up
            cost = lambda j: ((self.step_cost(base + j, rows) or c0) + j * per_draft  # noqa: E731
                              + (share * expected_tokens(alpha, j) if j else 0))
            k = choose_k(alpha, k_max, cost)
            rate = expected_tokens(alpha, k) / cost(k) if k else 0.0
            priced.append(n)
            if rate > best[2]:
                best = (k, src, rate)
        return best[0], best[1], priced

    def step_cost(self, n_tokens: int, rows: int) -> float | None:
        """The target's predicted step of n_tokens over `rows` sequences, no more than any larger step measured
        (StepCosts.at_most): a first decode step's outlier (cold caches) would otherwise price plain decode high
        for as long as drafting kept it from being measured again."""
        p, cap = self.costs.predict(n_tokens, rows), self.costs.at_most(n_tokens)
        return p if cap is None else cap if p is None else min(p, cap)

    def draft_cost(self, c0: float) -> float:
        """Seconds one drafted token of a request costs the draft model: a draft forward step of the requests it
        drafts for, shared among them (measured; before any is, the target's step c0 scaled by the bytes the
        draft reads against the target's)."""
        b = self._drafting
        t = self.draft.costs.predict(b, b)
        return (c0 * self.draft.cost_ratio if t is None else t) / b

    def draft_gap(self, seq: Sequence, c0: float) -> float:
        """Seconds the draft model's first forward for seq costs beyond one token: the tokens its cache lacks (made
        while seq did not draft), measured by the draft's steps of that many tokens; before any is, a token's
        drafting cost per FOLD of them."""
        n = len(seq.tokens) - 1 - self.draft.done.get(seq, 0)
        if n <= 0:
            return 0.0
        t1, tn = self.draft.costs.predict(1, 1), self.draft.costs.predict(n + 1, 1)
        if t1 is None or tn is None:
            return self.draft_cost(c0) * n / self.draft.FOLD
        return max(0.0, tn - t1)

    # ---- after the forward pass
    def drafted(self, seq: Sequence, k: int) -> bool:
        """Whether seq's sampled token is decided by verify: it runs k > 0 drafted tokens, or it samples and has
        a draft token for that position (decided by the acceptance rule)."""
        return seq in self._step and (k > 0 or (self._extra(seq) and len(self._step[seq].tokens) > 0))

    def draft_tokens(self, seq: Sequence, k: int) -> list:
        return self._step[seq].tokens[:k] if k else []

    def verify(self, seq: Sequence, k: int, rows) -> tuple[list, int]:
        """(tokens, drafts accepted) of seq, which ran k drafted tokens: rows(i) gives the processed logits of
        its i-th verified position."""
        ch = seq.chooser
        return self.verify_rule(rows, self._step[seq], k, ch.key, seq.num_tokens, ch.sampler)

    def accepted(self, seq: Sequence, k: int, accepted: int) -> None:
        """Fold one verification of k drafted tokens, `accepted` of them kept, into the request's state."""
        update_alpha(seq.spec, k, accepted, n=self._step[seq].n)
        m = seq.metrics
        m.spec_proposed += k
        m.spec_accepted += accepted
        m.spec_steps += 1


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verification step yields with k drafts at acceptance rate alpha (the bonus token included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def choose_k(alpha: float, k_max: int, cost, margin: float = MARGIN) -> int:
    """The k in 0 .. k_max with the most tokens per second, by cost(extra tokens) = the step's predicted time; k > 0
    only when its rate beats plain decode's by `margin`."""
    best, best_rate = 0, margin / cost(0)
    for k in range(1, k_max + 1):
        rate = expected_tokens(alpha, k) / cost(k)
        if rate > best_rate * 1.0001:
            best, best_rate = k, rate
    return best


def update_alpha(st: SpecState, proposed: int, accepted: int, weight: float | None = None, n: int = 0) -> None:
    """Fold one verification into the acceptance estimate of what drafted: the n-gram lookup's of match length n,
    or (n = 0) the draft model's. The per-token acceptance rate alpha is estimated as accepted drafts over drafts
    judged: the accepted ones and the first rejected one (the drafts after it were never judged), each an
    exponential average (weight: WEIGHT, or DRAFT_WEIGHT for the draft model). (Accepted over proposed would read
    a rate of 0.8 as 0.54 at k = 5.)"""
    if weight is None:
        weight = WEIGHT if n else DRAFT_WEIGHT
    if proposed:
        st.misses[n] = 0 if accepted else st.misses.get(n, 0) + 1
        judged = accepted + (accepted < proposed)
        if not n:
            st.hits = (1 - weight) * st.hits + weight * accepted
            st.judged = (1 - weight) * st.judged + weight * judged
        else:
            h, j = st.of_length(n)
            st.judged_n[n] = ((1 - weight) * h + weight * accepted, (1 - weight) * j + weight * judged)
        st.steps += 1
        st.proposed += proposed
        st.accepted += accepted


def skipped(st: SpecState, n: int) -> None:
    """A request (n = 0) or its match of length n was not drafted (its acceptance did not pay): the estimate
    drifts back towards the prior, so a request whose text turns predictable again gets to draft again (without
    drafting, the estimate would never be corrected), the more slowly the more verifications in a row accepted
    nothing (on text that never turns predictable, the failed verifications are then a vanishing share)."""
    rate = RECOVER / 2 ** min(st.misses.get(n, 0), 8)
    if n:
        h, j = st.of_length(n)
        st.judged_n[n] = (h + rate * (PRIOR * j - h), j)
    else:
        st.hits += rate * (PRIOR * st.judged - st.hits)
