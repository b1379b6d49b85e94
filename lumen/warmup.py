"""`python -m lumen.warmup [--model M ...] [--draft-model D ...]`: compile, ahead of time, everything a model's first
request runs (a draft model's: as speculative decoding loads it, requantized).

A first run compiles Lumen's Numba kernels into the compile cache ($LUMEN_HOME/numba, lumen/paths.py); every later
process loads them from there. Run this in an image build, or before a server reports healthy, so no user waits
on the compiler. Per model it loads the weights (the kernels of its weight types, lumen.kernels.entries),
runs a prefill and a decode step (the forward pass), a generation through the engine (the samplers) and a masked
step (the structured-output kernels), and reports the seconds, the functions compiled (cache misses) and the
ones loaded from the cache (on an empty cache the forward pass compiles in a child process meanwhile,
lumen.model.precompile, and is counted as loaded). A second warm-up of the same models compiles nothing. It also
compiles Lumen's Python modules to bytecode where that is missing (`compile_bytecode`), as pip does at install.
Warm-ups that start at once take turns (lumen.paths.compiling): the second loads what the first compiled.
`lumen.serve --replicas` runs one in the background (`in_background`) while Ray starts, so its replicas load
what it compiled and packed instead of waiting for Ray before they start compiling. The forward pass is one compiled function for every model, so a model whose weight types a machine has seen compiles
nothing either.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Warmed:
    model: str
    seconds: float          # load + the steps below, wall
    compiled: int           # functions compiled (Numba cache misses)
    compile_seconds: float  # of which compiling (outermost compiles)
    loaded: int             # functions loaded from Numba's cache


def _cache_hits() -> int:
    """Functions loaded from Numba's cache so far in this process, over Lumen's compiled functions."""
    from numba.core.dispatcher import Dispatcher
    n = 0
    for name, mod in list(sys.modules.items()):
        if name == "lumen" or name.startswith("lumen."):
            for obj in list(vars(mod).values()):
                if isinstance(obj, Dispatcher):
                    n += sum(obj._cache_hits.values())
    return n


def warm(model: str, *, threads: int | None = None, ctx: int = 64, draft: bool = False) -> Warmed:
    """Load model (a registry name or a .gguf path) and run every compiled path of a first request. draft: load it
    as speculative decoding loads a draft model (requantized, SpeculativeConfig.draft_quant) and run its forward
    pass: the packs and kernels a draft needs are not the model's own."""
    from numba.core import event
    import lumen
    from .engine.structured import bitmask
    from .paths import compiling

    class Count(event.Listener):
        depth = compiled = 0
        seconds = 0.0

        def on_start(self, ev):
            self.depth += 1
            self.compiled += 1
            if self.depth == 1:
                self.t0 = time.perf_counter()

        def on_end(self, ev):
            self.depth -= 1
            if self.depth == 0:
                self.seconds += time.perf_counter() - self.t0

    count = Count()
    hits = _cache_hits()
    t0 = time.perf_counter()
    with compiling(), event.install_listener("numba:compile", count):
        if draft:
            from .engine.config import SpeculativeConfig, draft_requant
            from .model.parts import load_parts
            parts = load_parts(model, requant=draft_requant(SpeculativeConfig().draft_quant), quiet=True)
            eng = lumen.Engine(parts, max_model_len=ctx, threads=threads, kv_cache_mb=16, max_num_seqs=1)
            eng.generate([[1, 2, 3, 4]], lumen.SamplingParams(max_tokens=2, ignore_eos=True))
            return Warmed(str(model), time.perf_counter() - t0, count.compiled, count.seconds, _cache_hits() - hits)
        m = lumen.load(model, ctx=ctx, threads=threads)
        ids = m.tokenize("Hello")[:4] or [0]
        m.prefill(ids)                                  # the forward pass (one compiled function for every shape)
        m.decode(ids[-1])
        m.reset()
        for _ in m.generate(ids, max_tokens=2, ignore_eos=True):   # the engine's step and its samplers
            pass
        bitmask.warm_up()                               # structured output's mask kernels
    return Warmed(str(model), time.perf_counter() - t0, count.compiled, count.seconds, _cache_hits() - hits)


