"""Tokenizers built from GGUF metadata that give exactly llama.cpp's token ids.

    tok = Tokenizer.from_metadata(meta)                # meta: GGUF key -> str/int/float/bool/list
    ids = tok.encode(text, add_bos=tok.add_bos_default, special=True)
    text = tok.decode(ids)
    stream = tok.stream(); out = "".join(stream.push(i) for i in generated_ids) + stream.flush()

`tokenizer.ggml.model` picks the implementation:
- "gpt2"  -> `BPETokenizer`: byte-level BPE. `tokenizer.ggml.pre` (absent: "default", as in llama.cpp) picks
  llama.cpp's pre-tokenizer (PRE_TYPES: every value llama.cpp knows but kimi-k2 and the ones without
  byte-level encoding; aliases map to the same behaviour). `PreTokenizer` reimplements llama.cpp's
  unicode_regex_split: the regexes of the list cut the text in turn, each one every piece the previous left,
  with llama.cpp's hand-written splitters where it has them (gpt2, llama3, qwen2, qwen35, digit groups,
  newlines) and otherwise its std::regex path (Unicode classes matched on a text collapsed to one byte per
  class) run by Python's `re`, all on llama.cpp's codepoint table. The merges then run on the pre-tokenized
  words by rank, as llama.cpp's do: here, and for a word of LONG_WORD characters or more in HF `tokenizers` (a
  word that is a vocab entry stays whole for the pre types where llama.cpp sets ignore_merges). Some pre types
  also change the add_bos default (llama3, tekken, chameleon) or have no default bos id (chatglm, glm4).
- "gemma4" (and "gpt2" with pre "gemma4") -> `EscapedBPETokenizer`: BPE by merge rank on the raw characters
  with spaces escaped to U+2581, cut only at newline runs, <0xXX> byte fallback.
- "llama" -> `SPMTokenizer`: llama.cpp's SentencePiece-style tokenizer (merge the adjacent pair whose
  concatenation is the vocab entry with the highest score, leftmost first; symbols that end up outside
  the vocab fall back to <0xXX> byte tokens). Written here in plain Python: it must be llama.cpp's
  algorithm, not sentencepiece's.
- "bert" -> `WPMTokenizer`: llama.cpp's WordPiece (BERT normalization, longest vocab entry first).
- "t5" -> `UGMTokenizer`: llama.cpp's SentencePiece unigram (precompiled charsmap normalization, Viterbi).
- "rwkv" -> `RWKVTokenizer`: the longest escaped-bytes token from the left.
Not supported: "plamo2", "hybriddna", "whitespace".

All follow llama.cpp (src/llama-vocab.cpp) step by step:
1. Special-token partition: the text is cut at special-token texts, longest text first. Control and
   unknown tokens are cut out only when `special=True`; user-defined tokens always are. Some models' special
   tokens also take the whitespace beside them (llama.cpp's lstrip/rstrip attributes, set by model name).
2. Each remaining piece of text is tokenized on its own (SPM: spaces become U+2581 first, and a space is
   prefixed after a special token when `tokenizer.ggml.add_space_prefix` is true).
3. End-of-generation ids are found the way llama.cpp finds them: eos, plus eot/eom/fim ids from the
   metadata or recognised by their text, plus a fixed list of texts (`<|im_end|>`, `<end_of_turn>`,
   `<|endoftext|>`, `</s>`, ...). Tokens so recognised become control tokens, which changes how they parse.
   The fill-in-the-middle prefix, suffix and middle tokens are found alike (metadata, else text; they do not end
   generation): `fim_pre_id`, `fim_suf_id`, `fim_mid_id`, None for a vocabulary without them.

A chat prompt is rendered text encoded with special=True, so the template's markers parse; the messages' own
control-token texts must not (a user's "<|im_start|>" would open a turn): `shield_messages` marks them before the
template renders, and encode(special=True, shielded=True) reads a marked text back as plain text.

Decoding renders each token as llama.cpp's `token_to_piece`: normal tokens as their text (byte-level
characters mapped back to bytes, U+2581 back to a space), byte tokens as their byte, user-defined tokens as
their text, and control/unknown tokens as their text only when `special=True`. The default is
`special=False`, as in llama-cli/llama-server output and llama-cpp-python's `detokenize` (which produced
the golden text); `special=True` is llama.cpp's `common_detokenize` default. Bytes are decoded as UTF-8
with U+FFFD for invalid sequences.
"""
from __future__ import annotations

import codecs
import heapq
import itertools
import operator
import re
import threading
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ..errors import GGUFError, UnsupportedError

# ---------------------------------------------------------------------------------------------------
# Token types (GGUF tokenizer.ggml.token_type) and llama.cpp's token attributes (bit flags)
# ---------------------------------------------------------------------------------------------------
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = 1, 2, 4, 8, 16, 32
# token_type value -> attribute; anything else (0 = undefined) is 0, which decodes to nothing
TYPE_TO_ATTR = {1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED,
                6: ATTR_BYTE}
ATTR_SPECIAL = ATTR_CONTROL | ATTR_UNKNOWN  # rendered only with special=True, parsed only with special=True
# shielded control-token text (Tokenizer.shield): U+FDD0 id U+FDD1, two noncharacters no vocabulary holds
SHIELD_OPEN, SHIELD_CLOSE = "\ufdd0", "\ufdd1"
SHIELDED = re.compile(f"{SHIELD_OPEN}([0-9]*){SHIELD_CLOSE}")

# llama.cpp recognises these tokens by their text (llama_vocab::impl::load)
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
             "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                 "<|code_prefix|>", "<|prefix|>")
FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                 "<|code_suffix|>", "<|suffix|>")
FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                 "<|code_middle|>", "<|middle|>")
FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: made user-defined

# llama.cpp's per-token lstrip/rstrip attributes: not in the GGUF, set by model name (_strip_flags)
STRIP_LEFT, STRIP_RIGHT = 1, 2
C_SPACE = " \t\n\v\f\r"  # C isspace(), what llama.cpp strips

SPACE = "\u2581"  # SentencePiece's escaped space
LONG_WORD = 256  # byte-level characters from which a BPE word is merged by HF tokenizers (BPETokenizer._long_words)
WORD_CACHE = 1 << 14  # words whose ids a BPE tokenizer keeps (BPETokenizer._words; HF's BPE kept 10,000)
SPM_WHOLE = 1024  # characters below which an SPM fragment is merged whole (SPMTokenizer._cut)
BYTE_TEXT = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # the text of a byte token



def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


# ---------------------------------------------------------------------------------------------------
# Metadata -> vocab
# ---------------------------------------------------------------------------------------------------
def _get(meta: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    """meta[key] checked to be a `kind` (bool is not an int here), or `default` when the key is absent."""
    value = meta.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise GGUFError(f"{key} is a {type(value).__name__}, expected {kind.__name__}")
    return value


def _get_list(meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...], n: int | None,
              required: bool) -> list | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise GGUFError(f"missing tokenizer key {key}")
        return None
    if not isinstance(value, (list, tuple)):
        raise GGUFError(f"{key} must be an array, got {type(value).__name__}")
    if n is not None and len(value) != n:
        raise GGUFError(f"{key} has {len(value)} entries but tokenizer.ggml.tokens has {n}")
    if value and not isinstance(value[0], kind):  # checking one element: arrays in GGUF are homogeneous
        raise GGUFError(f"{key} holds {type(value[0]).__name__}, expected {kind}")
    return list(value)


