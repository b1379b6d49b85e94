"""The serving engine: continuous batching over a paged KV cache, in the loop the field's engines share.

    plan = scheduler.schedule()          which tokens of which requests run this step (lumen.engine.scheduler)
    logits = runner.run(plan)            one forward pass over the ragged batch (lumen.engine.runner)
    outputs = postprocess(plan, logits)  sample, detokenize, stop; free what finished

    engine = lumen.Engine("smollm2-135m", max_num_seqs=16, max_num_batched_tokens=512, kv_cache_mb=512)
    outs = engine.generate(["The capital of France is", "def fib(n):"], lumen.SamplingParams(max_tokens=32))
    rid = engine.add_request("Once upon a time", params); engine.step(); engine.abort(rid)
    for out in engine.stream("Hello", params): print(out.delta_text, end="")

add_request and abort may be called from any thread while another runs step(): the queues are changed under a
lock that step() does not hold while the forward pass runs. An aborted request's blocks are freed at once; a
bad request gets an error of its own (finish_reason "error" when it was already running) and never disturbs
the others. Batch invariance: a request's logits are bit-identical whatever runs beside it, whatever the
chunk size or token budget, with or without a prefix-cache hit (lumen.kernels.attention), and each request
samples with its own RNG, so its tokens are too.
"""
from __future__ import annotations

import itertools
import logging
import os
from collections import deque
import threading
import time
from typing import Iterator, Sequence as Seq

import numpy as np

from ..errors import ContextError, LumenError
from ..kernels.attention import BLOCK
from ..profile import active as profiler_active
from .sampler import SamplerError
from .block_manager import BlockManager
from .runner import Runner
from .sampling import SamplingParams
from .scheduler import Scheduled, Scheduler
from .budget import MeasuredBudget
from .costs import StepCosts, calibrate
from .sequence import RequestOutput, Sequence, Status
from .speculative import PRIOR, DraftModel, NgramDrafter, SpecState, choose_k, skipped, update_alpha, verify

log = logging.getLogger("lumen.engine")
DEFAULT_KV_CACHE_MB = 1024        # capped at a fifth of the memory available when the engine starts


class RequestError(LumenError, ValueError):
    """A request cannot be served (bad prompt, too long, cannot ever fit); the engine is unaffected."""


