"""Seeded fuzz against llama.cpp itself, on text no golden file holds: random strings (CJK, RTL, Indic and Thai
scripts, combining marks, zero-width joiners, emoji ZWJ sequences, flags and skin tones, control characters and NUL,
whitespace and digit runs, code, special-token texts) must tokenize to llama-server's /tokenize ids in both special
modes, detokenize to its /detokenize text, and stream without U+FFFD; random conversations must render to its
/apply-template prompt byte for byte. A few hundred cases per model, seconds.

Needs llama-server ($LLAMA_SERVER, else on $PATH, else /tmp/lcpp/build/bin as the other llama.cpp tests; --jinja,
a build from 2026 with /apply-template); skipped without it.
"""
import os
import random
import shutil

import httpx
import pytest
from servers import ServerProcess

from lumen.format.chat import chat_template_from_metadata, render_chat
from lumen.format.gguf import GGUFFile
from lumen.format.tokenizer import Tokenizer

N_STRINGS = 250
N_CHATS = 60

RANGES = [(0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x0600, 0x06FF), (0x0590, 0x05FF),
          (0x0900, 0x097F), (0x0E00, 0x0E7F), (0x0400, 0x04FF), (0x0300, 0x036F), (0x1F300, 0x1FAFF),
          (0x2000, 0x206F), (0x20000, 0x2A6DF), (0x0080, 0x00FF), (0x1D400, 0x1D7FF), (0xFF00, 0xFFEF),
          (0xE000, 0xE0FF), (0xFFF0, 0xFFFF), (0x0000, 0x001F), (0x007F, 0x009F), (0xF0000, 0xF00FF)]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>",
            "</s>", "<s>", "<pad>", "<unk>", "<|fim_prefix|>", "<|fim_middle|>", "<tool_call>", "<mask>",
            "<0x41>", "<|im_start|", "|im_end|>", "<<|im_end|>>"]
PIECES = ["def f(x):\n    return x**2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
          "fn main() { println!(\"{}\", 42); }", "<div class=\"a\">&amp;</div>", "$ ls -la | grep '^d'",
          "👨\u200d👩\u200d👧\u200d👦", "🏳️\u200d🌈", "👍🏽", "🇯🇵🇺🇸", "1️⃣", "\u200d", "\ufeff", "\u202e",
          "it's", "I'M", "naïve", "Привет", "こんにちは", "مرحبا", "שלום", "नमस्ते", "สวัสดี", "e\u0301", "क्षि"]
SPACES = [" ", "\t", "\n", "\r\n", "\xa0", "\u3000", "\x0b", "\x0c", "\x85", "\u2028"]


def random_text(r: random.Random) -> str:
    out = []
    for _ in range(r.choice([1, 2, 3, 5, 8, 16])):
        k = r.random()
        if k < 0.3:
            lo, hi = r.choice(RANGES)
            out.append("".join(chr(r.randint(lo, hi)) for _ in range(r.randint(1, 6))))
        elif k < 0.42:
            out.append(r.choice(SPECIALS))
        elif k < 0.65:
            out.append(r.choice(PIECES))
        elif k < 0.8:
            out.append(r.choice(SPACES) * r.randint(1, 12))
        elif k < 0.9:
            out.append("".join(r.choice("0123456789") for _ in range(r.randint(1, 25))))
        else:
            out.append("".join(chr(r.randint(0, 127)) for _ in range(r.randint(1, 8))))
    return "".join(out)


def random_chat(r: random.Random) -> tuple[list, bool]:
    messages = [{"role": "system", "content": random_text(r)}] if r.random() < 0.5 else []
    for _ in range(r.randint(1, 3)):
        content = random_text(r)
        if r.random() < 0.15:
            content = [{"type": "text", "text": random_text(r)} for _ in range(r.randint(1, 3))]
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": random_text(r)}]
    if r.random() < 0.7:
        messages.pop()
    return messages, messages[-1]["role"] == "user"


DEFAULT_LLAMA_SERVER = "/tmp/lcpp/build/bin/llama-server"


def llama_server() -> str:
    """$LLAMA_SERVER, else llama-server on $PATH, else where the other llama.cpp tests look (tests/serve)."""
    path = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not path and os.access(DEFAULT_LLAMA_SERVER, os.X_OK):
        path = DEFAULT_LLAMA_SERVER
    if not path:
        pytest.skip("llama-server not found: set $LLAMA_SERVER or put it on $PATH")
    return path


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def reference(request, tmp_path_factory):
    """(Lumen's tokenizer, the model's chat template or None, a client of llama-server on the same model)."""
    server = llama_server()
    fixture = {"smollm2-135m": "smollm2_path", "gemma3-270m": "gemma3_path", "qwen2.5-coder-0.5b": "qwen05_file"}
    path = request.getfixturevalue(fixture[request.param])
    meta = GGUFFile(path).metadata
    log = tmp_path_factory.mktemp("llama-server") / "log.txt"
    proc = ServerProcess([server, "-m", str(path), "--jinja", "--host", "127.0.0.1", "-c", "256", "-t", "1",
                          "-np", "1", "--no-warmup"], log, health_timeout=120)
    try:
        with httpx.Client(base_url=proc.url, timeout=60) as client:
            yield Tokenizer.from_metadata(meta), chat_template_from_metadata(meta), client
    finally:
        proc.stop()


def test_ids_text_and_stream_match_llama_server(reference):
    tok, _, client = reference
    r = random.Random(20261205)
    bad = []
    for _ in range(N_STRINGS):
        text = random_text(r)
        for special in (False, True):
            want = client.post("/tokenize", json={"content": text, "add_special": False,
                                                  "parse_special": special}).json()["tokens"]
            if tok.encode(text, add_bos=False, special=special) != want:
                bad.append(("ids", special, text))
        ids = tok.encode(text, add_bos=False, special=False)
        if tok.decode(ids, special=True) != client.post("/detokenize", json={"tokens": ids}).json()["content"]:
            bad.append(("detokenize", text))
        stream = tok.stream()
        chunks = [stream.push(i) for i in ids] + [stream.flush()]
        if "".join(chunks) != tok.decode(ids) or any("\ufffd" in c for c in chunks) != ("\ufffd" in tok.decode(ids)):
            bad.append(("stream", text))
    assert bad == []


def test_chat_prompts_match_llama_server(reference):
    """Random conversations, a final assistant message continued (llama-server prefills it), rendered as
    /apply-template renders them."""
    tok, template, client = reference
    if template is None:
        pytest.skip("the model has no chat template (llama-server falls back to ChatML; Lumen refuses)")
    r = random.Random(20261206)
    bad = []
    for _ in range(N_CHATS):
        messages, add_generation_prompt = random_chat(r)
        want = client.post("/apply-template", json={"messages": messages}).json()["prompt"]
        got = render_chat(template, messages, bos_token=tok.token_text(tok.bos_id), eos_token=tok.token_text(tok.eos_id),
                          add_generation_prompt=add_generation_prompt, continue_final_message=not add_generation_prompt)
        if got != want:
            bad.append((messages, got, want))
    assert bad == []
