"""The drafters, behind one interface (`propose([(seq, k)]) -> {seq: Draft}`), and a request's speculation state.

NgramDrafter   prompt lookup: the last n tokens (n from n_max down to n_min) matched against the prompt and the
               output so far; what followed the most recent match is proposed, one token at a time
DraftModel     a second GGUF model with the target's vocabulary, run by its own runner and block pool (the
               engine's machinery), batched over the requests that speculate
Each proposed token is a function of the tokens before it alone (the n-gram lookup, or the draft model's token at
that position with a uniform keyed by request and position), so what a seeded request samples does not depend on
how many tokens were drafted at once, and a draft made for a request's tokens stays valid while they do not change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...kernels.attention import BLOCK
from ..block_manager import BlockManager, CachedPrefix
from ...model.parts import ModelParts
from ..runner import Runner
from ..sampling.sampler import DRAFT, uniform
from .verify import draw

PRIOR = 0.7          # the acceptance rate assumed before any is measured


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

    def __init__(self, parts: ModelParts, *, n_vocab: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, threads: int, governor=None):
        """parts: the draft model's; n_vocab: the target's vocabulary (they must agree); the sizes are the
        engine's; governor: the engine runner's (one thread count for the engine's steps)."""
        if parts.config.n_vocab != n_vocab:
            raise ValueError(f"the draft model's vocabulary has {parts.config.n_vocab} tokens, the target's "
                             f"{n_vocab}: they must share one")
        self.parts = parts
        max_blocks = -(-max_model_len // BLOCK)
        rows = max_num_seqs
        self.max_tokens = max(max_num_batched_tokens, rows * 16)
        self.runner = Runner(parts.config, parts.bundle, parts.rope_freqs, n_blocks=rows * max_blocks,
                             max_tokens=self.max_tokens, max_rows=rows, max_blocks=max_blocks, n_threads=threads)
        if governor is not None:
            self.runner.governor = governor
        self.blocks = BlockManager(rows * max_blocks, self.runner.table, prefix_caching=False)
        self.done: dict = {}                         # seq -> tokens of it in the draft's cache

    def forget(self, seq) -> None:
        if self.done.pop(seq, None) is not None:
            self.blocks.free(seq)

    def _forward(self, items: list, sample: bool):
        """One draft forward over items [(seq, tokens)]; the last row of each is sampled when asked."""
        r, i, rows = self.runner, 0, []
        for seq, toks in items:
            start = self.done[seq]
            self.blocks.grow(seq, start + len(toks))
            i = r.set_tokens(i, toks, start, self.blocks.row(seq))
            self.done[seq] = start + len(toks)
            rows.append(i - 1)
        r.set_out_rows(rows if sample else rows[-1:])
        return r.forward(i, len(rows) if sample else 1)

    def propose(self, requests: list) -> dict:
        """requests: [(seq, k)] -> {seq: Draft}: the draft's own tokens, drawn with the request's sampler and a
        uniform keyed by its position (DRAFT use), their distributions kept for verification. The draft's cache
        first catches up with the request's tokens (prefill chunks), then each drafted position is one batched
        forward of every request still drafting."""
        for seq in [q for q in self.done if q.finished]:
            self.forget(seq)
        active = []
        for seq, k in requests:
            if seq not in self.done:
                if not self.blocks.admit(seq, CachedPrefix([], [], 0), 0):
                    continue                         # every row is held (preempted requests keep theirs)
                self.done[seq] = 0
            self.done[seq] = min(self.done[seq], len(seq.tokens) - 1)   # past the tokens the draft agrees with
            if not self.blocks.can_grow(seq, len(seq.tokens) + k):
                continue                             # no room in the draft's pool: no draft this step
            active.append((seq, k))
        while True:                                  # catch up, everything but the pending token
            items, room = [], self.max_tokens
            for seq, _ in active:
                n = min(len(seq.tokens) - 1 - self.done[seq], room)
                if n > 0:
                    items.append((seq, seq.tokens[self.done[seq]:self.done[seq] + n]))
                    room -= n
            if not items:
                break
            self._forward(items, sample=False)
        drafts = {seq: ([], []) for seq, _ in active}
        for step in range(max((k for _, k in active), default=0)):
            items = [(seq, [seq.tokens[-1]] if step == 0 else [drafts[seq][0][-1]])
                     for seq, k in active if step < k]
            logits = self._forward(items, sample=True)
            for j, (seq, _) in enumerate(items):
                ch = seq.chooser
                x = ch.process(logits[j], seq.tokens + drafts[seq][0], len(seq.output_ids) + step)
                if ch.sampler.greedy:
                    t, q = ch.sampler.pick(x, 0.0), None
                else:
                    ids, p = ch.sampler.distribution(x)
                    t, q = draw(ids, p, uniform(ch.key, len(seq.tokens) + step, DRAFT)), (ids, p)
                drafts[seq][0].append(t)
                drafts[seq][1].append(q)
        out = {}
        for seq, _ in active:
            toks, qs = drafts[seq]
            if toks:
                out[seq] = Draft(toks, None if all(q is None for q in qs) else qs)
        return out
