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

import time
from dataclasses import dataclass, field

import numpy as np

from ...kernels.attention import BLOCK
from ...kernels.layout import C_DOUT, C_FAM, C_G, C_NIN, C_QT, C_T, F32, R, q_len, s_len
from ..costs.steps import StepCosts
from ..block_manager import BlockManager, CachedPrefix
from ...model.parts import ModelParts
from ..runner import Runner
from ..sequence import Status
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
    hits: float = PRIOR                             # accepted drafts per verification (exponential average)
    judged: float = 1.0                             # drafts judged per verification: accepted + the first rejected
    judged_n: dict = field(default_factory=dict)    # the n-gram drafter: n -> (hits, judged) per match length n
    matched: tuple = (-1, None)                     # (tokens, n) of the last match: k's choice and the draft share it
    misses: dict = field(default_factory=dict)      # n (0: the draft model) -> verifications in a row none accepted
    steps: int = 0                                  # verification steps
    proposed: int = 0
    accepted: int = 0

    @property
    def alpha(self) -> float:
        """The draft model's per-token acceptance rate estimate: hits / judged."""
        return self.hits / self.judged

    def alpha_of(self, n: int) -> float:
        """The n-gram drafter's estimate for match length n."""
        h, j = self.of_length(n)
        return h / j

    def of_length(self, n: int) -> tuple[float, float]:
        """(hits, judged) of match length n; for a length never verified, the request's other lengths' pooled with
        PRIOR (weighing as one verification): text whose drafts keep failing expects little of a new length too."""
        if n in self.judged_n:
            return self.judged_n[n]
        hs, js = PRIOR, 1.0
        for h, j in self.judged_n.values():
            hs, js = hs + h, js + j
        return hs / js, 1.0


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
    tokens up to `done[seq]`: it takes the prompt beside the target's prefill (`prefill`), and catches up (the
    tokens it lacks run in its first draft forward, a long gap in prefill chunks before) as it drafts. Drafts of
    all requests are made together: one batched forward per drafted position. Every forward's time is kept by shape
    (`costs`), which the speculator prices k with.

    vocab: the draft's output head computes the logits of the first `vocab` token ids only (the tiles of the
    head's rows are contiguous, so this is a prefix of its packed matrix; BPE vocabularies put the frequent
    tokens first): the draft then never proposes a token past them, which verification treats like any other
    wrong draft (lossless), and its head, 37% of a 0.5B model's bytes at 152k tokens, reads a fraction."""
    name = "draft"
    FOLD = 8                                        # a gap of up to this many tokens rides in the first forward
    CONFIDENCE = 0.4                                # a greedy draft stops after a token it gives less than this

    @staticmethod
    def check_vocabulary(parts: ModelParts, n_vocab: int, tokens: list | None = None) -> None:
        """ValueError unless the draft model's parts speak the target's vocabulary (its size and token texts)."""
        if parts.config.n_vocab != n_vocab:
            raise ValueError(f"the draft model's vocabulary has {parts.config.n_vocab} tokens, the target's "
                             f"{n_vocab}: they must share one")
        if tokens is not None and parts.tokenizer.tokens != tokens:
            i = next(i for i, (a, b) in enumerate(zip(parts.tokenizer.tokens, tokens)) if a != b)
            raise ValueError(f"the draft model's vocabulary differs from the target's: token {i} is "
                             f"{parts.tokenizer.tokens[i]!r} in the draft, {tokens[i]!r} in the target; they must "
                             f"share one")

    def __init__(self, parts: ModelParts, *, n_vocab: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, threads: int, governor=None, vocab: int | None = None,
                 target_bytes: int | None = None, tokens: list | None = None):
        """parts: the draft model's; n_vocab: the target's vocabulary size and tokens its token texts (they must
        agree: a draft speaking another vocabulary of the same size would only ever be rejected); the sizes are the
        engine's; governor: the engine runner's (one thread count for the engine's steps); vocab: the token ids
        the draft's head computes (None: all); target_bytes: what a target step reads (the prior of the draft's
        cost until its steps are measured)."""
        self.check_vocabulary(parts, n_vocab, tokens)
        self.parts = parts
        w = parts.bundle
        self.vocab = n_vocab if vocab is None or vocab >= n_vocab else -(-vocab // R) * R
        if self.vocab < n_vocab:
            w = prefix_head(w, self.vocab)
        max_blocks = -(-max_model_len // BLOCK)
        rows = max_num_seqs
        self.max_tokens = max(max_num_batched_tokens, rows * (self.FOLD + 1), rows * 16)
        self.runner = Runner(parts.config, w, parts.rope_freqs, n_blocks=rows * max_blocks,
                             max_tokens=self.max_tokens, max_rows=rows, max_blocks=max_blocks, n_threads=threads)
        if governor is not None:
            self.runner.governor = governor
        self.logits = np.full((rows, n_vocab), -np.inf, np.float32)    # past `vocab`: never written, -inf
        self.blocks = BlockManager(rows * max_blocks, self.runner.table, prefix_caching=False)
        self.done: dict = {}                         # seq -> tokens of it in the draft's cache
        self.costs = StepCosts()                     # the draft's forward steps, by (rows, tokens)
        self.confidence = self.CONFIDENCE
        draft_bytes = step_bytes(w)
        self.cost_ratio = draft_bytes / target_bytes if target_bytes else 0.5

    def forget(self, seq) -> None:
        """seq ended: its row and blocks go back to the pool (the speculator calls this, from the stepping
        thread)."""
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
        t0 = time.perf_counter()
        out = r.forward(i, len(rows) if sample else 1, self.logits)
        self.costs.add(i, time.perf_counter() - t0, len(items))
        return out

    def _admit(self, seq) -> bool:
        """Give seq a row of the draft's pool; False when every row is held. Waiting requests take free rows to
        prefill their prompts, and preempted ones keep theirs. A request that samples a token drafted for (one the
        target runs, or a preempted one, which samples again when readmitted) takes the row of one that does not
        (a waiting prompt, whose first token is a plain draw, or one that ended) when none is free: there are as
        many rows as requests can run or wait preempted, so each of them drafts, and a seeded one samples the same
        tokens whatever waits beside it (drafts depend on the tokens alone: the other only prefills again)."""
        if seq not in self.done:
            if not self.blocks.admit(seq, CachedPrefix([], [], 0), 0):
                idle = next((q for q in reversed(self.done) if not _samples(q)), None) if _samples(seq) else None
                if idle is None:
                    return False
                self.forget(idle)
                if not self.blocks.admit(seq, CachedPrefix([], [], 0), 0):
                    return False
            self.done[seq] = 0
        return True

    def prefill(self, seqs: list) -> None:
        """Catch the draft's cache up on the prompts of requests the target is prefilling, one forward of at most
        max_tokens tokens a step (so the draft's prompt is processed beside the target's, not in the first
        decode step), up to the FOLD tokens the first draft forward takes."""
        items, room = [], self.max_tokens
        for seq in seqs:
            if room <= 0 or not self._admit(seq):
                continue
            n = min(len(seq.tokens) - 1 - self.FOLD - self.done[seq], room)
            if n > 0 and self.blocks.can_grow(seq, self.done[seq] + n):
                items.append((seq, seq.tokens[self.done[seq]:self.done[seq] + n]))
                room -= n
        if items:
            self._forward(items, sample=False)

    def propose(self, requests: list) -> dict:
        """requests: [(seq, k)] -> {seq: Draft}: the draft's own tokens, drawn with the request's sampler and a
        uniform keyed by its position (DRAFT use), their distributions kept for verification. A greedy request's
        draft stops after a token the draft itself gives less than `confidence` (the drafts after a likely wrong
        one cost a draft step and a verification row each, for little). A long gap in the
        draft's cache is first filled in prefill chunks; the last FOLD tokens of a gap and the pending token run in
        the first draft forward; then each drafted position is one batched forward of every request still
        drafting."""
        active = []
        for seq, k in requests:
            if not self._admit(seq):
                continue
            self.done[seq] = min(self.done[seq], len(seq.tokens) - 1)   # past the tokens the draft agrees with
            if not self.blocks.can_grow(seq, len(seq.tokens) + k):
                continue                             # no room in the draft's pool: no draft this step
            active.append((seq, k))
        while True:                                  # catch up, but for the tokens the first draft forward takes
            items, room = [], self.max_tokens
            for seq, _ in active:
                n = min(len(seq.tokens) - 1 - self.FOLD - self.done[seq], room)
                if n > 0:
                    items.append((seq, seq.tokens[self.done[seq]:self.done[seq] + n]))
                    room -= n
            if not items:
                break
            self._forward(items, sample=False)
        drafts = {seq: ([], []) for seq, _ in active}
        unsure: set = set()                          # greedy requests whose last draft token was a guess
        for step in range(max((k for _, k in active), default=0)):
            items = [(seq, seq.tokens[self.done[seq]:] if step == 0 else [drafts[seq][0][-1]])
                     for seq, k in active if step < k and seq not in unsure]
            if not items:
                break
            logits = self._forward(items, sample=True)
            for j, (seq, _) in enumerate(items):
                ch = seq.chooser
                x = ch.process(logits[j], seq.tokens + drafts[seq][0], len(seq.output_ids) + step)
                if ch.sampler.greedy:
                    t, q = ch.sampler.pick(x, 0.0), None
                    head = x[:self.vocab]
                    if 1.0 / np.exp(head - head[t]).sum() < self.confidence:
                        unsure.add(seq)              # the next drafts would follow a likely wrong one
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


def _samples(seq) -> bool:
    """Whether seq may sample a token with a draft: it runs, or it was preempted after its first token."""
    return seq.status is Status.RUNNING or (seq.status is Status.WAITING and bool(seq.output_ids))


def prefix_head(w, n: int):
    """The Weights bundle w with an output head of its first n rows (n a multiple of the tile height R): a table
    row of its own over the same packed bytes (the buffers are shared, nothing is copied)."""
    pk = w.packs
    row = pk.table[w.output].copy()
    row[C_T], row[C_DOUT] = n // R, n
    packs = pk._replace(table=np.vstack([pk.table, row[None]]))
    return w._replace(packs=packs, output=pk.table.shape[0])


def step_bytes(w) -> int:
    """Bytes of packed weights a decode step reads: every matrix but the token embedding (read a row a token),
    unless it is the output head too (tied)."""
    t = w.packs.table
    used = {int(x) for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
            for x in getattr(w, name)} | {int(w.output)}
    total = 0
    for i in used:
        fam, T, G, n_in, qt = (int(t[i, c]) for c in (C_FAM, C_T, C_G, C_NIN, C_QT))
        total += q_len(fam, T, G, n_in) * (4 if fam == F32 else 1) + s_len(qt, T, G)
    return total
