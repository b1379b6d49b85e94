"""Speculative decoding: a drafter proposes up to k tokens for a request, and one forward pass of the target
verifies them all (the engine runs the request's pending token and its drafts as k + 1 rows of its batch).

Drafters, behind one interface (`propose(seqs_and_room) -> {seq: Draft}`):
    NgramDrafter     prompt lookup: the last n tokens (n from n_max down to n_min) matched against the prompt and
                     the output so far; what followed the most recent match is proposed, one token at a time
    DraftModel       a second GGUF model with the target's vocabulary, run by its own runner and block pool
                     (the engine's machinery), batched over the requests that speculate
Each proposed token is a function of the tokens before it alone (the n-gram lookup, or the draft model's
token at that position with a uniform keyed by request and position), so what a seeded request samples does
not depend on how many tokens were drafted at once.

Verification (`verify`), per position i = 0 .. k of the k + 1 logits rows:
    greedy       accept draft i while it equals the target's argmax; the first mismatch emits the target's token,
                 and if all k are accepted the target's next token is emitted too. The target's logits are the
                 bits plain decoding computes (batch invariance), so the output is bit-identical to it.
    sampling     the rule of Leviathan et al. and Chen et al.: accept draft d with probability min(1, p(d) / q(d));
                 on rejection emit a token drawn from the residual max(0, p - q) / Z and stop; after k
                 acceptances draw the next token from p. The output distribution equals the target's.
Rejected tokens' KV entries are dropped: the sequence's computed length stops at its accepted tokens and the
blocks past it are freed (lumen.engine.scheduler.Scheduler.computed).

Adaptive k (`choose_k`): per request (and for the n-gram drafter per match length), an exponential average of
its acceptance rate alpha; the expected tokens of
a step with k drafts, (1 - alpha^(k+1)) / (1 - alpha), against the step time the engine measured for that many
more tokens (lumen.engine.costs.StepCosts); k = 0 (plain decode) when speculation does not pay.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling import ACCEPT, PICK, RESIDUAL, uniform

PRIOR = 0.7          # the acceptance rate assumed before any is measured
RECOVER = 0.05       # per skipped chance, an n whose drafts were judged not to pay moves this share back to PRIOR
RULES = ("exact", "accept_all", "no_residual")   # the last two are wrong on purpose: the statistical test's foils


@dataclass
class Draft:
    tokens: list                                    # proposed ids
    q: list | None = None                           # per token: (ids or None, probs) the draft drew from; None: a
                                                    # point mass on the token (the n-gram drafter)
    n: int = 0                                      # the n-gram drafter: length of the match the draft follows


@dataclass
class SpecState:
    """One request's speculation: its drafter's index, its acceptance average, its counts."""
    index: dict = field(default_factory=dict)       # n -> {ngram tuple: position after its last occurrence}
    indexed: int = 0                                # tokens indexed so far
    alpha: float = PRIOR                            # acceptance rate estimate (exponential average)
    alpha_n: dict = field(default_factory=dict)     # the n-gram drafter: the same, per match length n (from PRIOR)
    matched: tuple = (-1, None)                     # (tokens, n) of the last match: k's choice and the draft share it
    steps: int = 0                                  # verification steps
    proposed: int = 0
    accepted: int = 0


# ---------------------------------------------------------------- drafters

class NgramDrafter:
    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 4):
        if not 1 <= n_min <= n_max <= 16:
            raise ValueError(f"ngram sizes must satisfy 1 <= n_min <= n_max <= 16, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max

    def _update(self, st: SpecState, tokens: list) -> None:
        """Index every n-gram that a known token follows: key -> position of that token (latest wins)."""
        for n in range(self.n_min, self.n_max + 1):
            st.index.setdefault(n, {})
        L = len(tokens)
        for e in range(max(st.indexed, self.n_min), L):     # n-grams ending just before position e
            for n in range(self.n_min, min(self.n_max, e) + 1):
                st.index[n][tuple(tokens[e - n:e])] = e
        st.indexed = max(st.indexed, L)

    def match(self, st: SpecState, tokens: list) -> int | None:
        """The length n of the longest suffix of tokens that occurred before (None: nothing to draft). A long
        match is a far better draft than a short one (code and quoting: about 0.8 of the tokens after a 4-token
        match are accepted, 0.3 after a 1- or 2-token match), so the acceptance rate is kept per n. A request's
        tokens only grow, so the match of a length is computed once (the engine asks when it picks k, the draft
        again)."""
        if st.matched[0] == len(tokens):
            return st.matched[1]
        self._update(st, tokens)
        found = None
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            if tuple(tokens[-n:]) in st.index[n]:
                found = n
                break
        st.matched = (len(tokens), found)
        return found

    def next_token(self, st: SpecState, tokens: list, tail: list, overlay: dict) -> int | None:
        """What followed the most recent occurrence of the longest matching suffix of tokens + tail among the
        n-grams of tokens + tail (overlay: those that end inside the tail), so a token proposed at a position
        depends on the tokens before it and nothing else."""
        ctx = (tokens[-self.n_max:] + tail)[-self.n_max:]
        for n in range(min(self.n_max, len(ctx)), self.n_min - 1, -1):
            key = tuple(ctx[-n:])
            e = overlay.get((n, key))
            if e is not None:
                return tail[e - len(tokens)]
            e = st.index[n].get(key)
            if e is not None:
                return tokens[e] if e < len(tokens) else tail[e - len(tokens)]
        return None

    def propose(self, requests: list) -> dict:
        """requests: [(seq, k)] -> {seq: Draft}; a sequence with no match gets no draft."""
        out = {}
        for seq, k in requests:
            st = seq.spec
            tokens = seq.tokens
            n_match = self.match(st, tokens)
            tail: list = []
            overlay: dict = {}
            while len(tail) < k:
                t = self.next_token(st, tokens, tail, overlay)
                if t is None:
                    break
                e = len(tokens) + len(tail)              # t's position; index the n-grams it follows
                ctx = (tokens[-self.n_max:] + tail)[-self.n_max:]
                for n in range(self.n_min, min(self.n_max, len(ctx)) + 1):
                    overlay[(n, tuple(ctx[-n:]))] = e
                tail.append(t)
            if tail:
                out[seq] = Draft(tail, n=n_match or 0)
        return out


class DraftModel:
    """A second model with the target's vocabulary, run by its own runner (the engine's forward pass) over its
    own block pool. Each speculating request has a row of its block table; the draft's cache holds the request's
    tokens up to `done[seq]`, and catches up (prefill of the new tokens) before drafting. Drafts of all requests
    are made together: one batched forward per drafted position."""
    name = "draft"

    def __init__(self, model, engine, *, threads: int):
        from ..kernels.attention import BLOCK
        from .block_manager import BlockManager
        from .llm import Model, load_parts
        from .runner import Runner
        parts = model.parts if isinstance(model, Model) else load_parts(model)
        if parts.config.n_vocab != engine.config.n_vocab:
            raise ValueError(f"the draft model's vocabulary has {parts.config.n_vocab} tokens, the target's "
                             f"{engine.config.n_vocab}: they must share one")
        self.parts = parts
        max_blocks = -(-engine.max_model_len // BLOCK)
        rows = engine.max_num_seqs
        self.max_tokens = max(engine.max_num_batched_tokens, rows * 16)
        self.runner = Runner(parts.config, parts.bundle, parts.rope_freqs, n_blocks=rows * max_blocks,
                             max_tokens=self.max_tokens, max_rows=rows, max_blocks=max_blocks, n_threads=threads)
        self.runner.governor = engine.runner.governor          # one thread count for the engine's steps
        self.blocks = BlockManager(rows * max_blocks, self.runner.table, prefix_caching=False)
        self.state: dict = {}                        # seq -> [row, n_blocks, done]

    def forget(self, seq) -> None:
        st = self.state.pop(seq, None)
        if st is not None:
            self.blocks.release(st[0], st[1])
            self.blocks.give_row(st[0])

    def _forward(self, items: list, sample: bool):
        """One draft forward over items [(seq, state, tokens)]; the last row of each is sampled when asked."""
        r, i, rows = self.runner, 0, []
        for seq, st, toks in items:
            need = self.blocks.blocks_for(st[2] + len(toks)) - st[1]
            if need > 0:
                self.blocks.allocate(st[0], st[1], st[1] + need)
                st[1] += need
            i = r.set_tokens(i, toks, st[2], st[0])
            st[2] += len(toks)
            rows.append(i - 1)
        r.set_out_rows(rows if sample else rows[-1:])
        return r.forward(i, len(rows) if sample else 1)

    def propose(self, requests: list) -> dict:
        """requests: [(seq, k)] -> {seq: Draft}: the draft's own tokens, drawn with the request's sampler and a
        uniform keyed by its position (DRAFT use), their distributions kept for verification. The draft's cache
        first catches up with the request's tokens (prefill chunks), then each drafted position is one batched
        forward of every request still drafting."""
        from .sampling import DRAFT
        for seq in [q for q in self.state if q.finished]:
            self.forget(seq)
        active = []
        for seq, k in requests:
            st = self.state.get(seq)
            if st is None:
                st = self.state[seq] = [self.blocks.take_row(), 0, 0]
            st[2] = min(st[2], len(seq.tokens) - 1)  # past the tokens the draft agrees with: stale
            if self.blocks.blocks_for(len(seq.tokens) + k) - st[1] > self.blocks.num_free:
                continue                             # no room in the draft's pool: no draft this step
            active.append((seq, k, st))
        while True:                                  # catch up, everything but the pending token
            items, room = [], self.max_tokens
            for seq, _, st in active:
                n = min(len(seq.tokens) - 1 - st[2], room)
                if n > 0:
                    items.append((seq, st, seq.tokens[st[2]:st[2] + n]))
                    room -= n
            if not items:
                break
            self._forward(items, sample=False)
        drafts = {seq: ([], []) for seq, _, _ in active}
        for step in range(max((k for _, k, _ in active), default=0)):
            items = [(seq, st, [seq.tokens[-1]] if step == 0 else [drafts[seq][0][-1]])
                     for seq, k, st in active if step < k]
            logits = self._forward(items, sample=True)
            for j, (seq, st, _) in enumerate(items):
                ch = seq.chooser
                x = ch.process(logits[j], seq.tokens + drafts[seq][0], len(seq.output_ids) + step)
                if ch.sampler.greedy:
                    t, q = ch.sampler.pick(x, 0.0), None
                else:
                    ids, p = ch.sampler.distribution(x)
                    t, q = _draw(ids, p, uniform(ch.key, len(seq.tokens) + step, DRAFT)), (ids, p)
                drafts[seq][0].append(t)
                drafts[seq][1].append(q)
        out = {}
        for seq, _, st in active:
            toks, qs = drafts[seq]
            if toks:
                out[seq] = Draft(toks, None if all(q is None for q in qs) else qs)
        return out


# ---------------------------------------------------------------- verification

def verify(row, draft: Draft, k: int, key: int, pos: int, sampler, rule: str = "exact") -> tuple[list, int]:
    """(emitted tokens, drafts accepted) of one request whose next position is pos, k of whose drafted tokens
    the target ran: row(i) gives the processed logits of its i-th verified position (the drafts before i
    accepted), i = 0 .. k. draft.tokens may hold one more token than k, the draft's token for position k: a
    sampled request then decides that position by the same acceptance rule, so every position's token is the
    same function of the draft and the keyed uniforms whether the target verified it in this step or not
    (without a draft token there, the plain draw). `sampler` is its lumen.engine.sampler.Sampler; uniforms are
    keyed by (key, position, use)."""
    emitted: list = []
    for i in range(k + 1):
        x = row(i)
        if sampler.greedy:
            t = sampler.pick(x, 0.0)
            emitted.append(t)
            if i == k or draft.tokens[i] != t:
                return emitted, i
            continue
        ids, p = sampler.distribution(x)
        if i >= len(draft.tokens):                   # no draft token for this position: the plain draw
            emitted.append(_draw(ids, p, uniform(key, pos + i, PICK)))
            return emitted, i
        d = draft.tokens[i]
        p_d = _prob(ids, p, d)
        q_ids, q = (None, None) if draft.q is None else draft.q[i]
        q_d = 1.0 if q is None else _prob(q_ids, q, d)
        u = uniform(key, pos + i, ACCEPT)
        if rule == "accept_all" or (rule == "exact" and u * q_d < p_d) or (rule == "no_residual" and q_d <= p_d):
            emitted.append(d)
            if i == k:                               # the draft's token for the position after the verified ones
                return emitted, k
            continue
        if rule == "no_residual":                     # wrong on purpose: a fresh draw from p, not the residual
            emitted.append(_draw(ids, p, uniform(key, pos + i, RESIDUAL)))
            return emitted, min(i, k)
        r_ids, r = _residual(ids, p, q_ids, q, d)
        emitted.append(_draw(r_ids, r, uniform(key, pos + i, RESIDUAL)))
        return emitted, min(i, k)
    raise AssertionError("unreachable")


def _prob(ids: np.ndarray | None, p: np.ndarray, t: int) -> float:
    if ids is None:
        return float(p[t]) if 0 <= t < p.size else 0.0
    hit = np.flatnonzero(ids == t)
    return float(p[hit[0]]) if hit.size else 0.0


def _residual(ids, p, q_ids, q, d) -> tuple[np.ndarray | None, np.ndarray]:
    """max(0, p - q), over p's support (q is zero elsewhere by the sign); q None: a point mass on d."""
    r = p.copy()
    if q is None:
        where = np.flatnonzero(ids == d) if ids is not None else np.array([d])
        r[where] = 0.0
    else:
        dense_q = _dense(q_ids, q, ids, p.size)
        r = np.maximum(r - dense_q, 0.0)
    s = r.sum()
    if s <= 0.0:                                     # p == q: the draft was certain to be accepted
        return ids, p
    return ids, r / s


