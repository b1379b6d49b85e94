"""A model's vocabulary as llguidance sees it, built from the GGUF vocabulary (no HF tokenizer exists here).

    vocab = grammar_vocab(tok)          # tok: lumen.format.tokenizer.Tokenizer; built once per tokenizer, cached
    vocab.ll                            # the llguidance.LLTokenizer every grammar of this model compiles against

llguidance needs each token's exact bytes, which tokens are special, the end-of-sequence token and a tokenize
function. From Lumen's tokenizer:
- bytes: what Lumen's detokenizer writes for the token (`Tokenizer.token_bytes`): GPT-2 byte-level characters
  mapped back to bytes (SmolLM2), U+2581 as a space and `<0xNN>` as the byte 0xNN (Gemma), user-defined tokens as
  their text. A grammar therefore constrains exactly the text the user receives.
- special: control and unknown tokens (which Lumen renders as nothing), and unused/undefined ones, are given to
  llguidance as 0xFF + their text: 0xFF never occurs in UTF-8, so no grammar text can be spelled with them.
  A normal token whose bytes start with 0xFF (Gemma's byte token `<0xFF>`) looks special to llguidance for the
  same reason; no UTF-8 text holds that byte, so no grammar could allow it anyway (`marker_ids` lists them).
- end of sequence: llguidance knows one EOS token, `eos_id` (the vocabulary's eos, or its lowest end-of-generation
  token without one). A model ends a turn with any of its end-of-generation tokens (Gemma's `<end_of_turn>` besides
  `<eos>`), so the mask functions (lumen.engine.structured.bitmask) allow all of `eog_ids` wherever the grammar
  allows EOS, and the matcher (lumen.engine.structured.matcher) feeds any of them to llguidance as EOS, unless the
  grammar names that token itself (Lark's `<|endoftext|>` or `<[id]>`).
- tokenize: Lumen's own encoder with no BOS, no added leading space (SentencePiece's add_space_prefix off) and
  special-token text read as plain text. llguidance calls it (holding the GIL) when it compiles a grammar, to
  tokenize forced text; masks never call it.

Note: with a vocabulary whose add_space_prefix is set (not the case for SmolLM2 or Gemma 3), Lumen's decode drops
one leading space of a generation's first token; the grammar sees that space.

Build cost (python profiling/structured_costs.py, load average 7.5): SmolLM2 (49152 tokens) 0.24-0.32 s,
Gemma 3 (262144 tokens) 1.9-2.4 s (0.14-0.2 s and 1.2 s in a quieter moment), mostly llguidance's token trie and
its mask slices; once per tokenizer, so the engine should start it when it starts (GrammarCompiler does, on its
thread).
"""
from __future__ import annotations

import copy
import threading
import time
import weakref

import llguidance
import numpy as np

from ...errors import LumenError
from ...format.tokenizer import ATTR_BYTE, ATTR_NORMAL, ATTR_USER_DEFINED, Tokenizer

SPECIAL_MARKER = b"\xff"  # llguidance's TokTrie::SPECIAL_TOKEN_MARKER


