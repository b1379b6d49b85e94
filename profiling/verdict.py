"""What every profiling script ends with: one VERDICT line that carries its numbers and the machine's load.

    from verdict import verdict
    verdict(f"attention is {share:.1f}% of prefill")   # VERDICT: attention is 11.3% of prefill [load 0.9 on 2 cores]

The load average goes with every figure because these scripts run on shared machines: a number read beside a
busy neighbour is a number about that neighbour too.
"""
from __future__ import annotations

import os


def load() -> str:
    """'load 0.9 on 2 cores': the 1-minute load average and the core count."""
    return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def verdict(text: str) -> str:
    """Print 'VERDICT: <text> [load ...]' (the one line tests and readers look for) and return it."""
    line = f"VERDICT: {text} [{load()}]"
    print(line, flush=True)
    return line
