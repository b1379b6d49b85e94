"""From how many rows does unpacking each weight tile first pay, on this machine and this model's matrices?

    python profiling/unpack_rows.py [--quick] [--model qwen2.5-coder-1.5b] [--ns 32,64,96,128] [--threads 2]

lumen.kernels.policy unpacks each tile of a Q5- or Q6-family matrix to a byte per column once from UNPACK_ROWS
rows, of a Q4-family one from UNPACK_ROWS_Q4; below, each pass of NR rows unpacks as it goes. Those thresholds were
read on one small matrix in cache on one thread. Here every layer's copy of each matrix (so the weights stream from
memory, as in a forward pass), grouped by name and type, on --threads threads, both ways in one process and
alternated: the thresholds are lowered to 1 row in a compile cache of this run's own, so the unpacked path is
compiled in at every N, and the as-it-goes path is taken by giving the kernel no unpack scratch (matmul.tiles unpacks
first only with room for a tile). The bits are the same either way (tests/kernels/test_matmul.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict

from verdict import count, list_of, one_line_errors, verdict     # (imports neither Lumen nor Numba: see _kernels)


def _kernels(cache: str):
    """Lumen's kernel modules, compiled into `cache` with the unpacking thresholds lowered to 1 row (Numba takes its
    cache directory, and the policy's constants, when the kernels are defined and compiled: nothing of Lumen may be
    imported before this)."""
    if "lumen" in sys.modules:
        raise RuntimeError("unpack_rows must import Lumen itself (a compile cache and a policy of its own)")
    os.environ["NUMBA_CACHE_DIR"] = cache
    import lumen.kernels.policy as policy
    thresholds = {"Q4": policy.UNPACK_ROWS_Q4, "Q5/Q6": policy.UNPACK_ROWS}
    policy.UNPACK_ROWS = policy.UNPACK_ROWS_Q4 = 1
    global QT, GGUFFile, ACT_FORMAT, kinds, R, mat, matmul_kernel, new_acts, prepare, prepare_x, unpack_scratch
    global per_thread, counters, resolve, np, numba, UNPACKED, POLICY
    import numba
    import numpy as np
    from lumen.format.gguf import GGUFFile
    from lumen.format.quants import ACT_FORMAT, QT
    from lumen.kernels.kinds import kinds
    from lumen.kernels.layout import R
    from lumen.kernels.matmul import mat, matmul_kernel, new_acts, prepare, prepare_x, unpack_scratch
    from lumen.kernels.scratch import per_thread
    from lumen.kernels.work import counters
    from lumen.model.store import resolve
    UNPACKED, POLICY = policy.UNPACKED, thresholds


def family(qt: int) -> str:
    return "Q4" if qt in (QT.Q4_0, QT.Q4_1, QT.Q4_K) else "Q5/Q6"


def groups(model: str, quick: bool) -> dict:
    """{(name, type): [the blk.L.name.weight tensors of that type]} for the types that unpack (policy.UNPACKED)."""
    g = GGUFFile(resolve(model))
    out = defaultdict(list)
    for name, t in g.tensors.items():
        if name.startswith("blk.") and len(t.shape) == 2 and int(t.qtype) in UNPACKED:
            out[(name.split(".", 2)[2].removesuffix(".weight"), int(t.qtype))].append(t)
    if quick:
        first = next(iter(out))
        return {first: out[first][:4]}
    return dict(out)


def ratios(tensors: list, ns: list, threads: int, reps: int) -> dict:
    """{N: median time unpacking first / median time as it goes} over all the tensors, one pass each per round."""
    ps = [prepare(t.data, t.qtype) for t in tensors]
    ms = [mat(p) for p in ps]
    n_in, d_out, qt = ps[0].n_in, ps[0].d_out, int(tensors[0].qtype)
    kd = kinds(mats=(qt,), embd=(), acts=())
    facc, work = per_thread((threads, R), np.float32), counters(threads)
    full, none = unpack_scratch(threads, n_in), unpack_scratch(threads, n_in, 0)
    fmt = ACT_FORMAT[QT(qt)]
    out = {}
    for N in ns:
        acts = new_acts(N, n_in, fmt)
        prepare_x(acts, np.random.default_rng(N).standard_normal((N, n_in)).astype(np.float32), fmt)
        y = np.zeros((N, d_out), np.float32)
        t = {"first": [], "goes": []}
        for r in range(reps + 1):                      # round 0 compiles and warms
            for way, wbuf in (("first", full), ("goes", none)) if r % 2 else (("goes", none), ("first", full)):
                t0 = time.perf_counter()
                for m in ms:
                    matmul_kernel((y, y, y), (m, m, m), 1, acts, facc, wbuf, work, kd)
                if r:
                    t[way].append(time.perf_counter() - t0)
        out[N] = statistics.median(t["first"]) / statistics.median(t["goes"])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ns", type=list_of(count), default="32,64,96,128")
    ap.add_argument("--threads", type=count, default=None)
    ap.add_argument("--reps", type=count, default=6)
    ap.add_argument("--quick", action="store_true", help="SmolLM2, one matrix name, 4 layers, N = 8, 64 (for tests)")
    a = ap.parse_args(argv)
    if a.quick:
        a.model, a.ns, a.reps = "smollm2-135m", [8, 64], 2
    ns = a.ns
    cache = tempfile.mkdtemp(prefix="lumen-unpack-rows-")
    try:
        _kernels(cache)
        if (a.threads or 1) > numba.config.NUMBA_NUM_THREADS:
            ap.error(f"argument --threads: must be between 1 and {numba.config.NUMBA_NUM_THREADS} (the threads "
                     f"Numba can use here), got {a.threads}")
        threads = a.threads or numba.get_num_threads()
        numba.set_num_threads(threads)
        with one_line_errors():
            matrices = groups(a.model, a.quick)
        pays = defaultdict(list)                       # family -> [(N, ratio)]
        print(f"{a.model}, {threads} threads: time unpacking each tile first / unpacking as it goes "
              f"(< 1: first pays), all layers, medians of {a.reps} alternated rounds")
        for (name, qt), tensors in matrices.items():
            r = ratios(tensors, ns, threads, a.reps)
            print(f"  {name:12s} {QT(qt).name:5s} {'x'.join(map(str, tensors[0].shape))} x{len(tensors):<3d} "
                  + "  ".join(f"N={n}: {v:.3f}" for n, v in r.items()), flush=True)
            for n, v in r.items():
                pays[family(qt)].append((n, v))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    said = []
    for fam, rows in pays.items():
        worst = {n: max(v for m, v in rows if m == n) for n in ns}
        first = next((n for n in ns if all(worst[m] <= 1.0 for m in ns if m >= n)), None)
        said.append(f"the {fam} family's worst matrix {' / '.join(f'{worst[n]:.2f}' for n in ns)} at N = "
                    f"{' / '.join(map(str, ns))}: first never slower from "
                    f"{'no N measured' if first is None else f'N = {first}'} (policy: {POLICY[fam]})")
    verdict(f"{a.model}, unpacking first / as it goes: " + "; ".join(said))


if __name__ == "__main__":
    main()
