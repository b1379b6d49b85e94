"""Lumen: a measurement-first LLM inference engine for GGUF models on the CPU."""
from __future__ import annotations

import os
import time

# When Lumen was imported: lumen.model.packcache trusts a source file's hash only if the file is older than this (the
# code running is then the code on disk).
IMPORT_TIME_NS = time.time_ns()

# libgomp (Numba's omp threading layer) spins idle threads for ~300k iterations by default. On a busy machine the
# spinning threads starve the ones with work: decode measured 80x slower at load 3.6 on 2 cores. A short spin
# keeps back-to-back parallel regions fast (decode 86-113 tok/s against 78-90 with the default, quiet machine) and
# yields under load; OMP_WAIT_POLICY=passive costs 2x decode (36-38 tok/s). Set before Numba starts its threads.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# Past as many threads as CPUs (a second thread that runs parallel regions has a pool of its own), libgomp spins
# only its throttled count: 100 with the wait policy unset, 1000 with it active (GOMP_SPINCOUNT still bounds
# both). A thread that runs from the second pool decoded at 186 tok/s unset, 313 active, 330 alone (2-vCPU EPYC
# Zen 5, SmolLM2); lumen.kernels.work.release_threads ends a pool that is no longer used.
os.environ.setdefault("OMP_WAIT_POLICY", "active")
# Numba's compile cache, keyed by the compiled code. Numba checks a cached function against its own source file
# only, but the forward pass inlines kernels from other files: after an edit to a kernel, the cached forward pass
# would still run the old kernel. So the cache lives in $LUMEN_HOME/numba/<hash of every source file that holds
# compiled code, and of the switches frozen into it (LUMEN_TIMERS, LUMEN_NO_VNNI)>; a change is a new directory.
# An explicit NUMBA_CACHE_DIR wins.
_COMPILED = ("kernels/*.py", "engine/forward.py", "timer.py", "machine.py", "format/quants.py")


def _compile_cache_dir() -> str:
    import hashlib
    from pathlib import Path
    root = Path(__file__).resolve().parent
    h = hashlib.sha256(f"timers={os.environ.get('LUMEN_TIMERS', '1')} "
                       f"novnni={os.environ.get('LUMEN_NO_VNNI', '0')}\n".encode())
    for pattern in _COMPILED:
        for p in sorted(root.glob(pattern)):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    from .model.store import lumen_home
    return str(lumen_home() / "numba" / h.hexdigest()[:16])


def _prune_compile_caches(keep: str, n: int = 3) -> None:
    """When this code's cache is new, drop all but the n most recently used caches of other code."""
    import shutil
    parent = os.path.dirname(keep)
    try:
        others = [e for e in os.scandir(parent) if e.is_dir() and e.path != keep]
        others.sort(key=lambda e: e.stat().st_mtime, reverse=True)
        for e in others[n - 1:]:
            shutil.rmtree(e.path, ignore_errors=True)
    except OSError:
        pass


if "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = _compile_cache_dir()
    if not os.path.isdir(os.environ["NUMBA_CACHE_DIR"]):
        _prune_compile_caches(os.environ["NUMBA_CACHE_DIR"])
    import sys as _sys
    if "numba" in _sys.modules:                        # imported before lumen: it read its config already
        import numba.core.config
        numba.core.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]

from .errors import ContextError, FetchError, GGUFError, LumenError, UnsupportedError

__all__ = ["load", "profile", "Model", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "LumenError",
           "GGUFError", "UnsupportedError", "FetchError", "ContextError"]
__version__ = "0.1.0"

# The layers, bottom up: format (GGUF file, quant types, tokenizer, chat template) -> model (Config, packed
# weights, the pack cache, the model store) -> kernels (Numba) -> engine (the forward pass, the runner, the block
# manager, the scheduler, the engine loop, Model) -> interfaces (generate, perplexity, bench, serve, profile).
_LAZY = {"Model": ("engine.llm", "Model"), "Engine": ("engine.engine", "Engine"),
         "EngineConfig": ("engine.config", "EngineConfig"),
         "SamplingParams": ("engine.sampling_params", "SamplingParams"),
         "RequestOutput": ("engine.sequence", "RequestOutput")}


def __getattr__(name: str):
    """Heavy parts are imported on first use, so `python -m lumen.models` does not load Numba."""
    if name == "profile":                      # the profiler module, callable: `with lumen.profile() as prof:`
        import importlib
        return importlib.import_module(".profile", __name__)
    if name in _LAZY:
        import importlib
        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{mod}", __name__), attr)
    raise AttributeError(f"module 'lumen' has no attribute {name!r}")


def load(model: str | os.PathLike, **kwargs):
    """Load a model by registry name (fetched on first use, see `python -m lumen.models`) or .gguf path."""
    from .engine.llm import Model
    from .model.store import resolve
    return Model(resolve(model), **kwargs)
