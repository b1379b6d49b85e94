"""Lumen: a measurement-first LLM inference engine for GGUF models on the CPU."""
from __future__ import annotations

import os

from .errors import ContextError, FetchError, GGUFError, LumenError, UnsupportedError

__all__ = ["load", "LumenError", "GGUFError", "UnsupportedError", "FetchError", "ContextError"]
__version__ = "0.1.0"


def load(model: str | os.PathLike, **kwargs):
    """Load a model by registry name (fetched on first use, see `python -m lumen.models`) or .gguf path."""
    from .model import Model
    from .models import resolve
    return Model(resolve(model), **kwargs)
