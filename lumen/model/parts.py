"""A GGUF file as the engine runs it: parsed and checked (`open_gguf`), its tokenizer (`build_tokenizer`), its
weights and their forward-pass bundle (`load_parts` -> ModelParts), shared read-only by every Model and Engine
made from it. On the model floor, below the engine, so the engine and lumen.Model load a model the same way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import GGUFError, LumenError
from ..paths import lumen_home
from ..format.gguf import GGUFFile
from .config import Config, check_tensors, config_from_metadata
from .weights import header_kinds, load_weights
from .forward import Weights


def build_tokenizer(meta):
    """The tokenizer described by the metadata. Any failure inside a tokenizer library on corrupt metadata
    becomes a GGUFError, so a bad file never surfaces as a foreign exception."""
    from ..format.tokenizer import Tokenizer
    try:
        return Tokenizer.from_metadata(meta)
    except LumenError:
        raise
    except Exception as e:  # noqa: BLE001 - third-party tokenizer libraries raise anything on bad vocabularies
        raise GGUFError(f"the tokenizer metadata is invalid: {type(e).__name__}: {e}") from e


def open_gguf(path: str | os.PathLike, *, cache: bool | None = None) -> tuple[GGUFFile, Config]:
    """Parse, validate and check a GGUF file against its architecture's tensor contract. cache: keep its parsed
    header in $LUMEN_HOME/headers (lumen.format.gguf.HeaderCache); None: when the pack cache is on
    (LUMEN_PACK_CACHE)."""
    from ..format.quants import SUPPORTED
    from . import packcache
    use = packcache.enabled() if cache is None else cache
    g = GGUFFile(path, cache=lumen_home() / "headers" if use else None)
    cfg = config_from_metadata(g.metadata)
    check_tensors(cfg, g.tensors, SUPPORTED)
    return g, cfg


@dataclass
class ModelParts:
    """What a GGUF file becomes, shared read-only by every Model and Engine made from it."""
    path: Path
    gguf: GGUFFile
    config: Config
    tokenizer: object
    weights: object          # lumen.model.weights.LoadedWeights
    bundle: Weights          # its arrays as the forward pass's Weights bundle
    rope_freqs: np.ndarray | None

    @staticmethod
    def thread_count(threads: int | None) -> int:
        """The thread count a Model or Engine runs on: `threads`, checked, or None: every thread Numba has
        (NUMBA_NUM_THREADS). Numba's count of the calling thread is left alone: each step sets its own
        (lumen.engine.threads.Governor). Set here, a model loaded with threads=1 made every model or engine loaded
        after it in that thread take 1 thread for None."""
        import numba
        max_threads = numba.config.NUMBA_NUM_THREADS
        if threads is None:
            return max_threads
        if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= max_threads:
            raise ValueError(f"threads must be between 1 and {max_threads}, got {threads!r}")
        return threads


def make_parts(path, g: GGUFFile, cfg: Config, tok, *, pack_cache: bool | None = None,
               quiet: bool = False, requant=None) -> ModelParts:
    """The parts of an opened GGUF file: its weights loaded (repacked, or from the pack cache). quiet: no line
    on stderr when the weights are packed; requant: None or QT.Q4_0 (lumen.model.weights.load_weights)."""
    from . import precompile
    precompile.start(header_kinds(g, cfg, requant))   # a first run: the forward pass compiles on the other core
    w = load_weights(g, cfg, pack_cache=pack_cache, quiet=quiet, requant=requant)
    return ModelParts(Path(path), g, cfg, tok, w, Weights(**w.arrays), w.rope_freqs)


def load_parts(model: str | os.PathLike, *, pack_cache: bool | None = None, quiet: bool = False,
               requant=None) -> ModelParts:
    """A registry name (fetched on first use) or a .gguf path -> its parts. quiet: nothing on stderr (the
    fetch's progress, the packing line); requant: None or QT.Q4_0 (lumen.model.weights.load_weights)."""
    from .store import resolve
    path = resolve(model, quiet=quiet)
    g, cfg = open_gguf(path, cache=pack_cache)
    return make_parts(path, g, cfg, build_tokenizer(g.metadata), pack_cache=pack_cache, quiet=quiet,
                      requant=requant)


def parts_of(model, *, pack_cache: bool | None = None, quiet: bool = False, requant=None) -> ModelParts:
    """ModelParts from parts, a lumen.Model (its parts, shared, as they were loaded) or a registry name / .gguf path
    (loaded, with requant: load_parts)."""
    if isinstance(model, ModelParts):
        return model
    parts = getattr(model, "parts", None)
    if isinstance(parts, ModelParts):
        return parts
    return load_parts(model, pack_cache=pack_cache, quiet=quiet, requant=requant)
