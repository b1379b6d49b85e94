"""The model object: a validated GGUF file, its Config, its tokenizer, and (next) its weights and forward pass."""
from __future__ import annotations

import os
from pathlib import Path

from .config import Config, check_tensors, config_from_metadata
from .errors import GGUFError, LumenError
from .gguf import GGUFFile


def _supported_types():
    from .quants import SUPPORTED
    return SUPPORTED


def build_tokenizer(meta):
    """The tokenizer described by the metadata. Any failure inside a tokenizer library on corrupt metadata
    becomes a GGUFError, so a bad file never surfaces as a foreign exception."""
    from .tokenizer import Tokenizer
    try:
        return Tokenizer.from_metadata(meta)
    except LumenError:
        raise
    except Exception as e:  # noqa: BLE001 - third-party tokenizer libraries raise anything on bad vocabularies
        raise GGUFError(f"the tokenizer metadata is invalid: {type(e).__name__}: {e}") from e


def open_gguf(path: str | os.PathLike) -> tuple[GGUFFile, Config]:
    """Parse, validate and check a GGUF file against its architecture's tensor contract."""
    g = GGUFFile(path)
    cfg = config_from_metadata(g.metadata)
    check_tensors(cfg, g.tensors, _supported_types())
    return g, cfg


class Model:
    """A loaded model. Construct with `lumen.load(name_or_path)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.gguf, self.config = open_gguf(self.path)
        self.tokenizer = build_tokenizer(self.gguf.metadata)

    @property
    def metadata(self) -> dict:
        return self.gguf.metadata

    def tokenize(self, text: str, *, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Text -> token ids. add_bos=None uses the model's default (tokenizer.ggml.add_bos_token)."""
        if add_bos is None:
            add_bos = self.tokenizer.add_bos_default
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def __repr__(self):
        c = self.config
        return f"<lumen.Model {c.arch} {c.name!r}: {c.n_layer} layers, d={c.n_embd}, vocab {c.n_vocab}>"
