"""Logits processors: llama.cpp's penalties, `(logits (n_vocab,), history_ids) -> logits`, applied before the
sampler (lumen.engine.sampling.sampler). `check_penalties` is the one check of their settings (lumen.SamplingParams and
make_logits_processors both call it).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from .sampler import SamplerError, _integer, _number

LogitsProcessor = Callable[[np.ndarray, Sequence[int]], np.ndarray]
LOGIT_LIMIT = 1e9       # penalized logits are clipped to +-this: past any real logit, and small enough that
                        # log-probabilities (logit - logsumexp, in float64) stay exact


def check_penalties(repeat_penalty, presence_penalty, frequency_penalty, last_n) -> tuple[float, float, float, int]:
    """The one check of the penalties' settings (lumen.SamplingParams and make_logits_processors both call it)."""
    repeat_penalty = _number("repeat_penalty", repeat_penalty)
    if not 0.0 < repeat_penalty < math.inf:
        raise SamplerError(f"repeat_penalty must be > 0 and finite (1 = off), got {repeat_penalty}", param="repeat_penalty")
    presence_penalty = _number("presence_penalty", presence_penalty)
    frequency_penalty = _number("frequency_penalty", frequency_penalty)
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not math.isfinite(v):
            raise SamplerError(f"{name} must be finite (0 = off), got {v}", param=name)
    last_n = _integer("repeat_last_n", last_n)
    if last_n < -1:
        raise SamplerError(f"repeat_last_n must be >= -1 (0 = off, -1 = whole history), got {last_n}", param="repeat_last_n")
    return repeat_penalty, presence_penalty, frequency_penalty, last_n


def make_logits_processors(*, repeat_penalty: float = 1.0, presence_penalty: float = 0.0,
                           frequency_penalty: float = 0.0, last_n: int = 64) -> LogitsProcessor:
    """Build `(logits (n_vocab,), history_ids) -> logits` applying llama.cpp's penalties, in place.

    For each distinct token among the last `last_n` of `history_ids` (llama.cpp feeds the prompt tokens too),
    with `count` its occurrences there:
        logit = logit * repeat_penalty if logit <= 0 else logit / repeat_penalty
        logit -= count * frequency_penalty + presence_penalty
    clipped to +-LOGIT_LIMIT (a logit that was -inf, masked, stays -inf). last_n 0 disables the
    penalties, -1 uses the whole history. With neutral settings the callable returns the logits untouched at once.
    """
    return penalizer(*check_penalties(repeat_penalty, presence_penalty, frequency_penalty, last_n))


def penalizer(repeat_penalty: float, presence_penalty: float, frequency_penalty: float,
              last_n: int) -> LogitsProcessor:
    """make_logits_processors for settings already checked (check_penalties)."""
    if last_n == 0 or (repeat_penalty == 1.0 and presence_penalty == 0.0 and frequency_penalty == 0.0):
        def identity(logits: np.ndarray, history_ids: Sequence[int]) -> np.ndarray:
            return logits
        return identity

    def penalize(logits: np.ndarray, history_ids: Sequence[int]) -> np.ndarray:
        window = history_ids[-last_n:] if last_n > 0 else history_ids
        hist = np.asarray(window, dtype=np.int64)    # (<= last_n,)
        if hist.size == 0:
            return logits
        ids, counts = np.unique(hist, return_counts=True)   # (d,) sorted, (d,)
        if ids[0] < 0 or ids[-1] >= logits.shape[-1]:
            raise SamplerError(f"history token ids must be in [0, {logits.shape[-1]}), "
                               f"got {int(ids[0]) if ids[0] < 0 else int(ids[-1])}")
        v0 = logits[ids]
        with np.errstate(all="ignore"):              # an extreme repeat_penalty overflows float32 (or is 0 in it)
            v = np.where(v0 <= 0, v0 * repeat_penalty, v0 / repeat_penalty)
            v -= counts * frequency_penalty + presence_penalty
        # +inf cannot be sampled: a finite logit stays finite, a masked (-inf) one stays masked
        logits[ids] = np.where(np.isfinite(v0), np.clip(v, -LOGIT_LIMIT, LOGIT_LIMIT), v0)
        return logits

    return penalize