def _strip_flags(meta: Mapping[str, Any], ids: Mapping[str, int], special: Sequence[int]) -> dict[int, int]:
    """The lstrip/rstrip attributes llama.cpp gives special tokens by the model's names (llama_vocab::impl::load:
    the GGUF has no field for them): the mask token of jina-v2 / nomic-bert-moe / jina-bert-v3 / modern-bert
    takes the spaces before it; every special token of Phi-3 but <unk>, <s> and <|endoftext|> (and </s>) the
    spaces after it."""
    pre = _get(meta, "tokenizer.ggml.pre", str) or ""
    arch = _get(meta, "general.architecture", str) or ""
    name = (_get(meta, "general.name", str) or "").lower()
    flags: dict[int, int] = {}
    if any(k in pre for k in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
            any(k in arch for k in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in ids:
            flags[ids["<mask>"]] = STRIP_LEFT
    elif "phi-3" in name or "phi3" in name:
        flags = dict.fromkeys(special, STRIP_RIGHT)
        if "</s>" in ids:
            flags[ids["</s>"]] = STRIP_RIGHT
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            flags.pop(ids.get(text), None)
    elif "modern-bert" in name and "[MASK]" in ids:
        flags[ids["[MASK]"]] = STRIP_LEFT
    return flags


def check_unicode(text: str) -> None:
    """ValueError if `text` holds a lone surrogate, which no tokenizer can encode: what bytes that are not UTF-8
    become when read with surrogateescape (argv, a C-locale stdin), or a "\\udcff" escape in JSON."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"a lone surrogate U+{c:04X}"
        raise ValueError(f"the text is not valid UTF-8: it holds {what}") from None


class Tokenizer:
    """Common part: vocab, special ids, special-token partition, decoding. Build with `from_metadata`."""

    model: str = ""

    def __init__(self, meta: Mapping[str, Any], *, bos: int | None, eos: int | None, unk: int | None,
                 add_bos: bool, add_space_prefix: bool):
        tokens = _get_list(meta, "tokenizer.ggml.tokens", str, None, required=True)
        if not tokens:
            raise GGUFError("tokenizer.ggml.tokens is empty")
        # llama.cpp renames empty tokens so every text is unique and non-empty
        if "" in tokens:
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        self.tokens: list[str] = tokens                   # (n_vocab,) token texts as stored
        self.n_vocab = n
        self.token_to_id: dict[str, int] = dict(zip(tokens, range(n)))
        if len(self.token_to_id) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if t in seen:
                    raise GGUFError(f"duplicate token in vocabulary: {t!r} has ids {seen[t]} and {i}")
                seen[t] = i
        types = _get_list(meta, "tokenizer.ggml.token_type", int, n, required=False)
        if types is None:
            self.attrs = [ATTR_NORMAL] * n                # (n_vocab,) llama.cpp token attributes
        else:
            self.attrs = list(map(TYPE_TO_ATTR.get, types, itertools.repeat(0, n)))
        # one past the last token the model's tokenizer has: the GGUF's trailing unused "[PADn]" tokens only pad
        # the list to the embedding rows (Qwen2: 151665..151935) and are no token a prompt can hold
        end = n
        while end > 1 and self.attrs[end - 1] == ATTR_UNUSED:
            end -= 1
        self.vocab_end: int = end

        def special_id(key: str, default: int | None) -> int | None:
            if default is not None and not 0 <= default < n:
                default = None                            # llama.cpp disables out-of-range defaults
            value = _get(meta, key, int)
            if value is None:
                return default
            if not 0 <= value < n:
                raise GGUFError(f"{key} = {value} is outside the vocabulary (n_vocab {n})")
            return value

        self.bos_id = special_id("tokenizer.ggml.bos_token_id", bos)
        self.eos_id = special_id("tokenizer.ggml.eos_token_id", eos)
        self.unk_id = special_id("tokenizer.ggml.unknown_token_id", unk)
        self.add_bos_default: bool = _get(meta, "tokenizer.ggml.add_bos_token", bool, add_bos)
        self.add_space_prefix: bool = _get(meta, "tokenizer.ggml.add_space_prefix", bool, add_space_prefix)
        bad = next((i for i in self._having(ATTR_BYTE) if not BYTE_TEXT.fullmatch(tokens[i])), None)
        if bad is not None:
            raise GGUFError(f"token {bad} has type byte but its text {tokens[bad]!r} is not <0xHH>")
        if self.add_bos_default and self.bos_id is None:
            raise GGUFError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        self.eot_ids: frozenset[int] = self._find_eog(meta)

        # special-token partition tables: (text, id) longest UTF-8 text first, ties by id
        order = sorted(self._having(ATTR_SPECIAL | ATTR_USER_DEFINED), key=self._partition_key)
        self._parse_all = self._index(order)
        self._parse_plain = self._index([i for i in order if not self.attrs[i] & ATTR_SPECIAL])
        self._strip: dict[int, int] = _strip_flags(meta, self.token_to_id, order)  # id -> STRIP_LEFT|STRIP_RIGHT
        self._pieces: dict[int, bytes] = {}                 # id -> piece with special=True, filled lazily

    def _having(self, flags: int) -> Iterable[int]:
        """The ids whose attributes have any of `flags`, in order (the loop runs in C: 7 ms for 151,936 ids)."""
        return itertools.compress(range(self.n_vocab), map(operator.and_, self.attrs, itertools.repeat(flags)))

    # --- end of generation ----------------------------------------------------------------------------
    def _find_eog(self, meta: Mapping[str, Any]) -> frozenset[int]:
        """llama.cpp's special_eog_ids. Tokens it recognises by text are made control tokens."""
        ids = self.token_to_id

        def detect(key: str, texts: Sequence[str]) -> int | None:
            tid = _get(meta, key, int)
            if tid is not None and not 0 <= tid < self.n_vocab:
                raise GGUFError(f"{key} = {tid} is outside the vocabulary (n_vocab {self.n_vocab})")
            if tid is None:  # llama.cpp takes the first hit of a hash-map walk; the lowest id here
                hits = sorted(ids[t] for t in texts if t in ids)
                if hits:
                    tid = hits[0]
                    self.attrs[tid] |= ATTR_CONTROL
            return tid

        eot = detect("tokenizer.ggml.eot_token_id", EOT_TEXTS)
        eom = detect("tokenizer.ggml.eom_token_id", EOM_TEXTS)
        # fill-in-the-middle: control tokens, but they do not end generation (None: the vocabulary has none)
        self.fim_pre_id = detect("tokenizer.ggml.fim_pre_token_id", FIM_PRE_TEXTS)
        self.fim_suf_id = detect("tokenizer.ggml.fim_suf_token_id", FIM_SUF_TEXTS)
        self.fim_mid_id = detect("tokenizer.ggml.fim_mid_token_id", FIM_MID_TEXTS)
        fim = [detect("tokenizer.ggml.fim_pad_token_id", FIM_PAD_TEXTS),
               detect("tokenizer.ggml.fim_rep_token_id", FIM_REP_TEXTS),
               detect("tokenizer.ggml.fim_sep_token_id", FIM_SEP_TEXTS)]
        eog = {t for t in fim if t is not None}
        for text in EOG_TEXTS:
            if text in ids:
                eog.add(ids[text])
                self.attrs[ids[text]] |= ATTR_CONTROL
        for text in ALWAYS_RENDERED:
            if text in ids:
                self.attrs[ids[text]] = ATTR_USER_DEFINED
        eog.update(t for t in (self.eos_id, eot, eom) if t is not None)
        texts = {self.tokens[t] for t in eog}
        # o200k_harmony / solar-open: "<|end|>" does not end generation when these are present
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            eog.discard(ids["<|end|>"])
            self.attrs[ids["<|end|>"]] = ATTR_USER_DEFINED
        # gemma4 / plamo: "</s>" is a normal token when one of these exists (paddleocr's is an end token)
        if ("<|tool_response>" in texts or "<|plamo:eos|>" in texts) and "</s>" in texts:
            eog.discard(ids["</s>"])
            self.attrs[ids["</s>"]] = ATTR_NORMAL
        return frozenset(eog)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eot_ids

    # --- special-token partition ------------------------------------------------------------------------
    def _index(self, order: list[int]) -> dict[str, list[int]]:
        """first character -> ids of special tokens starting with it, in partition order."""
        by_first: dict[str, list[int]] = {}
        for i in order:
            by_first.setdefault(self.tokens[i][0], []).append(i)
        return by_first

    def _partition_key(self, token_id: int) -> tuple[int, int]:
        return -len(self.tokens[token_id].encode()), token_id

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Cut `text` at special-token texts as llama.cpp's tokenizer_st_partition: for each special token,
        longest UTF-8 text first, split every remaining text fragment at its occurrences. A token with the
        lstrip (rstrip) attribute also takes the ASCII whitespace before (after) each occurrence."""
        index = self._parse_all if special else self._parse_plain
        found = [i for c in set(text).intersection(index) for i in index[c] if self.tokens[i] in text]
        if not found:
            return [text] if text else []
        found.sort(key=self._partition_key)
        fragments: list[str | int] = [text]
        for tid in found:
            needle = self.tokens[tid]
            strip = self._strip.get(tid, 0)
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or needle not in frag:
                    out.append(frag)
                    continue
                parts = frag.split(needle)
                last = len(parts) - 1
                for k, part in enumerate(parts):
                    if k:
                        out.append(tid)
                        if strip & STRIP_RIGHT:
                            part = part.lstrip(C_SPACE)
                    if k < last and strip & STRIP_LEFT:
                        part = part.rstrip(C_SPACE)
                    if part:
                        out.append(part)
            fragments = out
        return fragments

    # --- encode -------------------------------------------------------------------------------------------
    def default_bos(self, text: str, special: bool) -> bool:
        """Whether `text` gets a BOS by default: the model's add_bos_token, except for a text parsed as special that
        starts with the BOS token's text (a chat template that writes bos_token, as Gemma's and Llama 3's do, has
        put it there; a second one is not what the model was trained on; llama-server's rule too)."""
        if not self.add_bos_default:
            return False
        return not (special and self.bos_id is not None and isinstance(text, str)
                    and text.startswith(self.token_text(self.bos_id)))

    def encode(self, text: str, *, add_bos: bool, special: bool, shielded: bool = False) -> list[int]:
        """Token ids of `text`. add_bos: prepend bos_id. special: parse control-token texts (e.g.
        "<|im_start|>", "<start_of_turn>", "<bos>") as those tokens; user-defined tokens are always parsed.
        shielded (with special): the text holds parts shielded by `shield`, read back as plain text; only a caller
        that shielded says so, so any other text with U+FDD0 in it is encoded as it is, as llama.cpp encodes it."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        check_unicode(text)
        ids: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise GGUFError("add_bos requested but the vocabulary has no bos token")
            ids.append(self.bos_id)
        fragments = self._partition(text, special)
        if special and shielded and SHIELD_OPEN in text:            # (a shielded text: Tokenizer.shield)
            fragments = [self._unshield(f) if isinstance(f, str) else f for f in fragments]
        self._encode_fragments(fragments, ids)
        return ids

    # --- shielded text --------------------------------------------------------------------------------
    def shield(self, text: str) -> str:
        """`text` such that encode(special=True) reads every control-token text in it as plain text: what a user
        wrote, before it goes into a chat template whose own markers must parse. Each control or unknown
        token's text becomes SHIELD_OPEN + its id + SHIELD_CLOSE (Unicode noncharacters, no token's text), which
        encode(special=True, shielded=True) writes back as that text after the special-token partition; a SHIELD_OPEN
        in `text` itself becomes SHIELD_OPEN + SHIELD_CLOSE. So encode(shield(t), special=True, shielded=True) is
        encode(t, special=False), and the template's "<|im_start|>" stays a token while the user's is text."""
        if not isinstance(text, str):
            raise TypeError(f"shield() takes a str, got {type(text).__name__}")
        text = text.replace(SHIELD_OPEN, SHIELD_OPEN + SHIELD_CLOSE)
        found = [i for c in set(text).intersection(self._parse_all) for i in self._parse_all[c]
                 if self.attrs[i] & ATTR_SPECIAL and self.tokens[i] in text]
        for tid in sorted(found, key=self._partition_key):  # longest text first, as the partition cuts
            text = text.replace(self.tokens[tid], f"{SHIELD_OPEN}{tid}{SHIELD_CLOSE}")
        return text

    def shield_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict]:
        """Copies of chat messages with their text content shielded (a string, or the text of each
        {"type": "text"} part); the rest as given (what is not a list of mappings too: the template's checks say
        what is wrong with it)."""
        if not isinstance(messages, (list, tuple)):
            return messages
        out = []
        for m in messages:
            if not isinstance(m, Mapping):
                out.append(m)
                continue
            m = dict(m)
            content = m.get("content")
            if isinstance(content, str):
                m["content"] = self.shield(content)
            elif isinstance(content, list):
                m["content"] = [dict(p, text=self.shield(p["text"]))
                                if isinstance(p, Mapping) and isinstance(p.get("text"), str) else p for p in content]
            out.append(m)
        return out

    def _unshield(self, fragment: str) -> str:
        def text(m: re.Match) -> str:
            if not m[1]:
                return SHIELD_OPEN
            tid = int(m[1])
            return self.tokens[tid] if tid < self.n_vocab else m[0]
        return SHIELDED.sub(text, fragment)

    def _encode_fragments(self, fragments: list[str | int], out: list[int]) -> None:
        raise NotImplementedError

    # --- decode -------------------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocab (byte-level or U+2581-escaped, not decoded)."""
        return self.tokens[self._check(token_id)]

    def _check(self, token_id: int) -> int:
        try:
            token_id = operator.index(token_id)          # int or numpy integer; not a float, a str, None
        except TypeError:
            raise TypeError(f"a token id must be an integer, got {token_id!r}") from None
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary (n_vocab {self.n_vocab})")
        return token_id

    def token_bytes(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes llama.cpp's token_to_piece gives for one token (no leading-space strip)."""
        self._check(token_id)
        if not special and self.attrs[token_id] & ATTR_SPECIAL:
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            attr, text = self.attrs[token_id], self.tokens[token_id]
            if attr & (ATTR_SPECIAL | ATTR_USER_DEFINED):
                piece = text.encode()
            elif attr & ATTR_NORMAL:
                piece = self._normal_piece(text)
            elif attr & ATTR_BYTE:
                piece = bytes([int(text[3:5], 16)])  # "<0xE4>"
            else:
                piece = b""                          # unused / undefined tokens render as nothing
            self._pieces[token_id] = piece
        return piece

    def _normal_piece(self, text: str) -> bytes:
        raise NotImplementedError

    def decode_bytes(self, ids: Iterable[int], *, special: bool = False) -> bytes:
        """Concatenated pieces, as llama.cpp's detokenize (the first piece loses one leading space when
        add_space_prefix is set)."""
        pieces = [self.token_bytes(i, special=special) for i in ids]
        if pieces and self.add_space_prefix and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        return b"".join(pieces)

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Text of `ids`; special=True also renders control tokens ("<end_of_turn>") as their text."""
        return self.decode_bytes(ids, special=special).decode("utf-8", errors="replace")

    def stream(self, *, special: bool = False, start: bool = False) -> StreamDecoder:
        """An incremental decoder: push ids one by one, get text that never splits a UTF-8 character. By default
        the ids continue a prompt (a generation): every piece is kept whole, as llama-server streams them; with
        start=True they begin a text, and the first piece loses its prefixed space as in decode()."""
        return StreamDecoder(self, special=special, start=start)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id}, "
                f"eog={sorted(self.eot_ids)}, add_bos={self.add_bos_default})")

    # --- factory ------------------------------------------------------------------------------------------
    @staticmethod
    def from_metadata(meta: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer that `tokenizer.ggml.model` names from a GGUF metadata mapping."""
        model = _get(meta, "tokenizer.ggml.model", str)
        if model is None:
            raise GGUFError("missing tokenizer key tokenizer.ggml.model")
        if model == "gemma4" or (model == "gpt2" and _get(meta, "tokenizer.ggml.pre", str) in ESCAPED_BPE_PRES):
            return EscapedBPETokenizer(meta)
        if model == "gpt2":
            return BPETokenizer(meta)
        if model == "llama":
            return SPMTokenizer(meta)
        if model == "bert":
            return WPMTokenizer(meta)
        if model == "t5":
            return UGMTokenizer(meta)
        if model == "rwkv":
            return RWKVTokenizer(meta)
        raise UnsupportedError(f"tokenizer.ggml.model = {model!r} is not supported (supported: 'gpt2' byte-level "
                               f"BPE, 'gemma4' BPE on U+2581-escaped text, 'llama' SentencePiece, 'bert' WordPiece, "
                               f"'t5' SentencePiece unigram, 'rwkv' greedy bytes)")


class StreamDecoder:
    """Decode ids one at a time. push() returns only whole UTF-8 characters and keeps a split character's
    leading bytes until the rest arrives; flush() returns what is left (invalid bytes become U+FFFD). The
    concatenated output equals tok.decode(all ids), but for the one leading space decode() drops with
    add_space_prefix (SentencePiece's dummy prefix): only a stream with start=True drops it too. A generation
    continues its prompt, so its first token's space is text (" Paris" after "The capital of France is"), as
    llama-server's token_to_piece and vLLM's incremental detokenizer keep it."""

    def __init__(self, tok: Tokenizer, *, special: bool = False, start: bool = False):
        self.tok = tok
        self.special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = start

    def push(self, token_id: int) -> str:
        piece = self.tok.token_bytes(token_id, special=self.special)
        if self._first:
            self._first = False
            if self.tok.add_space_prefix and piece[:1] == b" ":
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# ---------------------------------------------------------------------------------------------------
# gpt2 pre-tokenizers: llama.cpp's unicode_regex_split, reimplemented
# ---------------------------------------------------------------------------------------------------
# llama.cpp classifies codepoints with its own table (unicode-data.cpp, Unicode 15.1): one category flag
# per codepoint, plus a whitespace flag for the Unicode White_Space set. Out of a segment the flags are 0.
U_UNDEFINED, U_NUMBER, U_LETTER, U_SEPARATOR, U_MARK, U_PUNCT, U_SYMBOL, U_CONTROL = 1, 2, 4, 8, 16, 32, 64, 128
U_WHITESPACE = 256
_CATEGORY_FLAG = {"Cn": U_UNDEFINED, "Cc": U_CONTROL, "Cf": U_CONTROL, "Co": U_CONTROL, "Cs": U_CONTROL,
                  "L": U_LETTER, "M": U_MARK, "N": U_NUMBER, "P": U_PUNCT, "S": U_SYMBOL, "Z": U_SEPARATOR}
_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                         0x202F, 0x205F, 0x3000])
# Codepoints assigned by Unicode 15.0 and 15.1, which llama.cpp's table has and Python 3.11's unicodedata (14.0)
# calls unassigned: (first, last, flag). Applied only where unicodedata says Cn, so Python 3.12/3.13 (15.0/15.1)
# agree too; a Python with a newer Unicode would class codepoints assigned after 15.1, which llama.cpp does not.
_UNICODE_15 = (
    (0x0CF3, 0x0CF3, U_MARK), (0x0ECE, 0x0ECE, U_MARK), (0x2FFC, 0x2FFF, U_SYMBOL), (0x31EF, 0x31EF, U_SYMBOL),
    (0x10EFD, 0x10EFF, U_MARK), (0x1123F, 0x11240, U_LETTER), (0x11241, 0x11241, U_MARK),
    (0x11B00, 0x11B09, U_PUNCT), (0x11F00, 0x11F01, U_MARK), (0x11F02, 0x11F02, U_LETTER),
    (0x11F03, 0x11F03, U_MARK), (0x11F04, 0x11F10, U_LETTER), (0x11F12, 0x11F33, U_LETTER),
    (0x11F34, 0x11F3A, U_MARK), (0x11F3E, 0x11F42, U_MARK), (0x11F43, 0x11F4F, U_PUNCT),
    (0x11F50, 0x11F59, U_NUMBER), (0x1342F, 0x1342F, U_LETTER), (0x13439, 0x1343F, U_CONTROL),
    (0x13440, 0x13440, U_MARK), (0x13441, 0x13446, U_LETTER), (0x13447, 0x13455, U_MARK),
    (0x1B132, 0x1B132, U_LETTER), (0x1B155, 0x1B155, U_LETTER), (0x1D2C0, 0x1D2D3, U_NUMBER),
    (0x1DF25, 0x1DF2A, U_LETTER), (0x1E030, 0x1E06D, U_LETTER), (0x1E08F, 0x1E08F, U_MARK),
    (0x1E4D0, 0x1E4EB, U_LETTER), (0x1E4EC, 0x1E4EF, U_MARK), (0x1E4F0, 0x1E4F9, U_NUMBER),
    (0x1F6DC, 0x1F6DC, U_SYMBOL), (0x1F774, 0x1F776, U_SYMBOL), (0x1F77B, 0x1F77F, U_SYMBOL),
    (0x1F7D9, 0x1F7D9, U_SYMBOL), (0x1FA75, 0x1FA77, U_SYMBOL), (0x1FA87, 0x1FA88, U_SYMBOL),
    (0x1FAAD, 0x1FAAF, U_SYMBOL), (0x1FABB, 0x1FABD, U_SYMBOL), (0x1FABF, 0x1FABF, U_SYMBOL),
    (0x1FACE, 0x1FACF, U_SYMBOL), (0x1FADA, 0x1FADB, U_SYMBOL), (0x1FAE8, 0x1FAE8, U_SYMBOL),
    (0x1FAF7, 0x1FAF8, U_SYMBOL), (0x2B739, 0x2B739, U_LETTER), (0x2EBF0, 0x2EE5D, U_LETTER),
    (0x31350, 0x323AF, U_LETTER))


