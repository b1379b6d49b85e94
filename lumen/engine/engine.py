"""The serving engine: continuous batching over a paged KV cache, in the loop the field's engines share.

    offers = speculator.propose(...)        drafts, before scheduling (lumen.engine.speculative)
    plan = scheduler.schedule(budget, k_for)  which tokens of which requests run this step, and how many of their
                                            drafted tokens (lumen.engine.scheduler: the one owner of the budget)
    logits = runner.run_plan(plan, drafts)  one forward pass over the ragged batch (lumen.engine.runner)
    outputs = postprocess(plan, logits)     sample or verify, detokenize, stop; free what finished

Structured output (SamplingParams.constraint, lumen.engine.structured.manager): a request waits outside the
queue until its grammar is compiled; drafts are cut at the first token the grammar refuses; the masks of the
constrained rows fill beside the forward pass and are applied to the logits before anything samples.

    engine = lumen.Engine("smollm2-135m", max_num_seqs=16, max_num_batched_tokens=512, kv_cache_mb=512)
    outs = engine.generate(["The capital of France is", "def fib(n):"], lumen.SamplingParams(max_tokens=32))
    rid = engine.add_request("Once upon a time", params); engine.step(); engine.abort(rid)
    for out in engine.stream("Hello", params): print(out.delta_text, end="")

add_request and abort may be called from any thread while another runs step(): the queues are changed under a
lock that step() does not hold while drafting or while the forward pass runs. An aborted request's blocks are
freed at once; a bad request gets an error of its own (finish_reason "error" when it was already running) and
never disturbs the others. Batch invariance: a request's logits are bit-identical whatever runs beside it,
whatever the chunk size or token budget, with or without a prefix-cache hit (lumen.kernels.attention), and each
request samples with its own RNG, so its tokens are too.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
import warnings
from collections import deque
from typing import Callable, Iterator, Sequence as Seq

import numpy as np

from ..errors import ContextWarning, LumenError, user_stacklevel
from ..kernels.attention import BLOCK
from ..timer import active as profiler_active
from .block_manager import BlockManager
from .kv_transfer import DO_REMOTE_DECODE, KVConnector, KVData
from .costs.budget import MeasuredBudget, PacedBudget
from .config import EngineConfig, draft_requant, kv_blocks
from ..model.parts import ModelParts, parts_of
from .runner import Runner
from .sampling.sampler import SamplerError
from .sampling.params import SamplingParams
from .scheduler import Scheduled, Scheduler
from .admission import RequestError, admit
from .sequence import RequestMetrics, RequestOutput, Sequence
from .speculative import DraftModel, Speculator
from .speculative.drafters import step_bytes
from .costs.steps import CostKey, StepCosts, calibrate
from .structured.constraint import StructuredOutputError
from .structured.manager import StructuredOutput

log = logging.getLogger("lumen.engine")
__all__ = ["Engine", "EngineConfig", "RequestError"]          # RequestError: lumen.engine.admission


def served_model_len(c: EngineConfig, cfg) -> tuple[int, int]:
    """(max_model_len, KV blocks) of an engine with config c over a model of Config cfg, known before its weights
    load (a server checks them before it starts replicas). With c.fit_model_len (a server) a context beyond the
    trained one, or beyond what the pool holds, is a ValueError when given, and lowered to the pool when not."""
    max_model_len = c.model_len(cfg.ctx_train)
    if c.fit_model_len and max_model_len > cfg.ctx_train:               # (before the pool's size)
        raise ValueError(f"max_model_len {max_model_len} is beyond the {cfg.ctx_train} tokens this model "
                         "was trained on")
    per_block = cfg.n_layer * cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v) * BLOCK * 2
    n_blocks = kv_blocks(c, per_block)
    if c.fit_model_len and n_blocks * BLOCK < max_model_len:
        if c.max_model_len is not None:
            raise ValueError(f"the KV cache holds {n_blocks * BLOCK} tokens, fewer than max_model_len "
                             f"{c.max_model_len}; raise kv_cache_mb or lower max_model_len")
        log.warning("max_model_len lowered from %d to %d: the KV cache (kv_cache_mb) holds no more",
                    max_model_len, n_blocks * BLOCK)
        max_model_len = n_blocks * BLOCK
    elif n_blocks * BLOCK < max_model_len:          # (each request is checked against the pool: say so now)
        log.warning("the KV cache holds %d tokens, fewer than max_model_len %d: a request needing more ends with an "
                    "error; raise kv_cache_mb or lower max_model_len", n_blocks * BLOCK, max_model_len)
    return max_model_len, n_blocks


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, **options):
        """model: a registry name, a .gguf path, a loaded lumen.Model or its ModelParts (weights are shared; a
        Model's threads and adaptive_threads are the engine's unless given).
        config: an EngineConfig, or its fields (and SpeculativeConfig's) as keywords (lumen.engine.config)."""
        if config is not None and options:
            raise TypeError("give an EngineConfig or its fields as keywords, not both")
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be a lumen.EngineConfig (or give its fields as keywords: "
                            f"Engine(model, **options)), got {type(config).__name__}")
        c = config if config is not None else EngineConfig.from_kwargs(**options)
        if config is None and "adaptive_threads" not in options and hasattr(model, "adaptive_threads"):
            c = dataclasses.replace(c, adaptive_threads=model.adaptive_threads)    # (a lumen.Model's, as threads)
        self.engine_config = c
        parts = self.parts = parts_of(model, pack_cache=c.pack_cache)
        self.config, self.tokenizer = parts.config, parts.tokenizer
        threads = c.threads
        if threads is None and parts is getattr(model, "parts", None):     # a lumen.Model: the threads it was given
            threads = getattr(model, "threads", None)
        self.threads = parts.thread_count(threads)
        self.end_ids = frozenset(parts.tokenizer.eot_ids)
        cfg = self.config
        self.max_num_seqs, self.max_num_batched_tokens = c.max_num_seqs, c.max_num_batched_tokens
        self.max_model_len, n_blocks = served_model_len(c, cfg)
        if not c.fit_model_len and self.max_model_len > cfg.ctx_train and not isinstance(model, ModelParts):
            # (as lumen.Model warns; ModelParts come from a Model or a tool that checked its own context)
            warnings.warn(ContextWarning(f"max_model_len={self.max_model_len} is beyond the {cfg.ctx_train} tokens "
                                         "this model was trained on (output past that is unreliable)"),
                          stacklevel=user_stacklevel())
        try:
            self.runner = Runner(cfg, parts.bundle, parts.rope_freqs, n_blocks=n_blocks,
                                 max_tokens=c.max_num_batched_tokens, max_rows=c.max_num_seqs,
                                 max_blocks=-(-self.max_model_len // BLOCK), n_threads=self.threads,
                                 adaptive_threads=c.adaptive_threads)
        except MemoryError as e:                    # its tables grow with max_model_len (RoPE) and the batch sizes
            raise LumenError(f"the engine's buffers for max_model_len {self.max_model_len}, max_num_seqs "
                             f"{c.max_num_seqs} and max_num_batched_tokens {c.max_num_batched_tokens} do not fit "
                             f"in memory ({e}): lower them") from None
        self.blocks = BlockManager(self.runner.n_blocks, self.runner.table, prefix_caching=c.enable_prefix_caching)
        self._lock = threading.RLock()
        self.kv = KVConnector(self.runner.kv, self.blocks, self._lock, hold_timeout_s=c.kv_hold_timeout_s)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=c.max_num_seqs,
                                   max_num_batched_tokens=c.max_num_batched_tokens,
                                   chunked_prefill=c.enable_chunked_prefill, connector=self.kv)
        self.costs = StepCosts()
        self.structured = StructuredOutput(parts.tokenizer, cfg.n_vocab)   # grammars compile on its thread
        sc = c.speculative
        draft = None if sc.draft_model is None else DraftModel(
            parts_of(sc.draft_model, requant=draft_requant(sc.draft_quant)), n_vocab=cfg.n_vocab,
            max_model_len=self.max_model_len, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, threads=self.threads,
            governor=self.runner.governor, vocab=sc.draft_vocab, target_bytes=step_bytes(parts.bundle),
            tokens=parts.tokenizer.tokens)
        self.speculator = Speculator(sc, self.costs, draft)
        self.cost_model = self.budgeter = None
        self._keys_per_token = 0.0                  # attention keys a token of the last step read (the fallback's K)
        if c.scheduler == "measured":
            self.cost_model = calibrate(self.runner, self.cost_key, tiny=c.cost_grid == "tiny")
            self.costs.fallback = lambda n, rows: self.cost_model.predict(n, rows, n * self._keys_per_token)
            self.budgeter = MeasuredBudget(self.cost_model, max_tokens=c.max_num_batched_tokens,
                                           slo_ttft_s=c.slo_ttft_s, slo_tpot_s=c.slo_tpot_s)
        elif c.scheduler == "paced":
            self.budgeter = PacedBudget(self.costs, max_tokens=c.max_num_batched_tokens, pace=c.pace)
        self.decisions: deque = deque(maxlen=4096)  # the measured scheduler's decisions, newest last
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []     # outputs made outside step() (aborts), returned by the next
        self._streams: dict[str, deque] = {}        # request id -> its stream()'s outputs not yet yielded
        self._step_lock = threading.Lock()          # one step at a time (streams followed from several threads)
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}-{id(self) & 0xffff:x}-"
        self.steps = 0
        self.closed = False

    @property
    def cost_key(self) -> CostKey:
        return CostKey(self.parts.path, self.threads, self.max_num_batched_tokens, self.max_num_seqs,
                       self.max_model_len)

    # ---- requests
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None, *,
                    metrics: RequestMetrics | None = None, kv_transfer_params: dict | None = None,
                    kv_data: KVData | None = None, arrival: float | None = None) -> str:
        """Queue a request; returns its id. Raises RequestError (a ValueError) when it cannot be served.
        metrics: a RequestMetrics for the engine to fill (default: a new one, in every output).
        kv_transfer_params, kv_data (lumen.engine.kv_transfer): {"do_remote_decode": True} holds the request's KV
        when it ends, for a decode engine; a prefill engine's kv_transfer_params with the runs received from it
        (kv_data) start the request from that KV.
        arrival: when the request arrived (time.perf_counter(); default now), where that was before this call: a
        decode engine's request arrived before its KV was pulled, and its TTFT and queue time count that wait."""
        params = SamplingParams() if params is None else params
        if request_id is not None and not (isinstance(request_id, str) and request_id):
            raise TypeError(f"request_id must be a non-empty string or None, got {request_id!r}")
        if metrics is not None and not isinstance(metrics, RequestMetrics):
            raise TypeError(f"metrics must be a RequestMetrics or None, got {type(metrics).__name__}")
        if self.closed:
            raise LumenError("this engine is closed (engine.close(), or the end of its `with` block)")
        if arrival is not None and (isinstance(arrival, bool) or not isinstance(arrival, (int, float))):
            raise TypeError(f"arrival must be a time.perf_counter() or None, got {type(arrival).__name__}")
        ids, max_tokens = admit(prompt, params, self.tokenizer, self.config.n_vocab, self.max_model_len,
                                self.blocks.n_blocks)
        if kv_transfer_params is not None or kv_data is not None:
            self.kv.check(kv_transfer_params, kv_data, len(ids))
            if kv_data is not None and params.prompt_logprobs is not None:
                raise RequestError("prompt_logprobs needs the prompt computed by this engine, not KV received "
                                   "from a prefill engine")
        with self._lock:
            rid = request_id if request_id is not None else self._prefix + str(next(self._ids))
            if rid in self._seqs:
                raise RequestError(f"request id {rid!r} is already in use")
            seq = Sequence(rid, ids, params, max_tokens, self.tokenizer, self.end_ids, metrics=metrics, now=arrival)
            if kv_transfer_params is not None:
                seq.kv_hold = bool(kv_transfer_params.get(DO_REMOTE_DECODE))
                seq.kv_transfer_params, seq.kv_data = (None, None) if seq.kv_hold else (kv_transfer_params, kv_data)
            self.speculator.admit(seq)
            ready = params.constraint is None or self.structured.admit(seq)   # False: compiling, it waits
            self._seqs[rid] = seq
            if ready:
                self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks now; unknown or finished ids are a no-op."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string (add_request's answer), got {type(request_id).__name__}")
        with self._lock:
            seq = self._seqs.pop(request_id, None)
            if seq is None or seq.finished:
                self.kv.release(request_id)         # a finished prefill's held KV, if any
                return
            if self.structured.discard(seq):        # still compiling its grammar: in no queue
                seq.finish("abort", time.perf_counter())
            else:
                self.scheduler.finish(seq, "abort", time.perf_counter())
            if self._step_lock.acquire(blocking=False):    # no step runs: its draft-model row can go now
                try:                                        # (else the next step's propose sweeps it)
                    self.speculator.finish(seq)
                finally:
                    self._step_lock.release()
            self._pending.append(seq.output([], []))

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_work or bool(self._pending) or bool(self.structured.compiling)

    # ---- the loop
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that advanced or ended. Outputs of requests that
        a stream() follows are also queued for it, whoever steps (another stream, generate, a loop), before the
        next step can run: a stream stepping from another thread then finds its request's outputs queued."""
        with self._step_lock:
            outs = self._step()
            if self._streams:                       # (a server's loop follows no stream: nothing to do per output)
                for out in outs:
                    q = self._streams.get(out.request_id)
                    if q is not None:
                        q.append(out)
        return outs

    def _step(self) -> list[RequestOutput]:
        prof = profiler_active()
        prof.begin_step("decode")
        t0 = time.perf_counter()
        outs, plan, decision = self._schedule(t0)
        if not plan:
            prof.cancel_step()
            if not outs:
                self.structured.wait(0.05)          # only grammars compiling: wait for one, do not spin
            return outs
        self.steps += 1
        prof.lap("schedule")
        drafts = {s.seq: self.speculator.draft_tokens(s.seq, s.k) for s in plan if s.k}
        masks = self.structured.start_masks(plan, drafts)     # filled beside the forward pass (None: no grammar)
        logits, n_tokens, n_keys = self.runner.run_plan(plan, drafts, prof)
        self.structured.apply_masks(masks, logits)
        with self._lock:
            outs += self._postprocess(plan, logits, prof)
        self._observe(decision, n_tokens, len(plan), n_keys, time.perf_counter() - t0 - self.speculator.draft_s)
        prof.end_step()
        return outs

    def _schedule(self, now: float) -> tuple[list[RequestOutput], list[Scheduled], object]:
        """(outputs made since the last step, this step's plan, the measured scheduler's decision or None). The
        speculator drafts before the scheduler plans, outside the lock (a draft model runs a forward pass); the
        scheduler asks it how many drafted tokens each decode runs as it spends the budget."""
        with self._lock:
            outs, self._pending = self._pending, []
            self.kv.expire(now)
            for seq, error in self.structured.ready():          # grammars compiled (or failed) since the last step
                if error is None:
                    self.scheduler.add(seq)
                else:
                    seq.error = error                   # in no queue, holding no blocks
                    seq.finish("error", now)
                    self._seqs.pop(seq.request_id, None)
                    outs.append(seq.output([], []))
            decision = self.budgeter.decide(self.scheduler, now) if self.budgeter is not None else None
            budget = self.scheduler.step_budget(decision and decision.budget)
            running = list(self.scheduler.running)
            waiting = [s for s in self.scheduler.waiting if s.spec is not None]
        offers = self.speculator.propose(running, waiting)
        offers = self.structured.trim_drafts(offers, self.speculator.draft_tokens)

        def k_for(seq, room: int, planned: int) -> int:
            return self.speculator.k_for(seq, offers.get(seq, 0), room, planned)
        with self._lock:
            plan = self.scheduler.schedule(budget, k_for if offers else None, decision and decision.max_running)
        return outs, plan, decision

    def _observe(self, decision, n_tokens: int, n_seqs: int, n_keys: int, wall: float) -> None:
        """What the step cost (the draft model's share not included: the speculator prices it apart), for the
        speculator's choice of k, the paced budget and the measured scheduler's cost model."""
        self.costs.add(n_tokens, wall, n_seqs)
        self._keys_per_token = n_keys / max(1, n_tokens)
        if self.cost_model is not None:
            self.cost_model.observe(n_tokens, n_seqs, n_keys, wall)
        if decision is not None:
            decision.measured_s = wall
            self.decisions.append(decision)
            if self.engine_config.explain:
                log.info(decision.line(self.steps))

    def _postprocess(self, plan: list[Scheduled], logits: np.ndarray, prof) -> list[RequestOutput]:
        """Choose the tokens of the sequences whose logits came back (verifying their drafts), advance every
        planned sequence by what was computed, then detokenize, check their stops and free the finished."""
        now = time.perf_counter()
        chosen, row, scored = [], 0, None
        for s in plan:
            seq, first = s.seq, row
            row += 1 + s.k if s.samples else 0
            if seq.prompt_logprobs is not None:     # its prompt rows come after every sampled row
                scored = [] if scored is None else scored
                scored.append(s)
            if seq.finished:                        # aborted while the step ran
                continue
            if not s.samples:
                self.scheduler.computed(s)
                continue
            if seq.max_tokens == 0:                 # the prompt only: it ends without a token
                seq.finish_reason = "length"
                chosen.append((s, [], 0))
                continue
            try:
                chosen.append((s, *self._choose(seq, s, logits, first)))
            except SamplerError as e:               # NaN logits and the like: this request only
                seq.error = str(e)
                chosen.append((s, [], 0))
        if scored is not None:
            self._prompt_logprobs(scored, logits, row)
        prof.lap("sample")
        outs = []
        for s, toks, accepted in chosen:
            seq = s.seq
            if seq.error is not None:
                self._finish(seq, "error", now)
                outs.append(seq.output([], []))
                continue
            pieces, emitted = [], []
            try:
                for t in toks:
                    pieces.append(seq.append(t, now))
                    emitted.append(t)
                    if seq.finish_reason is not None:
                        break
            except StructuredOutputError as e:      # a token its grammar refuses: an engine bug, this request only
                seq.error = str(e)
                self._finish(seq, "error", now)
                outs.append(seq.output(emitted, pieces))
                continue
            a = min(accepted, len(emitted))
            if seq.logprobs is not None and len(emitted) < len(toks):   # it ended among its verified tokens
                del seq.logprobs[len(seq.output_ids):]
            if s.k:
                self.speculator.accepted(seq, s.k, a)
            self.scheduler.computed(s, n_accepted=a)
            if seq.finish_reason is not None:
                self._finish(seq, None, now)
            outs.append(seq.output(emitted, pieces))
        prof.lap("detokenize")
        return outs

    @staticmethod
    def _prompt_logprobs(scored: list[Scheduled], logits: np.ndarray, row: int) -> None:
        """Take the prompt logprobs of the planned sequences that want them from their rows, which start at
        logits[row] (after the sampled rows), in plan order (lumen.engine.runner.Runner.run_plan)."""
        for s in scored:
            first, count = s.seq.prompt_rows(s.start, s.n)
            if count and not s.seq.finished:
                s.seq.add_prompt_logprobs(logits[row:row + count], first)
            row += count

    def _choose(self, seq: Sequence, s: Scheduled, logits: np.ndarray, row: int) -> tuple[list, int]:
        """(tokens, drafts accepted) for a sequence whose logits start at logits[row]. Every row goes through
        the request's TokenChooser.process first (bias, min_tokens, penalties), and logprobs come from it."""
        ch, hist, n_out = seq.chooser, seq.tokens, len(seq.output_ids)
        if not self.speculator.drafted(seq, s.k):
            x = ch.process(logits[row], hist, n_out)
            tok = ch.pick(x, len(hist))
            if seq.logprobs is not None:
                seq.logprobs.append(ch.logprobs(x, tok))
            return [tok], 0
        draft, done = self.speculator.draft_tokens(seq, s.k), {}

        def processed(i: int) -> np.ndarray:        # row i sees the drafts before it as history
            if i not in done:
                done[i] = ch.process(logits[row + i], hist + draft[:i], n_out + i)
            return done[i]
        toks, accepted = self.speculator.verify(seq, s.k, processed)
        if seq.logprobs is not None:
            for i, t in enumerate(toks):
                seq.logprobs.append(ch.logprobs(processed(i), t))
        return toks, accepted

    def _finish(self, seq: Sequence, reason: str | None, now: float) -> None:
        if seq.kv_hold and reason is None:          # stop or length: its KV is held for a decode engine
            self.kv.request_finished(seq, now)
        self.scheduler.finish(seq, reason, now)
        self.speculator.finish(seq)
        self._seqs.pop(seq.request_id, None)

    # ---- conveniences: both are clients of add_request / step / abort
    def generate(self, prompts, params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; results in input order. params: one for all,
        or one per prompt; None is SamplingParams(): temperature 1 and no max_tokens, so each request runs to an
        end token or the end of its context. A prompt that cannot be served gets finish_reason "error" and its
        message; params that are not SamplingParams are a TypeError."""
        if self.closed:                             # (else each prompt's output would be an "error" one)
            raise LumenError("this engine is closed (engine.close(), or the end of its `with` block)")
        if isinstance(prompts, (str, np.ndarray)) or (isinstance(prompts, (list, tuple)) and prompts
                                                      and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if isinstance(prompts, (dict, bytes)) or not hasattr(prompts, "__iter__"):
            raise TypeError(f"prompts must be a string, a list of token ids or a list of those, got "
                            f"{type(prompts).__name__}")
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif isinstance(params, dict) or not hasattr(params, "__iter__"):     # (a dict: a list of its keys)
            raise TypeError(f"params must be a lumen.SamplingParams or a list of them, one per prompt, got "
                            f"{type(params).__name__}")
        params = list(params)
        for sp in params:
            if sp is not None and not isinstance(sp, SamplingParams):
                raise TypeError(f"params must be a lumen.SamplingParams or a list of them, one per prompt, got a "
                                f"list holding a {type(sp).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        results: list[RequestOutput | None] = [None] * len(prompts)
        order = {}                                  # request id -> its index; its outputs queue as a stream's do,
        try:                                        # so any thread's step (another generate's) hands them over
            for i, (p, sp) in enumerate(zip(prompts, params)):
                try:
                    with self._lock:
                        rid = self.add_request(p, sp)
                        self._streams[rid] = deque()
                    order[rid] = i
                except (LumenError, ValueError) as e:
                    now = time.perf_counter()
                    results[i] = RequestOutput(f"invalid-{i}", [], [], "", True, "error",
                                               RequestMetrics(arrival=now, finished=now), error=str(e))
            while order:
                if not any(self._streams[rid] for rid in order):
                    if not self.step() and not self.has_unfinished() and not any(self._streams[r] for r in order):
                        raise LumenError(f"{len(order)} request(s) left the engine without a final output")
                for rid in list(order):
                    q = self._streams[rid]
                    while q:
                        out = q.popleft()
                        if out.finished:
                            results[order.pop(rid)] = out
                            self._streams.pop(rid, None)
                            break
        finally:                                    # interrupted: its requests must not run on unseen
            for rid in order:
                self._drop(rid)
        return results

    def stream(self, prompt, params: SamplingParams | None = None, *, metrics: RequestMetrics | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[RequestOutput]:
        """Yield the request's outputs as its tokens arrive (other requests advance too). Closing the iterator
        early, or dropping it, aborts the request. The request is queued at once (a bad one raises here, not at
        the first next). Several streams may be followed at once, interleaved or from several threads. stop, if
        given, is asked before every step the iterator runs: true ends the stream and aborts the request, so a
        caller (Ctrl-C in lumen.chat) is heard between a long prompt's chunks, not only when a token comes."""
        if stop is not None and not callable(stop):   # (else "'int' object is not callable" at the first next)
            raise TypeError(f"stop must be a callable that returns true to end the stream, or None, got "
                            f"{type(stop).__name__} (stop strings go in SamplingParams(stop=...))")
        with self._lock:                            # registered before any step can make its first output
            rid = self.add_request(prompt, params, metrics=metrics)
            self._streams[rid] = deque()
        return _Stream(self, rid, stop)

    def _follow(self, rid: str, stop: Callable[[], bool] | None = None) -> Iterator[RequestOutput]:
        q, done = self._streams[rid], False
        try:
            while not done:
                if not q:
                    if stop is not None and stop():
                        return                      # (finally: not done, so aborted)
                    if not self.step() and not q and not self.has_unfinished():
                        raise LumenError(f"request {rid} left the engine without a final output")
                    continue
                out = q.popleft()
                done = out.finished
                yield out
        finally:
            self._drop(rid, done)

    def _drop(self, rid: str, done: bool = False) -> None:
        """A stream is closed: forget its queue and abort its request unless it ended."""
        if self._streams.pop(rid, None) is not None and not done:
            self.abort(rid)

    # ---- the end
    def close(self) -> None:
        """Abort every request and stop the grammar threads; later requests raise LumenError. Streams still
        followed end with their "abort" output. Idempotent; `with lumen.Engine(...) as engine:` calls it."""
        with self._lock:
            self.closed = True
            rids = list(self._seqs)
        for rid in rids:
            self.abort(rid)
        with self._step_lock:                       # (a step under way may still fill its grammar masks)
            self.structured.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- state, for metrics and tests
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.structured.compiling)

    def stats(self) -> dict:
        bm = self.blocks
        return {"running": self.num_running, "waiting": self.num_waiting, "kv_usage": bm.usage,
                "kv_blocks": bm.n_blocks, "kv_free_blocks": bm.num_free, "prefix_hit_tokens": bm.hit_tokens,
                "prefix_query_tokens": bm.query_tokens, "preemptions": self.scheduler.num_preemptions,
                "steps": self.steps, "kv_held_blocks": self.kv.num_held_blocks}


class _Stream:
    """Engine.stream's iterator: a generator over the request's queue that also aborts the request when it is
    closed or garbage-collected before it was ever started (a generator's finally would not run then)."""

    def __init__(self, engine: Engine, rid: str, stop=None):
        self._engine, self._rid = engine, rid
        self._gen = engine._follow(rid, stop)

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()
        self._engine._drop(self._rid)

    def __del__(self):
        self.close()
