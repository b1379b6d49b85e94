"""Tokenizers: llama.cpp's ids for every corpus string (both models, both special modes), special-token
parsing, decode round trip, streaming decode of split UTF-8 characters, encode speed, bad metadata."""
import time

import pytest
from conftest import MODEL_NAMES, corpus, golden

from lumen.errors import GGUFError, UnsupportedError
from lumen.gguf import GGUFFile
from lumen.tokenizer import ATTR_BYTE, BPETokenizer, SPMTokenizer, Tokenizer

STRINGS = corpus()["strings"]
GOLDEN = {name: golden(name) for name in MODEL_NAMES}


def read_metadata(path) -> dict:
    """GGUF metadata as a plain mapping (key -> str/int/float/bool/list). lumen.gguf gives the same dict as
    gguf-py's `{k: f.contents() for k, f in GGUFReader(path).fields.items()}` (test_gguf.py checks it) in
    0.5 s instead of ~15 s for the two models."""
    return GGUFFile(path).metadata


@pytest.fixture(scope="session")
def metas(smollm2_path, gemma3_path) -> dict:
    return {"smollm2-135m": read_metadata(smollm2_path), "gemma3-270m": read_metadata(gemma3_path)}


@pytest.fixture(scope="session")
def toks(metas) -> dict:
    return {name: Tokenizer.from_metadata(meta) for name, meta in metas.items()}


@pytest.fixture(scope="session")
def smol(toks):
    return toks["smollm2-135m"]


@pytest.fixture(scope="session")
def gemma(toks):
    return toks["gemma3-270m"]


