"""Where Lumen keeps what it makes, and when its code was loaded. The bottom floor (it imports nothing of Lumen),
so every layer can ask for a cache path without importing the package's public facade (lumen/__init__.py).

    $LUMEN_HOME (default ~/.cache/lumen)
        models/<name>/<file>.gguf     fetched models (lumen.model.store)
        packs/<stem>-<key>.lpack      packed weights (lumen.model.packcache)
        numba/<key>/                  Numba's compile cache (compile_cache_dir below)
        costs/<stem>-<key>.json       the engine's measured step costs
        machine.json                  this machine's measured limits (lumen.machine)
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

# When Lumen was imported (lumen/__init__.py imports this module first): lumen.model.packcache trusts a source
# file's hash only if the file is older than this (the code running is then the code on disk).
IMPORT_TIME_NS = time.time_ns()

ROOT = Path(__file__).resolve().parent                  # the lumen package directory

# Numba's compile cache, keyed by the compiled code. Numba checks a cached function against its own source file
# only, but the forward pass inlines kernels from other files: after an edit to a kernel, the cached forward pass
# would still run the old kernel. So the cache lives in $LUMEN_HOME/numba/<hash of every source file that holds
# compiled code, and of the switches frozen into it (LUMEN_TIMERS, LUMEN_NO_VNNI)>; a change is a new directory.
# An explicit NUMBA_CACHE_DIR wins.
COMPILED = ("kernels/*.py", "model/forward.py", "timer.py", "machine.py", "format/quants.py")


def lumen_home() -> Path:
    """$LUMEN_HOME, or ~/.cache/lumen."""
    return Path(os.environ.get("LUMEN_HOME") or Path.home() / ".cache" / "lumen")


def compile_cache_dir() -> str:
    """$LUMEN_HOME/numba/<key of the compiled sources and build switches> (see COMPILED)."""
    h = hashlib.sha256(f"timers={os.environ.get('LUMEN_TIMERS', '1')} "
                       f"novnni={os.environ.get('LUMEN_NO_VNNI', '0')}\n".encode())
    for pattern in COMPILED:
        for p in sorted(ROOT.glob(pattern)):
            h.update(p.relative_to(ROOT).as_posix().encode() + b"\0" + p.read_bytes())
    return str(lumen_home() / "numba" / h.hexdigest()[:16])


def prune_compile_caches(keep: str, n: int = 3) -> None:
    """When this code's cache is new, drop all but the n most recently used caches of other code."""
    parent = os.path.dirname(keep)
    try:
        others = [e for e in os.scandir(parent) if e.is_dir() and e.path != keep]
        others.sort(key=lambda e: e.stat().st_mtime, reverse=True)
        for e in others[n - 1:]:
            shutil.rmtree(e.path, ignore_errors=True)
    except OSError:
        pass


def compile_cache_is_empty() -> bool:
    """Whether Numba's compile cache (NUMBA_CACHE_DIR) holds nothing yet: a first run, which will compile every
    kernel it uses (the commands say so at once, before the imports and the model load that precede the first
    compile)."""
    d = os.environ.get("NUMBA_CACHE_DIR")
    if not d:
        return False
    for _, _, files in os.walk(d):                      # (Numba makes a folder per source file at import)
        if files:
            return False
    return True                                         # no file, or no folder yet: Numba makes it when it writes


def use_compile_cache() -> None:
    """Point Numba at compile_cache_dir() unless NUMBA_CACHE_DIR is set (lumen/__init__.py, before any kernel
    compiles); pruning old caches when this one is new."""
    if "NUMBA_CACHE_DIR" in os.environ:
        return
    os.environ["NUMBA_CACHE_DIR"] = compile_cache_dir()
    if not os.path.isdir(os.environ["NUMBA_CACHE_DIR"]):
        prune_compile_caches(os.environ["NUMBA_CACHE_DIR"])
    import sys
    if "numba" in sys.modules:                          # imported before lumen: it read its config already
        import numba.core.config
        numba.core.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