class _CodepointFlags(dict):
    """character -> llama.cpp's flags for it (filled on first use)."""

    def __missing__(self, char: str) -> int:
        cat = unicodedata.category(char)
        flags = _CATEGORY_FLAG.get(cat) or _CATEGORY_FLAG[cat[0]]
        cp = ord(char)
        if flags == U_UNDEFINED:
            flags = next((f for first, last, f in _UNICODE_15 if first <= cp <= last), U_UNDEFINED)
        if cp in _WHITESPACE:
            flags |= U_WHITESPACE
        self[char] = flags
        return flags


_FLAGS = _CodepointFlags()

# std::regex cannot match Unicode classes, so llama.cpp runs a regex that names \p{..} classes on a "collapsed"
# text: ASCII stays, other whitespace becomes \v, other codepoints become one byte per class (0xD0 = none of
# them), and each class in the regex becomes [that byte + its ASCII members]. \p{Lu} etc. all mean letter.
_UCAT = {r"\p{N}": U_NUMBER, r"\p{L}": U_LETTER, r"\p{P}": U_PUNCT, r"\p{M}": U_MARK, r"\p{S}": U_SYMBOL,
         r"\p{Lu}": U_LETTER, r"\p{Ll}": U_LETTER, r"\p{Lt}": U_LETTER, r"\p{Lm}": U_LETTER, r"\p{Lo}": U_LETTER}
