"""The KV cache's block pool: which blocks are free, which sequence holds which, and which full blocks hold
which tokens (prefix caching).

A block holds BLOCK tokens' K and V in every layer (lumen.kernels.attention). Each running sequence owns a row of
the block table (`table[row, i]` = the block holding its tokens i*BLOCK .. i*BLOCK+BLOCK-1), written here as
blocks are allocated, so the forward pass reads block tables without any per-step copying.

Prefix caching: a full block is named by a digest of (its parent block's digest, its token ids), so equal names
mean equal token prefixes, and, because Lumen's attention is batch-invariant, bit-identical K/V. A block is
named once all its tokens are computed. Blocks are shared through reference counts. A block whose count drops to
0 goes to the end of the free queue but keeps its name: a later request with that prefix takes it back (a hit);
allocation takes blocks from the front of the queue, and a named block taken that way forgets its name (an
eviction). So freed cached blocks are evicted least recently freed first.

The scheduler reaches the pool through a small API keyed by request id (vLLM V1's KVCacheManager:
get_computed_blocks / allocate_slots), and never sees its tables:
    hit = bm.cached_prefix(tokens, limit)     the cached blocks of a waiting request's prefix (a CachedPrefix)
    bm.admit(rid, hit, n_tokens)              give it a row, the hit's blocks and room for n_tokens; False: no room
    bm.grow(rid, n_tokens)                    room for n_tokens in all; False: no room (the caller preempts)
    bm.can_grow(rid, n_tokens)                whether grow would succeed
    bm.computed(rid, tokens, n_computed)      name its newly full blocks, return blocks past what it holds
    bm.free(rid)                              give everything back
    bm.row(rid)                               its block-table row, for the runner
    bm.pin(key, blocks) / bm.unpin(key)       hold blocks without a row (a finished request's KV kept for a
                                              transfer, lumen.engine.kv_transfer), and give them back
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..kernels.attention import BLOCK


def block_digest(parent: bytes, tokens) -> bytes:
    """The name of a full block: sha256 over its parent's name and its token ids (int64, little-endian)."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<i8").tobytes()).digest()


class CachedPrefix(NamedTuple):
    """The cached blocks holding a prefix of a request's tokens (not yet taken), and how many tokens they hold."""
    blocks: list
    names: list
    n_tokens: int


@dataclass
class _Held:
    """What one request holds: its block-table row, its blocks' count and how many are named (the last name
    chains the next)."""
    row: int
    n_held: int = 0
    n_named: int = 0
    last_name: bytes = b""


