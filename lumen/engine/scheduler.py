"""Which tokens run this step (vLLM V1's scheduler, in Lumen's words).

One token budget per step (max_num_batched_tokens) and at most max_num_seqs sequences holding blocks:
1. Running sequences first, oldest first: each takes what it still needs (one decode token, the next chunk of
   its prompt, or 1 + k when the speculator drafted tokens for it: k_for(seq, room, planned) says how many of
   them pay in the room the budget leaves, at its place in this step), capped by what is left of the budget and by
   the pool's free blocks (drafted tokens never preempt anyone). When the pool has no block for it, the newest
   running sequence is preempted (its blocks freed, back to the front of the queue, nothing it generated lost:
   it is recomputed when readmitted), until it fits or is itself preempted.
2. Then waiting sequences, first come first served, while budget and sequence slots last: a prefix-cache hit
   turns its prefill into an extend (never over prompt tokens whose logprobs it wants: Sequence.cacheable); a
   long prompt is cut into chunks across steps (chunked prefill). A waiting sequence that does not fit is not
   skipped over (FCFS). Without chunked prefill a prompt runs whole, unless it is longer than
   max_num_batched_tokens.
A step's plan is a list of `Scheduled`; after the forward pass `computed` advances each sequence by what was
computed. The KV blocks are reached only through the block manager's API (admit, grow, computed, free).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class Scheduled:
    seq: Sequence
    start: int                 # first position computed this step (== seq.num_computed)
    n: int                     # tokens of seq.tokens computed this step
    row: int                   # its block-table row
    k: int = 0                 # room reserved for speculative tokens: they run after the n and are verified

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last known token, so its logits give the next one."""
        return self.start + self.n == self.seq.num_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True, connector=None):
        """connector: a lumen.engine.kv_transfer.KVConnector (KV received from a prefill engine counts as computed)."""
        self.blocks = blocks
        self.connector = connector
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

    def step_budget(self, budget: int | None) -> int:
        """This step's token budget: `budget` (a measured decision) capped by max_num_batched_tokens."""
        return self.budget if budget is None else min(budget, self.budget)

    # ---- the plan of one step
    def schedule(self, budget: int | None = None, k_for=None, max_running: int | None = None) -> list[Scheduled]:
        """budget: this step's token budget (default max_num_batched_tokens); max_running: admit waiting requests
        only while fewer run (default max_num_seqs); k_for(seq, room, planned): how many drafted tokens a decoding
        sequence runs after its own (Scheduled.k), given the room the budget leaves and the tokens planned before
        it (the speculator answers; None: no speculation)."""
        budget = self.step_budget(budget)
        bm = self.blocks
        plan: list[Scheduled] = []
        i = planned = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            left = seq.num_tokens - seq.num_computed
            n = min(left, budget)
            if n < left and not self._chunks(left):
                i += 1
                continue
            k = max(0, min(k_for(seq, budget - 1, planned), budget - 1)) if k_for is not None and left == 1 else 0
            while k and not bm.can_grow(seq.request_id, seq.num_computed + n + k):
                k -= 1                               # drafted tokens never cost another request its blocks
            while not bm.grow(seq.request_id, seq.num_computed + n + k):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:     # preempted itself: nothing more fits
                break
            plan.append(Scheduled(seq, seq.num_computed, n, bm.row(seq.request_id), k))
            budget -= n + k
            planned += n + k
            i += 1
        cap = self.max_num_seqs if max_running is None else min(max_running, self.max_num_seqs)
        while self.waiting and budget > 0 and len(self.running) < cap:
            seq = self.waiting[0]
            hit = bm.cached_prefix(seq.tokens, seq.cacheable)   # the last token is always computed
            start = hit.n_tokens if seq.kv_data is None else self.connector.num_external_tokens(seq, hit)
            n = min(seq.num_tokens - start, budget)
            if n < seq.num_tokens - start and not self._chunks(seq.num_tokens - start):
                break
            if not bm.admit(seq.request_id, hit, start + n, n_query=seq.num_tokens):
                break
            self.waiting.popleft()
            if seq.kv_data is not None:
                self.connector.after_alloc(seq, hit, start)
            seq.num_computed = start
            if seq.metrics.first_scheduled is None:
                seq.metrics.cached_tokens = hit.n_tokens      # (KV received from a prefill engine is not)
                seq.metrics.first_scheduled = time.perf_counter()    # the queue time ends here
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.append(Scheduled(seq, start, n, bm.row(seq.request_id)))
            budget -= n
        return plan

    def _chunks(self, left: int) -> bool:
        """Whether `left` tokens may run in chunks: always with chunked prefill; without it, only when they are
        more than max_num_batched_tokens (they could never run whole, and would block the queue forever)."""
        return self.chunked_prefill or left > self.budget

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and put it back at the front of the queue; it is recomputed later."""
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str | None, now: float) -> None:
        """Take the sequence out of the queues, free its blocks at once and mark it finished."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)
        seq.finish(reason, now)

    # ---- after the forward pass
    def computed(self, s: Scheduled, n_accepted: int = 0) -> None:
        """The step computed s.n tokens of s.seq (+ n_accepted of its draft, now in seq.tokens): advance it; the
        block manager names its newly full blocks and takes back those of rejected draft tokens."""
        seq = s.seq
        seq.num_computed = s.start + s.n + n_accepted
        self.blocks.computed(seq.request_id, seq.tokens, seq.num_computed)
