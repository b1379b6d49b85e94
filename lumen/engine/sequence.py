"""A request inside the engine: its tokens, how many of them are in the KV cache, its sampler (`TokenChooser`),
its stop conditions and detokenizer, and the times the metrics are made of (`RequestMetrics`, the one metrics
type: the engine's outputs, the server and Model.generate(stats=...) all read it). Outputs are `RequestOutput`s.
Its KV blocks are the block manager's business (lumen.engine.block_manager), keyed by its request id.
"""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

import numpy as np

from .sampling.logprobs import logprobs_of
from .sampling.processors import penalizer
from .sampling.sampler import PICK, Sampler, request_key, uniform
from .sampling.params import SamplingParams
from .stop_strings import StopChecker


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Times in seconds. queue: arrival -> first scheduled; ttft: arrival -> first token; tpot: mean time per
    later token; itl: the gaps between consecutive tokens; e2e: arrival -> finished."""
    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    itl: list = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    spec_proposed: int = 0             # speculative tokens proposed and verified
    spec_accepted: int = 0             # ... and accepted
    spec_steps: int = 0                # verification steps
    stop_reason: str = ""              # how it ended: "eos", "stop", "grammar" (complete), "length", "abort" or
                                       # "error" ("" meanwhile)

    @property
    def queue_s(self) -> float:
        return (self.first_scheduled or self.arrival) - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot_s(self) -> float | None:
        n = self.generated_tokens
        if n < 2 or self.first_token is None or self.last_token is None:
            return None
        return (self.last_token - self.first_token) / (n - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def gen_tokens(self) -> int:
        return self.generated_tokens

    @property
    def prefill_s(self) -> float:
        """Arrival -> first token: prompt processing and the first token's sampling (0 before it)."""
        return self.ttft_s or 0.0

    @property
    def decode_s(self) -> float:
        return sum(self.itl)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return len(self.itl) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Share of the drafted tokens that were accepted."""
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification step: the accepted drafts plus the target's own token."""
        return (self.spec_accepted + self.spec_steps) / self.spec_steps if self.spec_steps else None


