"""`python -m lumen.bench [single|batch|offline|serve|spec] ...`: pick the benchmark, pass it the rest."""
from __future__ import annotations

import sys

COMMANDS = ("single", "batch", "offline", "serve", "spec")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in COMMANDS else "single"
    if cmd == "batch":
        from .batch import main as run
    elif cmd == "offline":
        from .offline import main as run
    elif cmd == "serve":
        from .serve import main as run
    elif cmd == "spec":
        from .spec import main as run
    else:
        from .single import main as run
    return run(argv)