_UCAT_BYTE = {U_NUMBER: "\xd1", U_LETTER: "\xd2", U_PUNCT: "\xd3", U_MARK: "\xd4", U_SYMBOL: "\xd5"}
_UCAT_ASCII = {U_NUMBER: "0-9", U_LETTER: "A-Za-z", U_PUNCT: r"!-#%-*,-/:-;?-@\[-\]_\{\}", U_MARK: "",
               U_SYMBOL: r"\$\+<->^`\|\~"}


class _Collapse(dict):
    """ordinal -> the collapsed character (for str.translate)."""

    def __missing__(self, cp: int) -> str:
        if cp < 128:
            out = chr(cp)
        else:
            flags = _FLAGS[chr(cp)]
            out = "\x0b" if flags & U_WHITESPACE else _UCAT_BYTE.get(flags & 0xFF, "\xd0")
        self[cp] = out
        return out


_COLLAPSE = _Collapse()
# regexes without classes run on the codepoints (std::wregex), non-ASCII whitespace replaced by \v
_WIDE = {cp: "\x0b" for cp in _WHITESPACE if cp > 0x7F}


def _collapse_regex(expr: str) -> str:
    """llama.cpp's rewrite of a regex that names Unicode classes, for the collapsed text."""
    out, inside, i = [], False, 0
    while i < len(expr):
        ch = expr[i]
        if ch == "[" and (i == 0 or expr[i - 1] != "\\"):
            inside = True
        elif inside and ch == "]" and expr[i - 1] != "\\":
            inside = False
        elif expr.startswith("\\p{", i) and i + 3 < len(expr):
            close = expr.find("}", i + 3)
            flag = _UCAT.get(expr[i:close + 1]) if 0 <= close <= i + 10 else None
            if flag is not None:
                body = _UCAT_BYTE[flag] + _UCAT_ASCII[flag]
                out.append(body if inside else f"[{body}]")
                i = close + 1
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def _python_regex(expr: str) -> re.Pattern:
    """Compile an ECMAScript (std::regex, C locale) pattern with Python's `re`: ASCII \\s \\d \\w, and `$` only
    at the end of the text."""
    out, inside, i = [], False, 0
    while i < len(expr):
        ch = expr[i]
        if ch == "\\":
            out.append(expr[i:i + 2])
            i += 2
            continue
        if ch == "[" and not inside:
            inside = True
        elif ch == "]" and inside:
            inside = False
        elif ch == "$" and not inside:
            ch = r"\Z"
        out.append(ch)
        i += 1
    return re.compile("".join(out), re.ASCII)


