"""Tokenizers built from GGUF metadata that give exactly llama.cpp's token ids.

    tok = Tokenizer.from_metadata(meta)                # meta: GGUF key -> str/int/float/bool/list
    ids = tok.encode(text, add_bos=tok.add_bos_default, special=True)
    text = tok.decode(ids)
    stream = tok.stream(); out = "".join(stream.push(i) for i in ids) + stream.flush()

`tokenizer.ggml.model` picks the implementation:
- "gpt2"  -> `BPETokenizer`: byte-level BPE. The merges run in HF `tokenizers`; the pre-tokenizer is
  llama.cpp's regex list for `tokenizer.ggml.pre` (only "smollm" is supported so far).
- "llama" -> `SPMTokenizer`: llama.cpp's SentencePiece-style tokenizer (merge the adjacent pair whose
  concatenation is the vocab entry with the highest score, leftmost first; symbols that end up outside
  the vocab fall back to <0xXX> byte tokens). Written here in plain Python: it must be llama.cpp's
  algorithm, not sentencepiece's.

Both follow llama.cpp (src/llama-vocab.cpp) step by step:
1. Special-token partition: the text is cut at special-token texts, longest text first. Control and
   unknown tokens are cut out only when `special=True`; user-defined tokens always are.
2. Each remaining piece of text is tokenized on its own (SPM: spaces become U+2581 first, and a space is
   prefixed after a special token when `tokenizer.ggml.add_space_prefix` is true).
3. End-of-generation ids are found the way llama.cpp finds them: eos, plus eot/eom/fim ids from the
   metadata or recognised by their text, plus a fixed list of texts (`<|im_end|>`, `<end_of_turn>`,
   `<|endoftext|>`, `</s>`, ...). Tokens so recognised become control tokens, which changes how they parse.

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
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import GGUFError, UnsupportedError

# ---------------------------------------------------------------------------------------------------
# Token types (GGUF tokenizer.ggml.token_type) and llama.cpp's token attributes (bit flags)
# ---------------------------------------------------------------------------------------------------
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = 1, 2, 4, 8, 16, 32
# token_type value -> attribute; anything else (0 = undefined) is 0, which decodes to nothing
TYPE_TO_ATTR = {1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED,
                6: ATTR_BYTE}
ATTR_SPECIAL = ATTR_CONTROL | ATTR_UNKNOWN  # rendered only with special=True, parsed only with special=True

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

SPACE = "\u2581"  # SentencePiece's escaped space
BYTE_TEXT = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # the text of a byte token

# llama.cpp pre-tokenizer regexes (llm_tokenizer_bpe), applied in sequence; each match is its own piece
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {"smollm": (r"\p{N}", GPT2_REGEX)}


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


class Tokenizer:
    """Common part: vocab, special ids, special-token partition, decoding. Build with `from_metadata`."""

    model: str = ""

    def __init__(self, meta: Mapping[str, Any], *, bos: int | None, eos: int | None, unk: int | None,
                 add_bos: bool, add_space_prefix: bool):
        tokens = _get_list(meta, "tokenizer.ggml.tokens", str, None, required=True)
        if not tokens:
            raise GGUFError("tokenizer.ggml.tokens is empty")
        # llama.cpp renames empty tokens so every text is unique and non-empty
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        self.tokens: list[str] = tokens                   # (n_vocab,) token texts as stored
        self.n_vocab = n
        self.token_to_id: dict[str, int] = {t: i for i, t in enumerate(tokens)}
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
            self.attrs = [TYPE_TO_ATTR.get(t, 0) for t in types]

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
        bad = next((i for i, a in enumerate(self.attrs) if a & ATTR_BYTE and not BYTE_TEXT.fullmatch(tokens[i])), None)
        if bad is not None:
            raise GGUFError(f"token {bad} has type byte but its text {tokens[bad]!r} is not <0xHH>")
        if self.add_bos_default and self.bos_id is None:
            raise GGUFError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        self.eot_ids: frozenset[int] = self._find_eog(meta)

        # special-token partition tables: (text, id) longest text first, ties by id
        order = sorted((i for i, a in enumerate(self.attrs) if a & (ATTR_SPECIAL | ATTR_USER_DEFINED)),
                       key=lambda i: (-len(tokens[i]), i))
        self._parse_all = self._index(order)
        self._parse_plain = self._index([i for i in order if not self.attrs[i] & ATTR_SPECIAL])
        self._pieces: dict[int, bytes] = {}                 # id -> piece with special=True, filled lazily

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
        for key, texts in (("pre", FIM_PRE_TEXTS), ("suf", FIM_SUF_TEXTS), ("mid", FIM_MID_TEXTS)):
            detect(f"tokenizer.ggml.fim_{key}_token_id", texts)  # control tokens, but they do not end generation
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

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Cut `text` at special-token texts as llama.cpp's tokenizer_st_partition: for each special token,
        longest text first, split every remaining text fragment at its occurrences."""
        index = self._parse_all if special else self._parse_plain
        found = [i for c in set(text).intersection(index) for i in index[c] if self.tokens[i] in text]
        if not found:
            return [text] if text else []
        found.sort(key=lambda i: (-len(self.tokens[i]), i))
        fragments: list[str | int] = [text]
        for tid in found:
            needle = self.tokens[tid]
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or needle not in frag:
                    out.append(frag)
                    continue
                for k, part in enumerate(frag.split(needle)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            fragments = out
        return fragments

    # --- encode -------------------------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        """Token ids of `text`. add_bos: prepend bos_id. special: parse control-token texts (e.g.
        "<|im_start|>", "<start_of_turn>", "<bos>") as those tokens; user-defined tokens are always parsed."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise GGUFError("add_bos requested but the vocabulary has no bos token")
            ids.append(self.bos_id)
        self._encode_fragments(self._partition(text, special), ids)
        return ids

    def _encode_fragments(self, fragments: list[str | int], out: list[int]) -> None:
        raise NotImplementedError

    # --- decode -------------------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocab (byte-level or U+2581-escaped, not decoded)."""
        return self.tokens[self._check(token_id)]

    def _check(self, token_id: int) -> int:
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

    def stream(self, *, special: bool = False) -> StreamDecoder:
        """An incremental decoder: push ids one by one, get text that never splits a UTF-8 character."""
        return StreamDecoder(self, special=special)

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
        if model == "gpt2":
            return BPETokenizer(meta)
        if model == "llama":
            return SPMTokenizer(meta)
        raise UnsupportedError(f"tokenizer.ggml.model = {model!r} is not supported "
                               f"(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")


