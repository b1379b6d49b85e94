"""`python -m lumen.models` (`lumen models`): the model store's command line (the store is lumen/model/store.py)."""
from __future__ import annotations

import os
import sys

from .commands import Parser, prog, run
from .errors import FetchError
from .model import store
from .model.store import DEFAULT_MODEL, MODELS, fetch, home_blocker, lumen_home, model_path, state, unwritable, verify


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog=prog("models"), description=store.__doc__.splitlines()[0])
    ap.add_argument("--fetch", metavar="NAME", choices=sorted(MODELS),
                    help="fetch (and verify) one model unless it is fetched already: %(choices)s")
    ap.add_argument("--verify", metavar="NAME", choices=sorted(MODELS),
                    help="re-check a fetched model's sha256: %(choices)s")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:    # a pipe: one line per model, nothing cut
        console = Console(width=1 << 12)
    try:
        if home_blocker() is not None:  # nothing can ever be fetched there: say so now
            raise unwritable(NotADirectoryError())
        if args.fetch and state(args.fetch) == "verified":          # (--verify checks the file again)
            print(f"{args.fetch} is already fetched and verified: {model_path(args.fetch)}", file=sys.stderr)
        elif args.fetch:
            fetch(args.fetch)                            # a changed file is checked first, fetched again if bad
        if args.verify:
            path = verify(args.verify)                   # (a mismatch is a FetchError, said below)
            print(f"{args.verify}: sha256 matches, verified: {path}", file=sys.stderr)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:                               # (the partial download is deleted on the way out)
        print("\ninterrupted", file=sys.stderr)
        return 130
    table = Table(title=f"Lumen models (LUMEN_HOME={lumen_home()})")
    for col in ("name", "about", "size", "state", "path"):
        table.add_column(col, no_wrap=col == "name", overflow="fold" if col == "path" else "ellipsis")  # never cut
    for name, spec in MODELS.items():
        st = state(name)
        colour = {"verified": "green", "unverified": "yellow", "missing": "dim"}[st]
        table.add_row(name + (" (default)" if name == DEFAULT_MODEL else ""), spec.about,
                      f"{spec.size / 1e6:.1f} MB", f"[{colour}]{st}[/]", str(model_path(name)))
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
