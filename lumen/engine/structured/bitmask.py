"""Token bitmasks of a step's constrained rows: filled in one batched llguidance call, applied to logits rows.

    filler = MaskFiller(vocab)                           # one per engine; owns an LLExecutor and a thread
    job = filler.start([(matcher, row, draft), ...], n_rows)   # returns at once; fills while the forward runs
    logits = runner.forward(...)                          # (n_rows, V) float32; the forward releases the GIL
    masks = job.result()                                  # (n_rows, mask_words) int32, bit t of row r: token t
    apply_bitmasks(logits, masks, rows)                   # disallowed tokens -> -inf, before sampling/logprobs

Layout: bit t of a row is token t (word t // 32, bit t % 32), as llguidance writes it. `row` is the index of
the item's first logits row; an item with a speculative draft d_0..d_{k-1} owns rows row .. row+k: row+i is the
mask after d_0..d_{i-1}, the one its verification row i must be sampled under. The drafts must already be
grammar-valid (GrammarMatcher.validate_draft), as the engine has truncated them before the forward; the matcher
is advanced through them and rolled back inside llguidance, so its state is unchanged afterwards. Rows not in
any item are left as they were; rows of an item that llguidance does not reach are left all-zero.

Cost (CPU lock held, but load average 7-9 from other work on the 2 cores, so upper bounds). In real greedy
generations of a JSON schema (a throwaway Engine subclass masking synchronously; SmolLM2 and Gemma 3 chat
prompts, 43-47 tokens) one row takes 0.12-0.4 ms on either vocabulary (llguidance's slices keep Gemma's 262144
tokens as cheap as SmolLM2's 49152), with 4-15 ms outliers that track the machine's load; synchronous masking
added 0.3-1.0 ms a token to TPOTs of 12.6-14 ms (SmolLM2) and 25-27 ms (Gemma 3). Along the random walks of
python profiling/structured_costs.py: 1 row median 20-75 us, 16 rows in one call median 1.1-2.7 ms, p90
5-9 ms (free strings under a `format` or `pattern` regex reach 4-8 ms a row). The filler runs it beside the
forward pass, so a step waits only for what is left of it. `apply_bitmask` (Numba, branch-free, vectorised):
2.1-2.8 us a row for 49152 tokens, 12-15 us for 262144, whatever the mask holds (numpy's unpackbits + boolean
index: 20-130 us and 0.12-1.1 ms). Its first call in a process loads the Numba cache (0.01-0.25 s): MaskFiller calls warm_up().
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import llguidance
import numpy as np
from numba import njit

from .matcher import GrammarMatcher
from .vocab import GrammarVocab

NEG_INF = np.float32(-np.inf)
Item = tuple[GrammarMatcher, int, Sequence[int]]      # (matcher, first logits row, draft tokens)


def fill_masks(executor: llguidance.LLExecutor, masks: np.ndarray, items: Sequence[Item],
               vocab: GrammarVocab) -> None:
    """Fill the rows of `items` in `masks` with one batched llguidance call (two when some items have drafts and
    some have none), parallel over `executor`'s threads, GIL released. See the module docstring for the layout."""
    vocab.check_masks(masks)
    n = masks.shape[0]
    spans = []
    for m, row, draft in items:
        if row < 0 or row + len(draft) >= n:
            raise ValueError(f"rows {row}..{row + len(draft)} do not fit a bitmask of {n} rows")
        spans.append((row, row + len(draft) + 1))
    for a, b in spans:
        masks[a:b] = 0
    ptr, one = masks.ctypes.data, masks.shape[1] * 4
    plain = [(m.ll, row) for m, row, d in items if not d]
    drafted = [(m.ll, row, m._ll_tokens(d)) for m, row, d in items if d]
    if plain:
        executor.unsafe_compute_mask_ptr(plain, ptr, one, n)
    if drafted:                       # llguidance's draft call takes only non-empty drafts
        executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, one, n)
    if spans:
        vocab.allow_end_tokens(masks, np.concatenate([np.arange(a, b) for a, b in spans]))


class MaskFiller:
    """Fills a step's masks on its own thread (so the call overlaps the forward pass) into a buffer it owns.
    The array a job returns is valid until the next job starts."""

    def __init__(self, vocab: GrammarVocab, *, threads: int = 1, max_rows: int = 64):
        self.vocab = vocab
        self.executor = llguidance.LLExecutor(threads)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lumen-masks")
        self._masks = np.zeros((max_rows, vocab.mask_words), np.int32)   # (max_rows, mask_words)
        warm_up()

    def _buffer(self, n_rows: int) -> np.ndarray:
        if self._masks.shape[0] < n_rows:
            self._masks = np.zeros((max(n_rows, 2 * self._masks.shape[0]), self.vocab.mask_words), np.int32)
        return self._masks[:n_rows]

    def fill(self, items: Sequence[Item], n_rows: int) -> np.ndarray:
        """The (n_rows, mask_words) masks of `items`, filled on this thread."""
        masks = self._buffer(n_rows)
        fill_masks(self.executor, masks, items, self.vocab)
        return masks

    def start(self, items: Sequence[Item], n_rows: int) -> Future[np.ndarray]:
        """fill() on the filler's thread; returns at once. The matchers must not move until it is done."""
        items = [(m, int(r), list(d)) for m, r, d in items]
        return self._thread.submit(self.fill, items, n_rows)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


@njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def apply_bitmask(logits: np.ndarray, mask: np.ndarray) -> None:
    """logits (V,) float32 in place: token t -> -inf unless bit t of mask ((V + 31) // 32,) int32 is set.
    Unchecked (a Numba kernel): the caller guarantees the shapes; apply_bitmasks checks them."""
    n = logits.shape[0]
    full = n // 32
    for w in range(full):
        word = mask[w]
        if word == -1:                   # all 32 allowed
            continue
        base = w * 32
        for j in range(32):              # branch-free select: the compiler vectorises it
            logits[base + j] = logits[base + j] if (word >> j) & 1 else NEG_INF
    for t in range(full * 32, n):
        if not (mask[t // 32] >> (t % 32)) & 1:
            logits[t] = NEG_INF


def warm_up() -> None:
    """Load (or compile) the Numba mask kernels now rather than in a request's first step."""
    apply_bitmasks(np.zeros((1, 33), np.float32), np.full((1, 2), -1, np.int32), [0])


@njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def _apply_rows(logits: np.ndarray, masks: np.ndarray, rows: np.ndarray) -> None:
    for r in rows:
        apply_bitmask(logits[r], masks[r])


def apply_bitmasks(logits: np.ndarray, masks: np.ndarray, rows) -> None:
    """apply_bitmask(logits[r], masks[r]) for each r in rows, shapes checked: logits (n, V) float32,
    masks (>= n, (V + 31) // 32) int32. apply_bitmask itself checks nothing (a Numba kernel)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not (logits.dtype == np.float32 and logits.ndim == 2 and masks.dtype == np.int32 and masks.ndim == 2
            and masks.shape[1] == (logits.shape[1] + 31) // 32):
        raise ValueError(f"logits (n, V) float32 and masks (n, (V + 31) // 32) int32 expected, got "
                         f"{logits.dtype} {logits.shape} and {masks.dtype} {masks.shape}")
    if rows.size and not (0 <= rows.min() and rows.max() < min(logits.shape[0], masks.shape[0])):
        raise ValueError(f"rows {rows.min()}..{rows.max()} outside logits {logits.shape} / masks {masks.shape}")
    _apply_rows(logits, masks, rows)
