"""Which tokens run this step (vLLM V1's scheduler, in Lumen's words).

One token budget per step (max_num_batched_tokens) and at most max_num_seqs sequences holding blocks:
1. Running sequences first, oldest first: each takes what it still needs (one decode token, the next chunk of
   its prompt, or 1 + k for speculative verification), capped by what is left of the budget. When the pool has
   no block for it, the newest running sequence is preempted (its blocks freed, back to the front of the
   queue, nothing it generated lost: it is recomputed when readmitted), until it fits or is itself preempted.
2. Then waiting sequences, first come first served, while budget and sequence slots last: a prefix-cache hit
   turns its prefill into an extend; a long prompt is cut into chunks across steps (chunked prefill). A waiting
   sequence that does not fit is not skipped over (FCFS).
A step's plan is a list of `Scheduled`; `postprocess` then advances each sequence by what was computed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..kernels.attention import BLOCK
from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    start: int                 # first position computed this step (== seq.num_computed)
    n: int                     # tokens of seq.tokens computed this step
    k: int = 0                 # room reserved for speculative tokens
    draft: list = field(default_factory=list)   # the drafted tokens (<= k), run after them and verified
    q: list | None = None      # the draft's distributions, per drafted token (None: point masses)
    proposal: object = None    # the drafter's lumen.engine.speculative.Draft (may hold one more token than draft)

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last known token, so its logits give the next one."""
        return self.start + self.n == self.seq.num_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the plan of one step
    def schedule(self, budget: int | None = None, speculate=None, max_running: int | None = None) -> list[Scheduled]:
        """budget: this step's token budget (default max_num_batched_tokens); max_running: admit waiting requests
        only while fewer run (default max_num_seqs). speculate(seq, room, planned) -> how
        many tokens (<= room) to draft for a decoding sequence that speculates, given the tokens planned so far;
        room for them is reserved (Scheduled.k) and the drafts are filled in after scheduling."""
        budget = self.budget if budget is None else min(budget, self.budget)
        start_budget = budget
        bm = self.blocks
        plan: list[Scheduled] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n < seq.num_tokens - seq.num_computed and not self.chunked_prefill:
                i += 1
                continue
            k = 0
            if speculate is not None and seq.spec is not None and n == 1 and seq.num_tokens - seq.num_computed == 1:
                room = min(budget - 1, seq.max_tokens - len(seq.output_ids) - 1)
                k = speculate(seq, room, start_budget - budget) if room > 0 else 0
            need = bm.blocks_for(seq.num_computed + n + k) - seq.n_blocks
            while need > 0 and not bm.can_allocate(need):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:     # preempted itself: nothing more fits
                break
            if need > 0:
                bm.allocate(seq.row, seq.n_blocks, seq.n_blocks + need)
                seq.n_blocks += need
            plan.append(Scheduled(seq, seq.num_computed, n, k))
            budget -= n + k
            i += 1
        cap = self.max_num_seqs if max_running is None else min(max_running, self.max_num_seqs)
        while self.waiting and budget > 0 and len(self.running) < cap:
            seq = self.waiting[0]
            cached = bm.match_prefix(seq.tokens, seq.num_tokens - 1)   # the last token is always computed
            start = len(cached) * BLOCK
            n = min(seq.num_tokens - start, budget)
            if n < seq.num_tokens - start and not self.chunked_prefill:
                break
            need = bm.blocks_for(start + n) - len(cached)
            if need + sum(1 for b in cached if bm.refs[b] == 0) > bm.num_free:
                break
            self.waiting.popleft()
            seq.row = bm.take_row()
            bm.take_cached(cached, seq.row)
            bm.allocate(seq.row, len(cached), len(cached) + need)
            seq.n_blocks = len(cached) + need
            seq.num_computed = start
            seq.n_named = len(cached)
            seq.last_name = bm.name_of[cached[-1]] if cached else b""
            if seq.metrics.first_scheduled is None:
                seq.metrics.cached_tokens = start
            bm.query_tokens += seq.num_tokens
            bm.hit_tokens += start
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.append(Scheduled(seq, start, n))
            budget -= n
        return plan

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and put it back at the front of the queue; it is recomputed later."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.row >= 0:
            self.blocks.release(seq.row, seq.n_blocks)
            self.blocks.give_row(seq.row)
        seq.row, seq.n_blocks, seq.n_named, seq.last_name = -1, 0, 0, b""

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Take the sequence out of the queues and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        if reason is not None:
            seq.finish_reason = reason

    # ---- after the forward pass
    def computed(self, s: Scheduled, n_accepted: int = 0) -> None:
        """The step computed s.n tokens of s.seq (+ n_accepted of its draft, now in seq.tokens): advance it and
        name its newly full blocks; blocks past what it holds now are returned (rejected draft tokens)."""
        seq = s.seq
        seq.num_computed = s.start + s.n + n_accepted
        keep = self.blocks.blocks_for(max(seq.num_computed, seq.num_tokens))
        if keep < seq.n_blocks:
            self.blocks.release(seq.row, seq.n_blocks, keep)
            seq.n_blocks = keep
        seq.n_named, seq.last_name = self.blocks.name_full_blocks(seq.row, seq.tokens, seq.n_named,
                                                                  seq.num_computed, seq.last_name)