def _available_mb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Engine:
    def __init__(self, model, *, threads: int | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 512, kv_cache_mb: float | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 pack_cache: bool | None = None, draft_model=None, num_speculative_tokens: int = 5,
                 ngram_min: int = 1, ngram_max: int = 4, adaptive_k: bool = True, scheduler: str = "fcfs",
                 slo_ttft_s: float | None = None,
                 slo_tpot_s: float | None = None, explain: bool = False, cost_grid: str = "full",
                 adaptive_threads: bool = True, _runner: Runner | None = None):
        """model: a registry name, a .gguf path, or a loaded lumen.Model (its weights are shared).
        max_model_len: longest prompt + output (default: the model's trained context).
        kv_cache_mb: the KV block pool's size (default min(1024, a fifth of the available memory)).
        Speculative decoding (per request: SamplingParams(speculative="ngram" | "draft")): draft_model, a
        model with the target's vocabulary (name, path or lumen.Model) for "draft"; num_speculative_tokens, the
        most tokens drafted per step (a request may ask for fewer); ngram_min/ngram_max, the n-gram sizes the
        "ngram" drafter matches (lumen.engine.speculative); adaptive_k, choose each step's k from the request's
        acceptance rate and the measured step costs (False: always the most, as a fixed-k engine does).
        scheduler: "fcfs" (a fixed token budget, max_num_batched_tokens) or "measured": each step's budget chosen
        from this machine's measured step costs (lumen.engine.costs, lumen.engine.budget), for the SLO targets
        slo_ttft_s and slo_tpot_s when given (goodput), else for throughput; max_num_batched_tokens is then the
        largest budget. cost_grid: "full" (~30 s, cached in $LUMEN_HOME/costs) or "tiny" (tests). explain: log
        every step's decision (predicted and measured cost, the alternative rejected). threads: the most threads
        a step uses; adaptive_threads: fewer while other processes (or a server's event loop) want the cores
        (lumen.engine.threads), else always `threads`."""
        from .llm import Model, load_parts
        for name, v, lo in (("max_num_seqs", max_num_seqs, 1), ("max_num_batched_tokens", max_num_batched_tokens, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.model = model if isinstance(model, Model) else None
        parts = model.parts if isinstance(model, Model) else load_parts(model, pack_cache=pack_cache)
        self.parts = parts
        cfg = parts.config
        self.config, self.tokenizer = cfg, parts.tokenizer
        self.threads = parts.set_threads(threads)
        if max_model_len is None:
            max_model_len = cfg.ctx_train
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.max_model_len = max_model_len
        self.end_ids = frozenset(parts.tokenizer.eot_ids)
        max_blocks = -(-max_model_len // BLOCK)
        if _runner is None:
            per_block = cfg.n_layer * cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v) * BLOCK * 2
            if kv_cache_mb is None:
                avail = _available_mb()
                kv_cache_mb = DEFAULT_KV_CACHE_MB if avail is None else min(DEFAULT_KV_CACHE_MB, avail / 5)
            if not isinstance(kv_cache_mb, (int, float)) or isinstance(kv_cache_mb, bool) or kv_cache_mb <= 0:
                raise ValueError(f"kv_cache_mb must be a positive number, got {kv_cache_mb!r}")
            n_blocks = int(kv_cache_mb * 2 ** 20 // per_block)
            if n_blocks < 1:
                raise ValueError(f"kv_cache_mb={kv_cache_mb} holds no block ({per_block} bytes each)")
            _runner = Runner(cfg, parts.bundle, parts.rope_freqs, n_blocks=n_blocks,
                             max_tokens=max_num_batched_tokens, max_rows=max_num_seqs, max_blocks=max_blocks,
                             n_threads=self.threads, adaptive_threads=adaptive_threads)
        self.runner = _runner
        self.max_num_seqs = min(max_num_seqs, _runner.max_rows)
        self.max_num_batched_tokens = min(max_num_batched_tokens, _runner.max_tokens)
        self.blocks = BlockManager(_runner.n_blocks, _runner.table, prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens,
                                   chunked_prefill=enable_chunked_prefill)
        if not isinstance(num_speculative_tokens, int) or not 1 <= num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {num_speculative_tokens!r}")
        self.k_max = num_speculative_tokens
        self.adaptive_k = bool(adaptive_k)
        self.ngram = NgramDrafter(ngram_min, ngram_max)
        self.draft = None
        if draft_model is not None:
            self.draft = DraftModel(draft_model, self, threads=self.threads)
        self.costs = StepCosts()
        if scheduler not in ("fcfs", "measured"):
            raise ValueError(f"scheduler must be 'fcfs' or 'measured', got {scheduler!r}")
        for name, v in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1e6):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if scheduler == "fcfs" and (slo_ttft_s is not None or slo_tpot_s is not None):
            raise ValueError("SLO targets need scheduler='measured'")
        self.cost_model = self.budgeter = None
        if scheduler == "measured":
            self.cost_model = calibrate(self, tiny=cost_grid == "tiny")
            self.budgeter = MeasuredBudget(self.cost_model, max_tokens=self.max_num_batched_tokens,
                                           slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
        self.explain = explain
        self.decisions: deque = deque(maxlen=4096)  # the measured scheduler's decisions, newest last
        self.spec_rule = "exact"        # the acceptance rule; tests set a wrong one to show their test fails it
        self._lock = threading.RLock()
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []     # outputs made outside step() (aborts), returned by the next
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}-{id(self) & 0xffff:x}-"
        self.steps = 0

    # ---- requests
    def _prompt_ids(self, prompt, params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_bos=self.tokenizer.add_bos_default, special=params.special)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise RequestError("a token-id prompt must hold integers") from None
            if any(isinstance(t, (bool, np.bool_)) or isinstance(t, float) for t in prompt):
                raise RequestError("a token-id prompt must hold integers")
            V = self.config.n_vocab
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{V - 1})")
        else:
            raise RequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("the prompt is empty (no tokens)")
        return ids

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises RequestError (a ValueError) when it cannot be served."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a lumen.SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.config.n_vocab)
        if params.speculative == "draft" and self.draft is None:
            raise RequestError("speculative='draft' needs a draft model: Engine(..., draft_model=...)")
        ids = self._prompt_ids(prompt, params)
        n = len(ids)
        if n >= self.max_model_len:
            raise ContextError(f"the prompt has {n} tokens; max_model_len is {self.max_model_len}, which must "
                               f"also leave room for at least one generated token")
        room = self.max_model_len - n
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ContextError(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds max_model_len "
                               f"({self.max_model_len})")
        if self.blocks.blocks_for(n + max_tokens) > self.blocks.n_blocks:
            raise RequestError(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) needs "
                               f"{self.blocks.blocks_for(n + max_tokens)} KV blocks but the pool has "
                               f"{self.blocks.n_blocks}; raise kv_cache_mb or lower max_tokens")
        with self._lock:
            rid = request_id if request_id is not None else self._prefix + str(next(self._ids))
            if rid in self._seqs:
                raise RequestError(f"request id {rid!r} is already in use")
            seq = Sequence(rid, ids, params, max_tokens, self.tokenizer, self.end_ids)
            if params.speculative is not None:
                seq.spec = SpecState()
            self._seqs[rid] = seq
            self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks now; unknown or finished ids are a no-op."""
        with self._lock:
            seq = self._seqs.pop(request_id, None)
            if seq is None or seq.finished:
                return
            self.scheduler.finish(seq, "abort")
            seq.metrics.finished = time.perf_counter()
            self._pending.append(seq.output([], []))

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_work or bool(self._pending)

    # ---- the loop
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every request that advanced or ended."""
        prof = profiler_active()
        prof.begin_step("decode")
        t0 = time.perf_counter()
        with self._lock:
            outs, self._pending = self._pending, []
            decision = self.budgeter.decide(self.scheduler, t0) if self.budgeter is not None else None
            plan = self.scheduler.schedule(budget=decision and decision.budget, speculate=self._speculate,
                                           max_running=decision and decision.max_running)
        if not plan:
            prof.cancel_step()
            return outs
        self.steps += 1
        prof.lap("schedule")
        self._draft(plan)
        logits, n_tokens, n_keys = self._run(plan, prof)
        with self._lock:
            outs += self._postprocess(plan, logits, prof)
        wall = time.perf_counter() - t0
        self.costs.add(n_tokens, wall)
        if self.cost_model is not None:
            self.cost_model.observe(n_tokens, len(plan), n_keys, wall)
            decision.measured_s = wall
            self.decisions.append(decision)
            if self.explain:
                log.info(decision.line(self.steps))
        prof.end_step()
        return outs

    # ---- speculative decoding (lumen.engine.speculative)
    def _speculate(self, seq: Sequence, room: int, planned: int) -> int:
        """Drafted tokens for a decoding sequence: k with the most expected tokens per second of step time, by
        its acceptance rate and the step times measured for that many tokens (0: plain decode pays more)."""
        st = seq.spec
        k_max = min(room, seq.params.num_speculative_tokens or self.k_max)
        if k_max <= 0:
            return 0
        alpha, n = st.alpha, None
        if seq.params.speculative == "ngram":
            n = self.ngram.match(st, seq.tokens)
            if n is None:
                return 0                                            # nothing to draft from
            alpha = st.alpha_n.get(n, PRIOR)
        if not self.adaptive_k:
            return k_max
        base = planned + 1
        c0 = self.costs.predict(base)
        if c0 is None or not self.costs.known(base + k_max):       # not measured yet: explore both ends
            return 0 if st.steps % 8 == 7 and not self.costs.known(base) else k_max
        cost = lambda k: self.costs.predict(base + k) or c0  # noqa: E731
        k = choose_k(alpha, k_max, cost)
        if k == 0 and n is not None:
            skipped(st, n)
        return k

    def _draft(self, plan: list[Scheduled]) -> None:
        """Fill in the drafts of the planned sequences that reserved room for them. A sampled request that
        speculates also gets the draft's token for the position after its verified ones (and for a position it
        samples without drafting), which lumen.engine.speculative.verify decides by the acceptance rule."""
        by_kind: dict[str, list] = {}
        for s in plan:
            seq = s.seq
            extra = int(s.samples and seq.spec is not None and not seq.chooser.sampler.greedy
                        and bool(seq.output_ids))
            if s.k or extra:
                by_kind.setdefault(seq.params.speculative, []).append((seq, s.k + extra))
        got = {}
        if "ngram" in by_kind:
            got.update(self.ngram.propose(by_kind["ngram"]))
        if "draft" in by_kind:
            got.update(self.draft.propose(by_kind["draft"]))
        for s in plan:
            d = got.get(s.seq)
            if d is not None:
                s.draft, s.q, s.proposal = d.tokens[:s.k], d.q, d

    def _run(self, plan: list[Scheduled], prof) -> tuple[np.ndarray, int, int]:
        """Fill the runner's batch from the plan and run the forward pass; logits of the sampled rows (a
        speculating sequence: its last 1 + len(draft) rows), the step's tokens and the keys attention reads."""
        r = self.runner
        i, out_rows, kv_tokens, n_keys, n_decode = 0, [], 0, 0, 0
        for s in plan:
            seq = s.seq
            toks = seq.tokens[s.start:s.start + s.n]
            i = r.set_tokens(i, toks + s.draft if s.draft else toks, s.start, seq.row)
            n = s.n + len(s.draft)
            kv_tokens += s.start + n
            n_keys += n * s.start + n * (n + 1) // 2
            n_decode += s.n == 1
            if s.samples:
                out_rows.extend(range(i - 1 - len(s.draft), i))
        phase = "decode" if n_decode == len(plan) else "prefill" if n_decode == 0 else "mixed"
        n_out = r.set_out_rows(out_rows)
        if prof.enabled:
            prof.describe(phase, i, len(plan), kv_tokens, tuple(s.seq.request_id for s in plan))
            prof.lap("prepare")
        return r.forward(i, n_out), i, n_keys

    def _postprocess(self, plan: list[Scheduled], logits: np.ndarray, prof) -> list[RequestOutput]:
        """Advance every planned sequence by what was computed, choose the tokens of the ones whose logits came
        back (verifying their drafts), then detokenize, check their stops and free the finished."""
        now = time.perf_counter()
        chosen, k = [], 0
        for s in plan:
            seq = s.seq
            row = k
            k += (1 + len(s.draft)) if s.samples else 0
            if seq.finished:                        # aborted while the step ran
                continue
            if seq.metrics.first_scheduled is None:
                seq.metrics.first_scheduled = now
            if not s.samples:
                self.scheduler.computed(s)
                continue
            try:
                toks, accepted = self._choose(seq, s, logits, row)
            except SamplerError as e:               # NaN logits and the like: this request only
                chosen.append((s, str(e), 0))
                continue
            chosen.append((s, toks, accepted))
        prof.lap("sample")
        outs = []
        for s, toks, accepted in chosen:
            seq = s.seq
            if isinstance(toks, str):
                seq.error = toks
                self._finish(seq, "error", now)
                outs.append(seq.output([], []))
                continue
            pieces, emitted = [], []
            for t in toks:
                pieces.append(seq.append(t, now))
                emitted.append(t)
                if seq.finish_reason is not None:
                    break
            if s.proposal is not None and s.draft:
                a = min(accepted, len(emitted))
                update_alpha(seq.spec, len(s.draft), a, n=s.proposal.n)
                seq.metrics.spec_proposed += len(s.draft)
                seq.metrics.spec_accepted += a
                seq.metrics.spec_steps += 1
                self.scheduler.computed(s, n_accepted=a)
            else:
                self.scheduler.computed(s)
            if seq.finish_reason is not None:
                self._finish(seq, None, now)
            outs.append(seq.output(emitted, pieces))
        prof.lap("detokenize")
        return outs

    def _choose(self, seq: Sequence, s: Scheduled, logits: np.ndarray, row: int) -> tuple[list, int]:
        """(tokens, drafts accepted) for a sequence whose logits start at logits[row]."""
        ch = seq.chooser
        hist, n_out = seq.tokens, len(seq.output_ids)
        if s.proposal is None:
            x = ch.process(logits[row], hist, n_out)
            tok = ch.pick(x, len(hist))
            if seq.logprobs is not None:
                seq.logprobs.append(ch.logprobs(x, tok))
            return [tok], 0
        done: dict[int, np.ndarray] = {}

        def processed(i: int) -> np.ndarray:        # row i sees the drafts before it as history
            if i not in done:
                done[i] = ch.process(logits[row + i], hist + s.draft[:i], n_out + i)
            return done[i]
        toks, accepted = verify(processed, s.proposal, len(s.draft), ch.key, len(hist), ch.sampler, self.spec_rule)
        if seq.logprobs is not None:
            for i, t in enumerate(toks):
                seq.logprobs.append(ch.logprobs(processed(i), t))
        return toks, accepted

    def _finish(self, seq: Sequence, reason: str | None, now: float) -> None:
        self.scheduler.finish(seq, reason)
        seq.metrics.finished = now
        self._seqs.pop(seq.request_id, None)

    # ---- conveniences
    def generate(self, prompts, params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; results in input order. params: one for all,
        or one per prompt. A prompt that cannot be served gets finish_reason "error" and its message."""
        if isinstance(prompts, (str, np.ndarray)) or (isinstance(prompts, (list, tuple)) and prompts
                                                      and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        results: list[RequestOutput | None] = [None] * len(prompts)
        order = {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                order[self.add_request(p, sp)] = i
            except (LumenError, ValueError) as e:
                results[i] = RequestOutput(f"invalid-{i}", [], [], "", True, "error",
                                           _empty_metrics(), error=str(e))
        while order:
            for out in self.step():
                i = order.get(out.request_id)
                if i is not None and out.finished:
                    results[i] = out
                    del order[out.request_id]
        return results

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's outputs as its tokens arrive (other requests advance too). Closing the iterator
        early aborts the request."""
        rid = self.add_request(prompt, params)
        done = False
        try:
            while not done:
                for out in self.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.abort(rid)

    # ---- state, for metrics and tests
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> dict:
        bm = self.blocks
        return {"running": self.num_running, "waiting": self.num_waiting, "kv_usage": bm.usage,
                "kv_blocks": bm.n_blocks, "kv_free_blocks": bm.num_free, "prefix_hit_tokens": bm.hit_tokens,
                "prefix_query_tokens": bm.query_tokens, "preemptions": self.scheduler.num_preemptions,
                "steps": self.steps}


def _empty_metrics():
    from .sequence import RequestMetrics
    now = time.perf_counter()
    return RequestMetrics(arrival=now, finished=now)
