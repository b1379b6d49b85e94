"""A request inside the engine: its tokens, how many of them are in the KV cache, its blocks, its sampler, its
stop conditions and detokenizer, and the times the metrics are made of. Outputs are `RequestOutput`s.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling import SamplingParams, TokenChooser, make_stop_checker


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


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list, params: SamplingParams, max_tokens: int,
                 tokenizer, end_ids: frozenset, now: float | None = None):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.tokens = list(prompt_ids)         # prompt + output: what the KV cache holds (or will)
        self.params = params
        self.max_tokens = max_tokens           # resolved: never past the context
        self.status = Status.WAITING
        self.num_computed = 0                  # tokens whose K/V are in the cache
        self.row = -1                          # block-table row while it holds blocks
        self.n_blocks = 0
        self.n_named = 0                       # full blocks named for prefix caching
        self.last_name = b""
        self.chooser = TokenChooser(params, end_ids)
        self.stopper = make_stop_checker(params)
        self.detok = tokenizer.stream()
        self.text = ""
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason = None                # the stop string or stop_token_id that ended it (None: EOS)
        self.error: str | None = None
        self.metrics = RequestMetrics(arrival=time.perf_counter() if now is None else now,
                                      prompt_tokens=len(prompt_ids))
        self.spec = None                       # speculative state (lumen.engine.speculative), per request

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token: int, now: float) -> str:
        """Add a sampled token; returns the text it releases. Sets finish_reason when a stop condition holds."""
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
        last = ends or n >= self.max_tokens
        piece = "" if ends else self.detok.push(token)
        if last:
            piece += self.detok.flush()
        text, hit = self.stopper.feed(piece)
        if hit or ends:
            self.finish_reason = "stop"
            self.stop_reason = self.stopper.matched if hit else (token if token in self.params.stop_token_ids
                                                                 else None)
        elif n >= self.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and not hit:
            text += self.stopper.flush()
        self.text += text
        return text

    def output(self, delta_ids: list, pieces: list) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_ids, list(self.output_ids), self.text,
                             self.finished, self.finish_reason, self.metrics, delta_ids, "".join(pieces),
                             None if self.logprobs is None else list(self.logprobs), self.error,
                             self.stop_reason, pieces)
