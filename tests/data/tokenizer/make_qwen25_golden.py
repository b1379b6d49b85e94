"""Make tests/data/tokenizer/qwen25_golden.json: llama.cpp's token ids for Qwen2.5-Coder's tokenizer on varied
text (code, CJK, emoji, numbers, whitespace runs, special tokens), both with and without special-token parsing.

Tool:    llama.cpp's llama-server (built from llama-cpp-python 0.3.36's vendor/llama.cpp), `POST /tokenize` with
         {"content": text, "add_special": false, "parse_special": <special>}, on 127.0.0.1, one thread; or, given
         `lib` for the server, llama-cpp-python 0.3.36 itself: `Llama(model, vocab_only=True).tokenize(text.encode(),
         add_bos=False, special=<special>)` (both were run and gave the same file).
Models:  Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct Q4_K_M GGUFs (their tokenizer keys are identical but for
         the chat template; the ids of both are recorded and must agree).
Vocab:   the test builds the tokenizer from the llama-cpp-python sdist's vocab-only ggml-vocab-qwen2.gguf plus
         `patch` below (Qwen2.5-Coder's 19 extra special-token texts, 288 token types, eos and add_bos), and
         `tokenizer_sha256` (sha256 of the JSON of tokens, token types, merges and special ids of the models)
         proves the patched vocab is the models' one.
Texts:   HANDPICKED below, then generated with fixed seeds: whitespace runs, digit runs, slices of CODE (some
         with indentation turned to tabs), random codepoints from many scripts and the emoji blocks, random joins
         of ATOMS, and slices of tests/data/corpus.json. Stored with the ids, so the test does not regenerate them.
Output:  {"provenance", "patch", "tokenizer_sha256", "cases": [{"text", "ids", "ids_special"}]}, ASCII-escaped
         JSON, one case per line.

Command (from the repository root; a minute):
    . .venv/bin/activate && pip install -e '.[llamacpp]'     # llama-cpp-python 0.3.36 beside Lumen
    python tests/data/tokenizer/make_qwen25_golden.py LLAMA_SERVER|lib MODEL_0.5B.gguf MODEL_1.5B.gguf
"""
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from test_tokenizer import TOKENIZER_KEYS, apply_patch, tokenizer_sha256  # noqa: E402

from lumen.format.gguf import GGUFFile  # noqa: E402

PY = "def fib(n):\n\tif n < 2:\n\t\treturn n\n\treturn fib(n - 1) + fib(n - 2)\n"
HANDPICKED = [
    # code: tabs, indentation, mixed whitespace, operators
    PY, "    def __init__(self, x: int = 0) -> None:\n        self.x = x  # comment\n",
    "class A:\n    pass\n\n\n\nclass B(A):\n        pass", "if (a<=b && c!=d) { x |= 0x1F; }\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}", "fn main() {\n    println!(\"{:?}\", vec![1, 2, 3]);\n}",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"héllo\")\n}\n",
    "all: build\n\tgcc -O2 -o app main.c\t# tab after\n", "SELECT id, name FROM users WHERE age >= 18;",
    "const f = async (x) => { await g(x ?? 0); return `${x}px`; };", "x = [i**2 for i in range(10) if i % 2]",
    "{\n  \"key\": [1, 2.5, -3e-7, true, null],\n  \"nested\": {\"a\": \"b\"}\n}", "key: value\nlist:\n  - a\n  - b\n",
    "#include <stdio.h>\nint main(void){return 0;}", "<div class=\"x\">&nbsp;&lt;b&gt;</div>",
    "$ echo $HOME && ls -la ~/.cache | grep -v '^d'", "a_b__c___d snake_case CamelCase kebab-case SCREAMING_CASE",
    "/* block */ // line\n# hash\n-- sql\n<!-- html -->", "\\begin{equation} E = mc^2 \\end{equation}",
    "https://example.com/path?q=1&r=%20#frag", "user.name+tag@example.co.uk",
    # numbers: qwen2 cuts every digit
    "0", "12", "123", "1234567890", "3.14159", "-2.5e-10", "1,234,567.89", "0xDEADBEEF 0b1010 0o777", "v1.2.3-rc4",
    "2024-12-03T18:16:05Z", "+1 (555) 123-4567", "x1y22z333w4444", "٣٤٥ ３４５ ½¼ ⅫⅣ ¹²³ ①②", "99.9% of $1,000",
    # whitespace runs and newlines
    "", " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", " \n ", "a \n b",
    "a\n\n\nb", "a  \n  b", "trailing   ", "   leading", "mid    spaces", "tab\there\t\tand\t\t\tthere",
    " \t \t\n\t \n", "line1\r\nline2\rline3\n", "\xa0non-breaking\xa0space", "ideographic\u3000space",
    "\u2000\u2001\u2002\u2003 em/en spaces", "x\u200by\u200dz\ufeff", "\x0b\x0c vertical tab and form feed",
    # CJK and other scripts
    "日本語のテキストです。", "中文文本，标点符号。“引号”", "대표적인 출발점은 서울대입니다", "ひらがな カタカナ ﾊﾝｶｸ",
    "Привет, мир! Как дела?", "Ελληνικά κείμενα", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया।", "ภาษาไทย",
    "Tiếng Việt có dấu", "naïve café résumé façade", "e\u0301 a\u0308 o\u0302 combining marks", "straße İstanbul ıi",
    "混合English和中文123", "코드 code コード 代码",
    # emoji
    "😀", "👍🏽", "🇰🇷🇯🇵", "👨\u200d👩\u200d👧\u200d👦", "❤️ ✅ ⚠️", "emoji 😀🫠🦀 in text", "🔥🔥🔥",
    # contractions and punctuation
    "it's don't I'M we'll THEY'RE you've she'd", "'s 'S 'll 'LL", "rock 'n' roll", "''''", "...!!!???",
    "—–-‐‑ “quoted” ‘single’ «guillemets»", "a/b\\c|d", "(paren) [bracket] {brace} <angle>",
    # special tokens (parsed only with special; <tool_call> is user-defined: always)
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>", "<|endoftext|>",
    "<|endoftext|><|endoftext|>",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<|repo_name|>lumen\n<|file_sep|>a.py\nx = 1",
    "<|im_start", "<|im_end|", "<<|im_end|>>", "text<|im_end|>text", " <|im_start|> ", "<|box_start|>(1,2)<|box_end|>",
    # control characters and rare codepoints
    "\x01\x02\x1b[31mred\x1b[0m", "\x7f\x80\x9f", "\ue000\U000f0000 private use", "\U0001d54f\ua66e\u9f98 rare",
    "\u0378 unassigned", "Ǆǅǆ ǈ ǋ ﬁﬂ",
]
ATOMS = (list("abcXYZ019 \t\n\r.,!?'\"<>/|-_()[]{}=+*#;:") +
         ["'s", "'RE", "  ", "    ", "\n\n", "\t\t", "\r\n", "\xa0", "\u3000", "\u0301", "한국어", "日本", "ひら",
          "😀", "👨\u200d👩", "𝕏", "½", "٣", "Привет", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
          "<tool_call>", "<|fim_middle|>", "def ", "return ", "self.", "123", "4567", "0.5", "1e9", "->", "=>",
          "::", "//", "/*", "*/", "__", "Ġ", "▁", "Ċ"])
