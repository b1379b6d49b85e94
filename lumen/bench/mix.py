"""Prompt-length mixes for `lumen.bench serve --mix`: seeded, deterministic, cut from committed text.

    chat  prompts log-normal around 150 tokens (sigma 0.7: a tenth past ~370, a hundredth past ~750, at most
          2048), outputs log-normal around 96 (16..256): a chat service's spread
    long  prompts log-normal around 1400 tokens (sigma 0.2, 1024..2048: a file or a document in the prompt),
          outputs log-normal around 128 (32..256)

The lengths come from `lengths(mix, n, seed)`: uniforms from Python's `random.Random(seed).random()` (the same
sequence on every platform and Python version) through the normal's inverse CDF, so a seed names one workload.
The text of request i is a window of that many tokens of the committed corpus (every prompt of
lumen/bench/data/prompts.json, joined), at a seeded offset, so the prompts differ and no prefix cache helps.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

from .offline import load_prompts


@dataclass(frozen=True)
class Mix:
    prompt_median: float
    prompt_sigma: float
    prompt_range: tuple[int, int]
    output_median: float
    output_sigma: float
    output_range: tuple[int, int]


MIXES = {"chat": Mix(150, 0.7, (8, 2048), 96, 0.5, (16, 256)),
         "long": Mix(1400, 0.2, (1024, 2048), 128, 0.3, (32, 256))}
_N01 = NormalDist()


def _lognormal(u: float, median: float, sigma: float, lo: int, hi: int) -> int:
    u = min(max(u, 1e-12), 1 - 1e-12)
    return min(hi, max(lo, round(median * math.exp(sigma * _N01.inv_cdf(u)))))


def lengths(mix: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) for n requests of the named mix."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r} (choose from {', '.join(MIXES)})")
    m, rng = MIXES[mix], random.Random(seed)
    out = []
    for _ in range(n):
        p = _lognormal(rng.random(), m.prompt_median, m.prompt_sigma, *m.prompt_range)
        o = _lognormal(rng.random(), m.output_median, m.output_sigma, *m.output_range)
        out.append((p, o))
    return out


SEPARATOR = "\n\n"


def corpus_pieces() -> list[str]:
    """The committed text the prompts are cut from, piece by piece: every prompt of the benchmark's data."""
    return [it["prompt"] for it in load_prompts()]


def corpus() -> str:
    """The committed text the prompts are cut from: corpus_pieces() joined by SEPARATOR."""
    return SEPARATOR.join(corpus_pieces())


def windows(n_ids: int, plens: list[int], seed: int = 0) -> list[tuple[int, int]]:
    """(start, stop) token windows of a corpus of n_ids tokens, one per prompt length, at seeded offsets."""
    rng = random.Random(seed + 1)
    if plens and max(plens) > n_ids:
        raise ValueError(f"a {max(plens)}-token prompt does not fit in the {n_ids}-token corpus")
    out = []
    for p in plens:
        start = rng.randrange(0, n_ids - p + 1)
        out.append((start, start + p))
    return out
