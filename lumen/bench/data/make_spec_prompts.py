"""Build spec_prompts.json, the workloads of `lumen.bench spec`: where speculative decoding pays and where it must
not cost, from code that ships with CPython (the standard library's source, PSF license) and the free-chat
questions of make_prompts.py.

    python lumen/bench/data/make_spec_prompts.py     # rewrites lumen/bench/data/spec_prompts.json (deterministic)

workloads:
    completion  the first lines of a standard-library function (its signature, docstring and a few statements) in
                a code fence: the model writes the rest (new code; a draft model's guesses, little to copy)
    edit        a whole function and a rename of one of its names ("rewrite it renaming x to y"): the answer is
                the prompt's code with a few words changed (what prompt lookup feeds on)
    chat        a free question, asked through the model's chat template (`"chat": true`)
Each entry: {"id", "kind", "prompt", "chat"}. Made with the Python that runs this script (its version is recorded);
the committed file is what the benchmark reads, so it does not depend on the reader's Python.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import json
import random
import re
import sys
from pathlib import Path

from make_prompts import CHAT, MODULES, functions

PER_KIND = 12
BUILTINS = set(dir(builtins))


def completion(src: str) -> str | None:
    """The head of a function to complete: its first ~35% of lines, at least 4 and through its docstring."""
    lines = src.splitlines()
    if len(lines) < 12:
        return None
    cut = max(4, int(len(lines) * 0.35))
    return "```python\n" + "\n".join(lines[:cut]) + "\n"


def rename(src: str, rng: random.Random) -> tuple[str, str] | None:
    """A name used at least 3 times in a function (a parameter or a local), and a new name for it."""
    tree = ast.parse(src)
    names: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and len(node.id) > 1 and not node.id.isupper():
            names[node.id] = names.get(node.id, 0) + 1
        elif isinstance(node, ast.arg) and node.arg not in ("self", "cls"):
            names[node.arg] = names.get(node.arg, 0) + 1
    cands = sorted(n for n, c in names.items() if c >= 3 and n not in BUILTINS and re.fullmatch(r"[a-z_]\w*", n))
    if not cands:
        return None
    old = rng.choice(cands)
    return old, ("new_" + old.lstrip("_"))


def main() -> None:
    rng = random.Random(20261205)
    code = []
    for name in MODULES:
        code += functions(importlib.import_module(name))
    code = sorted(set(code))
    rng.shuffle(code)
    items = []
    picked = 0
    for src in code:
        p = completion(src)
        if p is not None and picked < PER_KIND:
            items.append({"kind": "completion", "prompt": p, "chat": False})
            picked += 1
    for src in code[::-1]:                       # other functions than the completions' (from the other end)
        r = rename(src, rng)
        if r is not None and sum(it["kind"] == "edit" for it in items) < PER_KIND and len(src) <= 1600:
            items.append({"kind": "edit", "chat": False, "prompt":
                          f"Here is a Python function:\n\n```python\n{src}\n```\n\nRewrite this function renaming "
                          f"`{r[0]}` to `{r[1]}`, and change nothing else. Output the whole function.\n\n```python\n"})
    for q in CHAT[:PER_KIND]:
        items.append({"kind": "chat", "prompt": q, "chat": True})
    for i, it in enumerate(items):
        it["id"] = f"{it['kind']}-{i:03d}"
    out = {"made_with": f"CPython {sys.version.split()[0]}", "items": items}
    path = Path(__file__).with_name("spec_prompts.json")
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    kinds = {k: sum(1 for it in items if it["kind"] == k) for k in ("completion", "edit", "chat")}
    print(f"wrote {path}: {len(items)} prompts {kinds}")


if __name__ == "__main__":
    main()
