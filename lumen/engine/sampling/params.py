"""SamplingParams: how one request turns logits into tokens and when it stops, validated field by field.

Everything `Model.generate` accepts, plus what serving needs (in the manner of vLLM's SamplingParams): a seed
per request (its own RNG, so its tokens do not depend on what runs beside it), ignore_eos, stop_token_ids,
min_tokens, logprobs (the top-k log-probabilities of each sampled token), prompt_logprobs (those of each prompt
token given the tokens before it) and logit_bias. max_tokens=0 computes the prompt only (to score it with
prompt_logprobs, or to fill the prefix cache) and ends with "length" without a token.

Each field is checked once, here; the sampler's and the penalties' fields by the same functions that
make_sampler and make_logits_processors call (lumen.engine.sampling.sampler.check_sampler_params,
lumen.engine.sampling.processors.check_penalties).

Order per token (lumen.engine.sequence.TokenChooser): logit_bias, min_tokens (end tokens masked), penalties,
then the sampler chain (top-k -> top-p -> min-p -> temperature, lumen.engine.sampling.sampler), drawn with a uniform
keyed by the request's seed and the token's position (lumen.engine.sampling.sampler.uniform). logprobs are the
log-softmax of the logits after bias and penalties, before temperature and truncation; prompt_logprobs are the
log-softmax of the model's logits as they are (nothing samples a prompt token), as in vLLM.

Structured output: `constraint` (a lumen.engine.structured.Constraint, checked when it was made) restricts every
token to those its grammar allows; the engine masks the logits before all of the above (disallowed tokens get
-inf, so logprobs are those of the masked distribution), and a request whose grammar is complete finishes with
"stop" (lumen.engine.engine).

Seeds: a seeded request's tokens are reproducible for the same engine configuration. With speculative decoding
the tokens it samples may differ from those of plain sampling with the same seed (the drafts change which
uniforms decide), but their distribution is the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..config import MAX_SPECULATIVE_TOKENS
from .processors import check_penalties
from .sampler import SamplerError, check_sampler_params

MAX_LOGPROBS = 20           # as OpenAI's top_logprobs


class _CheckedBias(dict):
    """A logit_bias SamplingParams has normalized ({token id: bias clamped to +-100}): a copy made by replace() keeps
    it without walking it again (the server makes one per choice of a request)."""


class _CheckedIds(tuple):
    """stop_token_ids SamplingParams has checked, kept as they are by replace()."""


def _fail(name: str, msg: str, value) -> None:
    raise SamplerError(f"{name} {msg}, got {value!r}", param=name)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None          # None: the rest of the context; 0: the prompt only
    temperature: float = 1.0               # 0 = greedy
    top_k: int = 0                         # 0 = off
    top_p: float = 1.0                     # 1 = off
    min_p: float = 0.0                     # 0 = off
    repeat_penalty: float = 1.0            # llama.cpp's, over the last repeat_last_n tokens (prompt included)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64                # 0 = penalties off, -1 = the whole history
    seed: int | None = None                # None: fresh entropy
    stop: tuple[str, ...] = ()             # stop strings: the text ends before the first one (None: none, as ())
    stop_token_ids: tuple[int, ...] = ()   # tokens that end the request (besides the model's end tokens; None: ())
    ignore_eos: bool = False               # keep going past the model's end tokens
    min_tokens: int = 0                    # end tokens and stop_token_ids are masked until this many were made,
                                           # and stop strings are not looked for in their text
    logprobs: int | None = None            # top-k log-probabilities per sampled token (0: the sampled one only)
    prompt_logprobs: int | None = None     # ... per prompt token after the first (lumen.engine.sequence)
    logit_bias: dict = field(default_factory=dict)   # token id -> added to its logit (clamped to +-100; None: {})
    special: bool = False                  # parse special-token text in a text prompt
    speculative: str | None = None         # None, "ngram" or "draft" (lumen.engine.speculative)
    num_speculative_tokens: int | None = None
    constraint: object = None              # a lumen.engine.structured.Constraint: the output must match it

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            _fail("max_tokens", "must be an integer >= 0 or None", self.max_tokens)
        t, top_k, top_p, min_p, seed = check_sampler_params(self.temperature, self.top_k, self.top_p, self.min_p,
                                                            self.seed)
        rp, pp, fp, last_n = check_penalties(self.repeat_penalty, self.presence_penalty, self.frequency_penalty,
                                             self.repeat_last_n)
        for name, v in (("temperature", t), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p), ("seed", seed),
                        ("repeat_penalty", rp), ("presence_penalty", pp), ("frequency_penalty", fp),
                        ("repeat_last_n", last_n)):
            set_(name, v)
        stop = (self.stop,) if isinstance(self.stop, str) else () if self.stop is None else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            _fail("stop", "must be a string or a list of non-empty strings", self.stop)
        set_("stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, _CheckedIds):
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
                _fail("stop_token_ids", "must be a list of token ids", self.stop_token_ids)
            set_("stop_token_ids", _CheckedIds(int(t) for t in ids))
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
        k = self.prompt_logprobs
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            _fail("prompt_logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]", k)
        if self.logit_bias is None:
            set_("logit_bias", _CheckedBias())
        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", "must be a dict of token id -> bias", self.logit_bias)
        if not isinstance(self.logit_bias, _CheckedBias):
            bias = _CheckedBias()
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
        if k is not None and (not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            _fail("num_speculative_tokens", f"must be None or an integer in [1, {MAX_SPECULATIVE_TOKENS}]", k)
        if k is not None and self.speculative is None:     # it would do nothing: say so rather than ignore it
            _fail("num_speculative_tokens", "is used with speculative='ngram' or 'draft'", k)
        if self.constraint is not None:          # imported here: llguidance loads only for structured output
            from ..structured import Constraint
            if not isinstance(self.constraint, Constraint):
                _fail("constraint", "must be None or a lumen.engine.structured.Constraint (Constraint.json_schema("
                      "...), .regex, .choice, .lark, .gbnf)", self.constraint)

    def check_vocab(self, n_vocab: int) -> None:
        """Token ids in the params must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            if not ids or max(ids) < n_vocab:        # (once per choice: max() is the fast test)
                continue
            bad = [t for t in ids if t >= n_vocab]
            if bad:
                _fail(name, f"holds token ids outside the vocabulary (0..{n_vocab - 1})", bad[:5])

    def replace(self, **kw) -> "SamplingParams":
        """A copy with these fields changed and checked; logit_bias and stop_token_ids, checked already, are not
        walked again unless given."""
        return replace(self, **kw)

