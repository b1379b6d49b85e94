"""lumen.Model: one loaded model and one sequence, the S = 1 face of the engine.

`prefill` (a chunk of prompt tokens at once) and `decode` (one token) run the engine's forward pass on a single
sequence whose blocks are the whole pool in order; `logits` is teacher-forced prefill; `generate` runs one
request through the engine (lumen.engine.engine) and yields its tokens as they come.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from ..errors import ContextError, ContextWarning, GGUFError, LumenError
from ..format.gguf import GGUFFile
from ..kernels.attention import BLOCK
from ..model.config import Config, check_tensors, config_from_metadata
from ..model.weights import load_weights
from .runner import Runner
from .sampling import SamplingParams

DEFAULT_CTX = 2048
DEFAULT_BATCH = 256


def build_tokenizer(meta):
    """The tokenizer described by the metadata. Any failure inside a tokenizer library on corrupt metadata
    becomes a GGUFError, so a bad file never surfaces as a foreign exception."""
    from ..format.tokenizer import Tokenizer
    try:
        return Tokenizer.from_metadata(meta)
    except LumenError:
        raise
    except Exception as e:  # noqa: BLE001 - third-party tokenizer libraries raise anything on bad vocabularies
        raise GGUFError(f"the tokenizer metadata is invalid: {type(e).__name__}: {e}") from e


def open_gguf(path: str | os.PathLike) -> tuple[GGUFFile, Config]:
    """Parse, validate and check a GGUF file against its architecture's tensor contract."""
    from ..format.quants import SUPPORTED
    g = GGUFFile(path)
    cfg = config_from_metadata(g.metadata)
    check_tensors(cfg, g.tensors, SUPPORTED)
    return g, cfg


@dataclass
class ModelParts:
    """What a GGUF file becomes, shared read-only by every Model and Engine made from it."""
    path: Path
    gguf: GGUFFile
    config: Config
    tokenizer: object
    weights: object          # lumen.model.weights.LoadedWeights
    bundle: object           # its lumen.engine.forward.Weights bundle
    rope_freqs: np.ndarray | None

    @staticmethod
    def set_threads(threads: int | None) -> int:
        """Set Numba's thread count for the calling thread (None: keep it); returns it."""
        import numba
        max_threads = numba.config.NUMBA_NUM_THREADS
        if threads is not None:
            if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= max_threads:
                raise ValueError(f"threads must be between 1 and {max_threads}, got {threads!r}")
            numba.set_num_threads(threads)
        return numba.get_num_threads()


def load_parts(model: str | os.PathLike, *, pack_cache: bool | None = None) -> ModelParts:
    """A registry name (fetched on first use) or a .gguf path -> its parts."""
    from ..model.store import resolve
    path = resolve(model)
    g, cfg = open_gguf(path)
    tok = build_tokenizer(g.metadata)
    w = load_weights(g, cfg, pack_cache=pack_cache)
    return ModelParts(Path(path), g, cfg, tok, w, w.bundle, w.rope_freqs)


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
    spec_proposed: int = 0                     # speculative decoding: tokens drafted, accepted, verify steps
    spec_accepted: int = 0
    spec_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.spec_accepted + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return len(self.itl_s) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tpot_s(self) -> float:
        return self.decode_s / len(self.itl_s) if self.itl_s else 0.0