@dataclass
class RequestOutput:
    """What a request has produced so far: `token_ids` and `text` are everything generated (the delta_ fields
    what this step added). finish_reason: None while running, then "stop", "length", "abort" or "error"."""
    request_id: str
    prompt_token_ids: list
    token_ids: list
    text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    delta_token_ids: list = field(default_factory=list)
    delta_text: str = ""
    logprobs: list | None = None        # per generated token: (log p, [(id, log p) of the top k])
    error: str | None = None
    stop_reason: object = None          # what stopped it: the stop string or stop token id; None for EOS
    delta_pieces: list = field(default_factory=list)   # the text each delta token released (joined: delta_text)
    kv_transfer_params: dict | None = None   # a prefill for a remote decode: where its held KV is (kv_transfer)
    prompt_logprobs: list | None = None  # per prompt token: None for the first, then as logprobs (complete from
                                         # the first output with a token on)


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list, params: SamplingParams, max_tokens: int,
                 tokenizer, end_ids: frozenset, now: float | None = None, metrics: RequestMetrics | None = None):
        """metrics: the RequestMetrics to fill (a caller's, e.g. Model.generate's stats); a new one by default."""
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.tokens = list(prompt_ids)         # prompt + output: what the KV cache holds (or will)
        self.params = params
        self.max_tokens = max_tokens           # resolved: never past the context
        self.status = Status.WAITING
        self.num_computed = 0                  # tokens whose K/V are in the cache
        self.chooser = TokenChooser(params, end_ids)
        self.stopper = StopChecker(list(params.stop))
        self.detok = tokenizer.stream()
        self.text = ""
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason = None                # the stop string or stop_token_id that ended it (None: EOS)
        self.error: str | None = None
        self.metrics = RequestMetrics() if metrics is None else metrics
        self.metrics.__init__(arrival=time.perf_counter() if now is None else now,   # a reused one starts afresh
                              prompt_tokens=len(prompt_ids))
        self.spec = None                       # speculative state (lumen.engine.speculative), per request
        self.grammar = None                    # structured output: its GrammarMatcher, once compiled
        self.grammar_future = None             # ... and the compilation it waits for (lumen.engine.engine)
        self.grammar_complete = False          # it ended because its grammar takes no more tokens
        self.kv_transfer_params: dict | None = None   # lumen.engine.kv_transfer: the producer's (a decode) or
        self.kv_hold = False                   # this request's once held (a prefill asked to hold its KV)
        self.kv_data = None                    # a decode's received KV runs, until admitted

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def cacheable(self) -> int:
        """How many leading tokens a prefix-cache hit may cover: all but the last, or, while prompt logprobs are
        wanted and missing, only those before the first one missing (a cached block's logits were never computed:
        the request computes them itself, and its blocks are named for others all the same)."""
        lps = self.prompt_logprobs
        if lps is None or len(lps) == len(self.prompt_ids):
            return len(self.tokens) - 1
        return len(lps) - 1

    def prompt_rows(self, start: int, n: int) -> tuple[int, int]:
        """(first position, count): the positions among start .. start+n-1 whose logits give a prompt token's
        logprob not yet taken (position p's give token p+1's). (0, 0) for a request that wants none."""
        lps = self.prompt_logprobs
        if lps is None:
            return 0, 0
        first = max(start, len(lps) - 1)
        return first, max(0, min(start + n, len(self.prompt_ids) - 1) - first)

    def add_prompt_logprobs(self, logits: np.ndarray, first: int) -> None:
        """Take the logprobs of prompt tokens first+1 .. from logits (count, V), the rows of positions first ..."""
        assert first == len(self.prompt_logprobs) - 1, "prompt logprobs out of order"
        ids = self.prompt_ids[first + 1:first + 1 + len(logits)]
        self.prompt_logprobs += logprobs_of(logits, ids, self.params.prompt_logprobs)

    def append(self, token: int, now: float) -> str:
        """Add a sampled token; returns the text it releases. Sets finish_reason when a stop condition holds (a
        structured-output request's grammar complete is one); stop strings and stop tokens count only after
        min_tokens tokens, as in vLLM. StructuredOutputError, the sequence unchanged,
        for a token its grammar does not allow."""
        complete = False
        if self.grammar is not None:
            self.grammar.advance(token)
            complete = self.grammar.is_stopped  # the grammar takes nothing more: finish with "stop"
        m = self.metrics
        if m.first_token is None:
            m.first_token = now
        else:
            m.itl.append(now - m.last_token)
        m.last_token = now
        m.generated_tokens += 1
        self.output_ids.append(token)
        self.tokens.append(token)
        n = len(self.output_ids)
        ends = token in self.chooser.stop_ids and n > self.params.min_tokens
        last = ends or complete or n >= self.max_tokens
        piece = "" if ends else self.detok.push(token)
        if last:
            piece += self.detok.flush()
        if n > self.params.min_tokens:
            text, hit = self.stopper.feed(piece)
        else:                              # the first min_tokens tokens' text is never searched for a stop string
            text, hit = piece, False
        if hit or ends or complete:
            self.finish_reason = "stop"
            self.grammar_complete = complete and not (hit or ends)
            self.stop_reason = self.stopper.matched if hit else (token if token in self.params.stop_token_ids
                                                                 else None)
        elif n >= self.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and not hit:
            text += self.stopper.flush()
        self.text += text
        return text

    def finish(self, reason: str | None, now: float) -> None:
        """Mark it finished (reason: a finish_reason, or None to keep the one append() set)."""
        self.status = Status.FINISHED
        if reason is not None:
            self.finish_reason = reason
        self.metrics.finished = now
        r = self.finish_reason or ""
        self.metrics.stop_reason = ("grammar" if self.grammar_complete else "eos") if r == "stop" and \
            self.stop_reason is None else r

    def output(self, delta_ids: list, pieces: list) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_ids, list(self.output_ids), self.text,
                             self.finished, self.finish_reason, self.metrics, delta_ids, "".join(pieces),
                             None if self.logprobs is None else list(self.logprobs), self.error,
                             self.stop_reason, pieces, self.kv_transfer_params if self.kv_hold else None,
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs))


class TokenChooser:
    """One request's path from a logits row to a token: its own RNG and penalties, with min_tokens and
    logit_bias applied, and its logprobs. Built once per request."""

    def __init__(self, params: SamplingParams, end_ids: frozenset):
        p = params
        self.params = p
        self.sampler = Sampler(p.temperature, p.top_k, p.top_p, p.min_p, p.seed)      # p is checked already
        self.key = request_key(p.seed)
        self.penalize = penalizer(p.repeat_penalty, p.presence_penalty, p.frequency_penalty, p.repeat_last_n)
        self.bias_ids = np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias))
        self.bias = np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias))
        self.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else end_ids)
        self.mask_ids = np.array(sorted(self.stop_ids | end_ids), np.int64)

    def pick(self, logits: np.ndarray, pos: int) -> int:
        """The token at position pos from its processed logits."""
        return self.sampler.pick(logits, 0.0 if self.sampler.greedy else uniform(self.key, pos, PICK))

    def process(self, logits: np.ndarray, history: Seq[int], n_generated: int) -> np.ndarray:
        """logits (V,) after bias, min_tokens and penalties (modified in place). Every token the engine picks,
        verifies or drafts for this request passes here first, and its logprobs are taken from the result: the
        place for a per-request logits mask (structured output)."""
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
            top = [(int(i), float(x[i] - lse)) for i in ids if x[i] > -np.inf]   # masked tokens are not offered
        return float(x[token] - lse), top