CODE = """\
import heapq
from collections.abc import Mapping, Sequence


class LRU:
    \"\"\"A least-recently-used cache: get/put in O(1).\"\"\"

    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self._data: dict[str, bytes] = {}

    def get(self, key: str, default=None):
        if key not in self._data:
            return default
        value = self._data.pop(key)
        self._data[key] = value   # most recent last
        return value

    def put(self, key: str, value: bytes) -> None:
        self._data.pop(key, None)
        self._data[key] = value
        while len(self._data) > self.capacity:
            del self._data[next(iter(self._data))]


def top_k(scores: Sequence[float], k: int = 5) -> list[int]:
    return heapq.nlargest(k, range(len(scores)), key=scores.__getitem__)
static int sum(const int *a, size_t n) {
\tint s = 0;
\tfor (size_t i = 0; i < n; i++)
\t\ts += a[i];
\treturn s;
}
export function debounce(fn, ms = 250) {
  let t;
  return (...args) => { clearTimeout(t); t = setTimeout(() => fn(...args), ms); };
}
impl<T: Ord> Heap<T> {
    pub fn push(&mut self, x: T) { self.v.push(x); self.sift_up(self.v.len() - 1); }
}
func (s *Server) Handle(w http.ResponseWriter, r *http.Request) {
\tif r.Method != http.MethodPost {
\t\thttp.Error(w, "method not allowed", 405)
\t\treturn
\t}
}
"""
SCRIPTS = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
           (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F), (0x2190, 0x23FF), (0x3000, 0x30FF),
           (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF), (0x1D400, 0x1D7FF)]