class StreamDecoder:
    """Decode ids one at a time. push() returns only whole UTF-8 characters and keeps a split character's
    leading bytes until the rest arrives; flush() returns what is left (invalid bytes become U+FFFD). The
    concatenated output equals tok.decode(all ids)."""

    def __init__(self, tok: Tokenizer, *, special: bool = False):
        self.tok = tok
        self.special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

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
# gpt2: byte-level BPE (HF tokenizers for the merges)
# ---------------------------------------------------------------------------------------------------
class BPETokenizer(Tokenizer):
    model = "gpt2"

    def __init__(self, meta: Mapping[str, Any]):
        pre = _get(meta, "tokenizer.ggml.pre", str)
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedError(f"tokenizer.ggml.pre = {pre!r} is not supported for gpt2 vocabularies "
                                   f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
        # llama.cpp defaults for BPE vocabularies: bos = eos = 11, no unk, no bos added, no space prefix
        super().__init__(meta, bos=11, eos=11, unk=None, add_bos=False, add_space_prefix=False)
        self.pre = pre
        merges = _get_list(meta, "tokenizer.ggml.merges", str, None, required=True)
        pairs = []
        for k, merge in enumerate(merges):
            cut = merge.find(" ", 1)  # llama.cpp splits at the first space after the first character
            if cut < 0:
                raise GGUFError(f"tokenizer.ggml.merges[{k}] = {merge!r} is not two tokens separated by a space")
            pairs.append((merge[:cut], merge[cut + 1:]))
        self._byte_char = _bytes_to_unicode()                         # byte -> byte-level char
        self._char_byte = {c: b for b, c in self._byte_char.items()}  # byte-level char -> byte
        self._hf = self._build_hf(pairs)

    def _build_hf(self, pairs: list[tuple[str, str]]):
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        # Bytes without a token (SmolLM2 has none for 0x04, 0xC0, 0xF5.., ...) still stand as symbols in
        # llama.cpp: they block merges across them, then are dropped (its byte fallback finds no token).
        # HF would skip them silently and merge across, so they get ids past the vocab, removed after.
        vocab = dict(self.token_to_id)
        for c in self._byte_char.values():
            vocab.setdefault(c, len(vocab))
        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)
        except Exception as e:  # a merge whose parts or result are not in the vocab
            raise GGUFError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {e}") from e
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[self.pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        return hf

    def _encode_fragments(self, fragments: list[str | int], out: list[int]) -> None:
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
            else:
                ids = self._hf.encode(frag, add_special_tokens=False).ids
                out.extend(i for i in ids if i < self.n_vocab)

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

    def _encode_fragments(self, fragments: list[str | int], out: list[int]) -> None:
        prev_special = True  # a space is prefixed to the first text and to text after a special token
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            self._merge(frag.replace(" ", SPACE), out)
            prev_special = False

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
