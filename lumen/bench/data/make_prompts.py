"""Build prompts.json, the committed request set of `lumen.bench offline`, `lumen.bench serve` and the speculative
decoding workloads: four kinds of requests from text that ships with CPython (the standard library's source and
docstrings, PSF license) plus a list of free-chat questions written for this file.

    python lumen/bench/data/make_prompts.py        # rewrites lumen/bench/data/prompts.json (deterministic)

kinds:
    code        a whole standard-library function or class in the prompt, with an edit to make; the answer repeats
                most of the file (what n-gram speculation feeds on)
    extract     a passage and a request to quote from it
    summarize   a passage to summarize
    chat        a short question
Each entry: {"id", "kind", "prompt", "max_tokens"}. Made with the Python that runs this script (its version is
recorded); the committed file is what the benchmarks read, so they do not depend on the reader's Python.
"""
from __future__ import annotations

import ast
import inspect
import json
import random
import sys
from pathlib import Path

MODULES = ["textwrap", "bisect", "heapq", "statistics", "fractions", "difflib", "shlex", "string", "calendar",
           "colorsys", "csv", "functools", "ipaddress", "json.encoder", "json.decoder", "pprint", "queue",
           "random", "sched", "secrets", "selectors", "tempfile", "timeit", "tokenize", "uuid", "zipfile",
           "argparse", "base64", "configparser", "dataclasses", "datetime", "decimal", "enum", "fnmatch",
           "glob", "gzip", "hashlib", "hmac", "locale", "logging", "mimetypes", "netrc", "operator", "pathlib",
           "pickle", "platform", "quopri", "reprlib", "smtplib", "socketserver", "stat", "sysconfig", "tarfile",
           "threading", "traceback", "typing", "urllib.parse", "warnings", "weakref", "webbrowser"]
EDITS = ["Add type hints to every parameter and return value.", "Rename the local variables to longer, clearer "
         "names.", "Add a docstring line at the top that says what it returns.", "Replace every double-quoted "
         "string with a single-quoted one.", "Add a comment above each loop explaining it."]
CHAT = ["What is a good way to start learning to program?", "Why is the sky blue?", "Give me three tips for "
        "writing clear emails.", "What should I pack for a weekend hiking trip?", "How do plants make food?",
        "Explain what a database index is.", "What are the health benefits of walking every day?", "How does a "
        "refrigerator keep food cold?", "Write a short poem about autumn leaves.", "What is the difference "
        "between weather and climate?", "How can I improve my sleep?", "Suggest a name for a friendly robot.",
        "What is recursion? Give an example.", "How do I make a good cup of tea?", "Why do cats purr?",
        "Tell me a fun fact about the ocean.", "What is the capital of Australia, and why is it not Sydney?",
        "How do vaccines work?", "Describe the water cycle.", "What makes a good team leader?",
        "How do airplanes stay in the air?", "What is machine learning, in simple words?", "Plan a three-day "
        "trip to Rome.", "What are prime numbers?", "Write a haiku about the sea.", "How do I stay focused while "
        "studying?", "What causes the seasons on Earth?", "Explain how a bicycle gear works.", "Why do we "
        "dream?", "What are some easy vegetables to grow at home?", "How does the internet work?", "Tell me a "
        "short story about a lost key.", "What is the Pythagorean theorem?", "How do bees make honey?",
        "What should a beginner know about investing?", "Why is exercise good for the brain?", "Explain the "
        "rules of chess briefly.", "How do I write a good resume?", "What is photosynthesis?", "How do "
        "volcanoes form?"]


def functions(mod) -> list[str]:
    src = inspect.getsource(mod)
    out = []
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            seg = ast.get_source_segment(src, node)
            if seg and 300 <= len(seg) <= 2400:
                out.append(seg)
    return out


def passages(mod) -> list[str]:
    out = []
    for _, obj in inspect.getmembers(mod):
        doc = inspect.getdoc(obj) if callable(obj) or inspect.isclass(obj) else None
        if doc and 400 <= len(doc) <= 2000 and doc.count("\n") >= 3:
            out.append(doc)
    return out


def main() -> None:
    import importlib
    rng = random.Random(20261130)
    code, text = [], []
    for name in MODULES:
        mod = importlib.import_module(name)
        code += functions(mod)
        text += passages(mod)
    code, text = sorted(set(code)), sorted(set(text))
    rng.shuffle(code)
    rng.shuffle(text)
    items = []
    for i, src in enumerate(code[:64]):
        items.append({"kind": "code", "max_tokens": 256, "prompt":
                      f"Here is a Python function:\n\n```python\n{src}\n```\n\n{EDITS[i % len(EDITS)]} "
                      "Output the whole function.\n\n```python\n"})
    for i, doc in enumerate(text[:64]):
        sentences = [s.strip() for s in doc.replace("\n", " ").split(". ") if len(s.strip()) > 30]
        word = rng.choice(sentences[len(sentences) // 2].split()) if sentences else "the"
        items.append({"kind": "extract", "max_tokens": 96, "prompt":
                      f"Passage:\n{doc}\n\nQuote, word for word, the sentence of the passage that contains the "
                      f"word \"{word.strip('.,:;()`')}\".\n\nQuote:"})
    for doc in text[64:128]:
        items.append({"kind": "summarize", "max_tokens": 128, "prompt":
                      f"Summarize the following text in two or three sentences.\n\n{doc}\n\nSummary:"})
    for q in CHAT:
        items.append({"kind": "chat", "max_tokens": 128, "prompt": q})
    for i, it in enumerate(items):
        it["id"] = f"{it['kind']}-{i:03d}"
    out = {"made_with": f"CPython {sys.version.split()[0]}", "items": items}
    path = Path(__file__).with_name("prompts.json")
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    kinds = {k: sum(1 for it in items if it["kind"] == k) for k in ("code", "extract", "summarize", "chat")}
    print(f"wrote {path}: {len(items)} prompts {kinds}")


if __name__ == "__main__":
    main()