# --- the hard requirement: llama.cpp's ids for every corpus string ---------------------------------------
@pytest.mark.parametrize("i", range(len(STRINGS)), ids=[f"{i:02d}" for i in range(len(STRINGS))])
@pytest.mark.parametrize("mode", ["ids", "ids_special"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_golden_ids(toks, name, mode, i):
    case = GOLDEN[name]["tokenize"][i]
    assert case["text"] == STRINGS[i]
    got = toks[name].encode(STRINGS[i], add_bos=False, special=mode == "ids_special")
    assert got == case[mode]


def test_golden_covers_every_string():
    for name in MODEL_NAMES:
        assert [c["text"] for c in GOLDEN[name]["tokenize"]] == STRINGS


# More cases, ids from the same llama.cpp (llama-cpp-python 0.3.36, vocab_only): a byte without a token
# (SmolLM2 has none for 0x04: dropped, and it still blocks the "!!" merge), contractions, Unicode spaces and
# numbers, byte fallback and ZWJ emoji, user-defined tokens, whitespace runs, special-token texts.
MORE_TEXTS = ["a\x04b!\x04!", "it's THEY'RE we'LL", "x\u3000y\u2000\u2000z\x85", "e\u0301 ½ Ⅻ ٣ ３ ¹²",
              "𝕏ꙮ龘 👨\u200d👩\u200d👧", "<b>bold</b>\t\t<table>", "a   b\n\n\n  c",
              "<|im_start|><start_of_turn><bos></s><s>"]
MORE_IDS = {  # name -> [(ids, ids_special)] in MORE_TEXTS order
    "smollm2-135m": [
        ([81, 82, 17, 17],) * 2,
        ([269, 506, 6462, 73, 23, 3256, 392, 23, 16421],) * 2,
        ([104, 12109, 218, 105, 321, 218, 321, 218, 106, 141, 223],) * 2,
        ([85, 151, 219, 216, 16738, 216, 173, 223, 121, 216, 164, 113, 216, 8083, 237, 216, 43183, 19133],) * 2,
        ([23159, 239, 233, 181, 243, 123, 180, 139, 242, 15107, 235, 118, 321, 231, 10813, 235, 119, 321, 231,
          10813, 235, 117],) * 2,
        ([44, 82, 46, 30471, 9617, 82, 46, 197, 197, 44, 6413, 46],) * 2,
        ([81, 256, 278, 1116, 3805, 265],) * 2,
        ([44, 108, 306, 79, 3738, 108, 21198, 3738, 79, 1714, 79, 20589, 21198, 34761, 29299, 99, 21198, 99, 46],
         [1, 44, 3738, 79, 1714, 79, 20589, 21198, 34761, 29299, 99, 21198, 99, 46])],
    "gemma3-270m": [
        ([236746, 242, 236763, 236888, 242, 236888],) * 2,
        ([509, 236789, 236751, 98321, 236789, 1357, 692, 236789, 2182],) * 2,
        ([236781, 465, 366, 366, 236762, 464, 366, 366, 464, 366, 366, 236802, 432, 371],) * 2,
        ([236744, 238288, 47041, 236743, 464, 371, 409, 223766, 236743, 238995, 71642, 238131],) * 2,
        ([478, 395, 387, 381, 472, 391, 412, 471, 428, 390, 236743, 243874, 237243, 243767, 237243, 244814],) * 2,
        ([200, 15640, 209, 255969, 168],) * 2,
        ([236746, 139, 236763, 109, 138, 236755],) * 2,
        ([236820, 236909, 548, 236779, 3041, 236909, 1798, 3041, 236779, 1340, 236779, 887, 1798, 46757, 2588,
          236751, 236813, 203],
         [236820, 236909, 548, 236779, 3041, 111038, 105, 2, 212, 203])],
}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_more_llamacpp_cases(toks, name):
    tok = toks[name]
    for text, (ids, ids_special) in zip(MORE_TEXTS, MORE_IDS[name], strict=True):
        assert tok.encode(text, add_bos=False, special=False) == ids, text
        assert tok.encode(text, add_bos=False, special=True) == ids_special, text


def test_against_llama_cpp(model_name, model_path, toks):
    """With llama-cpp-python installed (the `llamacpp` extra): random strings, ids in both modes and every
    token's piece against llama.cpp itself."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes
    import random

    tok = toks[model_name]
    llm = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
    atoms = list("abcXYZ019 \t\n\r.,!?'\"<>/|-_") + ["'s", "'RE", "  ", "\n\n", "\xa0", "\u3000", "\x04", "\u0301",
            "한국어", "日本", "ひら", "😀", "👨\u200d👩", "𝕏", "ꙮ", "½", "¹", "٣", "Привет", "<|im_start|>",
            "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "</s>", "<s>", "<b>", "\t\t", "▁", "Ġ"]
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 40)))
        for special in (False, True):
            assert tok.encode(text, add_bos=False, special=special) == \
                llm.tokenize(text.encode(), add_bos=False, special=special), (text, special)
    buf = ctypes.create_string_buffer(4096)  # Llama.detokenize drops pieces longer than its 32-byte buffer
    for i in range(tok.n_vocab):
        for special in (False, True):
            n = llama_cpp.llama_token_to_piece(llm._model.vocab, i, buf, len(buf), 0, special)
            assert tok.token_bytes(i, special=special) == buf.raw[:n], (i, special)
    assert tok.eot_ids == {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, i)}


# --- construction -----------------------------------------------------------------------------------------
def test_construction(metas, smol, gemma):
    assert isinstance(smol, BPETokenizer) and isinstance(gemma, SPMTokenizer)
    assert (smol.n_vocab, smol.bos_id, smol.eos_id, smol.add_bos_default) == (49152, 1, 2, False)
    assert (gemma.n_vocab, gemma.bos_id, gemma.eos_id, gemma.add_bos_default) == (262144, 2, 1, True)
    assert smol.add_bos_default == GOLDEN["smollm2-135m"]["add_bos"]
    assert gemma.add_bos_default == GOLDEN["gemma3-270m"]["add_bos"]
    # llama.cpp's EOG set: eos, <|im_end|>/<|endoftext|> by text, and <reponame> as the FIM-repo token
    assert {smol.token_text(i) for i in smol.eot_ids} == {"<|endoftext|>", "<|im_end|>", "<reponame>"}
    # Gemma: <eos>, <end_of_turn>, and </s> (llama.cpp lists it for paddleocr and makes it a control token)
    assert {gemma.token_text(i) for i in gemma.eot_ids} == {"<eos>", "<end_of_turn>", "</s>"}
    assert gemma.is_eog(106) and not gemma.is_eog(105)
    for meta in metas.values():  # a 262k vocab builds in well under a second
        t = time.perf_counter()
        Tokenizer.from_metadata(meta)
        assert time.perf_counter() - t < 2.0


def test_add_bos(smol, gemma):
    assert gemma.encode("Hello", add_bos=True, special=False) == [2, 9259]
    assert gemma.encode("", add_bos=True, special=True) == [2]
    assert smol.encode("Hello", add_bos=True, special=False) == [1, 19556]


def test_prompt_ids_match_golden(toks):
    """The greedy prompts as llama.cpp tokenized them (with the model's add_bos default)."""
    for name, tok in toks.items():
        for case in GOLDEN[name]["greedy"]:
            assert tok.encode(case["prompt"], add_bos=tok.add_bos_default, special=True) == case["prompt_ids"]


# --- special tokens -----------------------------------------------------------------------------------------
def test_special_tokens_both_ways(smol, gemma):
    chat = "<|im_start|>user\nhi<|im_end|>"
    assert smol.encode(chat, add_bos=False, special=True)[0] == 1
    assert 1 not in smol.encode(chat, add_bos=False, special=False)
    turn = "<start_of_turn>user\nhi<end_of_turn>\n"
    on = gemma.encode(turn, add_bos=False, special=True)
    off = gemma.encode(turn, add_bos=False, special=False)
    assert on[0] == 105 and 106 in on and 105 not in off and 106 not in off
    assert gemma.encode("<bos>x", add_bos=False, special=True)[0] == 2
    assert 2 not in gemma.encode("<bos>x", add_bos=False, special=False)
    # user-defined tokens (tabs, space runs, newlines, <b>) are cut out whatever `special` says
    for special in (False, True):
        assert gemma.encode("a\t\tb", add_bos=False, special=special)[1] == gemma.token_to_id["\t\t"]
        assert gemma.encode("<b>x</b>", add_bos=False, special=special)[0] == gemma.token_to_id["<b>"]
        assert gemma.encode("x   y", add_bos=False, special=special)[1] == gemma.token_to_id["   "]


def test_decode_special(smol, gemma):
    ids = gemma.encode("<start_of_turn>user\nhi<end_of_turn>", add_bos=True, special=True)
    assert gemma.decode(ids) == "user\nhi"
    assert gemma.decode(ids, special=True) == "<bos><start_of_turn>user\nhi<end_of_turn>"
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>", add_bos=False, special=True)
    assert smol.decode(ids) == "user\nhi"
    assert smol.decode(ids, special=True) == "<|im_start|>user\nhi<|im_end|>"


# --- decode -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_decode_round_trip(toks, name):
    tok = toks[name]
    bad = [s for s in STRINGS if tok.decode(tok.encode(s, add_bos=False, special=False)) != s]
    assert bad == []


def test_token_text(smol, gemma):
    assert smol.token_text(19556) == "Hello" and smol.token_text(216) == "Ġ"
    assert gemma.token_text(1902) == "▁world" and gemma.decode([1902]) == " world"
    with pytest.raises(ValueError):
        gemma.token_text(gemma.n_vocab)


# --- streaming ---------------------------------------------------------------------------------------------
MULTIBYTE = ["대표적인 출발점은 서울대", "日本語のテキスト", "emoji 😀🫠🦀🇰🇷 ok", "rare 𝕏 ꙮ 龘 𓀀 \u0fff",
             "naïve café", "Привет мир"]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_stream_never_splits_a_character(toks, name):
    tok = toks[name]
    held = 0
    for s in MULTIBYTE + STRINGS:
        ids = tok.encode(s, add_bos=False, special=False)
        stream = tok.stream()
        chunks = [stream.push(i) for i in ids] + [stream.flush()]
        assert "".join(chunks) == tok.decode(ids) == s
        assert not any("\ufffd" in c for c in chunks)
        held += sum(1 for i, c in zip(ids, chunks) if c == "" and tok.token_bytes(i))
    assert held > 0, "no token ended inside a character: the test does not exercise the hold-back"


def test_stream_byte_fallback(gemma):
    ids = gemma.encode("𝕏", add_bos=False, special=False)  # not in the vocab: four <0xXX> tokens
    assert [gemma.attrs[i] for i in ids] == [ATTR_BYTE] * 4
    stream = gemma.stream()
    assert [stream.push(i) for i in ids] == ["", "", "", "𝕏"]
    stream = gemma.stream()
    assert stream.push(ids[0]) == "" and stream.flush() == "\ufffd"  # a truncated character on flush


def test_stream_special(gemma):
    ids = gemma.encode("<start_of_turn>hi", add_bos=True, special=True)
    assert "".join(map(gemma.stream().push, ids)) == "hi"
    assert "".join(map(gemma.stream(special=True).push, ids)) == "<bos><start_of_turn>hi"


# --- speed ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_encode_speed(toks, name):
    tok = toks[name]
    text = "\n".join(STRINGS[20:60]).encode()[:2048].decode(errors="ignore")  # 2 KB, Korean and English
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        tok.encode(text, add_bos=False, special=True)
        best = min(best, time.perf_counter() - t)
    assert best < 0.05


# --- SPM merging on a tiny vocabulary -----------------------------------------------------------------------
def tiny_spm(extra: dict[str, float], **meta) -> dict:
    """An SPM vocab: <unk> <s> </s>, the 256 byte tokens, then `extra` pieces with their scores."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(extra)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + list(extra.values()),
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(extra), **meta}


def test_spm_merge_order():
    tok = Tokenizer.from_metadata(tiny_spm({"▁": -1, "a": -1, "b": -1, "ab": -2, "ba": -3, "aba": -4, "▁a": -5}))
    ids = tok.token_to_id
    # default add_space_prefix: " " is prefixed, ' ' becomes ▁; "ab" (-2) beats "▁a" (-5), then "ab"+"a"
    assert tok.encode("aba", add_bos=False, special=False) == [ids["▁"], ids["aba"]]
    # equal scores: the leftmost pair merges first
    tok = Tokenizer.from_metadata(tiny_spm({"a": -1, "b": -1, "ab": -2, "ba": -2},
                                           **{"tokenizer.ggml.add_space_prefix": False}))
    assert tok.encode("aba", add_bos=False, special=False) == [tok.token_to_id["ab"], tok.token_to_id["a"]]
    # a character outside the vocab falls back to its UTF-8 bytes; bos comes from the SPM default (1)
    assert tok.encode("é", add_bos=True, special=False) == [1, 3 + 0xC3, 3 + 0xA9]
    assert tok.decode([3 + 0xC3, 3 + 0xA9]) == "é"


def test_spm_space_prefix_after_special():
    tok = Tokenizer.from_metadata(tiny_spm({"▁": -1, "a": -1, "▁a": -2}))
    ids = tok.token_to_id
    assert tok.encode("a</s>a", add_bos=False, special=True) == [ids["▁a"], 2, ids["▁a"]]
    assert tok.decode([ids["▁a"], ids["▁a"]]) == "a a"  # the first piece loses the prefixed space


# --- bad metadata -------------------------------------------------------------------------------------------
def test_bad_metadata(metas):
    smol_meta, gemma_meta = metas["smollm2-135m"], metas["gemma3-270m"]

    def without(meta, key):
        return {k: v for k, v in meta.items() if k != key}

    with pytest.raises(GGUFError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata(without(smol_meta, "tokenizer.ggml.model"))
    with pytest.raises(UnsupportedError, match="'bert'"):
        Tokenizer.from_metadata({**smol_meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedError, match="llama3"):
        Tokenizer.from_metadata({**smol_meta, "tokenizer.ggml.pre": "llama3"})
    with pytest.raises(GGUFError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata(without(gemma_meta, "tokenizer.ggml.tokens"))
    with pytest.raises(GGUFError, match="tokenizer.ggml.merges"):
        Tokenizer.from_metadata(without(smol_meta, "tokenizer.ggml.merges"))
    with pytest.raises(GGUFError, match="tokenizer.ggml.scores"):
        Tokenizer.from_metadata(without(gemma_meta, "tokenizer.ggml.scores"))
    with pytest.raises(GGUFError, match="entries"):
        Tokenizer.from_metadata({**gemma_meta, "tokenizer.ggml.scores": gemma_meta["tokenizer.ggml.scores"][:-1]})
    with pytest.raises(GGUFError, match="entries"):
        Tokenizer.from_metadata({**smol_meta, "tokenizer.ggml.token_type": [1, 1]})
    with pytest.raises(GGUFError, match="outside the vocabulary"):
        Tokenizer.from_metadata({**smol_meta, "tokenizer.ggml.eos_token_id": 10**6})
    with pytest.raises(GGUFError, match="expected bool"):
        Tokenizer.from_metadata({**smol_meta, "tokenizer.ggml.add_bos_token": "yes"})
    with pytest.raises(GGUFError, match="not two tokens"):
        Tokenizer.from_metadata({**smol_meta, "tokenizer.ggml.merges": ["a b", "ab"]})
    with pytest.raises(GGUFError, match="do not fit"):
        Tokenizer.from_metadata({**smol_meta, "tokenizer.ggml.merges": ["zzzq zzzr"]})
    tokens = smol_meta["tokenizer.ggml.tokens"]
    with pytest.raises(GGUFError, match="duplicate"):
        Tokenizer.from_metadata({**smol_meta, "tokenizer.ggml.tokens": tokens[:-1] + [tokens[0]]})
    broken = tiny_spm({"<0xZZ>": 0.0})
    broken["tokenizer.ggml.token_type"][-1] = 6
    with pytest.raises(GGUFError, match="<0xHH>"):
        Tokenizer.from_metadata(broken)
    with pytest.raises(GGUFError, match="bos"):
        Tokenizer.from_metadata(tiny_spm({}, **{"tokenizer.ggml.tokens": ["<unk>"], "tokenizer.ggml.scores": [0.0],
                                                "tokenizer.ggml.token_type": [2]}))