class Model:
    """A loaded model. Construct with `lumen.load(name_or_path, ctx=..., threads=...)`."""

    def __init__(self, path: str | os.PathLike, *, ctx: int | None = None, threads: int | None = None,
                 n_batch: int = DEFAULT_BATCH, pack_cache: bool | None = None, parts: ModelParts | None = None,
                 adaptive_threads: bool = True):
        """ctx: tokens of context to allocate (None: DEFAULT_CTX, or the trained context if smaller; beyond the
        trained context warns). n_batch: prefill chunk size. pack_cache: read the repacked weights from the
        on-disk cache (lumen.model.packcache) when valid, store them there otherwise; None = on unless
        LUMEN_PACK_CACHE=0. threads: the most threads a forward pass uses; adaptive_threads: fewer while other
        processes want the cores (lumen.engine.threads), else always `threads`."""
        if parts is None:
            g, cfg = open_gguf(path)
            tok = build_tokenizer(g.metadata)
        else:
            g, cfg, tok = parts.gguf, parts.config, parts.tokenizer
        if ctx is None:
            ctx = min(DEFAULT_CTX, cfg.ctx_train)
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
            raise ValueError(f"ctx must be a positive integer, got {ctx!r}")
        if ctx > cfg.ctx_train:
            warnings.warn(ContextWarning(f"ctx={ctx} is beyond the {cfg.ctx_train} tokens this model was "
                                         "trained on (output past that is unreliable)"), stacklevel=2)
        if not isinstance(n_batch, int) or isinstance(n_batch, bool) or n_batch < 1:
            raise ValueError(f"n_batch must be a positive integer, got {n_batch!r}")
        self.threads = ModelParts.set_threads(threads)
        if parts is None:
            w = load_weights(g, cfg, pack_cache=pack_cache)
            parts = ModelParts(Path(path), g, cfg, tok, w, w.bundle, w.rope_freqs)
        self.parts = parts
        self.path, self.gguf, self.config, self.tokenizer = parts.path, g, cfg, tok
        self.weights = parts.weights
        self.n_ctx = ctx
        self.n_batch = min(n_batch, ctx)
        nb = -(-ctx // BLOCK)
        self.runner = Runner(cfg, parts.bundle, parts.rope_freqs, n_blocks=nb, max_tokens=self.n_batch, max_rows=1,
                             max_blocks=nb, n_threads=self.threads, adaptive_threads=adaptive_threads)
        self.n_past = 0                              # positions 0 .. n_past-1 are in the cache
        self._engine = None
        self._spec = {}                              # speculative decoding options of the engine (speculation())
        self.reset()

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

    # ---- forward: one sequence, its blocks the pool in order ----
    def reset(self) -> None:
        """Forget the sequence: the next prefill starts at position 0."""
        self.n_past = 0
        self.runner.table[0] = np.arange(self.runner.table.shape[1])

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("expected a non-empty 1-D sequence of token ids")
        if ids.min() < 0 or ids.max() >= self.config.n_vocab:
            bad = int(ids[(ids < 0) | (ids >= self.config.n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.config.n_vocab - 1})")
        if self.n_past + ids.size > self.n_ctx:
            raise ContextError(f"{self.n_past} tokens in the cache + {ids.size} new ones exceed the context "
                               f"of {self.n_ctx} tokens; load the model with a larger ctx (max trained: "
                               f"{self.config.ctx_train})")

    def _run(self, ids: np.ndarray, n_out: int, phase: str, logits: np.ndarray | None = None) -> np.ndarray:
        """One forward call over a chunk (len <= n_batch) at the current position: logits of its last n_out rows."""
        r, N = self.runner, ids.size
        r.set_tokens(0, ids, self.n_past, 0)
        r.set_out_rows(range(N - n_out, N))
        out = r.forward(N, n_out, logits, phase=phase, kv_tokens=self.n_past + N)
        self.n_past += N
        return out

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
        """Compile the forward pass (or load it from Numba's cache) with one throwaway token; returns seconds."""
        t = time.perf_counter()
        self.reset()
        self.decode(0)
        self.reset()
        return time.perf_counter() - t

    # ---- generation: one request through the engine ----
    @property
    def engine(self):
        """The engine generate() runs on: this model's runner and pool, one sequence, no prefix caching."""
        if self._engine is None:
            from .engine import Engine
            self._engine = Engine(self, max_model_len=self.n_ctx, max_num_seqs=1,
                                  max_num_batched_tokens=self.n_batch, enable_prefix_caching=False,
                                  _runner=self.runner, **self._spec)
        return self._engine

    def speculation(self, *, draft_model=None, num_speculative_tokens: int = 5, ngram_min: int = 1,
                    ngram_max: int = 4) -> None:
        """Set up speculative decoding for generate(..., speculative="ngram" | "draft"): draft_model (a
        lumen.Model, name or path sharing this model's vocabulary) for "draft", the most tokens drafted per step,
        the n-gram sizes the "ngram" drafter matches (lumen.engine.speculative)."""
        self._spec = dict(draft_model=draft_model, num_speculative_tokens=num_speculative_tokens,
                          ngram_min=ngram_min, ngram_max=ngram_max)
        self._engine = None

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repeat_last_n: int = 64,
                 seed: int | None = None, stop: Sequence[str] = (), special: bool = False,
                 stats: GenStats | None = None, params: SamplingParams | None = None,
                 speculative: str | None = None, num_speculative_tokens: int | None = None,
                 ignore_eos: bool = False) -> Iterator[Token]:
        """Yield generated tokens as they are produced, from a fresh sequence.

        prompt: text (tokenized with the model's BOS default; `special` parses special-token text) or token ids.
        Stops at max_tokens, an end-of-generation token (EOS / end-of-turn from the metadata), or a stop string
        (the text before it is yielded, the stop string itself is not). The end-of-generation token itself is
        yielded only if it releases held-back text (a possible stop-string prefix), with that text.
        params: a SamplingParams instead of the keyword arguments (for everything else it holds).
        speculative: "ngram" or "draft" (see speculation()) drafts tokens and verifies them in one pass.
        ignore_eos: keep going past end-of-generation tokens (fixed-length benchmarks).
        """
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, got {max_tokens!r}")
        if params is None:
            if max_tokens == 0:
                return iter(())
            params = SamplingParams(max_tokens=max_tokens or None, temperature=temperature, top_k=top_k,
                                    top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                                    presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                    repeat_last_n=repeat_last_n, seed=seed, stop=tuple(stop), special=special,
                                    speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                                    ignore_eos=ignore_eos)
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, special=params.special)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty (no tokens); give some text or token ids")
        n_new = params.max_tokens or 0
        if len(ids) + n_new > self.n_ctx:
            raise ContextError(f"the prompt ({len(ids)} tokens) plus max_tokens ({n_new}) exceeds the "
                               f"context of {self.n_ctx} tokens; use a larger ctx or fewer tokens")
        stats = stats if stats is not None else GenStats()
        stats.prompt_tokens = len(ids)
        engine = self.engine
        self.n_past = 0
        rid = engine.add_request(ids, params)
        return self._stream(engine, rid, stats)

    def _stream(self, engine, rid: str, stats: GenStats) -> Iterator[Token]:
        done = False
        try:
            while not done:
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    done = out.finished
                    m = out.metrics
                    if m.first_token is not None and not stats.ttft_s:
                        stats.ttft_s = m.first_token - m.arrival
                        stats.prefill_s = stats.ttft_s
                    stats.gen_tokens = m.generated_tokens
                    stats.itl_s = m.itl
                    stats.decode_s = sum(m.itl)
                    stats.spec_proposed, stats.spec_accepted = m.spec_proposed, m.spec_accepted
                    stats.spec_steps = m.spec_steps
                    if done:
                        stats.stop_reason = ("eos" if out.finish_reason == "stop" and out.stop_reason is None
                                             else out.finish_reason)
                        if out.error:
                            raise LumenError(out.error)
                    for tok, text in zip(out.delta_token_ids, out.delta_pieces):
                        if tok in engine.end_ids and not text:
                            continue
                        yield Token(tok, text)
        finally:
            if not done:
                engine.abort(rid)
            self.reset()

    def __repr__(self):
        c = self.config
        return f"<lumen.Model {c.arch} {c.name!r}: {c.n_layer} layers, d={c.n_embd}, vocab {c.n_vocab}>"

