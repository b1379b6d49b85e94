"""Make tests/data/tokenizer/pre_golden.json: llama.cpp's token ids for 200 fixed texts under every gpt2
pre-tokenizer type Lumen supports (`tokenizer.ggml.pre`), so tests/format/test_tokenizer.py checks exactness without
llama-cpp-python.

Tool:    llama-cpp-python 0.3.36 (its bundled llama.cpp), `Llama(path, vocab_only=True)`, then
         `llm.tokenize(text.encode(), add_bos=False, special=...)`; bos and add_bos from llama_vocab_bos /
         llama_vocab_get_add_bos.
Vocab:   SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c952...db53, Lumen's `smollm2-135m`): its tokens, token types,
         merges and bos/eos/unk/padding ids, plus 1110 digit tokens and merges (test_tokenizer.pre_vocab: SmolLM2
         has no multi-digit token, so digit grouping would not show), in a vocab-only GGUF (arch llama, tiny
         hparams, no tensors, no add_bos_token key) written with gguf.GGUFWriter, one file per pre value
         (test_tokenizer.write_vocab_gguf, and with_pre, which swaps the pre value in the written bytes).
Pre:     one value per distinct llama.cpp behaviour (test_tokenizer.PRE_REPS: qwen2, llama-bpe, gpt-2, default,
         smollm, then the first name of every other type); aliases map to the same llama.cpp type.
Texts:   HANDPICKED below (special=True for those with special-token texts), the corpus strings (tests/data/
         corpus.json) shorter than 100 characters with special=False, then test_tokenizer.random_texts(n, 20250)
         to 200 in all, special alternating (True first). Stored with the ids, so the test does not regenerate them.
Output:  {"provenance", "pre": {pre: {type, add_bos, bos, pick}}, "texts": [{text, special, ids}]}: a text's `ids`
         holds the distinct id lists llama.cpp gave it (most pre types agree on most texts), and pre's `pick` is a
         string with one base-36 digit per text: the index of its list there. So llama.cpp's ids for text i under
         pre p are texts[i]["ids"][int(pre[p]["pick"][i], 36)]. ASCII-escaped JSON (no editor can normalise a
         character), one text per line.

Command (from the repository root; about 30 s):
    . .venv/bin/activate && pip install -e '.[llamacpp]'     # llama-cpp-python 0.3.36 beside Lumen
    python tests/data/tokenizer/make_pre_golden.py
"""
import hashlib
import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from test_tokenizer import (PRE_REPS, PRE_TYPES, STRINGS, load_llama_vocab, pre_vocab,  # noqa: E402
                            random_texts, with_pre, write_vocab_gguf)

from lumen.format.gguf import GGUFFile  # noqa: E402
from lumen.model.store import resolve  # noqa: E402