# --- llama.cpp's hand-written splitters, used when the regex text is exactly the one they replace ---------
# Each takes the text, its flags, a segment [a, b) and appends the end of every piece to `ends`.
def _split_gpt2(s: str, fl: list[int], a: int, b: int, ends: list[int]) -> None:
    """'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""
    pos = a
    while pos < b:
        c, f = s[pos], fl[pos]
        if c == "'" and pos + 1 < b:
            if s[pos + 1] in "stmd":
                pos += 2
                ends.append(pos)
                continue
            if pos + 2 < b and s[pos + 1:pos + 3] in ("re", "ve", "ll"):
                pos += 3
                ends.append(pos)
                continue
        space = c == " "
        f2 = (fl[pos + 1] if pos + 1 < b else 0) if space else f
        if f2 & (U_LETTER | U_NUMBER):                               # ' ?\p{L}+', ' ?\p{N}+'
            cls = f2 & (U_LETTER | U_NUMBER)
            pos += space
            while pos < b and fl[pos] & cls:
                pos += 1
        elif f2 and not f2 & (U_WHITESPACE | U_LETTER | U_NUMBER):  # ' ?[^\s\p{L}\p{N}]+'
            pos += space
            while pos < b and not fl[pos] & (U_WHITESPACE | U_LETTER | U_NUMBER):
                pos += 1
        else:
            end = pos
            while end < b and fl[end] & U_WHITESPACE:
                end += 1
            if end - pos > 1 and end < b:                            # '\s+(?!\S)'
                pos = end - 1
            elif end > pos:                                          # '\s+'
                pos = end
            else:
                pos += 1
        ends.append(pos)


def _split_llama3(s: str, fl: list[int], a: int, b: int, ends: list[int], digits: int = 3,
                  letter: int = U_LETTER) -> None:
    """(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|
    \\s*[\\r\\n]+|\\s+(?!\\S)|\\s+ ; qwen2: \\p{N} (digits=1); qwen35: [\\p{L}\\p{M}] for \\p{L} (letter)."""
    other = U_WHITESPACE | letter | U_NUMBER
    pos = a
    while pos < b:
        c, f = s[pos], fl[pos]
        if c == "'" and pos + 1 < b:  # only ASCII letters lowercase to these in llama.cpp's table
            if s[pos + 1] in "sStTmMdD":
                pos += 2
                ends.append(pos)
                continue
            if pos + 2 < b and s[pos + 1:pos + 3] in ("re", "rE", "Re", "RE", "ve", "vE", "Ve", "VE",
                                                       "ll", "lL", "Ll", "LL"):
                pos += 3
                ends.append(pos)
                continue
        if c != "\r" and c != "\n" and not f & U_NUMBER and (
                f & letter or (pos + 1 < b and fl[pos + 1] & letter)):   # [^\r\n\p{L}\p{N}]?\p{L}+
            pos += 1
            while pos < b and fl[pos] & letter:
                pos += 1
        elif f & U_NUMBER:                                               # \p{N}{1,3}
            start = pos
            while pos < b and fl[pos] & U_NUMBER:
                pos += 1
                if digits == 1 or pos - start == 3:
                    break
        else:
            space = c == " "
            f2 = (fl[pos + 1] if pos + 1 < b else 0) if space else f
            if not f2 & other:                                           # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
                pos += space
                while pos < b and not fl[pos] & other:
                    pos += 1
                while pos < b and s[pos] in "\r\n":
                    pos += 1
            else:
                end, last_newline = pos, 0
                while end < b and fl[end] & U_WHITESPACE:
                    if s[end] in "\r\n":
                        last_newline = end + 1
                    end += 1
                if last_newline:                                         # \s*[\r\n]+
                    pos = last_newline
                elif end - pos > 1 and end < b:                          # \s+(?!\S)
                    pos = end - 1
                elif end > pos:                                          # \s+
                    pos = end
                else:
                    pos += 1
        ends.append(pos)


def _split_qwen2(s, fl, a, b, ends):
    _split_llama3(s, fl, a, b, ends, digits=1)


def _split_qwen35(s, fl, a, b, ends):
    _split_llama3(s, fl, a, b, ends, digits=1, letter=U_LETTER | U_MARK)


def _split_digit_groups(s: str, fl: list[int], a: int, b: int, ends: list[int]) -> None:
    """llama.cpp's AFMoE digits: a run of n numbers is cut after its first n % 3, then every 3. Text before
    a run stays joined to the run's first group, text after the last run is one piece."""
    pos = last = a
    while pos < b:
        if fl[pos] & U_NUMBER:
            start = pos
            while pos < b and fl[pos] & U_NUMBER:
                pos += 1
            cut = start + (pos - start) % 3
            if cut == start:
                cut += 3
            while cut <= pos:
                ends.append(cut)
                cut += 3
            last = pos
        else:
            pos += 1
    if last < b:
        ends.append(b)


def _split_newlines(s: str, fl: list[int], a: int, b: int, ends: list[int]) -> None:
    """[^\\n]+|[\\n]+"""
    pos = a
    while pos < b:
        newline = s[pos] == "\n"
        while pos < b and (s[pos] == "\n") == newline:
            pos += 1
        ends.append(pos)


_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
    r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_NEWLINES = r"[^\n]+|[\n]+"
_RE_TINY_AYA_DIGITS = r"\d{1,3}(?=(?:\d{3})*\b)"
_RE_AFMOE_DIGITS = r"\p{AFMoE_digits}"
PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "LLAMA3": (  # LLAMA3
        _RE_LLAMA3,
    ),
    "JAIS2": (  # JAIS2
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|"
        r"\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    ),
    "DBRX": (  # DBRX, SMAUG
        _RE_LLAMA3,
    ),
    "DEEPSEEK_LLM": (  # DEEPSEEK_LLM
        "[\r\n]",
        "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
        "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
        "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
        "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-"
        "\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
        "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d"
        "\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
        "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
        "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
        "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}+",
    ),
    "DEEPSEEK3_LLM": (  # DEEPSEEK3_LLM, HUNYUAN_DENSE, JOYAI_LLM, HY_V4
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
        " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
    "SPARK2_5": (  # SPARK2_5
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
        " ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
        r"\p{N}",
    ),
    "YOUTU": (  # YOUTU
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
        "\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|"
        r"'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p"
        r"{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "DEEPSEEK_CODER": (  # DEEPSEEK_CODER
        "[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}",
    ),
    "FALCON": (  # FALCON
        r"[\p{P}\$\+<=>\^~\|`]+",
        _RE_GPT2,
        r"[0-9][0-9][0-9]",
    ),
    "STARCODER": (  # STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2
        r"\p{N}",
        _RE_GPT2,
    ),
    "GPT2": (  # GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING
        _RE_GPT2,
    ),
    "QWEN2": (  # STABLELM2, QWEN2, HUNYUAN, SOLAR_OPEN
        _RE_QWEN2,
    ),
    "QWEN35": (  # QWEN35
        _RE_QWEN35,
    ),
    "PORO": (  # PORO, BLOOM, GPT3_FINNISH
        " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",
    ),
    "CHATGLM4": (  # CHATGLM4
        _RE_LLAMA3,
    ),
    "VIKING": (  # VIKING
        " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",
        r"\p{N}",
    ),
    "TEKKEN": (  # TEKKEN
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|"
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "CHAMELEON": (  # CHAMELEON
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _RE_GPT2,
    ),
    "GPT4O": (  # GPT4O, MINIMAX_M2
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|"
        r"'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|"
        r"'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "GRANITE_EMB_MULTI": (  # GRANITE_EMB_MULTI
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|"
        r"'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))"
        r"*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "TINY_AYA": (  # TINY_AYA
        _RE_TINY_AYA_DIGITS,
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|"
        r"'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p"
        r"{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "BAILINGMOE": (  # BAILINGMOE
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
        r"\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "SEED_CODER": (  # SEED_CODER
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}|"
        r" ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "UFAKZEKA": (  # UFAKZEKA
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "GROK_2": (  # GROK_2
        _RE_QWEN2,
    ),
    "AFMOE": (  # AFMOE
        _RE_AFMOE_DIGITS,
        "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf\u0e40-\u0e7f"
        "\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
        " ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "LAGUNA": (  # LAGUNA
        _RE_NEWLINES,
        _RE_QWEN2,
    ),
    "EXAONE_MOE": (  # EXAONE_MOE
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
        r"[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|"
        r"\s+",
    ),
    "SUPERBPE": (  # SUPERBPE
        r"\p{N}+",
        r"(?=(\d{3})+(?!\d))",
    ),
    "MINICPM5": (  # MINICPM5
        r"\p{N}{1,3}",
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "DEFAULT": (  # DEFAULT
        r"[\p{P}\$\+<=>\^~\|]+",
        _RE_GPT2,
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ),
}


# llama.cpp's hand-written splitters replace exactly these regex texts
_CUSTOM = {_RE_GPT2: _split_gpt2, _RE_LLAMA3: _split_llama3, _RE_QWEN2: _split_qwen2, _RE_QWEN35: _split_qwen35,
           _RE_NEWLINES: _split_newlines, _RE_AFMOE_DIGITS: _split_digit_groups,
           _RE_TINY_AYA_DIGITS: _split_digit_groups}


class PreTokenizer:
    """llama.cpp's unicode_regex_split for a regex list: every regex cuts each piece the previous ones left
    (a match is a piece, and so is the text between matches)."""

    def __init__(self, exprs: Sequence[str]):
        self.exprs = tuple(exprs)
        self._steps: list[tuple[str, Any]] = []
        for expr in self.exprs:
            if expr in _CUSTOM:
                self._steps.append(("custom", _CUSTOM[expr]))
            elif any(cat in expr for cat in _UCAT):
                self._steps.append(("collapsed", _python_regex(_collapse_regex(expr))))
            else:
                self._steps.append(("wide", _python_regex(expr)))

    def split(self, text: str) -> list[str]:
        if not text:
            return []
        ends = [len(text)]                 # end offset of every piece, in order
        fl = collapsed = wide = None
        for kind, step in self._steps:
            new: list[int] = []
            start = 0
            if kind == "custom":
                if fl is None:
                    fl = list(map(_FLAGS.__getitem__, text))
                for end in ends:
                    step(text, fl, start, end, new)
                    start = end
            else:
                if kind == "collapsed":
                    if collapsed is None:
                        collapsed = text.translate(_COLLAPSE)
                    subject = collapsed
                else:
                    if wide is None:
                        wide = text.translate(_WIDE)
                    subject = wide
                for end in ends:
                    last = start
                    for m in step.finditer(subject[start:end]):
                        a, b = start + m.start(), start + m.end()
                        if a > last:
                            new.append(a)
                        if b > a:
                            new.append(b)
                        last = b
                    if last < end:
                        new.append(end)
                    start = end
            ends = new
        return [text[a:b] for a, b in zip([0, *ends], ends)]


class PreType(NamedTuple):
    """What a `tokenizer.ggml.pre` value selects in llama.cpp (llama_vocab::impl::load)."""
    regexes: str                 # key of PRE_REGEXES (llama.cpp's LLAMA_VOCAB_PRE_TYPE_ name)
    ignore_merges: bool = False  # a pre-tokenized word that is a vocab entry is that token, without merging
    add_bos: bool = False        # default of tokenizer.ggml.add_bos_token
    bos: bool = True             # False: no default bos id (chatglm)


def _pre_types() -> dict[str, PreType]:
    plain = {
        "default": "DEFAULT", "dbrx": "DBRX", "smaug-bpe": "DBRX", "jais-2": "JAIS2",
        "deepseek-llm": "DEEPSEEK_LLM", "deepseek-coder": "DEEPSEEK_CODER",
        "deepseek-v3": "DEEPSEEK3_LLM", "hunyuan-dense": "DEEPSEEK3_LLM", "joyai-llm": "DEEPSEEK3_LLM",
        "hy_v4": "DEEPSEEK3_LLM", "spark2_5": "SPARK2_5", "falcon": "FALCON",
        "starcoder": "STARCODER", "refact": "STARCODER", "command-r": "STARCODER", "smollm": "STARCODER",
        "codeshell": "STARCODER", "exaone": "STARCODER", "minerva-7b": "STARCODER", "mellum2": "STARCODER",
        "qwen2": "QWEN2", "deepseek-r1-qwen": "QWEN2", "kormo": "QWEN2", "f2llmv2": "QWEN2", "megrez": "QWEN2",
        "stablelm2": "QWEN2", "hunyuan": "QWEN2", "solar-open": "QWEN2", "grok-2": "GROK_2", "laguna": "LAGUNA",
        "qwen35": "QWEN35", "poro-chat": "PORO", "bloom": "PORO", "gpt3-finnish": "PORO", "viking": "VIKING",
        "gpt-4o": "GPT4O", "llama4": "GPT4O", "kanana2": "GPT4O", "talkie": "GPT4O", "minimax-m2": "GPT4O",
        "tiny_aya": "TINY_AYA", "cohere2moe": "TINY_AYA", "bailingmoe": "BAILINGMOE", "bailingmoe2": "BAILINGMOE",
        "llada-moe": "BAILINGMOE", "seed-coder": "SEED_CODER", "ufakzeka": "UFAKZEKA", "afmoe": "AFMOE",
        "exaone-moe": "EXAONE_MOE", "superbpe": "SUPERBPE",
    }
    gpt2 = ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
            "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais",
            "trillion", "granite-docling")
    llama3 = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
              "jina-v5-nano")
    types = {name: PreType(key) for name, key in plain.items()}
    types.update((name, PreType("GPT2")) for name in gpt2)
    types.update((name, PreType("LLAMA3", ignore_merges=True, add_bos=True)) for name in llama3)
    types["tekken"] = PreType("TEKKEN", ignore_merges=True, add_bos=True)
    types["chameleon"] = PreType("CHAMELEON", add_bos=True)
    types["youtu"] = PreType("YOUTU", ignore_merges=True)
    types["granite-embed-multi-97m"] = PreType("GRANITE_EMB_MULTI", ignore_merges=True)
    types["minicpm5"] = PreType("MINICPM5", ignore_merges=True)
    types["chatglm-bpe"] = PreType("CHATGLM4", bos=False)
    types["glm4"] = types["glm5"] = PreType("CHATGLM4", ignore_merges=True, bos=False)
    return dict(sorted(types.items()))


# tokenizer.ggml.pre -> its llama.cpp behaviour. Not here (llama.cpp has them): kimi-k2 (splitter not
# reimplemented), sarvam-moe and whitespace (no byte-level encoding), gemma4 and granite-embed-multi-311m
# (EscapedBPETokenizer).
PRE_TYPES = _pre_types()


# ---------------------------------------------------------------------------------------------------
# gpt2: byte-level BPE (HF tokenizers for the merges)
# ---------------------------------------------------------------------------------------------------
class BPETokenizer(Tokenizer):
    model = "gpt2"

    def __init__(self, meta: Mapping[str, Any]):
        pre = _get(meta, "tokenizer.ggml.pre", str) or "default"  # llama.cpp: missing (older files) = default
        kind = PRE_TYPES.get(pre)
        if kind is None:
            hint = " (llama.cpp calls GPT-2's 'gpt-2')" if pre == "gpt2" else ""
            raise UnsupportedError(f"tokenizer.ggml.pre = {pre!r} is not supported for gpt2 vocabularies{hint} "
                                   f"(supported: {', '.join(PRE_TYPES)})")
        # llama.cpp defaults for BPE vocabularies: bos = eos = 11, no unk, no space prefix; some pre types add
        # bos by default or have no default bos
        super().__init__(meta, bos=11 if kind.bos else None, eos=11, unk=None, add_bos=kind.add_bos,
                         add_space_prefix=False)
        self.pre = pre
        self.pre_type = kind
        self.pre_tokenizer = PreTokenizer(PRE_REGEXES[kind.regexes])
        self._ranks = _merge_ranks(_get_list(meta, "tokenizer.ggml.merges", str, None, required=True))
        self._byte_char = _bytes_to_unicode()                         # byte -> byte-level char
        self._char_byte = {c: b for b, c in self._byte_char.items()}  # byte-level char -> byte
        self._to_chars = [self._byte_char[b] for b in range(256)]     # str.translate of latin-1: bytes -> chars
        self._words: dict[str, list[int]] = {}                        # word -> its ids, up to WORD_CACHE words
        self._hf = None                 # HF's BPE model for words of LONG_WORD characters or more (_long_words)
        self._hf_lock = threading.Lock()

    def pre_tokenize(self, text: str) -> list[str]:
        """The words llama.cpp's pre-tokenizer cuts `text` into (before byte-level encoding)."""
        return self.pre_tokenizer.split(text)

    def _encode_fragments(self, fragments: list[str | int], out: list[int]) -> None:
        words = self._words
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                continue
            for word in self.pre_tokenizer.split(frag):
                ids = words.get(word)
                if ids is None:
                    if len(words) >= WORD_CACHE:
                        words.clear()
                    ids = words[word] = self._word_ids(word)
                out.extend(ids)

    def _word_ids(self, word: str) -> list[int]:
        """llama.cpp's ids of one pre-tokenized word: its UTF-8 bytes as byte-level characters, merged by rank
        (`_bpe`); a symbol outside the vocab falls back to its characters' tokens, and a byte without one
        (SmolLM2 has none for 0x04, 0xC0, 0xF5..) is dropped, as llama.cpp's byte fallback finds none."""
        vocab = self.token_to_id
        chars = word.encode().decode("latin-1").translate(self._to_chars)
        tid = vocab.get(chars) if self.pre_type.ignore_merges else None
        if tid is not None:                     # the pre types where llama.cpp keeps a word that is a token whole
            return [tid]
        hf = self._long_words() if len(chars) >= LONG_WORD else None
        if hf is not None:
            return [i for i in hf.encode([chars], is_pretokenized=True, add_special_tokens=False).ids
                    if i < self.n_vocab]
        out = []
        for sym in _bpe(chars, self._ranks):
            tid = vocab.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(t for t in map(vocab.get, sym) if t is not None)
        return out

    def _long_words(self):
        """HF `tokenizers`' BPE model of the same merges, built on first need (0.2-0.3 s for Qwen2's), for long
        words: `_bpe` is Python's heap, 3.5-8x slower than HF's Rust on a word of 10^5 characters. False (and
        `_bpe` for every word) when HF refuses the merges, which llama.cpp and `_bpe` accept: parts or results
        that are not tokens. Only the merges byte-level text can use are given it (one space, inside), in rank
        order, so its merges are `_bpe`'s."""
        with self._hf_lock:
            if self._hf is None:
                from tokenizers import Tokenizer as HFTokenizer
                from tokenizers import models
                vocab = dict(self.token_to_id)
                for c in self._byte_char.values():      # bytes without a token: ids past the vocab, dropped after
                    vocab.setdefault(c, len(vocab))
                pairs = [tuple(m.split(" ")) for m in sorted(self._ranks, key=self._ranks.__getitem__)
                         if m.count(" ") == 1 and m[0] != " " and m[-1] != " "]
                try:
                    self._hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
                except Exception:               # noqa: BLE001 - HF raises its own errors on merges it refuses
                    self._hf = False
            return self._hf or None

    def _normal_piece(self, text: str) -> bytes:
        out = bytearray()
        for c in text:
            b = self._char_byte.get(c)
            if b is None:  # not a byte-level character: llama.cpp writes this marker
                out += b"[UNK_BYTE_0x" + c.encode().hex().encode() + text.encode() + b"]"
            else:
                out.append(b)
        return bytes(out)


# ---------------------------------------------------------------------------------------------------
# llama: SentencePiece-style merging by score, byte fallback (llama.cpp's llm_tokenizer_spm)
# ---------------------------------------------------------------------------------------------------
class SPMTokenizer(Tokenizer):
    model = "llama"

    def __init__(self, meta: Mapping[str, Any]):
        # llama.cpp defaults for SPM vocabularies: bos 1, eos 2, unk 0, bos added, space prefix added
        super().__init__(meta, bos=1, eos=2, unk=0, add_bos=True, add_space_prefix=True)
        scores = _get_list(meta, "tokenizer.ggml.scores", (float, int), self.n_vocab, required=True)
        self.scores: list[float] = scores   # (n_vocab,) merge priority: higher merges first
        # byte b -> id of "<0xBB>" (or of the one-character token for ASCII); None if the vocab has neither
        self._byte_ids: list[int | None] = []
        for b in range(256):
            tid = self.token_to_id.get(f"<0x{b:02X}>")
            if tid is None and b < 0x80:
                tid = self.token_to_id.get(chr(b))
            self._byte_ids.append(tid)
        self._adjacent: frozenset[str] | None = None    # every two characters adjacent in a vocab entry

    def _encode_fragments(self, fragments: list[str | int], out: list[int]) -> None:
        prev_special = True  # a space is prefixed to the first text and to text after a special token
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            for piece in self._cut(frag.replace(" ", SPACE)):
                self._merge(piece, out)
            prev_special = False

    def _cut(self, text: str) -> Iterable[str]:
        """`text` cut where no merge can cross: between two characters that are adjacent in no vocab entry (every
        merged symbol is a vocab entry, so none can hold both). Merging the pieces apart gives the ids of merging
        the text whole (a merge on one side never changes which pairs exist on the other, and each side keeps its
        own merge order), but the merge costs O(n log n) on its heap and its memory, and prose cuts at almost every
        word end. A text shorter than SPM_WHOLE is merged whole."""
        if len(text) < SPM_WHOLE:
            yield text
            return
        if self._adjacent is None:              # (built on first use: 0.7 s for Gemma's 262k entries)
            self._adjacent = frozenset(t[j:j + 2] for t in self.token_to_id for j in range(len(t) - 1))
        adjacent, start = self._adjacent, 0
        for i in range(1, len(text)):
            if text[i - 1:i + 1] not in adjacent:
                yield text[start:i]
                start = i
        yield text[start:]

    def _merge(self, text: str, out: list[int]) -> None:
        """llama.cpp's llm_tokenizer_spm_session::tokenize on one escaped fragment."""
        vocab, scores = self.token_to_id, self.scores
        sym = list(text)                        # (n,) symbol texts; "" once merged into the left neighbour
        n = len(sym)
        nxt = list(range(1, n + 1))             # (n,) next live symbol, -1 at the end
        nxt[-1] = -1
        prv = list(range(-1, n - 1))            # (n,) previous live symbol, -1 at the start
        heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, length of the pair)

        def push(left: int, right: int) -> None:
            tid = vocab.get(sym[left] + sym[right])
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, len(sym[left]) + len(sym[right])))

        for i in range(1, n):
            push(i - 1, i)
        while heap:  # highest score first, leftmost on ties
            _, left, right, size = heapq.heappop(heap)
            a, b = sym[left], sym[right]
            if not a or not b or len(a) + len(b) != size:
                continue                        # stale: one side has merged since this pair was queued
            sym[left], sym[right] = a + b, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            if prv[left] >= 0:
                push(prv[left], left)
            if nxt[left] >= 0:
                push(left, nxt[left])

        i = 0
        while i != -1:
            tid = vocab.get(sym[i])
            if tid is not None:
                out.append(tid)
            else:                               # not in the vocab: one <0xXX> token per UTF-8 byte
                for byte in sym[i].encode():
                    bid = self._byte_ids[byte]
                    if bid is None:
                        raise GGUFError(f"vocabulary has no byte token <0x{byte:02X}> for {sym[i]!r}")
                    out.append(bid)
            i = nxt[i]

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode()


