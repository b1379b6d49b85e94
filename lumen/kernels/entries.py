"""The entry table of a model's kinds: the addresses of its type-specific kernels, each compiled (or loaded from
Numba's cache) for one type on its own, which the forward pass calls through lumen.kernels.kinds.call (the
kinds module's docstring says why), and of the attention kernel. Apart from lumen.kernels.kinds because it
compiles the kernels of lumen.kernels.matmul and lumen.kernels.dequant, which import that module. The tile loop
(lumen.kernels.matmul.tiles) is one entry for every matrix type: given the table, it calls the tile passes of
each type through it.

The attention kernel and the row functions (lumen.kernels.rows) are called through the table too, not for their
types (they are the same for every model) but for the compile: Numba optimizes and generates a callee's code again
inside every caller that links it, so the forward pass linked the attention kernel's whole tree (the largest of
its kernels) and compiled it a second time; and the table is made in the process that loads the model while
another compiles the forward pass (lumen.model.precompile).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import typeof

from .activation import GATED, add_row
from .attention import attention_kernel, attention_signature, lane_address
from .dequant import dequant_row_entry, row_signature
from .kinds import (ACT, ADD, ATTN, ATTN_LANE, MATMUL, N_ENTRIES, N_TYPES, QUANT, RMSNORM, ROPE, ROWS, TILES,
                    address, kinds, new_only, sets)
from .matmul import ENTRIES, entry_signature, matmul_kernel, matmul_signature, quantize_address, tiles, tiles_signature
from .norm import rmsnorm_row
from .rope import rope_row
from .rows import row_address

ROW_FUNCTIONS = {RMSNORM: rmsnorm_row, ADD: add_row, ROPE: rope_row}


@functools.lru_cache(maxsize=None)
def _entry(slot: int, t: int) -> int:
    if slot == TILES:
        return address(tiles, tiles_signature(typeof(np.zeros(N_ENTRIES, np.int64))))
    if slot in ENTRIES:
        fn = ENTRIES[slot][0]
        return address(fn, entry_signature(fn, t))
    if slot == ATTN:
        return address(attention_kernel, attention_signature(), "attention")
    if slot == MATMUL:
        return address(matmul_kernel, matmul_signature())
    if slot == ATTN_LANE:
        return lane_address()
    if slot == ROWS:
        return address(dequant_row_entry, row_signature(typeof(kinds(mats=(), embd=(t,), acts=()))))
    if slot == ACT:
        return row_address(GATED[t])
    if slot == QUANT:
        return quantize_address()
    return row_address(ROW_FUNCTIONS[slot])


def jobs(k: np.ndarray) -> list[tuple[int, int, int]]:
    """The entries of a kinds value's table, in the order `entries` makes them: (index, slot, type) (ValueError for
    a type without a slot)."""
    mats, embd, acts = sets(typeof(k))
    for t in mats + embd:
        if not 0 <= t < N_TYPES:
            raise ValueError(f"GGML type {t} has no entry slot")
    out = [(TILES + t, TILES, 0) for t in mats]            # `tiles` is one function for every type
    out += [(slot + t, slot, t) for t in mats for slot, (_, ts) in ENTRIES.items() if t in ts]
    out += [(ROWS + t, ROWS, t) for t in embd] + [(ACT + a, ACT, a) for a in acts]
    return out + [(slot, slot, 0) for slot in (*ROW_FUNCTIONS, QUANT, ATTN_LANE, ATTN, MATMUL)]


def entries(k: np.ndarray) -> np.ndarray:
    """The entry table (N_ENTRIES,) i8 of a kinds value (lumen.kernels.kinds.kinds): at TILES + t `tiles` (one
    compiled function, given the table) for each matrix type t it names, and the tile kernels of t it calls there
    (lumen.kernels.matmul.ENTRIES: at ONE + t, PASS + t, and PASS_U + t for the types that unpack a tile first), at
    ROWS + t the row dequantizer of each embedding type t, at ACT + a the row function of its gated
    activation a, each compiled for its one kind; 0 for every other (the loader checked that the model uses
    none); at ATTN the attention kernel, at ATTN_LANE the lane function it runs, at RMSNORM, ADD and ROPE those
    row functions, at QUANT the activations' row rounding, at MATMUL the matmul kernel. A table is returned as it
    is."""
    if k.dtype == np.int64:
        return k
    table = np.zeros(N_ENTRIES, np.int64)
    for i, slot, t in jobs(k):
        table[i] = _entry(slot, t)
    return table


def compile_from_the_end(k: np.ndarray) -> None:
    """Compile (or load) the entries of k's table, the last first: the precompiling child (lumen.model.precompile)
    does this once the forward pass is compiled, while the loading process makes them from the first; each entry
    is one compile turn (lumen.kernels.kinds.address), so the two meet in the middle and nothing compiles twice;
    what the cache already holds it skips (`new_only`)."""
    with new_only():
        for _, slot, t in reversed(jobs(k)):
            _entry.__wrapped__(slot, t)