N_TEXTS = 200
HANDPICKED = [
    "", " ", "  ", "\n", "\r\n", "\n\n\n", "\r\n\n  \t", " \t\n", "a\n\nb", "a  \n  b", "x\r\ny\r",
    "\t\tindented\n\t\tcode",
    "1234567", " 1234567", "12 345 6789 0", "3.14159 -2.5e10", "1,234,567.89", "x1y22z333", "٣٤٥ ３４５ ½¼ ⅫⅣ ¹²³",
    "it's", "IT'S", "they'll THEY'LL They'Ll", "we're WE'RE we'Re", "I've I'VE", "I'm I'M", "he'd HE'D", "'s 's 'S",
    "don't DON'T", "l'amour d'été", "rock 'n' roll", "''''", "'", "' s", "Hello, World!", "HELLO WORLD",
    "CamelCaseWord snake_case_word kebab-case-word", "ALLCAPS lowerUPPER UPPERlower", "naïve café résumé",
    "e\u0301 a\u0308 combining", "Ǆǅǆ ǈ ǋ", "straße STRASSE", "ﬁﬂ", "İstanbul ıi", "日本語のテキスト",
    "中文文本，标点。", "대표적인 출발점은 서울대", "ひらがな カタカナ ﾊﾝｶｸ", "Привет, мир!", "Ελληνικά",
    "مرحبا بالعالم۔", "नमस्ते दुनिया।", "ภาษาไทย", "ភាសាខ្មែរ", "မြန်မာ", "ꦗꦮ ꩠꩡ",
    "emoji 😀🫠🦀🇰🇷 👨\u200d👩\u200d👧 ok", "x\u200by\u200dz\ufeff", "\x00\x01\x04\x1c\x1f\x7f",
    "\xa0\u2000\u3000\u2028\u2029\x85 a\x0b\x0cb", "\ue000\U000f0000 \u0378\U0010ffff",
    "\u0cf3\u0ece \U00011f50\U00011f04 \U0001e4d0\U0001e4f0 \U00031350 \U0002ebf0 \U0001fa75",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|><reponame>x", "<sentinel:42> IMGIMGABCZ IMGIMGZ",
    "def f(x):\n    return x**2  # square\n", "if (a<=b && c!=d) { x |= 0x1F; }", "https://example.com/a?b=c&d=e#f",
    "user@example.com", "$100 + 5% ^ ~x | `y`", "...!!!???,,,;;;", "—–-‐‑", "“quoted” ‘single’ «guillemets»",
    "a/b\\c", "/* */ // <!-- -->", "    leading spaces", "trailing spaces    ", "mixed \t tabs \t and  spaces",
    "(paren) a|b, c.d!", " " * 9 + "x", " " * 600 + "y", "\n" * 5 + "z" + "\t" * 3,
    # SmolLM2's merges were learned on its own pieces, so most other splits give the same ids; these do not:
    "cafe\u0301's nai\u0308ve's",  # qwen35 (marks join letters) vs qwen2 (a mark takes the apostrophe)
    "'Sa 'mb 'Rec 'LLa",             # ufakzeka (no contractions) vs qwen2
    "x\u200d\n\t\t\r\ny", "“\n\n  \r|",  # seed-coder (punctuation keeps no newline) vs qwen2
]


def main() -> None:
    smol_path = resolve("smollm2-135m", quiet=True)
    meta = pre_vocab(GGUFFile(smol_path).metadata)
    texts = [{"text": t, "special": "<|" in t} for t in HANDPICKED]
    texts += [{"text": s, "special": False} for s in STRINGS if len(s) < 100]
    texts += [{"text": s, "special": k % 2 == 0}
              for k, s in enumerate(random_texts(N_TEXTS - len(texts), 20250))]
    assert len(texts) == N_TEXTS, len(texts)
    import llama_cpp
    pre_info, ids = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base.gguf"
        write_vocab_gguf(base, meta)
        data = base.read_bytes()
        for pre in PRE_REPS:
            path = Path(tmp) / f"{pre}.gguf"
            path.write_bytes(with_pre(data, pre))
            llm = load_llama_vocab(path)
            vocab = llm._model.vocab
            bos = llama_cpp.llama_vocab_bos(vocab)
            pre_info[pre] = {"type": PRE_TYPES[pre].regexes, "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
                             "bos": None if bos < 0 else bos}
            ids[pre] = [llm.tokenize(t["text"].encode(), add_bos=False, special=t["special"]) for t in texts]
            del llm
    provenance = {
        "made_by": "tests/data/tokenizer/make_pre_golden.py",
        "llama_cpp_python": version("llama-cpp-python"),
        "vocab": f"{smol_path.name} sha256 {hashlib.sha256(smol_path.read_bytes()).hexdigest()}",
        "vocab_extra": "1110 digit tokens and merges (tests/format/test_tokenizer.py pre_vocab)",
        "call": "Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=special)",
    }
    for i, t in enumerate(texts):
        t["ids"] = []
        for pre in PRE_REPS:
            if ids[pre][i] not in t["ids"]:
                t["ids"].append(ids[pre][i])
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    assert max(len(t["ids"]) for t in texts) <= len(digits)
    for pre in PRE_REPS:
        pre_info[pre]["pick"] = "".join(digits[t["ids"].index(x)] for t, x in zip(texts, ids[pre]))
    lines = ["{", f' "provenance": {json.dumps(provenance)},', ' "pre": {']
    lines += [f"  {json.dumps(pre)}: {json.dumps(pre_info[pre])}," for pre in PRE_REPS]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" },", ' "texts": [']
    lines += [f"  {json.dumps(t, separators=(', ', ': '))}," for t in texts]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" ]", "}"]
    out = Path(__file__).with_name("pre_golden.json")
    out.write_text("\n".join(lines) + "\n")
    json.loads(out.read_text())
    print(f"wrote {out}: {len(texts)} texts x {len(PRE_REPS)} pre values, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