# ---------------------------------------------------------------------------------------------------
# gemma4: BPE on the raw UTF-8 text with spaces escaped to U+2581 (llama.cpp's GEMMA4 pre type)
# ---------------------------------------------------------------------------------------------------
ESCAPED_BPE_PRES = ("gemma4", "granite-embed-multi-311m")  # gpt2 vocabularies with this pre type


class EscapedBPETokenizer(Tokenizer):
    """llama.cpp's BPE with the GEMMA4 pre type (`tokenizer.ggml.model` "gemma4", or "gpt2" with pre "gemma4" /
    "granite-embed-multi-311m"): spaces become U+2581, the text is cut only into runs of newlines and runs of
    other characters, and each run is merged by merge rank over its characters (no byte-level alphabet). A run
    of newlines that is a vocab entry is that token. A symbol left outside the vocab becomes one <0xXX> token
    per UTF-8 byte (dropped where the vocab has none). The bos token is always added by default."""
    model = "gemma4"

    def __init__(self, meta: Mapping[str, Any]):
        gpt2 = _get(meta, "tokenizer.ggml.model", str) == "gpt2"   # gpt2's defaults, else none
        super().__init__(meta, bos=11 if gpt2 else None, eos=11 if gpt2 else None, unk=None, add_bos=True,
                         add_space_prefix=False)
        if self.bos_id is None:
            raise GGUFError("tokenizer.ggml.bos_token_id is not set, but a gemma4 vocabulary always adds bos")
        self.add_bos_default = True   # llama.cpp overrides tokenizer.ggml.add_bos_token = false for this type
        self.pre = _get(meta, "tokenizer.ggml.pre", str) or "gemma4"
        merges = _get_list(meta, "tokenizer.ggml.merges", str, None, required=True)
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models
        try:
            bpe = models.BPE(vocab=dict(self.token_to_id), merges=_merge_pairs(merges), fuse_unk=False,
                             byte_fallback=True)
        except Exception as e:  # a merge whose parts or result are not in the vocab
            raise GGUFError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {e}") from e
        self._hf = HFTokenizer(bpe)

    def pre_tokenize(self, text: str) -> list[str]:
        """The runs llama.cpp merges separately (after escaping spaces)."""
        return _RUNS.findall(text.replace(" ", SPACE))

    def _encode_fragments(self, fragments: list[str | int], out: list[int]) -> None:
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                continue
            words = self.pre_tokenize(frag)
            k = 0
            for i, word in enumerate(words):  # a newline run that is a token stays whole, the rest go to HF
                tid = self.token_to_id.get(word) if word[0] == "\n" else None
                if tid is not None:
                    self._merge(words[k:i], out)
                    out.append(tid)
                    k = i + 1
            self._merge(words[k:], out)

    def _merge(self, words: list[str], out: list[int]) -> None:
        if words:
            out.extend(self._hf.encode(words, is_pretokenized=True, add_special_tokens=False).ids)

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode()