class BlockManager:
    def __init__(self, n_blocks: int, table: np.ndarray, *, prefix_caching: bool = True):
        """n_blocks: the pool's size; table (rows, max_blocks) int64: the block tables the forward pass reads."""
        if n_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {n_blocks}")
        self.n_blocks = n_blocks                     # the pool's size
        self.table = table                           # (rows, max_blocks) i8
        self.prefix_caching = prefix_caching
        self._refs = [0] * n_blocks
        self._name_of: list[bytes | None] = [None] * n_blocks
        self.by_name: dict[bytes, int] = {}          # read by the Ray router's cache-aware routing
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_blocks))   # front = next to allocate
        self._free_rows = list(range(table.shape[0] - 1, -1, -1))                   # pop() -> lowest row
        self._held: dict[object, _Held] = {}
        self._pinned: dict[object, list[int]] = {}   # key -> blocks held without a row (pin)
        self.hit_tokens = 0                          # prompt tokens served from the cache
        self.query_tokens = 0                        # prompt tokens looked up
        self.evictions = 0

    # ---- accounting
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of the pool held by sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.n_blocks

    @staticmethod
    def blocks_for(n_tokens: int) -> int:
        return -(-n_tokens // BLOCK)

    def row(self, rid) -> int:
        return self._held[rid].row

    def held(self, rid) -> list[int]:
        """The blocks the request holds, in order."""
        h = self._held[rid]
        return [int(b) for b in self.table[h.row, :h.n_held]]

    # ---- the API
    def cached_prefix(self, tokens, limit: int) -> CachedPrefix:
        """Cached blocks holding tokens[0 : k*BLOCK] for the largest k with k*BLOCK <= limit, in order."""
        blocks, names, parent = [], [], b""
        if self.prefix_caching:
            for i in range(limit // BLOCK):
                name = block_digest(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
                b = self.by_name.get(name)
                if b is None:
                    break
                blocks.append(b)
                names.append(name)
                parent = name
        return CachedPrefix(blocks, names, len(blocks) * BLOCK)

    def admit(self, rid, hit: CachedPrefix, n_tokens: int, n_query: int = 0) -> bool:
        """Give request rid a row, the blocks of its cached prefix `hit` and room for n_tokens tokens in all;
        False (nothing changed) when the pool has no room. n_query: its prompt tokens (the hit-rate counters)."""
        need = self.blocks_for(n_tokens) - len(hit.blocks)
        if need + sum(1 for b in hit.blocks if self._refs[b] == 0) > len(self._free) or not self._free_rows:
            return False
        h = self._held[rid] = _Held(self._free_rows.pop(), len(hit.blocks), len(hit.blocks),
                                    hit.names[-1] if hit.names else b"")
        for i, b in enumerate(hit.blocks):
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1
            self.table[h.row, i] = b
        self._allocate(h, need)
        self.query_tokens += n_query
        self.hit_tokens += hit.n_tokens
        return True

    def grow(self, rid, n_tokens: int) -> bool:
        """Room for n_tokens tokens in all; False (nothing changed) when the pool has too few free blocks."""
        h = self._held[rid]
        need = self.blocks_for(n_tokens) - h.n_held
        if need > len(self._free):
            return False
        self._allocate(h, need)
        return True

    def can_grow(self, rid, n_tokens: int) -> bool:
        """Whether grow(rid, n_tokens) would succeed."""
        return self.blocks_for(n_tokens) - self._held[rid].n_held <= len(self._free)

    def computed(self, rid, tokens, n_computed: int) -> None:
        """tokens[:n_computed] are in the cache: name the full blocks among them (prefix caching) and return the
        blocks past max(n_computed, len(tokens)) (room reserved for draft tokens that were rejected)."""
        h = self._held[rid]
        keep = self.blocks_for(max(n_computed, len(tokens)))
        if keep < h.n_held:
            self._release(h, keep)
        if not self.prefix_caching:
            return
        parent = h.last_name
        for i in range(h.n_named, n_computed // BLOCK):
            name = block_digest(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
            b = int(self.table[h.row, i])
            if name not in self.by_name and self._name_of[b] is None:
                self.by_name[name] = b
                self._name_of[b] = name
            parent = name
            h.n_named = i + 1
        h.last_name = parent

    def free(self, rid) -> None:
        """Give back everything request rid holds (no-op when it holds nothing)."""
        h = self._held.pop(rid, None)
        if h is not None:
            self._release(h, 0)
            self._free_rows.append(h.row)
            self._free_rows.sort(reverse=True)

    def pin(self, key, blocks) -> None:
        """Hold `blocks` (already held by someone, e.g. a request about to be freed) under `key`, with no row."""
        if key in self._pinned:
            raise ValueError(f"{key!r} already pins blocks")
        blocks = [int(b) for b in blocks]
        for b in blocks:
            if self._refs[b] == 0:
                raise ValueError(f"block {b} is free: only held blocks can be pinned")
            self._refs[b] += 1
        self._pinned[key] = blocks

    def unpin(self, key) -> None:
        """Give back the blocks pinned under `key` (no-op when none), last first as _release does."""
        for b in reversed(self._pinned.pop(key, [])):
            self._drop(b)

    @property
    def num_pinned(self) -> int:
        return sum(len(b) for b in self._pinned.values())

    # ---- the pool
    def _allocate(self, h: _Held, n: int) -> None:
        for i in range(h.n_held, h.n_held + n):
            b, _ = self._free.popitem(last=False)
            name = self._name_of[b]
            if name is not None:                     # a cached block: evicted now
                del self.by_name[name]
                self._name_of[b] = None
                self.evictions += 1
            self._refs[b] = 1
            self.table[h.row, i] = b
        h.n_held += max(n, 0)

    def _release(self, h: _Held, keep: int) -> None:
        """Drop the blocks keep .. n_held-1, last first, so that a cached prefix's early blocks are evicted last."""
        for i in range(h.n_held - 1, keep - 1, -1):
            self._drop(int(self.table[h.row, i]))
        h.n_held = keep
        h.n_named = min(h.n_named, keep)

    def _drop(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            self._free[b] = None
            if self._name_of[b] is None:
                self._free.move_to_end(b, last=False)  # unnamed: nothing to keep, reuse first
                                                        # named: reusable by a hit until evicted

    def check(self) -> None:
        """Internal consistency (tests): free blocks have no holder, names map both ways, holders add up."""
        assert all(self._refs[b] == 0 for b in self._free), "a free block is held"
        assert sum(1 for r in self._refs if r == 0) == len(self._free), "a block with no holder is not free"
        for name, b in self.by_name.items():
            assert self._name_of[b] == name, "name tables disagree"
        counts = [0] * self.n_blocks
        for h in self._held.values():
            for b in self.table[h.row, :h.n_held]:
                counts[int(b)] += 1
        for blocks in self._pinned.values():
            for b in blocks:
                counts[b] += 1
        assert counts == self._refs, "reference counts disagree with the holders"
