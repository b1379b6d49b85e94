"""The model object: a validated GGUF file, its Config, tokenizer, weights, run state, and the two entry points
`prefill` (a chunk of prompt tokens at once) and `decode` (one token), over the same weights and KV cache."""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from .config import ROPE_NEOX, Config, check_tensors, config_from_metadata
from .errors import ContextError, ContextWarning, GGUFError, LumenError
from .forward import forward_kernel
from .gguf import GGUFFile
from .profiler import active as profiler_active
from .profiler import forward_costs
from .timer import tick_rate, ticks

DEFAULT_CTX = 2048
DEFAULT_BATCH = 256
PAR_ROWS = 8  # rows at which the small ops (norms, rope, adds) switch to their parallel kernels


def _supported_types():
    from .quants import SUPPORTED
    return SUPPORTED


def build_tokenizer(meta):
    """The tokenizer described by the metadata. Any failure inside a tokenizer library on corrupt metadata
    becomes a GGUFError, so a bad file never surfaces as a foreign exception."""
    from .tokenizer import Tokenizer
    try:
        return Tokenizer.from_metadata(meta)
    except LumenError:
        raise
    except Exception as e:  # noqa: BLE001 - third-party tokenizer libraries raise anything on bad vocabularies
        raise GGUFError(f"the tokenizer metadata is invalid: {type(e).__name__}: {e}") from e


def open_gguf(path: str | os.PathLike) -> tuple[GGUFFile, Config]:
    """Parse, validate and check a GGUF file against its architecture's tensor contract."""
    g = GGUFFile(path)
    cfg = config_from_metadata(g.metadata)
    check_tensors(cfg, g.tensors, _supported_types())
    return g, cfg


class Token(NamedTuple):
    """One generated token: its id and the text it makes printable now (may be '' while a UTF-8 character or a
    possible stop string is incomplete)."""
    id: int
    text: str


@dataclass
class GenStats:
    """Timings of one generate() call. TTFT = prompt processing + first token; TPOT = mean time per later token."""
    prompt_tokens: int = 0
    gen_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""
    itl_s: list = field(default_factory=list)  # inter-token latencies of decode steps

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = len(self.itl_s)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tpot_s(self) -> float:
        return self.decode_s / len(self.itl_s) if self.itl_s else 0.0


