"""What every profiling script ends with, one VERDICT line that carries its numbers and the machine's load, and how
each one refuses a wrong command line before it measures anything.

    from verdict import verdict
    verdict(f"attention is {share:.1f}% of prefill")   # VERDICT: attention is 11.3% of prefill [load 0.9 on 2 cores]

The load average goes with every figure because these scripts run on shared machines: a number read beside a
busy neighbour is a number about that neighbour too.

    ap.add_argument("--ns", type=list_of(count), default="1,8,16")   # --ns 1,x: argparse's usage line, then
    ap.add_argument("--threads", type=thread_count)                  # "x.py: error: argument --ns: ...", status 2
    with one_line_errors():                                          # --model nosuch: "x.py: unknown model ...",
        model = lumen.load(a.model, threads=a.threads)               # status 1, not a traceback

Nothing here imports Lumen or Numba when imported: startup.py times those imports in its child, compile_profile.py
records its child's compiles from before Lumen is imported, and unpack_rows.py points Numba's cache elsewhere first.
"""
from __future__ import annotations

import math
import os
import sys
from argparse import ArgumentTypeError
from contextlib import contextmanager


def load() -> str:
    """'load 0.9 on 2 cores': the 1-minute load average and the core count."""
    return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def verdict(text: str) -> str:
    """Print 'VERDICT: <text> [load ...]' (the one line tests and readers look for) and return it."""
    line = f"VERDICT: {text} [{load()}]"
    print(line, flush=True)
    return line


# ---- the command line: argparse types (a wrong value is argparse's usage error, status 2) and the model

def _parsed(text: str, kind, what: str):
    """kind(text), or argparse's error "expected <what>, got '<text>'"."""
    try:
        return kind(text)
    except ValueError:
        raise ArgumentTypeError(f"expected {what}, got {text!r}") from None


def count(text: str) -> int:
    """argparse type: a whole number of at least 1 (repeats, tokens, rows, requests)."""
    n = _parsed(text, int, "a whole number")
    if n < 1:
        raise ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def thread_count(text: str) -> int:
    """argparse type: a thread count, 1 to the threads Numba can use (Numba is imported here, when one is given)."""
    import numba
    n, hi = count(text), numba.config.NUMBA_NUM_THREADS
    if n > hi:
        raise ArgumentTypeError(f"must be between 1 and {hi} (the threads Numba can use here), got {n}")
    return n


def _number(text: str) -> float:
    x = _parsed(text, float, "a number")
    if not math.isfinite(x):
        raise ArgumentTypeError(f"expected a finite number, got {text!r}")
    return x


def positive(text: str) -> float:
    """argparse type: a number above 0 (a rate, an SLO, a size in MB)."""
    x = _number(text)
    if x <= 0:
        raise ArgumentTypeError(f"must be above 0, got {text}")
    return x


def non_negative(text: str) -> float:
    """argparse type: a number of at least 0 (seconds to pause, a cost)."""
    x = _number(text)
    if x < 0:
        raise ArgumentTypeError(f"must be at least 0, got {text}")
    return x


def list_of(item):
    """argparse type: comma-separated values, each read by the type `item` ('1,8,16' with count); the message
    names the bad item, and the whole value where it has more ("expected a whole number, got 'x' in '1,x'")."""
    def parse(text: str) -> list:
        out = []
        for part in text.split(","):
            try:
                out.append(item(part.strip()))
            except ArgumentTypeError as e:
                raise ArgumentTypeError(f"{e} in {text!r}" if "," in text else str(e)) from None
        return out
    return parse


@contextmanager
def one_line_errors():
    """Inside: a LumenError (an unknown model name, a path that does not exist or is not a GGUF file, a model that
    cannot be fetched) ends the script with its message on one line, `x.py: message`, and status 1, as Lumen's
    commands do: every LumenError is raised on purpose, with a message a user can act on; a traceback adds nothing."""
    from lumen.errors import LumenError
    try:
        yield
    except LumenError as e:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: {e}") from None


def checked_model(name: str) -> str:
    """The path of the GGUF file `name` gives (a registry name, fetched on first use, or a path), read and checked
    as lumen.load checks it (magic, version, architecture, tensor table), for a script that loads the model late or
    in another process (a server, a child): a name or file it cannot use ends the script here (one_line_errors)."""
    with one_line_errors():
        from lumen.model.parts import open_gguf
        from lumen.model.store import resolve
        path = resolve(name)
        open_gguf(path)
    return str(path)
