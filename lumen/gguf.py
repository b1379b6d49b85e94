"""`python -m lumen.gguf FILE|NAME`: a GGUF file's metadata and tensor table (the reader is lumen/format/gguf.py)."""
from __future__ import annotations

import sys
import os
from typing import Any

from lumen.errors import FetchError, GGUFError
from lumen.format.gguf import GGUFFile
from lumen.model.store import resolve
from .commands import Parser, prog


def _short(v: Any, width: int = 80) -> str:
    if isinstance(v, list):
        head = ", ".join(repr(x) for x in v[:5])
        return f"[{head}{', ...' if len(v) > 5 else ''}] ({len(v)} items)"
    s = repr(v)
    return s if len(s) <= width else s[:width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table
    ap = Parser(prog=prog("gguf"), description="Show a GGUF file's metadata and tensors")
    ap.add_argument("file", help="path to a .gguf file, or a registry name (python -m lumen.models)")
    args = ap.parse_args(argv)
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:    # a pipe: one line per key, nothing cut
        console = Console(width=1 << 12)
    try:
        path = resolve(args.file)                       # a name or a path, said as every other tool says it
        g = GGUFFile(path)
    except (GGUFError, FetchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    meta = Table(title=f"{g.path.name}: GGUF v{g.version}, {len(g.metadata)} metadata keys")
    meta.add_column("key", overflow="fold")                           # a key cut to "...rms_epsi…" names nothing
    meta.add_column("value", overflow="fold")
    for k, v in g.metadata.items():
        meta.add_row(k, _short(v))
    console.print(meta)
    if not g.tensors:                                   # (its data offset, aligned, can lie past the file's end)
        console.print(f"no tensors: a metadata-only file (a vocabulary, as llama.cpp's ggml-vocab-*.gguf), not a "
                      f"model to run; {g.size:,} file bytes")
        return 0
    tab = Table(title=f"{len(g.tensors)} tensors, data at offset {g.data_start}")
    for col, just in (("name", "left"), ("type", "left"), ("shape (ggml dims)", "left"), ("bytes", "right")):
        tab.add_column(col, justify=just, overflow="fold")
    total = 0
    for t in g.tensors.values():
        tab.add_row(t.name, t.qtype.name, str(list(t.dims)), f"{t.nbytes:,}")
        total += t.nbytes
    console.print(tab)
    console.print(f"total tensor bytes: {total:,} of {g.size:,} file bytes")
    return 0


if __name__ == "__main__":
    from lumen.commands import run
    sys.exit(run(main))