class Model:
    """A loaded model. Construct with `lumen.load(name_or_path, ctx=..., threads=...)`."""

    def __init__(self, path: str | os.PathLike, *, ctx: int | None = None, threads: int | None = None,
                 n_batch: int = DEFAULT_BATCH, pack_cache: bool | None = None):
        """ctx: None = DEFAULT_CTX, or the trained context if smaller; beyond the trained context warns.
        pack_cache: read the repacked weights from the on-disk cache (lumen.packcache) when valid, store them
        there otherwise; None = on unless LUMEN_PACK_CACHE=0."""
        import numba
        self.path = Path(path)
        self.gguf, self.config = open_gguf(self.path)
        self.tokenizer = build_tokenizer(self.gguf.metadata)
        if ctx is None:
            ctx = min(DEFAULT_CTX, self.config.ctx_train)
        if not isinstance(ctx, int) or ctx < 1:
            raise ValueError(f"ctx must be a positive integer, got {ctx!r}")
        if ctx > self.config.ctx_train:
            warnings.warn(ContextWarning(f"ctx={ctx} is beyond the {self.config.ctx_train} tokens this model was "
                                         "trained on (output past that is unreliable)"), stacklevel=2)
        if not isinstance(n_batch, int) or n_batch < 1:
            raise ValueError(f"n_batch must be a positive integer, got {n_batch!r}")
        max_threads = numba.config.NUMBA_NUM_THREADS
        if threads is not None:
            if not isinstance(threads, int) or not 1 <= threads <= max_threads:
                raise ValueError(f"threads must be between 1 and {max_threads}, got {threads!r}")
            numba.set_num_threads(threads)
        self.threads = numba.get_num_threads()
        self.n_ctx = ctx
        self.n_batch = min(n_batch, ctx)
        from .forward import F_PAR_ROWS
        from .kernels.dequant import F16_TO_F32
        from .state import RunState
        from .weights import load_weights
        self.weights = load_weights(self.gguf, self.config, pack_cache=pack_cache)
        self.state = RunState(self.config, ctx, self.n_batch, self.threads, self.weights.rope_freqs)
        c = self.config
        flags = np.zeros(F_PAR_ROWS + 1, np.int64)
        flags[:] = [c.qkv_bias, c.qk_norm, c.post_norms, c.act == "gelu", c.rope_type == ROPE_NEOX, c.n_head,
                    c.n_head_kv, c.head_dim, c.head_dim_v, c.n_layer, PAR_ROWS]
        self._flags = flags
        self._params = np.array([c.rms_eps, c.attn_scale, c.embd_scale], np.float32)
        self._lut = F16_TO_F32

    # ---- tokenizer ----
    @property
    def metadata(self) -> dict:
        return self.gguf.metadata

    def tokenize(self, text: str, *, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Text -> token ids. add_bos=None uses the model's default (tokenizer.ggml.add_bos_token)."""
        if add_bos is None:
            add_bos = self.tokenizer.add_bos_default
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids)

    # ---- forward ----
    def reset(self) -> None:
        """Forget the sequence: the next prefill starts at position 0."""
        self.state.n_past = 0

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("expected a non-empty 1-D sequence of token ids")
        if ids.min() < 0 or ids.max() >= self.config.n_vocab:
            bad = int(ids[(ids < 0) | (ids >= self.config.n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.config.n_vocab - 1})")
        if self.state.n_past + ids.size > self.n_ctx:
            raise ContextError(f"{self.state.n_past} tokens in the cache + {ids.size} new ones exceed the context "
                               f"of {self.n_ctx} tokens; load the model with a larger ctx (max trained: "
                               f"{self.config.ctx_train})")

    def _run(self, ids: np.ndarray, n_out: int, phase: str, logits: np.ndarray | None = None) -> np.ndarray:
        """One forward call over a chunk (len <= n_batch) at the current position; returns logits (n_out, V),
        written into `logits` when given (C-contiguous float32 (n_out, V))."""
        st, w = self.state, self.weights
        N = ids.size
        pos0 = st.n_past
        positions = np.arange(pos0, pos0 + N, dtype=np.int64)
        if logits is None:
            logits = st.logits_rows(n_out)
        pk = w.packs
        prof = profiler_active()
        if prof is not None:
            own_step = not prof.in_step
            if own_step:
                prof.begin_step(phase, N, pos0)
        forward_kernel(w.buf, w.mt, w.gt, pk.table, pk.q, pk.q8, pk.qf, pk.s, pk.o, w.fvec, w.vt, self._flags,
                       self._params, self._lut, ids, positions, pos0, n_out, st.x[:N], st.xn[:N], st.q[:N], st.k[:N], st.v[:N], st.att[:N], st.ffa[:N],
                       st.ffb[:N], logits, st.mmscratch, st.k_cache, st.v_cache, st.windows, st.rope_sel,
                       st.cos_tab, st.sin_tab, st.s_att, st.o_att, st.ml_att, st.times, prof is not None)
        if prof is not None:  # the bookkeeping here is the profiler's own cost, kept out of the step's time
            c_exit = ticks()
            if not own_step:
                prof.pause(at=c_exit)
            prof.record_forward(c_exit, st.times, forward_costs(self, N, pos0, n_out))
            if own_step:
                prof.end_step(at=c_exit)
            else:
                prof.resume()
        st.n_past += N
        return logits[:n_out]

    def prefill(self, ids: Sequence[int], *, all_logits: bool = False) -> np.ndarray:
        """Run prompt tokens through the model in chunks of n_batch, appending to the cache. Returns the last
        position's logits (V,), or every position's (len(ids), V) when all_logits."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        self._check_ids(ids)
        out = np.empty((ids.size, self.config.n_vocab), np.float32) if all_logits else None
        last = None
        for a in range(0, ids.size, self.n_batch):
            chunk = ids[a:a + self.n_batch]
            if all_logits:
                self._run(chunk, chunk.size, "prefill", out[a:a + chunk.size])
            else:
                last = self._run(chunk, 1, "prefill")
        return out if all_logits else last[0].copy()

    def decode(self, token: int) -> np.ndarray:
        """Run one token at the next position; returns its logits (V,) (a view, valid until the next call)."""
        ids = np.array([token], dtype=np.int64)
        self._check_ids(ids)
        return self._run(ids, 1, "decode")[0]

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits (len(ids), n_vocab) for a fresh sequence."""
        self.reset()
        return self.prefill(ids, all_logits=True)

    def warmup(self) -> float:
        """Compile the forward kernel (or load it from Numba's cache) with one throwaway token; returns seconds."""
        t = time.perf_counter()
        self.reset()
        self.decode(0)
        self.reset()
        return time.perf_counter() - t

    # ---- generation ----
    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repeat_last_n: int = 64,
                 seed: int | None = None, stop: Sequence[str] = (), special: bool = False,
                 stats: GenStats | None = None) -> Iterator[Token]:
        """Yield generated tokens as they are produced, from a fresh sequence.

        prompt: text (tokenized with the model's BOS default; `special` parses special-token text) or token ids.
        Stops at max_tokens, an end-of-generation token (EOS / end-of-turn from the metadata), or a stop string
        (the text before it is yielded, the stop string itself is not). The end-of-generation token itself is
        yielded only if it releases held-back text (a possible stop-string prefix), with that text.
        """
        from .sampler import StopChecker, make_logits_processors, make_sampler
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
        sample = make_sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        process = make_logits_processors(repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                                         frequency_penalty=frequency_penalty, last_n=repeat_last_n)
        ids = self.tokenize(prompt, special=special) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty (no tokens); give some text or token ids")
        if len(ids) + max_tokens > self.n_ctx:
            raise ContextError(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                               f"context of {self.n_ctx} tokens; use a larger ctx or fewer tokens")
        stats = stats if stats is not None else GenStats()
        stats.prompt_tokens = len(ids)
        return self._generate(ids, max_tokens, sample, process, StopChecker(list(stop)), stats)

    def _generate(self, ids, max_tokens, sample, process, stopper, stats) -> Iterator[Token]:
        eog = self.tokenizer.eot_ids
        stream = self.tokenizer.stream()
        history = list(ids)
        prof = profiler_active()
        self.reset()
        t0 = time.perf_counter()
        logits = self.prefill(ids)
        stats.prefill_s = time.perf_counter() - t0
        try:
            yield from self._loop(ids, max_tokens, sample, process, stopper, stats, eog, stream, history, prof,
                                  logits, t0)
        finally:
            if prof is not None and prof.in_step:
                prof.end_step()

    def _loop(self, ids, max_tokens, sample, process, stopper, stats, eog, stream, history, prof, logits, t0):
        """The decode loop; with a profiler, one step per token: sample, detokenize, decode (consumer excluded)."""
        t_last = None
        for i in range(max_tokens):
            if prof is not None:
                if prof.in_step:
                    prof.end_step()
                prof.begin_step("decode", 1, self.state.n_past)
            tok = sample(process(logits, history))
            if prof is not None:
                prof.lap("sample")
            now = time.perf_counter()
            if i == 0:
                stats.ttft_s = now - t0
            else:
                stats.itl_s.append(now - t_last)
                stats.decode_s += now - t_last
            t_last = now
            stats.gen_tokens += 1
            if tok in eog:
                stats.stop_reason = "eos"
                if prof is not None:
                    prof.pause(at=prof.lap("loop"))
                text, hit = stopper.feed(stream.flush())
                tail = text if hit else text + stopper.flush()
                if tail:
                    yield Token(tok, tail)
                return
            history.append(tok)
            last = i + 1 == max_tokens
            if prof is not None:
                prof.lap("loop")  # the generate loop's own bookkeeping
            text, hit = stopper.feed(stream.push(tok) + (stream.flush() if last else ""))
            if last and not hit:
                text += stopper.flush()
            if prof is not None:
                prof.pause(at=prof.lap("detokenize"))
            if hit:
                stats.stop_reason = "stop"
                if text:
                    yield Token(tok, text)
                return
            yield Token(tok, text)
            if not last:
                if prof is not None:
                    prof.resume()
                logits = self.decode(tok)
                if prof is not None:
                    prof.end_step()
        stats.stop_reason = "length"  # a profiled last step stays paused: it ended when its token was yielded

    def __repr__(self):
        c = self.config
        return f"<lumen.Model {c.arch} {c.name!r}: {c.n_layer} layers, d={c.n_embd}, vocab {c.n_vocab}>"
