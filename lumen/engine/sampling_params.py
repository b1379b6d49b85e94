"""SamplingParams: how one request turns logits into tokens and when it stops, validated field by field.

Everything `Model.generate` accepts, plus what serving needs (in the manner of vLLM's SamplingParams): a seed
per request (its own RNG, so its tokens do not depend on what runs beside it), ignore_eos, stop_token_ids,
min_tokens, logprobs (the top-k log-probabilities of each sampled token) and logit_bias.

Order per token: logit_bias, min_tokens (end tokens masked), penalties (lumen.engine.sampler.make_logits_processors),
then the sampler chain (top-k -> top-p -> min-p -> temperature, lumen.engine.sampler.make_sampler), drawn with a
uniform keyed by the request's seed and the token's position (`uniform`). logprobs are the log-softmax of the
logits after bias and penalties, before temperature and truncation.

Seeds: a seeded request's tokens are reproducible for the same engine configuration. With speculative decoding
the tokens it samples may differ from those of plain sampling with the same seed (the drafts change which
uniforms decide), but their distribution is the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Sequence

import numpy as np

from .sampler import SamplerError, StopChecker, make_logits_processors, make_sampler

MAX_LOGPROBS = 20           # as OpenAI's top_logprobs
PICK, ACCEPT, RESIDUAL, DRAFT = range(4)   # what a keyed uniform is for (see `uniform`)
_M64 = (1 << 64) - 1


def uniform(key: int, pos: int, use: int) -> float:
    """A uniform in [0, 1) that depends on (key, position, use) alone (splitmix64 of their mix). A request draws
    the uniform that decides its token at a position from its key and that position, so its tokens do not
    depend on how the engine grouped its steps (speculative drafts of any length, preemption, batching)."""
    z = (key + 0x9E3779B97F4A7C15 * (4 * pos + use + 1)) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return ((z ^ (z >> 31)) >> 11) * (1.0 / (1 << 53))


def request_key(seed: int | None) -> int:
    """A request's key: mixed from its seed, or fresh entropy without one."""
    if seed is None:
        import os
        return int.from_bytes(os.urandom(8), "little")
    return int(uniform(int(seed) & _M64, 0, 0) * (1 << 53)) ^ (int(seed) >> 11)


