"""Make tests/data/tokenizer/vocab_golden.json: llama.cpp's token ids for the vocab-only GGUFs of the
llama-cpp-python sdist that come without llama.cpp's own .inp/.out suite (aquila, baichuan, gpt-neox,
nomic-bert-moe: the only t5 / unigram one), so tests/format/test_tokenizer.py checks them too.

Tool:    llama-cpp-python 0.3.36, `Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=False,
         special=<special>)`, plus the ids with add_special=True for one text.
Vocab:   models/ggml-vocab-<name>.gguf from the llama-cpp-python 0.3.36 sdist, as the tests download it (pytest's
         cache under .pytest_cache/d/lumen/).
Texts:   make_qwen25_golden.py's HANDPICKED texts, the first 60 of its generated ones and SPECIAL_TEXTS below.
Output:  {"provenance", "texts": [...], "vocabs": {name: {"ids": [...], "ids_special": [... or null when equal],
         "add_special": ids of ADD_SPECIAL_TEXT with add_special=True}}}, ASCII-escaped JSON.

Command (from the repository root, after the tokenizer tests have downloaded the sdist; under a minute):
    . .venv/bin/activate && pip install -e '.[llamacpp]'     # llama-cpp-python 0.3.36 beside Lumen
    python tests/data/tokenizer/make_vocab_golden.py
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

from make_qwen25_golden import HANDPICKED, generated  # noqa: E402
from test_tokenizer import ADD_SPECIAL_TEXT, VOCABS_WITHOUT_SUITE  # noqa: E402


# the special-token texts of these vocabs (the hand-picked texts have Qwen's)
SPECIAL_TEXTS = ["<s>Hello</s>", " <s> a </s> ", "<unk><pad>", "x<mask>y", "a <mask> b", "<|endoftext|>x"]


def main() -> None:
    import llama_cpp
    folder = ROOT / ".pytest_cache" / "d" / "lumen" / "llama-cpp-python-0.3.36-vocabs"
    texts = list(dict.fromkeys(HANDPICKED + generated()[:60] + SPECIAL_TEXTS))
    vocabs = {}
    for name in VOCABS_WITHOUT_SUITE:
        llm = llama_cpp.Llama(str(folder / f"ggml-vocab-{name}.gguf"), vocab_only=True, verbose=False)
        ids = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts]
        special = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]
        vocabs[name] = {"ids": ids, "ids_special": [s if s != i else None for i, s in zip(ids, special)],
                        "add_special": llm.tokenize(ADD_SPECIAL_TEXT.encode(), add_bos=True, special=False)}
        del llm
    provenance = {"made_by": "tests/data/tokenizer/make_vocab_golden.py", "llama_cpp_python": "0.3.36",
                  "call": "Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=False, special=special)"}
    lines = ["{", f' "provenance": {json.dumps(provenance)},', f' "texts": {json.dumps(texts)},', ' "vocabs": {']
    for name, v in vocabs.items():
        lines.append(f'  {json.dumps(name)}: {{')
        lines += [f'   "{k}": {json.dumps(v[k])},' for k in ("ids", "ids_special")]
        lines.append(f'   "add_special": {json.dumps(v["add_special"])}')
        lines.append("  },")
    lines[-1] = "  }"
    lines += [" }", "}"]
    out = HERE / "vocab_golden.json"
    out.write_text("\n".join(lines) + "\n")
    json.loads(out.read_text())
    print(f"wrote {out}: {len(texts)} texts x {len(vocabs)} vocabs, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
