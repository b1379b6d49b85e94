"""Is one sequence's decode bound by memory, or by the matvec's own work on the weights?

    python profiling/decode_stream.py [--quick] [--model qwen2.5-coder-1.5b] [--repeats 7]

Per FFN matrix kind (gate, up, down), the decode matvec at all threads, interleaved: (a) one layer's matrix again
and again (a few MB: in the L3 after the first call) against (b) every layer's copy in turn (the model's whole FFN:
from memory). Weight bytes (the GGUF's) over time for each, beside the machine's read bandwidth
(`python -m lumen.profile --machine`): (a) far above (b) and (b) below the bandwidth says the weights' stream, not
the kernel's instructions, is what a decode step waits on.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from lumen.format.gguf import GGUFFile
from lumen.kernels.matmul import matvec, prepare
from lumen.format.quants import QT
from lumen.machine import limits
from lumen.model.store import resolve
from verdict import verdict


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="qwen2.5-coder-1.5b")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="SmolLM2, 4 layers, 2 repeats, ffn_gate only (for tests)")
    a = ap.parse_args(argv)
    model, repeats = ("smollm2-135m", 2) if a.quick else (a.model, a.repeats)
    g = GGUFFile(resolve(model))
    rng = np.random.default_rng(0)
    bw = limits()["bw_gbps"]                             # all threads (lumen.profile --machine)
    rows = []
    for kind in ("ffn_gate",) if a.quick else ("ffn_gate", "ffn_up", "ffn_down"):
        ts = [t for n, t in g.tensors.items() if n.endswith(f".{kind}.weight")][:4 if a.quick else None]
        qt = ts[0].qtype
        ts = [t for t in ts if t.qtype == qt]                 # (Q4_K_M mixes types across layers: one type here)
        ws = [prepare(t.data, qt) for t in ts]
        x = rng.standard_normal((1, ws[0].n_in)).astype(np.float32)
        out = np.empty((1, ws[0].d_out), np.float32)
        for w in ws:                                          # compiled, and every copy touched once
            matvec(out, x, w, qt)
        hot, cold = [], []
        for _ in range(repeats):
            c = time.perf_counter()
            for _ in ws:
                matvec(out, x, ws[0], qt)
            hot.append((time.perf_counter() - c) / len(ws))
            c = time.perf_counter()
            for w in ws:
                matvec(out, x, w, qt)
            cold.append((time.perf_counter() - c) / len(ws))
        nbytes = ts[0].data.nbytes
        h, c = nbytes / statistics.median(hot) / 1e9, nbytes / statistics.median(cold) / 1e9
        rows.append((kind, h, c))
        print(f"{kind:>9} {QT(qt).name:>5} {len(ws):>2} layers x {nbytes / 1e6:5.1f} MB: one copy {h:6.1f} GB/s, "
              f"every copy {c:6.1f} GB/s ({100 * c / bw:.0f}% of {bw:.1f} GB/s)")
    hot, cold = min(r[1] for r in rows), max(r[2] for r in rows)
    verdict(f"{model} decode matvec: {hot:.0f}+ GB/s on a matrix in cache, at most {cold:.0f} GB/s streaming every "
            f"layer's against {bw:.0f} GB/s read bandwidth (medians of {repeats}) -> "
            + ("the stream, not the kernel's work, bounds decode" if hot > 1.3 * cold and cold < 0.9 * bw
               else "the kernel's own work bounds decode" if hot < 1.1 * cold else "mixed"))


if __name__ == "__main__":
    main()
