"""`python -m lumen.bench [single|batch|offline|serve] ...`: pick the benchmark, pass it the rest of the arguments."""
from __future__ import annotations

import sys

COMMANDS = ("single", "batch", "offline", "serve")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in COMMANDS else "single"
    if cmd == "batch":
        from .batch import main as run
    elif cmd == "offline":
        from .offline import main as run
    elif cmd == "serve":
        from .serve import main as run
    else:
        from .single import main as run
    return run(argv)