def generated() -> list[str]:
    rng = random.Random(2025)
    out = []
    for n in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 100):   # whitespace runs between words
        ws = rng.choice([" ", "\t", "\n", " \t", "\n ", "\r\n"])
        out.append(f"a{ws * n}b" if n % 2 else f"{ws * n}x{ws * (n // 2)}")
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 16, 20, 25, 40):           # digit runs
        digits = "".join(rng.choice("0123456789") for _ in range(n))
        out.append(rng.choice(["{}", " {}", "x{}", "{} apples", "v{}.0", "{},{}"]).format(digits, digits[::-1]))
    code_lines = [line for line in CODE.splitlines() if line.strip()]
    for _ in range(25):                                                     # code, indentation as tabs too
        k = rng.randrange(len(code_lines) - 6)
        block = "\n".join(code_lines[k:k + rng.randint(1, 6)])
        out.append(block.replace("    ", "\t") if rng.random() < 0.4 else block)
    for _ in range(40):                                                     # random codepoints
        lo, hi = rng.choice(SCRIPTS)
        chars = []
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.3:
                lo, hi = rng.choice(SCRIPTS)
            chars.append(chr(rng.randint(lo, hi)))
        out.append("".join(chars))
    for _ in range(60):                                                     # random joins of atoms
        out.append("".join(rng.choice(ATOMS) for _ in range(rng.randint(1, 40))))
    strings = json.loads((ROOT / "tests" / "data" / "corpus.json").read_text())["strings"]
    for _ in range(20):                                                     # slices of the corpus
        s = rng.choice(strings)
        a = rng.randrange(len(s) + 1)
        out.append(s[a:a + rng.randint(1, 300)])
    return out


def patch_from(base: dict, meta: dict) -> dict:
    """What turns the vocab-only qwen2 file's metadata into `meta`'s tokenizer: token texts and types by id,
    and the other keys that differ."""
    tokens = {i: t for i, (a, t) in enumerate(zip(base["tokenizer.ggml.tokens"], meta["tokenizer.ggml.tokens"],
                                                   strict=True)) if a != t}
    ranges: list[list[int]] = []   # [first, last, type] runs of changed token types
    for i, (a, t) in enumerate(zip(base["tokenizer.ggml.token_type"], meta["tokenizer.ggml.token_type"], strict=True)):
        if a != t:
            if ranges and ranges[-1][1] == i - 1 and ranges[-1][2] == t:
                ranges[-1][1] = i
            else:
                ranges.append([i, i, t])
    keys = {k: meta.get(k) for k in TOKENIZER_KEYS[5:] if base.get(k) != meta.get(k)}
    assert all(base.get(k) == meta.get(k) for k in TOKENIZER_KEYS[:2] + TOKENIZER_KEYS[4:5])
    return {"tokens": {str(i): t for i, t in tokens.items()}, "token_type": ranges, "keys": keys}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_ids(server: str, model: str, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """(ids without, ids with special-token parsing) for every text, from one llama-server run."""
    port = free_port()
    proc = subprocess.Popen([server, "-m", model, "-t", "1", "-c", "512", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError("llama-server did not come up")

        def tokenize(text: str, special: bool) -> list[int]:
            body = json.dumps({"content": text, "add_special": False, "parse_special": special}).encode()
            req = urllib.request.Request(url + "/tokenize", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())["tokens"]
        return [(tokenize(t, False), tokenize(t, True)) for t in texts]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def library_ids(model: str, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """The same from llama-cpp-python's bindings, the vocabulary only."""
    import llama_cpp
    llm = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    return [tuple(llm.tokenize(t.encode(), add_bos=False, special=special) for special in (False, True))
            for t in texts]


def main() -> None:
    server, *models = sys.argv[1:]
    cache = ROOT / ".pytest_cache" / "d" / "lumen" / "llama-cpp-python-0.3.36-vocabs"   # the tests' download
    base = GGUFFile(cache / "ggml-vocab-qwen2.gguf").metadata
    metas = [GGUFFile(m).metadata for m in models]
    sha = tokenizer_sha256(metas[0])
    assert all(tokenizer_sha256(m) == sha for m in metas), "the models' tokenizers differ"
    patch = patch_from(base, metas[0])
    assert tokenizer_sha256(apply_patch(base, patch)) == sha
    texts = list(dict.fromkeys(HANDPICKED + generated()))   # distinct, in order
    ids = [library_ids(m, texts) if server == "lib" else server_ids(server, m, texts) for m in models]
    assert all(x == ids[0] for x in ids), "the models give different ids"
    call = ("Llama(model, vocab_only=True).tokenize(text.encode(), add_bos=False, special=special)" if server == "lib"
            else "llama-server POST /tokenize {content, add_special: false, parse_special: special}")
    provenance = {"made_by": "tests/data/tokenizer/make_qwen25_golden.py", "llama_cpp_python": "0.3.36",
                  "models": [Path(m).name for m in models], "call": call}
    lines = ["{", f' "provenance": {json.dumps(provenance)},', f' "tokenizer_sha256": "{sha}",',
             f' "patch": {json.dumps(patch)},', ' "cases": [']
    lines += [f"  {json.dumps({'text': t, 'ids': a, 'ids_special': b})}," for t, (a, b) in zip(texts, ids[0])]
    lines[-1] = lines[-1].rstrip(",")
    lines += [" ]", "}"]
    out = Path(__file__).with_name("qwen25_golden.json")
    out.write_text("\n".join(lines) + "\n")
    json.loads(out.read_text())
    print(f"wrote {out}: {len(texts)} texts, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
