"""Where Lumen keeps what it makes, and when its code was loaded. The bottom floor (it imports nothing of Lumen),
so every layer can ask for a cache path without importing the package's public facade (lumen/__init__.py).

    $LUMEN_HOME (default ~/.cache/lumen)
        models/<name>/<file>.gguf     fetched models (lumen.model.store)
        packs/<stem>-<src>-<key>.lpack  packed weights (lumen.model.packcache)
        headers/<stem>-<path>-<key>.header  parsed GGUF headers (lumen.format.gguf.HeaderCache)
        numba/<key>/                  Numba's compile cache (compile_cache_dir below)
        costs/<stem>-<key>.json       the engine's measured step costs
        machine.json                  this machine's measured limits (lumen.machine)
        machine.lock                  held while they are measured: one process at a time
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

# When Lumen was imported (lumen/__init__.py imports this module first): lumen.model.packcache trusts a source
# file's hash only if the file is older than this (the code running is then the code on disk).
IMPORT_TIME_NS = time.time_ns()

ROOT = Path(__file__).resolve().parent                  # the lumen package directory

# Numba's compile cache, keyed by the compiled code. Numba checks a cached function against its own source file
# only, but the forward pass inlines kernels from other files: after an edit to a kernel, the cached forward pass
# would still run the old kernel. So the cache lives in $LUMEN_HOME/numba/<hash of every source file that holds
# compiled code, of the switches frozen into it (LUMEN_TIMERS, LUMEN_NO_VNNI, the NUMBA_CPU_NAME and
# NUMBA_CPU_FEATURES of a build for another CPU), and of what else the code depends
# on: Lumen's version, Numba's and llvmlite's, Python's, and the CPU's model and features (a home shared by
# several machines or environments keeps one cache for each)>; a change is a new directory. An explicit
# NUMBA_CACHE_DIR wins.
COMPILED = ("kernels/*.py", "model/forward.py", "timer.py", "machine.py", "format/quants.py")


def lumen_home() -> Path:
    """$LUMEN_HOME (a leading ~ is the user's home, even where no shell expanded it), or ~/.cache/lumen."""
    home = os.environ.get("LUMEN_HOME")
    return Path(os.path.expanduser(home)) if home else Path.home() / ".cache" / "lumen"


def _platform() -> bytes:
    """What compiled code depends on besides Lumen's sources: Lumen's version, the version files of Numba and
    llvmlite (read, not imported: Numba must not start before the cache directory is set), Python's version, and
    the CPU's model and feature flags. Cheap enough for every start (no package metadata scan)."""
    import importlib.util
    import re
    import sys
    m = re.search(r'__version__ = "([^"]+)"', (ROOT / "__init__.py").read_text())
    parts = [f"lumen={m.group(1) if m else '?'}", f"python={sys.version}"]
    for pkg in ("numba", "llvmlite"):
        spec = importlib.util.find_spec(pkg)
        try:
            parts.append(f"{pkg}=" + (Path(spec.origin).parent / "_version.py").read_text())
        except (AttributeError, TypeError, OSError):
            parts.append(f"{pkg}=?")
    try:
        with open("/proc/cpuinfo") as f:
            parts += [line for line in f.read().splitlines()[:40]
                      if line.startswith(("vendor_id", "model name", "flags"))][:3]
    except OSError:
        import platform
        parts.append(f"cpu={platform.machine()} {platform.processor()}")
    return "\n".join(parts).encode()


def compile_cache_dir() -> str:
    """$LUMEN_HOME/numba/<key of the compiled sources, build switches and platform> (see COMPILED)."""
    h = hashlib.sha256(f"timers={os.environ.get('LUMEN_TIMERS', '1')} "
                       f"novnni={os.environ.get('LUMEN_NO_VNNI', '0')}\n".encode())
    target = (os.environ.get("NUMBA_CPU_NAME"), os.environ.get("NUMBA_CPU_FEATURES"))
    if target != (None, None):                          # compiled for another CPU (lumen.kernels.simd): its own
        h.update(f"target={target}\n".encode())         # cache, and its own step costs (keyed by this name)
    h.update(_platform())
    for pattern in COMPILED:
        for p in sorted(ROOT.glob(pattern)):
            h.update(p.relative_to(ROOT).as_posix().encode() + b"\0" + p.read_bytes())
    return str(lumen_home() / "numba" / h.hexdigest()[:16])


def prune_compile_caches(keep: str, n: int = 3) -> None:
    """When this code's cache is new, keep n caches in all: it and the n - 1 most recently used caches of other
    code (a cache's folder time is its last use: use_compile_cache touches it)."""
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
        if any(not f.endswith(".lock") for f in files):  # (the locks: lock_compile_cache, compiling)
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
    else:
        try:                                            # its time is its last use: what pruning keeps
            os.utime(os.environ["NUMBA_CACHE_DIR"])
        except OSError:                                 # (a read-only home)
            pass
    import sys
    if "numba" in sys.modules:                          # imported before lumen: it read its config already
        import numba.core.config
        numba.core.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]


