"""Lumen: a measurement-first LLM inference engine for GGUF models on the CPU."""
from __future__ import annotations

import os

# First of Lumen's modules, so its IMPORT_TIME_NS (what lumen.model.packcache checks source files against) is when
# Lumen was imported.
from .paths import use_compile_cache

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
# Numba's compile cache: $LUMEN_HOME/numba/<key of the compiled code> (lumen/paths.py). Before Numba starts.
use_compile_cache()

from .errors import ContextError, FetchError, GGUFError, LumenError, UnsupportedError

__all__ = ["load", "profile", "Model", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "LumenError",
           "GGUFError", "UnsupportedError", "FetchError", "ContextError"]
__version__ = "0.1.0"

# The layers, bottom up (tests/test_layers.py keeps imports pointing down): errors, timer, paths -> format (GGUF
# file, quant types, tokenizer, chat template) -> kernels (Numba) -> model (Config, packed weights, the pack cache,
# the model store, the forward pass and its loader) -> engine (the runner, the block manager, the scheduler, the
# engine loop) -> this facade (lumen.load, Model) and the profiler -> interfaces (generate, perplexity, bench,
# serve, models, gguf).
_LAZY = {"Model": ("llm", "Model"), "Engine": ("engine.engine", "Engine"),
         "EngineConfig": ("engine.config", "EngineConfig"),
         "SamplingParams": ("engine.sampling.params", "SamplingParams"),
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
    """Load a model by registry name (fetched on first use, see `python -m lumen.models`) or .gguf path. kwargs:
    lumen.Model's options (max_model_len or ctx, threads, max_num_batched_tokens or n_batch, pack_cache,
    adaptive_threads); TypeError naming them for any other, before the model is fetched."""
    import inspect
    from .llm import Model
    from .model.store import resolve
    known = [p for p in inspect.signature(Model.__init__).parameters if p not in ("self", "path", "parts")]
    if unknown := [k for k in kwargs if k not in known and k != "parts"]:     # (parts: the CLIs' parsed GGUF)
        raise TypeError(f"lumen.load() got an unexpected keyword argument {unknown[0]!r}; its options are "
                        f"{', '.join(known)}")
    return Model(resolve(model), **kwargs)
