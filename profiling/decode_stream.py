"""Is one sequence's decode bound by memory, or by the matvec's own work on the weights?

    python profiling/decode_stream.py [--quick] [--model qwen2.5-coder-1.5b] [--repeats 7] [--threads N]

Per FFN matrix kind (gate, up, down), the decode matvec at all threads, interleaved: (a) one layer's matrix again
and again (a few MB: in the L3 after the first call) against (b) every layer's copy in turn (the model's whole FFN:
from memory) and (c) a plain read of as many bytes (lumen.machine's f32 sum, one part per thread), in GB/s of the
packed weights. (a) far above (b) with (b) near (c) says the stream bounds decode; (b) near 1 / (1/a + 1/c) says the
kernel's work and the stream add up instead of overlapping (each core waits for memory, then computes), which no
share of the bandwidth figure shows.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from lumen.format.gguf import GGUFFile
from lumen.kernels.matmul import matvec, prepare
from lumen.format.quants import QT
from lumen.machine import on_threads, split, sum_kernel
from lumen.model.store import resolve
from verdict import count, one_line_errors, verdict


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="qwen2.5-coder-1.5b")
    ap.add_argument("--repeats", type=count, default=7)
    ap.add_argument("--threads", type=int, default=0, help="threads of the matvec and the plain read (default: all)")
    ap.add_argument("--quick", action="store_true", help="SmolLM2, 4 layers, 2 repeats, ffn_gate only (for tests)")
    a = ap.parse_args(argv)
    if a.threads < 0:
        ap.error(f"--threads must be 0 (all) or more, got {a.threads}")
    model, repeats = ("smollm2-135m", 2) if a.quick else (a.model, a.repeats)
    with one_line_errors():
        g = GGUFFile(resolve(model))
    rng = np.random.default_rng(0)
    if a.threads:
        numba.set_num_threads(min(a.threads, numba.config.NUMBA_NUM_THREADS))
    threads = numba.get_num_threads()
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
        nbytes = ws[0].nbytes
        parts = split(np.ones(nbytes * len(ws) // 4, np.float32), threads)   # as many bytes as every copy
        sum_kernel(parts[0][:1024])
        hot, cold, read = [], [], []
        for _ in range(repeats):
            c = time.perf_counter()
            for _ in ws:
                matvec(out, x, ws[0], qt)
            hot.append((time.perf_counter() - c) / len(ws))
            c = time.perf_counter()
            for w in ws:
                matvec(out, x, w, qt)
            cold.append((time.perf_counter() - c) / len(ws))
            c = time.perf_counter()
            on_threads([lambda p=p: sum_kernel(p) for p in parts])
            read.append((time.perf_counter() - c) / len(ws))
        h, c, r = (nbytes / statistics.median(v) / 1e9 for v in (hot, cold, read))
        rows.append((kind, h, c, r))
        print(f"{kind:>9} {QT(qt).name:>5} {len(ws):>2} layers x {nbytes / 1e6:5.1f} MB, {threads} threads: one copy "
              f"{h:6.1f} GB/s, every copy {c:6.1f} GB/s, a plain read {r:6.1f} GB/s (in series: "
              f"{1 / (1 / h + 1 / r):5.1f})")
    kind, h, c, r = min(rows, key=lambda row: row[2] / row[3])          # the kind farthest from a plain read
    serial = 1 / (1 / h + 1 / r)
    verdict(f"{model} decode matvec, {threads} threads, {kind}: {h:.0f} GB/s on a matrix in cache, {c:.0f} GB/s "
            f"streaming every layer's, a plain read {r:.0f} GB/s (medians of {repeats}) -> "
            + ("the stream bounds decode" if c > 0.85 * r
               else "the kernel's work and the stream add up instead of overlapping" if c < 1.15 * serial
               else "the kernel's own work bounds decode" if h < 1.1 * c else "mixed"))


if __name__ == "__main__":
    main()