_RUNS = re.compile(r"[^\n]+|\n+")


def _merge_ranks(merges: list[str]) -> dict[str, int]:
    """tokenizer.ggml.merges as merge text -> rank (its index; of duplicates the first, as llama.cpp's bpe_ranks),
    for `_bpe`, which looks a pair up as "left right": llama.cpp cuts a merge at its first space after the first
    character, and a byte-level symbol holds no space, so the merges whose cut is elsewhere (a part holding a space)
    are pairs no byte-level text ever forms, in llama.cpp as here. A dict of the texts builds in ~40 ms for Qwen2's
    151k merges, where HF `tokenizers` took 0.3 s to build its model from the pairs: most of a warm start's
    tokenizer. (A merge whose parts or result are not tokens is kept, as llama.cpp keeps it: its result falls
    back to its characters' tokens.)"""
    _check_merges(merges)
    return dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))


def _check_merges(merges: list[str]) -> bool:
    """GGUFError for a merge that is not two tokens separated by a space (llama.cpp cuts each at its first space
    after the first character); True when every merge's first space is that cut (none starts with a space)."""
    first = list(map(str.find, merges, itertools.repeat(" ")))
    if 0 not in first and -1 not in first:
        return True
    k = next((k for k, merge in enumerate(merges) if merge.find(" ", 1) < 0), None)
    if k is not None:
        raise GGUFError(f"tokenizer.ggml.merges[{k}] = {merges[k]!r} is not two tokens separated by a space")
    return False


def _bpe(word: str, ranks: Mapping[str, int]) -> list[str]:
    """The symbols byte-level BPE leaves of `word` (llama.cpp's llm_tokenizer_bpe_session, HF's BPE model): from
    its characters, merge the adjacent pair of the lowest rank, the leftmost of equal ones, until no pair has a
    rank. A heap of candidate pairs, each checked when taken by its length (a pair whose sides merged since is
    longer): O(n log n) for a long word."""
    n = len(word)
    if n < 2:
        return [word]
    sym = list(word)
    nxt = [*range(1, n), -1]
    prv = list(range(-1, n - 1))
    heap = [(r, i, 2) for i in range(n - 1) if (r := ranks.get(f"{word[i]} {word[i + 1]}")) is not None]
    heapq.heapify(heap)
    while heap:
        _, i, size = heapq.heappop(heap)
        j = nxt[i]
        if j < 0 or not sym[i] or len(sym[i]) + len(sym[j]) != size:
            continue                            # stale: a side merged with another symbol since
        sym[i] += sym[j]
        sym[j] = ""
        k = nxt[i] = nxt[j]
        if k >= 0:
            prv[k] = i
            r = ranks.get(f"{sym[i]} {sym[k]}")
            if r is not None:
                heapq.heappush(heap, (r, i, len(sym[i]) + len(sym[k])))
        h = prv[i]
        if h >= 0:
            r = ranks.get(f"{sym[h]} {sym[i]}")
            if r is not None:
                heapq.heappush(heap, (r, h, len(sym[h]) + len(sym[i])))
    return [t for t in sym if t]


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as pairs: llama.cpp cuts each at the first space after its first character."""
    if _check_merges(merges):                # no merge starts with a space: the first space is the cut
        return list(map(tuple, map(str.split, merges, itertools.repeat(" "), itertools.repeat(1))))
    return [(merge[:cut], merge[cut + 1:]) for merge in merges for cut in (merge.find(" ", 1),)]


# ---------------------------------------------------------------------------------------------------
# bert: WordPiece (llama.cpp's llm_tokenizer_wpm)
# ---------------------------------------------------------------------------------------------------
def _is_cjk(cp: int) -> bool:
    """llama.cpp's (and HF BertPreTokenizer's) CJK ideograph ranges: each such character is a word."""
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or
            0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF or
            0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


class _WordChar(dict):
    """(character, lowercase, strip_accents) -> (kind, text): kind 0 = part of a word, 1 = a word of its own,
    2 = ends the word (whitespace), 3 = dropped. Filled on first use."""

    def __missing__(self, key: tuple[str, bool, bool]) -> tuple[int, str]:
        c, lowercase, strip_accents = key
        if strip_accents:  # llama.cpp keeps the first codepoint of the NFD form
            c = unicodedata.normalize("NFD", c)[0]
        cp, flags = ord(c), _FLAGS[c]
        if flags & U_WHITESPACE:
            value = (2, "")
        elif cp == 0 or cp == 0xFFFD or flags & U_CONTROL or (strip_accents and flags & U_MARK):
            value = (3, "")
        else:
            text = c.lower()[0] if lowercase else c  # simple case mapping: one codepoint
            alone = flags & U_PUNCT or (cp < 0x7F and flags & U_SYMBOL) or _is_cjk(cp)
            value = (1 if alone else 0, text)
        self[key] = value
        return value


_WORD_CHAR = _WordChar()


class WPMTokenizer(Tokenizer):
    """BERT's WordPiece as llama.cpp runs it. The text is normalized (`tokenizer.ggml.normalizer.lowercase`,
    default true; `...strip_accents`, default the same: a character becomes the first codepoint of its NFD form
    and marks are dropped) and cut into words at whitespace; control characters are dropped and each
    punctuation mark, ASCII symbol or CJK ideograph is a word of its own. Each word, prefixed with U+2581, is
    covered by the longest vocab entries from the left; a word that cannot be covered is the unknown token.
    add_bos adds the CLS (bos) token before and the SEP token after, as llama.cpp's add_special."""
    model = "bert"

    def __init__(self, meta: Mapping[str, Any]):
        # llama.cpp defaults for WPM vocabularies: bos (CLS) 101, unk 100, sep 102, bos added
        super().__init__(meta, bos=101, eos=None, unk=100, add_bos=True, add_space_prefix=False)
        sep = _get(meta, "tokenizer.ggml.seperator_token_id", int, 102)  # llama.cpp's spelling of the key
        self.sep_id = sep if 0 <= sep < self.n_vocab else None
        if self.unk_id is None:
            raise GGUFError("a bert vocabulary needs an unknown token (tokenizer.ggml.unknown_token_id)")
        self.lowercase: bool = _get(meta, "tokenizer.ggml.normalizer.lowercase", bool, True)
        self.strip_accents: bool = _get(meta, "tokenizer.ggml.normalizer.strip_accents", bool, self.lowercase)
        self._longest = max(map(len, self.tokens))  # (characters) no vocab entry is longer

    def encode(self, text: str, *, add_bos: bool, special: bool, shielded: bool = False) -> list[int]:
        ids = super().encode(text, add_bos=add_bos, special=special, shielded=shielded)
        if add_bos:
            if self.sep_id is None:
                raise GGUFError("add_bos requested but the vocabulary has no separator token")
            ids.append(self.sep_id)
        return ids

    def words(self, text: str) -> list[str]:
        """The normalized words of `text`, before the U+2581 prefix."""
        words, word = [], []
        key = self.lowercase, self.strip_accents
        for c in text:
            kind, s = _WORD_CHAR[(c, *key)]
            if kind == 0:
                word.append(s)
            elif kind != 3:
                if word:
                    words.append("".join(word))
                    word = []
                if kind == 1:
                    words.append(s)
        if word:
            words.append("".join(word))
        return words

    def _encode_fragments(self, fragments: list[str | int], out: list[int]) -> None:
        vocab, longest = self.token_to_id, self._longest
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                continue
            for word in self.words(frag):
                word = SPACE + word
                n, i, ids = len(word), 0, []
                while i < n:  # the longest entry that starts at i
                    for j in range(min(n, i + longest), i, -1):
                        tid = vocab.get(word[i:j])
                        if tid is not None:
                            ids.append(tid)
                            i = j
                            break
                    else:
                        ids = [self.unk_id]
                        break
                out.extend(ids)

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode()


# ---------------------------------------------------------------------------------------------------
# t5: SentencePiece unigram (llama.cpp's llm_tokenizer_ugm)
# ---------------------------------------------------------------------------------------------------
class _Charsmap:
    """SentencePiece's precompiled_charsmap: a XOR-compressed double array trie (XCDA) over UTF-8 bytes whose
    leaves point at NUL-terminated replacement strings. Layout: u32 size of the array, the u32 entries, then the
    strings. An entry packs BASE in bits 10-30 (shifted by 8 when bit 9 is set), LEAF in bit 8, LCHECK in bits
    0-7 (and 31)."""

    def __init__(self, blob: bytes):
        if len(blob) < 4:
            raise GGUFError("tokenizer.ggml.precompiled_charsmap is too short for its header")
        size = int.from_bytes(blob[:4], "little")
        if size % 4 or 4 + size > len(blob):
            raise GGUFError(f"tokenizer.ggml.precompiled_charsmap: array of {size} bytes does not fit {len(blob)}")
        self.nodes = memoryview(blob[4:4 + size]).cast("I").tolist()   # (size/4,) packed XCDA entries
        self.strings = blob[4 + size:]                                 # NUL-terminated replacements

    def _base(self, i: int) -> int:
        node = self.nodes[i]
        return (node >> 10) << ((node & 512) >> 6)

    def longest(self, data: bytes, start: int) -> tuple[int, bytes]:
        """(length, replacement) of the longest key at data[start:], (0, b"") if none."""
        nodes, n = self.nodes, len(self.nodes)
        best, value = 0, -1
        i = self._base(0)
        for k in range(start, len(data)):
            c = data[k]
            if c == 0:
                break
            i ^= c
            if i >= n or nodes[i] & 0x800000FF != c:   # LCHECK: not a child of the previous node
                break
            leaf = nodes[i] >> 8 & 1
            i ^= self._base(i)
            if i >= n:
                break
            if leaf:
                best, value = k - start + 1, nodes[i] & 0x7FFFFFFF
        if not best:
            return 0, b""
        end = self.strings.find(b"\0", value)
        if value >= len(self.strings) or end < 0:
            raise GGUFError("tokenizer.ggml.precompiled_charsmap: a replacement string is out of bounds")
        return best, self.strings[value:end]


