"""The command-line tools: one table, shared by the `lumen` console script and each tool's own help.

    lumen COMMAND [ARGS]     the console script (lumen/cli.py)
    python -m lumen.COMMAND  the same tool, run as a module

`prog(cmd)` names a tool the way the user invoked it, so `--help` and errors show what to type again. Every tool
ends with the exit status EXIT_STATUS states (`lumen --help` prints it): 2 for a wrong command line, said before any
model loads; 1 for a run that failed; 130 and 141 from run().
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from .errors import ContextWarning, LumenError

# command -> (module whose main(argv) runs it, one line for `lumen --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("lumen.generate", "generate text from a prompt (a model name or a .gguf path)"),
    "chat": ("lumen.chat", "a conversation with a model in the terminal (/clear, /exit)"),
    "serve": ("lumen.serve.cli", "an OpenAI-compatible server (chat page, dashboard, metrics, Ray replicas)"),
    "bench": ("lumen.bench.cli", "benchmarks beside llama.cpp: single, batch, offline, serve, spec"),
    "profile": ("lumen.profile.__main__", "per-op profile of a run, roofline, machine limits"),
    "models": ("lumen.models", "known models and their state; --fetch NAME"),
    "perplexity": ("lumen.perplexity", "perplexity of a model on a text file"),
    "gguf": ("lumen.gguf", "a GGUF file's metadata and tensor table"),
    "warmup": ("lumen.warmup", "compile the kernels for the given models ahead of time (image builds, servers)"),
}


EXIT_STATUS = """exit status (every command):
  0    done
  1    the run failed: a model or perplexity's text that cannot be found, fetched, read or loaded; a prompt that
       cannot be used (empty, not UTF-8, longer than the context); an engine, server or llama.cpp tool that failed
  2    the command line is wrong, said before any model loads: what argparse rejects, a flag's value out of its
       range or with a flag it does not go with, a prompt (--file), grammar, schema or tools file that cannot be
       read or parsed, an output path that cannot be written (--json), a llama.cpp tool path that is not an
       executable, no prompt
  130  interrupted (Ctrl-C)
  141  the reader of the output went away (`lumen generate ... | head`)"""


NEGATIVE_NUMBER = re.compile(r"^-(?:(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf|infinity|nan)$", re.I)


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a wrong command line is one line on stderr, `prog: error: message`, and status 2
    (argparse prints its whole usage first: 20 lines for generate, the error last). A negative number in any float
    spelling (-1e300, -inf) is a value: argparse's own pattern took it for a flag ("expected one argument")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        """An unknown flag is said before a missing required one (argparse checks the required ones first, so
        `perplexity --bogus` said "--file is required")."""
        required = [a for a in self._actions if a.required and a.option_strings]
        if not required:
            return super().parse_args(args, namespace)
        for a in required:
            a.required = False
        try:
            _, extras = self.parse_known_args(args, copy.copy(namespace))
        finally:
            for a in required:
                a.required = True
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return super().parse_args(args, namespace)


def threads_error(threads: int | None) -> str | None:
    """Why --threads cannot be used (a usage error, status 2), or None: 1 to the cores Numba can use."""
    if threads is None:
        return None
    import numba
    hi = numba.config.NUMBA_NUM_THREADS
    return None if 1 <= threads <= hi else f"--threads must be between 1 and {hi}, got {threads}"


def invoked_as_script() -> bool:
    """True when the process was started as the `lumen` console script (not `python -m lumen.X`)."""
    return os.path.basename(sys.argv[0] or "") == "lumen"


def prog(cmd: str) -> str:
    """'lumen bench batch', 'python -m lumen bench batch' or 'python -m lumen.bench batch', as the user invoked
    it."""
    if invoked_as_script():
        return f"lumen {cmd}"
    if Path(sys.argv[0] or "").parts[-2:] == ("lumen", "__main__.py"):     # python -m lumen COMMAND
        return f"python -m lumen {cmd}"
    head, _, rest = cmd.partition(" ")
    return f"python -m lumen.{head}" + (f" {rest}" if rest else "")


def run(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int | str | None:
    """A tool's main(argv) as the process's exit status, the way a shell tool ends:
    - its reader gone (`... | head`): quiet, status 141 (128 + SIGPIPE, as a shell reports `yes | head`);
    - Ctrl-C that the tool did not handle itself: one line, status 130 (128 + SIGINT), no traceback.
    argparse's exits (--help, a usage error) pass through, their output flushed here too. Started with stdout
    closed (`>&-`, where Python's sys.stdout is None), the output goes nowhere, as to /dev/null. On a stdout that
    cannot encode all text (PYTHONIOENCODING=ascii, a Latin-1 locale) a character it lacks is written as its
    backslash escape (caf\\xe9), as Python writes stderr, not a UnicodeEncodeError halfway through the text."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")
    escape_unencodable(sys.stdout)
    was_devnull = stdout_is_devnull()
    try:
        try:
            code = main(argv)
        except SystemExit as e:                          # argparse: --help, usage errors
            code = e.code
            if code == 1 and not was_devnull and stdout_is_devnull():   # rich's reader gone: it points stdout at
                code = 141                               # /dev/null and exits 1 (Console.on_broken_pipe)
        except KeyboardInterrupt:
            sys.stdout.flush()
            print("\ninterrupted", file=sys.stderr)
            code = 130
        sys.stdout.flush()                               # a pipe's last block: a reader gone raises here
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())           # the interpreter's own last flush must not fail again
        return 141


def stdout_is_devnull() -> bool:
    """True when file descriptor 1 is /dev/null (False when it cannot be told)."""
    try:
        out, null = os.fstat(sys.stdout.fileno()), os.stat(os.devnull)
    except (OSError, ValueError, AttributeError):        # (a stdout with no descriptor: io.StringIO in a test)
        return False
    return (out.st_dev, out.st_ino) == (null.st_dev, null.st_ino)


def escape_unencodable(stream) -> None:
    """Make a text stream whose encoding is not a UTF one write what it cannot encode as backslash escapes. Its
    errors handler is "strict", or "surrogateescape" where the C locale is not coerced to UTF-8 (LC_ALL=C where
    no C.UTF-8 locale exists, or PYTHONCOERCECLOCALE=0): that one writes back only undecodable bytes, and any
    other character it cannot encode raised UnicodeEncodeError at the first "é" of a reply."""
    import codecs
    encoding, errors = getattr(stream, "encoding", None), getattr(stream, "errors", None)
    try:
        utf = codecs.lookup(encoding).name.startswith("utf")
    except (LookupError, TypeError):
        return
    if not utf and errors in ("strict", "surrogateescape") and hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="backslashreplace")


def check_writable(path: str, what: str) -> str | None:
    """Why `path` cannot be written, or None: a tool checks its output files before a long run, not after."""
    p = Path(path)
    if p.is_dir():
        return f"{what} path {path} is a directory"
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return f"cannot write {what} to {path}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return f"cannot write {what} to {path}: permission denied"
    return None


@contextmanager
def trained_context_only(hint: str, allow: bool = False):
    """Every command line refuses a context beyond the model's trained one, where lumen.load only warns: the
    block's ContextWarning becomes a LumenError ending with `hint` (what to change); allow (--force-ctx): ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if allow else "error", ContextWarning)
        try:
            yield
        except ContextWarning as e:
            raise LumenError(f"{e}; {hint}") from None
