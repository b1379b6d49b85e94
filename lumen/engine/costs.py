"""Step times the engine measured, by the number of tokens in the step: what speculative decoding weighs its
drafts against (lumen.engine.speculative.choose_k).

Every engine step's wall time (schedule to outputs) is folded into an exponential average for its token count
(exact up to 32 tokens, then power-of-two buckets). A prediction for a count that was never measured
interpolates linearly between the nearest measured counts, and extrapolates from the last two beyond them;
with fewer than two measured counts it returns None (the caller explores).
"""
from __future__ import annotations

import bisect

EXACT = 32


def bucket(n_tokens: int) -> int:
    if n_tokens <= EXACT:
        return n_tokens
    return 1 << (n_tokens - 1).bit_length()


class StepCosts:
    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.ema: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self._keys: list[int] = []

    def add(self, n_tokens: int, seconds: float) -> None:
        b = bucket(n_tokens)
        if b in self.ema:
            self.ema[b] += self.weight * (seconds - self.ema[b])
            self.count[b] += 1
        else:
            self.ema[b] = seconds
            self.count[b] = 1
            bisect.insort(self._keys, b)

    def predict(self, n_tokens: int) -> float | None:
        b = bucket(n_tokens)
        if b in self.ema:
            return self.ema[b]
        ks = self._keys
        if len(ks) < 2:
            return None
        i = bisect.bisect_left(ks, b)
        lo, hi = (ks[0], ks[1]) if i == 0 else (ks[-2], ks[-1]) if i == len(ks) else (ks[i - 1], ks[i])
        t_lo, t_hi = self.ema[lo], self.ema[hi]
        return max(1e-9, t_lo + (t_hi - t_lo) * (b - lo) / (hi - lo))

    def known(self, n_tokens: int) -> bool:
        return bucket(n_tokens) in self.ema