def compile_bytecode(root: str | os.PathLike | None = None) -> int:
    """Compile the modules of the package at root (default: Lumen's) to bytecode where it is missing or stale, as
    pip does when it installs a package, even where Python would not write it itself (PYTHONDONTWRITEBYTECODE, as
    container images often set, and where this command runs at build time): each later start then loads bytecode
    instead of compiling Lumen's sources, 0.1 s of the CLI's start and 0.3 s of the server's on a 2-vCPU Xeon.
    Returns the modules compiled; a folder that cannot be written is left as it is."""
    import importlib.util
    import py_compile
    root = Path(root) if root is not None else Path(__file__).resolve().parent
    n = 0
    for src in sorted(root.rglob("*.py")):
        try:
            st = src.stat()
            with open(importlib.util.cache_from_source(str(src)), "rb") as f:
                head = f.read(16)                       # magic, flags, source mtime and size (importlib's check)
            if head[:4] == importlib.util.MAGIC_NUMBER and (
                    head[4:8] != bytes(4)                # hash-based: Python checks it against the source itself
                    or (int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF
                        and int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF)):
                continue
        except OSError:
            pass
        try:
            py_compile.compile(str(src), doraise=True)
            n += 1
        except (OSError, py_compile.PyCompileError):
            pass
    return n


def build_parser() -> argparse.ArgumentParser:
    from .commands import Parser, prog
    from .model.store import DEFAULT_MODEL
    p = Parser(
        prog=prog("warmup"),
        description="Compile Lumen's kernels for the given models ahead of time (into the compile cache under "
                    "LUMEN_HOME), so a later start answers at full speed at once. A second run compiles nothing.")
    p.add_argument("-m", "--model", action="append", default=None, metavar="MODEL",
                   help=f"a registry name or a .gguf path; repeat for several (default: {DEFAULT_MODEL})")
    p.add_argument("--draft-model", action="append", default=[], metavar="MODEL",
                   help="a draft model for speculative decoding, warmed as it loads for that (requantized); repeat "
                        "for several")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    return p


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    from .commands import threads_error
    if why := threads_error(args.threads):
        ap.error(why)
    from .errors import LumenError
    from .model.store import DEFAULT_MODEL
    from .model.store import MODELS, resolve
    models = [(name, False) for name in args.model or ([] if args.draft_model else [DEFAULT_MODEL])]
    models += [(name, True) for name in args.draft_model]
    total = 0

    def fail(name: str, e: Exception) -> int:
        said = str(e)                                   # most messages name the model already
        print(f"error: {said}" if name in said else f"error: {name}: {said}", file=sys.stderr)
        return 1
    for name, _ in models:                              # a typo in the last name fails before the first compile
        if name not in MODELS:
            try:
                resolve(name, quiet=True)
            except (LumenError, OSError) as e:
                return fail(name, e)
    from rich.console import Console
    from .generate import status_while_compiling
    console = Console(stderr=True)
    for name, draft in models:
        try:
            with status_while_compiling(console):      # a first run compiles for a minute or two: say so
                w = warm(name, threads=args.threads, draft=draft)
        except (LumenError, ValueError, OSError) as e:
            return fail(name, e)
        except KeyboardInterrupt:                       # what compiled so far is in the cache already
            print("\ninterrupted", file=sys.stderr)
            return 130
        total += w.compiled
        print(f"{w.model}: ready in {w.seconds:.1f} s; compiled {w.compiled} function{'s' * (w.compiled != 1)} "
              f"({w.compile_seconds:.1f} s), loaded {w.loaded} from the cache", flush=True)
    if len(models) > 1:
        print(f"compiled {total} function{'s' * (total != 1)} in all")
    if n := compile_bytecode():
        print(f"compiled {n} of Lumen's modules to bytecode")
    return 0


def in_background(models: list[str], threads: int | None = None, drafts: list[str] = ()):
    """Warm `models` up in a child process while this one does something else (the Ray path: Ray's start takes
    seconds of mostly waiting). Replicas that load meanwhile take turns with it (lumen.paths.compiling) and load
    what it compiled and packed instead of compiling it themselves. The child dies with this process; `stop` ends
    it. drafts: draft models, warmed as speculative decoding loads them. Returns the child, or None when it could
    not start (the replicas then compile as before)."""
    import os
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [a for m in models for a in ("--model", str(m))] + [a for m in drafts for a in ("--draft-model", str(m))]
    args += ["--threads", str(threads)] if threads else []
    code = (f"import sys; r = {root!r}; r in sys.path or sys.path.insert(0, r)\n"     # this lumen, wherever it was
            f"from lumen.warmup import _child; _child({os.getpid()}, {args!r})")        # imported from
    try:
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def stop(child) -> None:
    """End a child of in_background that is still running (SIGTERM, then SIGKILL after 5 s)."""
    import subprocess
    if child is None or child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(5)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _child(parent: int, argv: list[str]) -> None:
    """In the child of in_background: die with the parent, warm up quietly."""
    from .model.precompile import _die_with_parent
    _die_with_parent(parent)
    sys.exit(main(argv))


if __name__ == "__main__":
    from lumen.commands import run
    sys.exit(run(main))
