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
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..kernels.attention import BLOCK


def block_digest(parent: bytes, tokens) -> bytes:
    """The name of a full block: sha256 over its parent's name and its token ids (int64, little-endian)."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<i8").tobytes()).digest()


class BlockManager:
    def __init__(self, n_blocks: int, table: np.ndarray, *, prefix_caching: bool = True):
        """n_blocks: the pool's size; table (rows, max_blocks) int64: the block tables the forward pass reads."""
        if n_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {n_blocks}")
        self.n_blocks = n_blocks
        self.table = table                           # (rows, max_blocks) i8
        self.prefix_caching = prefix_caching
        self.refs = [0] * n_blocks
        self.name_of: list[bytes | None] = [None] * n_blocks
        self.by_name: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n_blocks))   # front = next to allocate
        self.free_rows = list(range(table.shape[0] - 1, -1, -1))                   # pop() -> lowest row
        self.hit_tokens = 0                          # prompt tokens served from the cache
        self.query_tokens = 0                        # prompt tokens looked up
        self.evictions = 0

    # ---- accounting
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Share of the pool held by sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.n_blocks

    @property
    def max_blocks_per_seq(self) -> int:
        return self.table.shape[1]

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // BLOCK)

    # ---- a sequence's blocks
    def take_row(self) -> int:
        return self.free_rows.pop()

    def give_row(self, row: int) -> None:
        self.free_rows.append(row)
        self.free_rows.sort(reverse=True)

    def match_prefix(self, tokens, limit: int) -> list[int]:
        """Cached blocks holding tokens[0 : k*BLOCK] for the largest k with k*BLOCK <= limit, in order (not yet
        taken: call `take_cached`)."""
        if not self.prefix_caching:
            return []
        out, parent = [], b""
        for i in range(limit // BLOCK):
            name = block_digest(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
            b = self.by_name.get(name)
            if b is None:
                break
            out.append(b)
            parent = name
        return out

    def take_cached(self, blocks: list[int], row: int) -> None:
        """Give the cached blocks (from match_prefix) to the sequence in `row`, as its first blocks."""
        for i, b in enumerate(blocks):
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1
            self.table[row, i] = b

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self.free)

    def allocate(self, row: int, have: int, need: int) -> None:
        """Extend the sequence in `row` from `have` to `need` blocks (the caller checked can_allocate)."""
        for i in range(have, need):
            b, _ = self.free.popitem(last=False)
            name = self.name_of[b]
            if name is not None:                     # a cached block: evicted now
                del self.by_name[name]
                self.name_of[b] = None
                self.evictions += 1
            self.refs[b] = 1
            self.table[row, i] = b

    def release(self, row: int, n_blocks: int, keep: int = 0) -> None:
        """Drop the sequence's blocks keep .. n_blocks-1 (all of them by default), last first, so that a cached
        prefix's early blocks are evicted last."""
        for i in range(n_blocks - 1, keep - 1, -1):
            b = int(self.table[row, i])
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.name_of[b] is None:
                    self.free[b] = None
                    self.free.move_to_end(b, last=False)   # unnamed: nothing to keep, reuse first
                else:
                    self.free[b] = None                    # named: reusable by a hit until evicted

    def name_full_blocks(self, row: int, tokens, n_named: int, n_computed: int, parent: bytes) -> tuple[int, bytes]:
        """Name the sequence's full, computed blocks from n_named on; returns (new n_named, last name)."""
        if not self.prefix_caching:
            return n_named, parent
        for i in range(n_named, n_computed // BLOCK):
            name = block_digest(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
            b = int(self.table[row, i])
            if name not in self.by_name and self.name_of[b] is None:
                self.by_name[name] = b
                self.name_of[b] = name
            parent = name
            n_named = i + 1
        return n_named, parent

    def check(self) -> None:
        """Internal consistency (tests): free blocks have no holder, names map both ways."""
        assert all(self.refs[b] == 0 for b in self.free), "a free block is held"
        assert sum(1 for r in self.refs if r == 0) == len(self.free), "a block with no holder is not free"
        for name, b in self.by_name.items():
            assert self.name_of[b] == name, "name tables disagree"
