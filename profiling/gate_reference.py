"""Which gate reference tracks the decode step's CPU time as memory conditions change? (tests/benchmarks, 3a)

    python profiling/gate_reference.py [--quick] [--runs 12] [--pause 15] [--neighbour]

One thread. Each run is 15 interleaved rounds of: the gate's int16 L2 loop (1600 passes), a streaming u64 sum over
as many bytes as one SmolLM2 decode step reads (Weights.decode_bytes), the gate's int8 matvec over as many bytes
(conftest.MemoryReference), and two decode steps at position 64. A run prints its medians of each time and of
step / each reference; the last line gives each ratio's spread over the runs, (max - min) / median: the
reference whose ratio spreads least tracks the step best. --neighbour runs a 256 MB np.copyto loop in another
process on the other vCPU (a neighbour's memory traffic) during every run; compare with a quiet series.
--quick: 2 runs of 3 rounds, no pause (for tests).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "benchmarks"))
import conftest as gate  # noqa: E402  (the gate's own references)
from verdict import count, non_negative, verdict

NEIGHBOUR = """import numpy as np, time
a = np.ones(1 << 28, np.uint8); b = np.empty_like(a); t = time.time() + 3600
while time.time() < t: np.copyto(b, a)"""


@njit(fastmath=True, cache=True)
def stream_sum(words, reps):
    """reps passes of a sum over words (u64): one read of every byte, as fast as one thread streams."""
    acc = np.uint64(0)
    for _ in range(reps):
        for i in range(words.shape[0]):
            acc += words[i]
    return acc


def cpu(f) -> float:
    c0 = time.process_time()
    f()
    return time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=count, default=12)
    ap.add_argument("--pause", type=non_negative, default=15.0, help="seconds between runs (default 15)")
    ap.add_argument("--rounds", type=count, default=15, help="interleaved rounds per run (default 15)")
    ap.add_argument("--neighbour", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 runs of 3 rounds, no pause (for tests)")
    a = ap.parse_args()
    if a.quick:
        a.runs, a.rounds, a.pause = 2, 3, 0.0
    import lumen
    numba.set_num_threads(1)
    m = lumen.load("smollm2-135m", ctx=1024, n_batch=512, threads=1)    # (its steps set their own count)
    m.reset()
    m.prefill(np.arange(10, 74))

    def step():
        m.n_past = 64
        m.decode(100)
    nbytes = m.weights.decode_bytes
    int16, matvec = gate.Reference(), gate.MemoryReference(nbytes)
    words = np.random.default_rng(0).integers(0, 1 << 62, nbytes // 8, dtype=np.uint64)
    stream_sum(words[:8], 1)
    step()
    refs = {"int16 L2": lambda: int16(1600), f"stream {nbytes >> 20} MiB": lambda: stream_sum(words, 1),
            matvec.name: lambda: matvec(1)}
    per_pass = {"int16 L2": 1600}
    nb = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if a.neighbour else None
    ratios = {name: [] for name in refs}
    try:
        time.sleep(1 if nb else 0)
        for run in range(a.runs):
            if run:
                time.sleep(a.pause)
            rows = []
            for _ in range(a.rounds):
                int16.next()
                t = {name: cpu(f) / per_pass.get(name, 1) for name, f in refs.items()}
                t["step"] = cpu(lambda: [step() for _ in range(2)]) / 2
                rows.append(t)
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            rel = {name: statistics.median(r["step"] / r[name] for r in rows) for name in refs}
            for name in refs:
                ratios[name].append(rel[name])
            print(f"{time.strftime('%H:%M:%S')} {'neighbour' if nb else 'quiet'}: step {med['step'] * 1e3:.3f} ms; "
                  + "; ".join(f"{name} {med[name] * 1e3:.4g} ms, step / it {rel[name]:.4g}" for name in refs),
                  flush=True)
    finally:
        if nb:
            nb.kill()
    spread = {name: (max(v) - min(v)) / statistics.median(v) for name, v in ratios.items()}
    best = min(spread, key=spread.get)
    verdict(f"spread of step / reference over {a.runs} runs ({'neighbour' if nb else 'quiet'}): "
            + ", ".join(f"{name} {x:.1%}" for name, x in spread.items())
            + f"; the {best} reference tracks the decode step best")


if __name__ == "__main__":
    main()