def _dense(q_ids, q, ids, n) -> np.ndarray:
    """q laid over p's support: ids (n,) token ids (None: the whole vocabulary, n = V)."""
    if ids is None:
        out = np.zeros(n)
        if q_ids is None:
            out[:q.size] = q
        else:
            out[q_ids] = q
        return out
    qmap = dict(zip(range(q.size), q)) if q_ids is None else dict(zip(q_ids.tolist(), q.tolist()))
    return np.array([qmap.get(int(t), 0.0) for t in ids])


def _draw(ids, p, u: float) -> int:
    c = np.cumsum(p)
    i = min(int(np.searchsorted(c, u * c[-1], side="right")), p.size - 1)
    while p[i] == 0.0 and i > 0:
        i -= 1
    return i if ids is None else int(ids[i])


# ---------------------------------------------------------------- adaptive k

def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verification step yields with k drafts at acceptance rate alpha (the bonus token included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def choose_k(alpha: float, k_max: int, cost) -> int:
    """The k in 0 .. k_max with the most tokens per second, by cost(extra tokens) = the step's predicted time."""
    best, best_rate = 0, 1.0 / cost(0)
    for k in range(1, k_max + 1):
        rate = expected_tokens(alpha, k) / cost(k)
        if rate > best_rate * 1.0001:
            best, best_rate = k, rate
    return best


def update_alpha(st: SpecState, proposed: int, accepted: int, weight: float = 0.3, n: int = 0) -> None:
    """Fold one verification into the acceptance average (the share of proposed tokens accepted), and into that
    of match length n when the draft followed an n-token match."""
    if proposed:
        st.alpha = (1 - weight) * st.alpha + weight * (accepted / proposed)
        if n:
            st.alpha_n[n] = (1 - weight) * st.alpha_n.get(n, PRIOR) + weight * (accepted / proposed)
        st.steps += 1
        st.proposed += proposed
        st.accepted += accepted


def skipped(st: SpecState, n: int) -> None:
    """A match of length n was not drafted (its acceptance did not pay): its estimate drifts back towards the
    prior, so a request whose text turns to copying again gets to draft again (without drafting, the estimate
    would never be corrected)."""
    a = st.alpha_n.get(n, PRIOR)
    st.alpha_n[n] = a + RECOVER * (PRIOR - a)