def _fail(name: str, msg: str, value) -> None:
    raise SamplerError(f"{name} {msg}, got {value!r}")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None          # None: the rest of the context
    temperature: float = 1.0               # 0 = greedy
    top_k: int = 0                         # 0 = off
    top_p: float = 1.0                     # 1 = off
    min_p: float = 0.0                     # 0 = off
    repeat_penalty: float = 1.0            # llama.cpp's, over the last repeat_last_n tokens (prompt included)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64                # 0 = penalties off, -1 = the whole history
    seed: int | None = None                # None: fresh entropy
    stop: tuple[str, ...] = ()             # stop strings: the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()   # tokens that end the request (besides the model's end tokens)
    ignore_eos: bool = False               # keep going past the model's end tokens
    min_tokens: int = 0                    # end tokens and stop_token_ids are masked until this many were made
    logprobs: int | None = None            # top-k log-probabilities per sampled token (0: the sampled one only)
    logit_bias: dict = field(default_factory=dict)   # token id -> added to its logit (clamped to +-100)
    special: bool = False                  # parse special-token text in a text prompt
    speculative: str | None = None         # None, "ngram" or "draft" (lumen.engine.speculative)
    num_speculative_tokens: int | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", "must be a positive integer or None", self.max_tokens)
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not math.isfinite(float(v)):
                _fail(name, "must be a finite number", v)
            set_(name, float(v))
        if self.temperature < 0:
            _fail("temperature", "must be >= 0 (0 = greedy)", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", "must be in (0, 1]", self.top_p)
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", "must be in [0, 1]", self.min_p)
        if self.repeat_penalty <= 0:
            _fail("repeat_penalty", "must be > 0 (1 = off)", self.repeat_penalty)
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("top_k", "must be an integer >= 0 (0 = off)", self.top_k)
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            _fail("repeat_last_n", "must be an integer >= -1", self.repeat_last_n)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2 ** 63):
            _fail("seed", "must be None or an integer in [0, 2^63)", self.seed)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            _fail("stop", "must be a string or a list of non-empty strings", self.stop)
        set_("stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            _fail("stop_token_ids", "must be a list of token ids", self.stop_token_ids)
        set_("stop_token_ids", tuple(int(t) for t in ids))
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", "must be true or false", self.ignore_eos)
        if not isinstance(self.special, bool):
            _fail("special", "must be true or false", self.special)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", "must be an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must not exceed max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _fail("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", "must be a dict of token id -> bias", self.logit_bias)
        bias = {}
        for k, v in self.logit_bias.items():
            try:
                tok = int(k)                     # JSON gives string keys
            except (TypeError, ValueError):
                _fail("logit_bias", "keys must be token ids", k)
            if tok < 0 or not _is_num(v) or not math.isfinite(float(v)):
                _fail("logit_bias", "must map token ids >= 0 to finite numbers", {k: v})
            bias[tok] = min(100.0, max(-100.0, float(v)))
        set_("logit_bias", bias)
        if self.speculative not in (None, "ngram", "draft"):
            _fail("speculative", "must be None, 'ngram' or 'draft'", self.speculative)
        k = self.num_speculative_tokens
        if k is not None and (not _is_int(k) or not 1 <= k <= 16):
            _fail("num_speculative_tokens", "must be None or an integer in [1, 16]", k)

    def check_vocab(self, n_vocab: int) -> None:
        """Token ids in the params must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", tuple(self.logit_bias))):
            bad = [t for t in ids if t >= n_vocab]
            if bad:
                _fail(name, f"holds token ids outside the vocabulary (0..{n_vocab - 1})", bad[:5])

    def replace(self, **kw) -> "SamplingParams":
        return replace(self, **kw)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class TokenChooser:
    """One request's path from a logits row to a token: its own RNG and penalties, with min_tokens and
    logit_bias applied, and its logprobs. Built once per request."""

    def __init__(self, params: SamplingParams, end_ids: frozenset):
        p = params
        self.params = p
        self.sampler = make_sampler(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                                    seed=p.seed)
        self.key = request_key(p.seed)
        self.penalize = make_logits_processors(repeat_penalty=p.repeat_penalty, presence_penalty=p.presence_penalty,
                                               frequency_penalty=p.frequency_penalty, last_n=p.repeat_last_n)
        self.bias_ids = np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias))
        self.bias = np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias))
        self.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else end_ids)
        self.mask_ids = np.array(sorted(self.stop_ids | end_ids), np.int64)

    def pick(self, logits: np.ndarray, pos: int) -> int:
        """The token at position pos from its processed logits."""
        return self.sampler.pick(logits, 0.0 if self.sampler.greedy else uniform(self.key, pos, PICK))

    def process(self, logits: np.ndarray, history: Sequence[int], n_generated: int) -> np.ndarray:
        """logits (V,) after bias, min_tokens and penalties (modified in place)."""
        if self.bias_ids.size:
            logits[self.bias_ids] += self.bias
        if n_generated < self.params.min_tokens and self.mask_ids.size:
            logits[self.mask_ids] = -np.inf
        return self.penalize(logits, history)

    def logprobs(self, logits: np.ndarray, token: int) -> tuple[float, list[tuple[int, float]]]:
        """(log p of token, [(id, log p)] of the top `params.logprobs`) from the processed logits."""
        x = logits.astype(np.float64)
        m = float(x.max())
        lse = m + math.log(float(np.exp(x - m).sum()))
        k = self.params.logprobs or 0
        top = []
        if k:
            ids = np.argpartition(-x, k - 1)[:k]
            ids = ids[np.lexsort((ids, -x[ids]))]
            top = [(int(i), float(x[i] - lse)) for i in ids]
        return float(x[token] - lse), top


def make_stop_checker(params: SamplingParams) -> StopChecker:
    return StopChecker(list(params.stop))