@contextmanager
def _flock(directory: str, shared: bool, name: str = "lumen.lock"):
    """An flock on directory/name (shared or exclusive) for the block; none if the file cannot be made."""
    import fcntl
    try:
        os.makedirs(directory, exist_ok=True)
        f = open(os.path.join(directory, name), "a+b")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield


def lock_compile_cache() -> None:
    """Make Numba's cache safe for processes that compile at once (lumen.kernels calls this on import).

    Numba saves a function's compiled code by reading its index, picking the next free data file name, writing the
    index and then the data, with no lock: two processes that compile two signatures of one function at once both
    take the same name, and the index can end up pointing a signature at the other's code, or lose one of them;
    a process that loads between the index and the data reads a missing or stale file. Here each save holds an
    exclusive lock on the cache directory's lumen.lock and each load a shared one, so the index and the data
    always change together.

    A cache file that cannot be unpickled (cut short: Numba does not fsync, so a power cut can leave it empty)
    made Numba raise in every later process; here it is a miss: the function compiles again and its save
    rewrites the index (a damaged index counts as empty) and the data. A save that fails (ENOSPC: Numba raised
    it out of the call that compiled) leaves the function uncached."""
    import pickle
    from numba.core import caching
    cls = caching.IndexDataCacheFile
    if getattr(cls, "_lumen_locked", False):
        return
    save, load, load_index = cls.save, cls.load, cls._load_index
    damaged = (EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError, KeyError,
               pickle.UnpicklingError)

    def locked_save(self, key, data):
        with _flock(self._cache_path, shared=False):
            try:
                return save(self, key, data)
            except OSError:                             # a full disk: the function runs, uncached
                return None

    def locked_load(self, key):
        with _flock(self._cache_path, shared=True):
            try:
                return load(self, key)
            except damaged:
                return None

    def whole_index(self):
        try:
            return load_index(self)
        except damaged:
            return {}

    cls.save, cls.load, cls._load_index, cls._lumen_locked = locked_save, locked_load, whole_index, True


def unique_symbols() -> None:
    """Give every function Numba compiles a random id, not the next of a count that starts at 1 in each process
    (lumen.kernels calls this on import, before any kernel compiles).

    The id is part of a compiled function's symbol, and the symbol is how Numba finds the code it loads from its
    cache. Two processes that compile two signatures of one function (tiles_1 for Q4_1 in one, for Q5_0 in the
    other) at the same point of their start took the same id; the signatures' record types are named by another
    per-process count, so both symbols came out the same (tiles_1 v6 Record 2179). A third process that loads both
    from the cache found one body under that name and ran it for both types: SmolLM2 (Q4_1) decoded garbage after
    Qwen2.5 (Q5_0) was loaded. A random 63-bit id makes symbols from different processes differ (Numba issue
    10486 describes the same collision after fork)."""
    from numba.core import bytecode
    ident = bytecode.FunctionIdentity
    if not getattr(ident, "_lumen_random", False):
        import secrets

        class _RandomIds:
            def __iter__(self):
                return self

            def __next__(self) -> int:
                return secrets.randbits(63)

        ident._unique_ids, ident._lumen_random = _RandomIds(), True


def load_without_refresh() -> None:
    """Load a function from Numba's cache without first refreshing its target context (lumen.kernels calls this on
    import): only the runtime (NRT), whose symbols loaded code links to, is set up.

    Numba refreshes the context before every cache load; the first refresh in a process imports and registers all
    its implementations and typing templates (numba.np, numba.cpython, typed containers ...): 0.21-0.27 s here,
    a sixth of a warm start of the 1.5B, for code already compiled. A compile still refreshes the context first
    (numba.core.compiler.CompilerBase), so a process that compiles anything has it as before."""
    from numba.core import caching
    from numba.core.runtime import rtsys
    cls = caching.Cache
    if getattr(cls, "_lumen_lazy", False):
        return

    def load_overload(self, sig, target_context):
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)

    cls.load_overload, cls._lumen_lazy = load_overload, True


@contextmanager
def compiling():
    """Hold the machine's compile turn for the block: one process at a time compiles into the compile cache, and
    the others wait, then load what it compiled instead of compiling the same functions beside it (two replicas
    starting on a fresh host each compiled everything, on the same cores). Wrap a first forward pass or a
    warm-up in it; a process whose kernels are cached holds it for as long as loading them takes."""
    with compile_turn("compiling"):
        yield


@contextmanager
def compile_turn(what: str):
    """Hold the machine's turn to compile `what` (a name) for the block: processes that start at once (replicas,
    test workers) compile it one after the other, and the later ones load it from the cache instead of compiling
    it beside the first on the same cores. Different names are independent (no process waits for itself)."""
    with _flock(os.environ.get("NUMBA_CACHE_DIR") or compile_cache_dir(), shared=False, name=f"{what}.lock"):
        yield
