"""lumen.Model: one loaded model and one sequence, the S = 1 face of the engine.

`prefill` (a chunk of prompt tokens at once) and `decode` (one token) run the engine's forward pass on a single
sequence whose blocks are the whole pool of the model's own runner, in order; `logits` is teacher-forced
prefill. `generate` is a client of lumen.Engine like any other: it runs one request through `Model.engine` (an
Engine over the same weights, with its own runner and KV pool, made on first use) and yields its tokens from the
engine's stream. The two never share a runner, so `reset()` only ever touches the model's own cache.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from functools import cached_property
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from .errors import ContextError, ContextWarning, LumenError, plural, user_stacklevel
from .kernels.attention import BLOCK
from .kernels.work import numba_threads
from .engine.admission import prompt_ids
from .engine.config import check_bool, check_int
from .engine.engine import Engine
from .model.parts import build_tokenizer  # noqa: F401 (re-exported)
from .model.parts import ModelParts, make_parts, open_gguf
from .engine.runner import Runner
from .engine.sampling.params import SamplingParams
from .engine.sequence import RequestMetrics

DEFAULT_CTX = 2048
MAX_CTX = 1 << 24           # the most positions RoPE tables hold exactly in float32 (lumen.kernels.rope)
DEFAULT_BATCH = 256
DEFAULT_MAX_TOKENS = 128    # generate()'s max_tokens when none is given


class Token(NamedTuple):
    """One generated token: its id and the text it makes printable now (may be '' while a UTF-8 character or a
    possible stop string is incomplete)."""
    id: int
    text: str




class Model:
    """A loaded model. Construct with `lumen.load(name_or_path, max_model_len=..., threads=...)`."""

    def __init__(self, path: str | os.PathLike, *, max_model_len: int | None = None, threads: int | None = None,
                 max_num_batched_tokens: int | None = None, pack_cache: bool | None = None,
                 parts: ModelParts | None = None, adaptive_threads: bool = True, ctx: int | None = None,
                 n_batch: int | None = None):
        """max_model_len: tokens of context to allocate (None: DEFAULT_CTX, or the trained context if smaller;
        beyond the trained context warns). max_num_batched_tokens: the largest prefill chunk (DEFAULT_BATCH).
        These are lumen.Engine's names; `ctx` and `n_batch` (llama.cpp's) are accepted for them. pack_cache: read
        the repacked weights from the on-disk cache (lumen.model.packcache) when valid, store them there otherwise;
        None = on unless LUMEN_PACK_CACHE=0. threads: the most threads a forward pass uses (None: NUMBA_NUM_THREADS,
        whatever another model was given); adaptive_threads: fewer while other processes want the cores
        (lumen.engine.threads), else always `threads`."""
        for name, alias, value, other in (("max_model_len", "ctx", max_model_len, ctx),
                                          ("max_num_batched_tokens", "n_batch", max_num_batched_tokens, n_batch)):
            if value is not None and other is not None:
                raise TypeError(f"give {name} or {alias} (the same setting), not both")
        ctx_name = "ctx" if ctx is not None else "max_model_len"                # errors use the caller's word
        batch_name = "n_batch" if n_batch is not None else "max_num_batched_tokens"
        ctx = max_model_len if max_model_len is not None else ctx
        n_batch = max_num_batched_tokens if max_num_batched_tokens is not None else n_batch
        n_batch = DEFAULT_BATCH if n_batch is None else n_batch
        if parts is None:
            g, cfg = open_gguf(path, cache=pack_cache)
            tok = build_tokenizer(g.metadata)
        else:
            g, cfg, tok = parts.gguf, parts.config, parts.tokenizer
        if ctx is None:
            ctx = min(DEFAULT_CTX, cfg.ctx_train)
        check_int(ctx_name, ctx, hi=MAX_CTX)
        if ctx > cfg.ctx_train:
            warnings.warn(ContextWarning(f"{ctx_name}={ctx} is beyond the {cfg.ctx_train} tokens this model was "
                                         "trained on (output past that is unreliable)"), stacklevel=user_stacklevel())
        check_int(batch_name, n_batch)
        check_bool("adaptive_threads", adaptive_threads)
        check_bool("pack_cache", pack_cache, none_ok=True)
        self.threads = ModelParts.thread_count(threads)
        if parts is None:
            with numba_threads(self.threads):           # (the weights pack on that many threads)
                parts = make_parts(path, g, cfg, tok, pack_cache=pack_cache)
        self.parts = parts
        self.path, self.gguf, self.config, self.tokenizer = parts.path, g, cfg, tok
        self.weights = parts.weights
        self.n_ctx = self.max_model_len = ctx
        self.n_batch = self.max_num_batched_tokens = min(n_batch, ctx)
        self.adaptive_threads = adaptive_threads
        self.n_past = 0                              # positions 0 .. n_past-1 are in the cache
        self._forward_lock = threading.RLock()       # one prefill / decode / logits at a time (own runner, n_past)
        self._engine = None
        self._engine_lock = threading.Lock()
        self._spec = {}                              # speculative decoding options of the engine (speculation())
        self.closed = False                          # close(): generate() refuses

    @cached_property
    def runner(self) -> Runner:
        """The runner of prefill / decode / logits (made on first use): one sequence, its blocks the pool in
        order (block-table row 0 = 0, 1, 2, ...)."""
        nb = -(-self.n_ctx // BLOCK)
        r = Runner(self.config, self.parts.bundle, self.parts.rope_freqs, n_blocks=nb, max_tokens=self.n_batch,
                   max_rows=1, max_blocks=nb, n_threads=self.threads, adaptive_threads=self.adaptive_threads)
        r.table[0] = np.arange(nb)
        return r

    # ---- tokenizer ----
    @property
    def metadata(self) -> dict:
        return self.gguf.metadata

    def tokenize(self, text: str, *, add_bos: bool | None = None, special: bool = False, shielded: bool = False
                 ) -> list[int]:
        """Text -> token ids. add_bos=None uses the model's default (tokenizer.ggml.add_bos_token), but not twice
        (lumen.format.tokenizer.Tokenizer.default_bos). shielded: a conversation rendered from shielded messages
        (Tokenizer.shield_messages), whose control-token texts are read back as text."""
        if not isinstance(text, str):
            raise TypeError(f"tokenize() takes a str, got {type(text).__name__}"
                            + ("; decode the bytes first" if isinstance(text, (bytes, bytearray)) else ""))
        check_bool("add_bos", add_bos, none_ok=True)        # (add_bos="no" was truthy: a BOS added)
        check_bool("special", special)
        check_bool("shielded", shielded)
        tok = self.tokenizer
        return tok.encode(text, add_bos=tok.default_bos(text, special) if add_bos is None else add_bos,
                          special=special, shielded=shielded)

    def detokenize(self, ids) -> str:
        """Token ids -> text. TypeError for text (its characters are no token ids) or a single id."""
        if isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__"):
            raise TypeError(f"detokenize() takes a sequence of token ids, got {type(ids).__name__}")
        return self.tokenizer.decode(ids)

    # ---- forward: one sequence, its blocks the pool in order ----
    def reset(self) -> None:
        """Forget the sequence: the next prefill starts at position 0."""
        self.n_past = 0

    @staticmethod
    def _as_ids(ids) -> np.ndarray:
        """Token ids as an int64 array; TypeError for text or non-integers (numpy would cast 1.5 to 1)."""
        arr = np.asarray(ids) if not isinstance(ids, str) else None
        if arr is None or (arr.size and arr.dtype.kind not in "iu"):
            raise TypeError(f"expected token ids (integers), got {type(ids).__name__}"
                            + (f" of {arr.dtype}" if arr is not None else "") + "; model.tokenize(text) makes them")
        if arr.size and arr.dtype.kind == "u" and arr.max() > np.iinfo(np.int64).max:   # (the cast would wrap it)
            raise ValueError(f"token id {int(arr.max())} is outside the vocabulary")
        return np.ascontiguousarray(arr, dtype=np.int64)

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("expected a non-empty 1-D sequence of token ids")
        if ids.min() < 0 or ids.max() >= self.config.n_vocab:
            bad = int(ids[(ids < 0) | (ids >= self.config.n_vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.config.n_vocab - 1})")
        if self.n_past + ids.size > self.n_ctx:
            raise ContextError(f"{plural(self.n_past, 'token')} in the cache + {plural(ids.size, 'new one')} exceed "
                               f"the context of {plural(self.n_ctx, 'token')}; load the model with a larger ctx "
                               f"(max trained: {self.config.ctx_train})")

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
        ids = self._as_ids(ids)
        with self._forward_lock:
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
        if not isinstance(token, (int, np.integer)) or isinstance(token, bool):
            raise TypeError(f"decode takes one token id (an int), got {type(token).__name__}")
        ids = np.array([token], dtype=np.int64)
        with self._forward_lock:
            self._check_ids(ids)
            return self._run(ids, 1, "decode")[0]

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits (len(ids), n_vocab) for a fresh sequence (safe to call from several threads:
        one runs at a time)."""
        self._check_open()
        with self._forward_lock:
            self.reset()
            return self.prefill(ids, all_logits=True)

    def warmup(self) -> float:
        """Compile the forward pass (or load it from Numba's cache) with one throwaway token; returns seconds."""
        t = time.perf_counter()
        with self._forward_lock:
            self.reset()
            self.decode(0)
            self.reset()
        return time.perf_counter() - t

    # ---- generation: one request through the engine ----
    @property
    def engine(self) -> Engine:
        """The engine generate() runs on (made on first use): this model's weights, one sequence, a KV pool of
        n_ctx tokens, no prefix caching, the speculative options of speculation()."""
        with self._engine_lock:                      # (threads calling generate at once make one engine)
            self._check_open()
            if self._engine is None:
                self._engine = Engine(self.parts, threads=self.threads, max_model_len=self.n_ctx, max_num_seqs=1,
                                      max_num_batched_tokens=self.n_batch, num_kv_blocks=-(-self.n_ctx // BLOCK),
                                      enable_prefix_caching=False, adaptive_threads=self.adaptive_threads,
                                      **self._spec)
            return self._engine

    def speculation(self, *, draft_model=None, num_speculative_tokens: int = 5, ngram_min: int = 1,
                    ngram_max: int = 4, draft_vocab: int | None = 32768, draft_quant: str | None = "q4_0") -> None:
        """Set up speculative decoding for generate(..., speculative="ngram" | "draft"): draft_model (a lumen.Model,
        name or path sharing this model's vocabulary) for "draft", the most tokens drafted per step, the n-gram
        sizes the "ngram" drafter matches, the token ids the draft proposes, how a draft given by name or path is
        requantized as it loads (lumen.engine.speculative, lumen.engine.config.SpeculativeConfig). Checked here, the
        draft model loaded once: bad options raise now and leave the model as it was (stored unchecked, they made
        every later generate() fail, speculative or not)."""
        from .engine.config import SpeculativeConfig, draft_requant
        from .engine.speculative.drafters import DraftModel
        from .model.parts import parts_of
        spec = dict(draft_model=None, num_speculative_tokens=num_speculative_tokens, ngram_min=ngram_min,
                    ngram_max=ngram_max, draft_vocab=draft_vocab, draft_quant=draft_quant)
        SpeculativeConfig(**spec)                                   # ValueError for a bad option
        if draft_model is not None:                                 # FetchError, GGUFError, TypeError
            spec["draft_model"] = draft = parts_of(draft_model, requant=draft_requant(draft_quant))
            DraftModel.check_vocabulary(draft, self.config.n_vocab, self.tokenizer.tokens)
        with self._engine_lock:
            self._spec, self._engine = spec, None

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 stats: RequestMetrics | None = None, **sampling) -> Iterator[Token]:
        """Yield generated tokens as they are produced, from a fresh sequence.

        prompt: text (tokenized with the model's BOS default; `special` parses special-token text) or token ids.
        params: a lumen.SamplingParams; or its fields as keywords (`sampling`: max_tokens, temperature, top_k,
        top_p, min_p, the penalties, seed, stop, special, speculative, ignore_eos, constraint, ...), where
        max_tokens defaults to 128, or fewer where the context ends (None: the rest of the context), and
        temperature to 0 (greedy).
        Stops at max_tokens, an end-of-generation token (EOS / end-of-turn from the metadata), or a stop string
        (the text before it is yielded, the stop string itself is not). The end-of-generation token itself is
        yielded only if it releases held-back text (a possible stop-string prefix), with that text.
        A constraint's grammar that fails to compile raises LumenError with llguidance's message. logprobs and
        prompt_logprobs are refused (a Token has none): lumen.Engine's outputs carry them.
        stats: a RequestMetrics (lumen.engine.sequence) the engine fills as the request runs: ttft_s, tpot_s,
        prefill_tps, decode_tps, gen_tokens, stop_reason, the speculative counts.
        """
        self._check_open()
        default_length = params is None and "max_tokens" not in sampling
        if stats is not None and not isinstance(stats, RequestMetrics):   # (the engine's word for it: metrics)
            raise TypeError(f"stats must be a lumen.engine.sequence.RequestMetrics or None, got {type(stats).__name__}")
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        if unknown := [k for k in sampling if k not in fields]:     # (not "SamplingParams.__init__() got ...")
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the sampling keywords are "
                            f"lumen.SamplingParams' fields: {', '.join(sorted(fields))}")
        if params is None:
            sampling = {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": 0.0, **sampling}
            if isinstance(sampling["max_tokens"], np.integer):  # (as SamplingParams takes it: a count from numpy)
                sampling["max_tokens"] = int(sampling["max_tokens"])
            if sampling["max_tokens"] is not None:              # None: the rest of the context
                try:
                    check_int("max_tokens", sampling["max_tokens"], 0)
                except ValueError as e:                         # (the command line's -n -1 is None here)
                    raise ValueError(f"{e}; None generates until the context ends") from None
            params = SamplingParams(**sampling)
        elif sampling:
            raise TypeError(f"give a SamplingParams or its fields as keywords, not both ({', '.join(sampling)})")
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a lumen.SamplingParams (or give its fields as keywords), got "
                            f"{type(params).__name__}")
        # (a Token is an id and its text: logprobs asked for here were computed and dropped without a word)
        if asked := [f for f in ("logprobs", "prompt_logprobs") if getattr(params, f) is not None]:
            raise ValueError(f"Model.generate yields Token(id, text), which has no {asked[0]}: run the request "
                             f"through lumen.Engine (engine.generate, engine.stream), whose RequestOutput has them")
        # (said here: the engine's own message names `lumen serve --draft-model` and Engine(draft_model=...))
        if params.speculative == "draft" and self._spec.get("draft_model") is None:
            raise ValueError('speculative="draft" needs a draft model: call model.speculation(draft_model=M) '
                             "first (a lumen.Model, registry name or .gguf path sharing this vocabulary)")
        ids = prompt_ids(prompt, self.tokenizer, self.config.n_vocab, params.special)   # RequestError if bad
        if params.max_tokens == 0:                          # nothing to generate (the request was still checked)
            return iter(())
        room = self.n_ctx - len(ids)
        if room < 1:
            raise ContextError(f"the prompt ({plural(len(ids), 'token')}) leaves no room to generate in the context "
                               f"of {plural(self.n_ctx, 'token')}; load the model with a larger max_model_len or "
                               "shorten the prompt")
        if default_length and params.max_tokens > room:      # the default ends where the context does
            params = dataclasses.replace(params, max_tokens=room)
        n_new = params.max_tokens or 0
        if len(ids) + n_new > self.n_ctx:
            raise ContextError(f"the prompt ({plural(len(ids), 'token')}) plus max_tokens ({n_new}) exceeds the "
                               f"context of {plural(self.n_ctx, 'token')}; use a larger ctx or fewer tokens")
        return self._tokens(self.engine.stream(ids, params, metrics=stats), self.engine.end_ids)

    def chat(self, messages: Sequence[dict], params: SamplingParams | None = None, *,
             stats: RequestMetrics | None = None, chat_template_kwargs: dict | None = None,
             **sampling) -> Iterator[Token]:
        """Yield the assistant's reply to a conversation, as generate() yields tokens.

        messages: [{"role": "system" | "user" | "assistant", "content": str}, ...], written by the model's chat
        template (tokenizer.chat_template) with the assistant's turn opened, as `lumen chat` and the server's
        /v1/chat/completions write them; the reply ends with the turn (or at max_tokens). params and sampling
        keywords as for generate() (greedy unless a temperature is given). Content may also be a list of
        {"type": "text", "text": ...} parts, and None for an assistant message. ValueError (ChatMessageError) for
        messages the server would answer with a 400 (an unknown role, content that is not text, a malformed tool
        call: lumen.format.chat.plain_messages); LumenError (ChatTemplateError) for a model without a chat
        template or messages its template cannot render.
        chat_template_kwargs: more template variables (vLLM's, e.g. {"enable_thinking": False} for Qwen3).
        """
        from .format.chat import plain_messages, render_chat, require_chat_template
        tok = self.tokenizer
        messages = plain_messages(messages)
        text = render_chat(require_chat_template(self.metadata), tok.shield_messages(messages),  # (text stays text)
                           bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                           eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
                           template_kwargs=chat_template_kwargs)
        ids = self.tokenize(text, special=True, shielded=True)          # (its markers; the messages' text as text)
        return self.generate(ids, params, stats=stats, **sampling)

    @staticmethod
    def _tokens(outputs: Iterator, end_ids: frozenset) -> Iterator[Token]:
        """The engine's outputs of one request as Tokens (an end token only when it releases text)."""
        for out in outputs:
            if out.finished and out.error:
                raise LumenError(out.error)
            for tok, text in zip(out.delta_token_ids, out.delta_pieces):
                if tok in end_ids and not text:
                    continue
                yield Token(tok, text)

    # ---- the end
    def _check_open(self) -> None:
        if self.closed:
            raise LumenError("this model is closed (model.close(), or the end of its `with` block)")

    def close(self) -> None:
        """Close the engine generate() runs on (its requests are aborted, its grammar threads stopped); later
        calls of generate(), chat() and logits() raise LumenError. The weights stay mapped while anything refers to
        them (an Engine made from this model, before or after, keeps working). Idempotent; `with lumen.load(...) as
        model:` calls it."""
        with self._engine_lock:
            engine, self._engine, self.closed = self._engine, None, True
        if engine is not None:
            engine.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self):
        c = self.config
        return f"<lumen.Model {c.arch} {c.name!r}: {c.n_layer} layers, d={c.n_embd}, vocab {c.n_vocab}>"

