"""Co-runners: another process beside a benchmark, on purpose, because a user's machine is never idle.

    with corunner("busy", seconds=120):      # or "sleep", or "none"
        ... measure ...

- `sleep`: a process that sleeps 1 ms in a loop: almost no CPU, but it wakes 1000 times a second and takes a core
  for a moment each time (a log shipper, a timer, an idle event loop).
- `busy`: a process that spins a Python loop: one whole core's worth of demand (a neighbour's job, a tokenizer,
  a load generator).
- `none`: nothing (the idle figure that the others are divided by).

Each co-runner is its own process, bounded in time (it exits by itself after `seconds`, when the benchmark's
process is gone, killed or not, and is killed when the block ends), so no benchmark leaves one behind. The block begins once the co-runner says it is in its loop (an
interpreter starting is a busy process for tens of ms, whatever the kind), and after the co-runner is killed it
waits SETTLE_S, longer than the thread governor's RESET_S (lumen.engine.threads): what is measured next (the next
repetition's idle figure) starts from a pause after which the governor sees nobody and takes every thread,
instead of the count the co-runner left behind (which would read the next idle figure on one thread).
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from contextlib import contextmanager

from .tools import comma_list

KINDS = ("none", "sleep", "busy")
SETTLE_S = 1.2          # seconds after a co-runner ends before the block does (> lumen.engine.threads.RESET_S)

_READY = "import sys\nsys.stdout.write('ready\\n')\nsys.stdout.flush()\n"     # in its loop from here on
_LIVE = "import os, time\nend, parent = time.monotonic() + float(sys.argv[1]), int(sys.argv[2])\n"  # argv: s, ppid
_UP = "(time.monotonic() < end and os.getppid() == parent)"     # its time is not over, its benchmark still runs
_CODE = {
    "sleep": _READY + _LIVE + f"while {_UP}:\n    time.sleep(0.001)\n",
    "busy": _READY + _LIVE + f"n = 0\nwhile True:\n    n += 1\n    if n & 0xFFFF == 0 and not {_UP}:\n        break\n",
}
START_TIMEOUT_S = 30.0  # a co-runner that has not said ready by then is a fault


@contextmanager
def corunner(kind: str, seconds: float = 600.0):
    """Run co-runner `kind` (KINDS) for at most `seconds` while the block runs; yields its Popen (None for none)."""
    if kind not in KINDS:
        raise ValueError(f"co-runner must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "none":
        yield None
        return
    p = subprocess.Popen([sys.executable, "-c", _CODE[kind], str(float(seconds)), str(os.getpid())],
                         stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE)
    try:
        # its own start (an interpreter starting: a busy process for tens of ms, whatever the kind) is over before
        # the measurement begins, or a sleeping loop would be measured as a busy one for the first step
        if not select.select([p.stdout], [], [], START_TIMEOUT_S)[0] or p.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the {kind} co-runner did not start (exit code {p.poll()})")
        yield p
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
        time.sleep(SETTLE_S)


def parse_kinds(text: str | None) -> list[str]:
    """--corunner's value ("sleep,busy") -> the co-runners to measure beside, in order (none is always measured
    too, as the idle figure)."""
    if not text:
        return []
    kinds = comma_list("--corunner", text)
    bad = [k for k in kinds if k not in KINDS or k == "none"]
    if bad:
        raise ValueError(f"--corunner takes {', '.join(k for k in KINDS if k != 'none')} (comma-separated), "
                         f"got {bad[0]!r}")
    return list(dict.fromkeys(kinds))


def ratio_rows(values: dict, kinds: list[str]) -> list[dict]:
    """values[kind][(figure, engine)] = per-repetition figures (repetitions interleaved over the kinds) ->
    one row per (figure, engine, co-runner): its median, and the median of its per-repetition ratios to the
    same engine's idle figure in the same repetition."""
    import statistics
    rows = []
    for key, idle in values["none"].items():
        for kind in kinds:
            v = values[kind].get(key)
            if not v:
                continue
            n = min(len(v), len(idle))
            rows.append({"figure": key[0], "engine": key[1], "corunner": kind, "median": statistics.median(v),
                         "idle_median": statistics.median(idle),
                         "ratio": statistics.median(v[i] / idle[i] for i in range(n) if idle[i] > 0)})
    return rows


def render_ratios(rows: list[dict], console, title: str) -> None:
    from rich.table import Table
    t = Table(title=title)
    for col in ("figure", "engine", "beside", "t/s", "idle t/s", "ratio to idle"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["figure"], r["engine"], r["corunner"], f"{r['median']:.1f}", f"{r['idle_median']:.1f}",
                  f"{r['ratio']:.2f}")
    console.print(t)
    console.print("co-runners: sleep = a process sleeping 1 ms in a loop; busy = a process spinning a Python loop "
                  "(lumen.bench.corunner); ratio = median over repetitions of (figure beside it / the same engine's "
                  "idle figure in the same repetition)", markup=False)