class _Wrapper:
    """What llguidance.LLTokenizer reads from a Python tokenizer ("TokenizerWrapper"); it keeps the object for
    the tokenize callback, so this holds no reference back to the GrammarVocab or to the cached Tokenizer."""
    is_tokenizer_wrapper = True

    def __init__(self, tokens: list[bytes], special_ids: list[int], eos: int, bos: int | None, encoder: Tokenizer):
        self.tokens = tokens                  # (n_vocab,) bytes; dropped once llguidance has copied them
        self.special_token_ids = special_ids
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.encoder = encoder

    def __call__(self, text: str | bytes) -> list[int]:
        """llguidance's tokenize callback: Lumen's ids of text, no BOS, no leading space added, specials as text."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.encoder.encode(text, add_bos=False, special=False)


class GrammarVocab:
    """The llguidance view of one Lumen tokenizer. Build with `grammar_vocab(tok)`, which caches it."""

    def __init__(self, tok: Tokenizer):
        t0 = time.perf_counter()
        self.n_vocab = tok.n_vocab
        self.mask_words = (tok.n_vocab + 31) // 32          # int32 words in one bitmask row
        shown = ATTR_NORMAL | ATTR_BYTE | ATTR_USER_DEFINED  # the attributes Lumen renders as text
        self.special_ids: tuple[int, ...] = tuple(i for i, a in enumerate(tok.attrs) if not a & shown or a & ~shown)
        special = set(self.special_ids)
        # (n_vocab,) the bytes llguidance matches: Lumen's rendering, or marker + text for special tokens
        token_bytes = [SPECIAL_MARKER + tok.tokens[i].encode() if i in special else tok.token_bytes(i)
                       for i in range(tok.n_vocab)]
        eog = sorted(tok.eot_ids)
        eos = tok.eos_id if tok.eos_id is not None else (eog[0] if eog else None)
        if eos is None:
            raise LumenError("structured output needs an end-of-sequence token; this vocabulary has none")
        self.eos_id: int = eos
        self.eog_ids: tuple[int, ...] = tuple(sorted({eos, *eog}))   # every token that ends a generation
        encoder = copy.copy(tok)             # shares the tables; only the space prefix differs
        encoder.add_space_prefix = False
        # normal tokens llguidance reads as special (first byte 0xFF): never part of UTF-8 text
        self.marker_ids: tuple[int, ...] = tuple(i for i, b in enumerate(token_bytes)
                                                 if b[:1] == SPECIAL_MARKER and i not in special)
        self._wrapper = _Wrapper(token_bytes, list(self.special_ids), eos, tok.bos_id, encoder)
        self.ll = llguidance.LLTokenizer(self._wrapper)
        self._wrapper.tokens = []            # llguidance holds its own copy (~9 MB of bytes objects for Gemma)
        self.build_s = time.perf_counter() - t0

    def check_masks(self, masks) -> None:
        """masks must be a writeable C-contiguous int32 (n, mask_words) array (llguidance writes raw memory)."""
        if not (isinstance(masks, np.ndarray) and masks.dtype == np.int32 and masks.ndim == 2
                and masks.shape[1] == self.mask_words and masks.flags.c_contiguous and masks.flags.writeable):
            raise ValueError(f"bitmask rows must be a writeable C-contiguous int32 (n, {self.mask_words}) array, "
                             f"got {getattr(masks, 'dtype', type(masks).__name__)} {getattr(masks, 'shape', '')}")

    def allow_end_tokens(self, masks: np.ndarray, rows: np.ndarray | None = None) -> None:
        """masks (n, mask_words), in place: where a row (of `rows`, default all) allows llguidance's EOS, allow
        every end-of-generation token of the model too."""
        rows = np.arange(masks.shape[0]) if rows is None else rows
        w, b = divmod(self.eos_id, 32)
        allowed = (masks[rows, w] >> b) & 1                # (len(rows),) 0/1
        for t in self.eog_ids:
            if t != self.eos_id:
                masks[rows, t // 32] |= (allowed << (t % 32)).astype(np.int32)

    def tokenize(self, text: str) -> list[int]:
        """The tokenize callback llguidance uses (Lumen's encoder, no BOS, no added space)."""
        return self._wrapper(text)

    def __repr__(self) -> str:
        return (f"GrammarVocab(n_vocab={self.n_vocab}, eos={self.eos_id}, eog={list(self.eog_ids)}, "
                f"special={len(self.special_ids)}, build {self.build_s:.2f} s)")


_CACHE: weakref.WeakKeyDictionary[Tokenizer, GrammarVocab] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def grammar_vocab(tok: Tokenizer) -> GrammarVocab:
    """The GrammarVocab of `tok`, built on first use and kept while the tokenizer lives (thread-safe; a second
    caller waits for the first one's build)."""
    with _CACHE_LOCK:
        vocab = _CACHE.get(tok)
        if vocab is None:
            vocab = _CACHE[tok] = GrammarVocab(tok)
        return vocab
