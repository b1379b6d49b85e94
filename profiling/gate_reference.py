"""Which reference tracks the decode step's CPU time as memory conditions change? (tests/benchmarks, item 3a)

    python profiling/gate_reference.py [--rounds 15] [--neighbour]

One thread. Interleaved rounds of: the gate's int16 L2 loop (1600 passes), three decode steps at position 64,
a streaming u64 sum over as many bytes as one SmolLM2 decode step reads (Weights.decode_bytes), three decode
steps again. Prints the medians of the step's time after each reference and of step / int16 loop (the steps
after it) and step / stream (the steps after it), as the gate pairs them. --neighbour runs a 256 MB np.copyto loop in another process
on the other vCPU during the rounds (memory traffic from a neighbour); compare with a quiet run.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "benchmarks"))
import conftest as gate  # noqa: E402  (the gate's own references)

NEIGHBOUR = """import numpy as np, time
a = np.ones(1 << 28, np.uint8); b = np.empty_like(a); t = time.time() + 600
while time.time() < t: np.copyto(b, a)"""


def cpu(f) -> float:
    c0 = time.process_time()
    f()
    return time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--neighbour", action="store_true")
    a = ap.parse_args()
    import lumen
    numba.set_num_threads(1)
    m = lumen.load("smollm2-135m", ctx=1024, n_batch=512)
    m.reset()
    m.prefill(np.arange(10, 74))

    def step():
        m.n_past = 64
        m.decode(100)
    ref, stream = gate.Reference(), gate.StreamReference(m.weights.decode_bytes)
    step()
    nb = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if a.neighbour else None
    try:
        time.sleep(1 if nb else 0)
        rows = []
        for _ in range(a.rounds):
            ref.next()
            r = cpu(lambda: ref(1600)) / 1600
            w = cpu(lambda: [step() for _ in range(3)]) / 3   # after the L2 loop: the model may still be cached
            s = cpu(lambda: stream(1))
            d = cpu(lambda: [step() for _ in range(3)]) / 3   # after the stream: the model was evicted
            rows.append((r, s, d, w))
    finally:
        if nb:
            nb.kill()
    r, s, d, w = (statistics.median(v) for v in zip(*rows))
    print(f"{'neighbour' if nb else 'quiet'}: int16 pass {r * 1e6:.2f} us, {stream.name} {s * 1e3:.2f} ms, step "
          f"after the int16 loop {w * 1e3:.3f} ms, after the stream {d * 1e3:.3f} ms | step / int16 "
          f"{statistics.median(x[3] / x[0] for x in rows):.0f}, step / stream {statistics.median(x[2] / x[1] for x in rows):.4f}")


if __name__ == "__main__":
    main()
