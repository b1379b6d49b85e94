"""Imports run down the floors, never up, and never in a circle.

Every module under lumen/ is parsed (ast, nothing is imported) and each import it makes, at module level or inside
a function, is resolved to a module of the package. Two rules:

- a module imports only from its own floor or the floors below it (FLOORS, bottom up);
- no import circle: none among module-level imports (Python would run a half-initialised module), and none
  through lazy imports inside functions either (a lazy import only hides the circle from the interpreter).

A new module must be given a floor here (a test fails until it is).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

LUMEN = Path(__file__).resolve().parent.parent / "lumen"

# Bottom up. A module belongs to the floor of the longest prefix that names it ("lumen" alone is the package's
# __init__.py: the public facade, `lumen.load` and the lazy `lumen.Engine` / `lumen.profile`).
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("lumen.errors", "lumen.timer", "lumen.paths",      # exceptions, the tick clock + profiler hook,
              "lumen.commands", "lumen.cpu")),                   # paths, the table of command-line tools, the
                                                                 # CPU's identity
    ("format", ("lumen.format",)),                               # GGUF file, quant types, tokenizer, chat template
    ("kernels", ("lumen.kernels",)),                             # Numba kernels: arrays in, arrays out
    ("model", ("lumen.model", "lumen.machine")),                 # Config, packed weights, pack cache, model store,
                                                                 # the forward pass and its loader; the machine's
                                                                 # measured limits (kept in the store)
    ("engine", ("lumen.engine",)),                               # runner, scheduler, sampling, engine
    ("api", ("lumen", "lumen.profile")),                         # the facade (lumen.load, Model) and the profiler
    ("interfaces", ("lumen.generate", "lumen.perplexity", "lumen.chat", "lumen.bench", "lumen.serve",
                    "lumen.models", "lumen.gguf", "lumen.cli", "lumen.__main__",  # command lines and the server
                    "lumen.warmup")),
]

# Known arrows up, each (importer, imported): none. The profiler hook lives in lumen.timer and the cache paths in
# lumen.paths, so the engine needs neither lumen.profile nor the facade.
KNOWN_UP: set[tuple[str, str]] = set()

# Known circles through lazy imports, each as the lazy import (importer, imported) that closes it: none.
KNOWN_CIRCLE_EDGES: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(LUMEN.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(LUMEN.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The lumen modules a `from X import a, b` names: X.a where X.a is a module, else X."""
    if node.level:
        base = importer.split(".")
        base = base[:len(base) - node.level + (1 if is_package else 0)]
        where = ".".join(base + ([node.module] if node.module else []))
    else:
        where = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{where}.{alias.name}"
        out.append(sub if sub in MODULES else where)
    return out


def imports(name: str) -> list[tuple[str, bool, int]]:
    """(imported lumen module, at module level?, line) for every import in module `name`."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, top, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.extend((m, top, child.lineno) for m in _resolve(name, path.name == "__init__.py", child))
            visit(child, inner)

    visit(tree, True)
    return [(m, top, line) for m, top, line in found if m == "lumen" or m.startswith("lumen.")]


def _owner(module: str) -> str:
    """The known module that `module` (possibly a name inside it, `lumen.x.y` for module lumen.x) refers to."""
    while module not in MODULES:
        module = module.rpartition(".")[0]
    return module


GRAPH = {name: [(_owner(m), top, line) for m, top, line in imports(name)] for name in MODULES}


def floor(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise AssertionError(f"{module} has no floor: add it to FLOORS in tests/test_layers.py")
    return best


def circles(module_level_only: bool, without: set = frozenset()) -> list[frozenset]:
    """The strongly connected components with more than one module (Tarjan's algorithm), the imports in
    `without` left out."""
    edges = {n: sorted({m for m, top, _ in deps if m != n and (top or not module_level_only) and (n, m) not in without})
             for n, deps in GRAPH.items()}
    index, low, on, stack, out = {}, {}, set(), [], []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_every_module_has_a_floor():
    missing = [m for m in MODULES if not any(m == p or m.startswith(p + ".") for _, ps in FLOORS for p in ps)]
    assert not missing, f"modules without a floor (add them to FLOORS): {missing}"


def test_no_import_runs_up_a_floor():
    up = []
    for name, deps in GRAPH.items():
        for m, _, line in deps:
            if floor(m) > floor(name) and (name, m) not in KNOWN_UP:
                up.append(f"{MODULES[name].relative_to(LUMEN.parent)}:{line}: {name} ({FLOORS[floor(name)][0]}) "
                          f"imports {m} ({FLOORS[floor(m)][0]})")
    assert not up, "imports from a lower floor to a higher one:\n" + "\n".join(up)


def test_known_exceptions_still_exist():
    """An allow-list entry that no longer matches an import is stale: delete it."""
    edges = {(n, m) for n, deps in GRAPH.items() for m, _, _ in deps}
    assert KNOWN_UP <= edges, f"stale KNOWN_UP entries: {KNOWN_UP - edges}"
    in_circles = {(n, m) for c in circles(module_level_only=False) for n in c for m, _, _ in GRAPH[n] if m in c}
    assert KNOWN_CIRCLE_EDGES <= in_circles, f"stale KNOWN_CIRCLE_EDGES entries: {KNOWN_CIRCLE_EDGES - in_circles}"


def test_no_module_level_import_circle():
    assert circles(module_level_only=True) == []


def test_no_import_circle_through_lazy_imports():
    found = [sorted(c) for c in circles(module_level_only=False, without=KNOWN_UP | KNOWN_CIRCLE_EDGES)]
    assert not found, f"import circles (lazy imports included): {found}"


@pytest.mark.parametrize("source, expected", [
    ("from ..profile import active", {"lumen.profile"}),
    ("from .. import IMPORT_TIME_NS", {"lumen"}),
    ("from ..model.forward import OPS", {"lumen.model.forward"}),
    ("from . import block_manager", {"lumen.engine.block_manager"}),
    ("def f():\n    import lumen.serve.app", {"lumen.serve.app"}),
])
def test_imports_are_resolved(source, expected, tmp_path, monkeypatch):
    """The resolver itself: relative imports, a submodule named in `from X import`, lazy imports."""
    fake, real = LUMEN / "engine" / "scheduler.py", Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == fake else real(self, *a, **k))
    assert {_owner(m) for m, _, _ in imports("lumen.engine.scheduler")} == expected
