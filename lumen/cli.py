"""`lumen COMMAND [ARGS]`: the console script. Each command is a tool's own main(argv) (lumen/commands.py), so
`lumen generate ...` and `python -m lumen.generate ...` take the same arguments and do the same thing."""
from __future__ import annotations

import importlib
import sys

from .commands import COMMANDS, EXIT_STATUS, run


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    return ("usage: lumen COMMAND [ARGS]   (lumen COMMAND --help for a command's options)\n\n"
            "A measurement-first LLM inference engine: GGUF models on the CPU.\n\ncommands:\n" + "\n".join(lines)
            + "\n\n" + EXIT_STATUS)


def main(argv: list[str] | None = None) -> int:
    """The console script's entry point: the command's own main, ended as a shell tool ends (commands.run)."""
    return run(dispatch, argv)


def dispatch(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "help":             # `lumen help generate`, as git and pip
        argv = [argv[1], "--help"]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"lumen {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"lumen: unknown command {cmd!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    main_of = importlib.import_module(COMMANDS[cmd][0]).main
    return main_of(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