class UGMTokenizer(Tokenizer):
    """llama.cpp's unigram tokenizer (T5 and XLM-R style vocabularies). The text is normalized by the
    precompiled charsmap (longest match first; a prefix of a user-defined token's text is kept as is), spaces
    become U+2581 (`tokenizer.ggml.remove_extra_whitespaces`: runs collapse to one space before each word;
    `tokenizer.ggml.add_space_prefix`: one before the text), then Viterbi picks the segmentation with the
    highest sum of scores (user-defined tokens score 0; a codepoint no token starts with is the unknown token
    at the lowest score minus 10, and unknown runs collapse to one). Ties go to the first candidate found,
    scanning left to right and shortest first, as llama.cpp does."""
    model = "t5"

    def __init__(self, meta: Mapping[str, Any]):
        # llama.cpp defaults for UGM vocabularies: eos 1, unk 2, no bos, no space prefix, bos not added
        super().__init__(meta, bos=None, eos=1, unk=2, add_bos=False, add_space_prefix=False)
        if self.unk_id is None:
            raise GGUFError("a t5 vocabulary needs an unknown token (tokenizer.ggml.unknown_token_id)")
        scores = _get_list(meta, "tokenizer.ggml.scores", (float, int), self.n_vocab, required=True)
        self.remove_extra_whitespaces: bool = _get(meta, "tokenizer.ggml.remove_extra_whitespaces", bool, False)
        self.add_eos: bool = _get(meta, "tokenizer.ggml.add_eos_token", bool, True)
        if self.add_eos and self.eos_id is None:
            raise GGUFError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")
        charsmap = _get_list(meta, "tokenizer.ggml.precompiled_charsmap", int, None, required=False)
        self._charsmap = _Charsmap(bytes(b & 0xFF for b in charsmap)) if charsmap else None
        normal = [i for i, a in enumerate(self.attrs) if a & ATTR_NORMAL]
        low = min((scores[i] for i in normal), default=float("inf"))
        self._unk_score = low - 10.0
        # (text -> (id, score)) of the tokens Viterbi may use: normal, user-defined and unused ones
        usable = ATTR_NORMAL | ATTR_USER_DEFINED | ATTR_UNUSED
        self._pieces_scores = {self.tokens[i]: (i, 0.0 if a & ATTR_USER_DEFINED else float(scores[i]))
                               for i, a in enumerate(self.attrs) if a & usable}
        # first three characters -> the longest usable token starting with them (bounds Viterbi's scan)
        self._reach: dict[str, int] = {}
        for text in self._pieces_scores:
            key = text[:3]
            if len(text) > self._reach.get(key, 0):
                self._reach[key] = len(text)
        # every prefix of a user-defined token's UTF-8 text (llama.cpp's trie walk stops where they part)
        self._user_prefixes = {t.encode()[:k] for i, t in enumerate(self.tokens) if self.attrs[i] & ATTR_USER_DEFINED
                               for k in range(1, len(t.encode()) + 1)}

    def encode(self, text: str, *, add_bos: bool, special: bool, shielded: bool = False) -> list[int]:
        """As Tokenizer.encode; add_bos stands for llama.cpp's add_special here: it also appends eos when
        `tokenizer.ggml.add_eos_token` (default true) is set."""
        ids = super().encode(text, add_bos=add_bos, special=special, shielded=shielded)
        if add_bos and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def normalize(self, text: str) -> str:
        """llama.cpp's llm_tokenizer_ugm_session::normalize, with spaces as U+2581."""
        data = text.encode()
        pieces: list[bytes] = []
        i, n = 0, len(data)
        while i < n:
            k = 0
            while i + k < n and data[i:i + k + 1] in self._user_prefixes:
                k += 1
            if k:
                pieces.append(data[i:i + k])
                i += k
                continue
            if self._charsmap is not None:
                k, repl = self._charsmap.longest(data, i)
                if k:
                    pieces.append(repl)
                    i += k
                    continue
            k = _utf8_len(data[i])
            pieces.append(data[i:i + k])
            i += k
        norm = b"".join(pieces).decode("utf-8", errors="replace")
        merge = self.remove_extra_whitespaces
        out: list[str] = []
        in_word = prepended = False
        for c in norm:
            if c != " ":
                if not in_word:
                    in_word = True
                    if (self.add_space_prefix and not prepended) or merge:
                        out.append(SPACE)
                        prepended = True
                out.append(c)
            else:
                in_word = False
                if not merge:
                    out.append(SPACE)
        return "".join(out)

    def _encode_fragments(self, fragments: list[str | int], out: list[int]) -> None:
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
            else:
                self._viterbi(self.normalize(frag), out)

    def _viterbi(self, text: str, out: list[int]) -> None:
        n = len(text)
        if not n:
            return
        pieces, reach, unk = self._pieces_scores, self._reach, self.unk_id
        best = [(-float("inf"), unk, 0)] * (n + 1)   # (n+1,) (score sum, token, start) of the best path to here
        best[0] = (0.0, unk, 0)
        for i in range(n):
            base = best[i][0]
            single = False
            end = min(n, i + max(2, reach.get(text[i:i + 3], 0)))   # no token starting here is longer
            for j in range(i + 1, end + 1):
                hit = pieces.get(text[i:j])
                if hit is not None:
                    single = single or j == i + 1
                    score = base + hit[1]
                    if score > best[j][0]:
                        best[j] = (score, hit[0], i)
            if not single:
                score = base + self._unk_score
                if score > best[i + 1][0]:
                    best[i + 1] = (score, unk, i)
        ids: list[int] = []
        pos, prev_unk = n, False
        while True:
            _, tid, start = best[pos]
            if not (prev_unk and tid == unk):
                ids.append(tid)
            if start == 0:
                break
            prev_unk = tid == unk
            pos = start
        out.extend(reversed(ids))

    def _normal_piece(self, text: str) -> bytes:
        return text.replace(SPACE, " ").encode()


def _utf8_len(lead: int) -> int:
    """Length of the UTF-8 sequence a lead byte starts (llama.cpp's unicode_len_utf8)."""
    return (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)[lead >> 4]


# ---------------------------------------------------------------------------------------------------
# rwkv: greedy longest match on bytes (llama.cpp's llm_tokenizer_rwkv)
# ---------------------------------------------------------------------------------------------------
def _rwkv_unescape(text: str) -> bytes:
    """llama.cpp's llama_unescape_rwkv_token: \\t \\n \\r, \\xhh (lowercase hex digits), and \\c for any other c."""
    out = bytearray()
    raw = text.encode()
    i, n = 0, len(raw)
    while i < n:
        c = raw[i]
        if c != 0x5C or i + 1 >= n:          # not a backslash (a trailing one is dropped, as in llama.cpp)
            if c != 0x5C:
                out.append(c)
            i += 1
            continue
        e = raw[i + 1]
        if e == 0x78:                        # \xhh: two digits, each '0'-'9' or 'a'-'f' (anything else as llama.cpp)
            digits = raw[i + 2:i + 4]
            if len(digits) == 2:             # cut short at the end: nothing, as in llama.cpp
                value = 0
                for d in digits:
                    value = (value << 4) + (d - 87 if d >= 0x61 else d - 0x30)
                out.append(value & 0xFF)
            i += 4
        else:
            out.append({0x74: 9, 0x6E: 10, 0x72: 13}.get(e, e))
            i += 2
    return bytes(out)


class RWKVTokenizer(Tokenizer):
    """RWKV's "world" tokenizer as llama.cpp runs it: token texts are escaped bytes (`_rwkv_unescape`), and the
    text's UTF-8 bytes are covered greedily by the longest token from the left (a later id wins between equal
    texts). A byte no token starts with is the unknown token (dropped when there is none)."""
    model = "rwkv"

    def __init__(self, meta: Mapping[str, Any]):
        # llama.cpp defaults for RWKV vocabularies: no special ids, nothing added
        super().__init__(meta, bos=None, eos=None, unk=None, add_bos=False, add_space_prefix=False)
        self._raw = [_rwkv_unescape(t) for t in self.tokens]          # (n_vocab,) the bytes of each token
        self._by_bytes = {raw: i for i, raw in enumerate(self._raw) if raw}
        self._longest = max(map(len, self._by_bytes), default=1)

    def _encode_fragments(self, fragments: list[str | int], out: list[int]) -> None:
        table, longest = self._by_bytes, self._longest
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                continue
            data = frag.encode()
            pos, n = 0, len(data)
            while pos < n:
                for end in range(min(n, pos + longest), pos, -1):
                    tid = table.get(data[pos:end])
                    if tid is not None:
                        out.append(tid)
                        pos = end
                        break
                else:
                    if self.unk_id is not None:
                        out.append(self.unk_id)
                    pos += 1

    def token_bytes(self, token_id: int, *, special: bool = False) -> bytes:
        """Every token renders as its unescaped bytes, but control/unknown ones only with special=True."""
        self._check(token_id)
        if not special and self.attrs[token_id] & ATTR_SPECIAL:
            return b""
        return self._raw[token_id]
