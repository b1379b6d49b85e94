"""What keeps the batched tile kernels from the int8 dot roof: the broadcasts beside the vpdpbusd?

    python profiling/vnni_ports.py [--quick] [--reuse 1,2,4] [--model smollm2-135m] [--ns 1,4,8,16,64]

Part 1, the building block alone (one thread, 16 KB of weights in L1, 64-byte aligned): vpdpbusd into 16
accumulators with the activation quads in registers (as lumen.machine measures the roof), then with each quad
broadcast from memory and used for `reuse` weight vectors (as a tile kernel must: a quad of a different activation
row or column for every step). If a broadcast costs a vector port slot, reuse 1 runs at about half the register
rate and reuse 4 near it.

Part 2, the tile kernels as they are: one matrix of each type the model has (its first layer's), in cache, at N
rows, one thread, best of 7: GOP/s and the share of the one-thread roof.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

import lumen.kernels.ir as kir
from lumen.format.gguf import GGUFFile
from lumen.format.quants import ACT_FORMAT, QT
from lumen.kernels import simd
from lumen.kernels.kinds import kinds
from lumen.kernels.layout import R
from lumen.kernels.matmul import mat, matmul_kernel, new_acts, prepare, prepare_x, unpack_scratch
from lumen.kernels.scratch import per_thread
from lumen.kernels.work import counters
from lumen.machine import aligned, limits
from lumen.model.store import resolve
from verdict import count, list_of, one_line_errors, verdict

RUN, ACC, QUADS = 64, 16, 64        # weight vectors per unrolled run, accumulators, distinct activation quads


def make_dot(reuse: int):
    """dot(out, w, x, n): n passes over w (u8, 64-byte vectors) of vpdpbusd into ACC accumulators. reuse = 0: the
    8 activation quads in registers; reuse = r: quad j // r of x (QUADS of them, so none stays in a register)
    broadcast from memory for vector j."""
    vt = kir.VI

    def codegen(context, builder, sig, args):
        out_v, w_v, x_v, n_v = args
        i64 = ir.IntType(64)
        wp = kir.ptr(context, builder, sig.args[1], w_v, kir.I8)
        xp = kir.ptr(context, builder, sig.args[2], x_v, kir.I8)
        nitems = context.make_array(sig.args[1])(context, builder, w_v).nitems
        runs = builder.udiv(nitems, ir.Constant(i64, 64 * RUN))

        def bcast(base, k):
            p = builder.bitcast(builder.gep(base, [ir.Constant(i64, 4 * k)]), kir.I32.as_pointer())
            return kir.splat(builder, builder.load(p, align=1), vt)

        xr = [bcast(xp, k) for k in range(8)]
        slots = [cgutils.alloca_once_value(builder, ir.Constant(vt, None)) for _ in range(ACC)]
        with cgutils.for_range(builder, n_v):
            with cgutils.for_range(builder, runs) as run:
                base = builder.gep(wp, [builder.mul(run.index, ir.Constant(i64, 64 * RUN))])
                xb = builder.gep(xp, [builder.mul(builder.urem(run.index, ir.Constant(i64, 4)),
                                                  ir.Constant(i64, 4 * QUADS))])
                acc = [builder.load(s) for s in slots]
                for j in range(RUN):
                    wj = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(i64, 64 * j)]),
                                                      vt.as_pointer()), align=1)
                    xv = bcast(xb, (j // reuse) % QUADS) if reuse else xr[j % 8]
                    acc[j % ACC] = simd._dpbusd(builder, acc[j % ACC], wj, xv)
                for s, a in zip(slots, acc):
                    builder.store(a, s)
        total = builder.load(slots[0])
        for s in slots[1:]:
            total = builder.add(total, builder.load(s))
        op = kir.ptr(context, builder, sig.args[0], out_v, kir.I32)
        builder.store(total, builder.bitcast(op, vt.as_pointer()), align=4)
        return context.get_dummy_value()

    def typer(typingctx, out, w, x, n):
        return types.void(out, w, x, types.intp), codegen

    typer.__name__ = f"dot_reuse_{reuse}"
    dot = intrinsic(typer)

    @njit
    def run(out, w, x, n):
        dot(out, w, x, n)
    return run


def best(fn, reps: int = 7) -> float:
    t = []
    for _ in range(reps):
        c = time.perf_counter()
        fn()
        t.append(time.perf_counter() - c)
    return min(t)


@njit(cache=True)
def _repeat(out, m, acts, facc, wbuf, work, k, kd):
    for _ in range(k):
        matmul_kernel((out, out, out), (m, m, m), 1, acts, facc, wbuf, work, kd)


def kernel_rates(g: GGUFFile, ns: list, quick: bool) -> list:
    """(type, shape, {N: GOP/s}) for the first layer's matrix of each type of the model g (one thread, in cache)."""
    seen, rows = set(), []
    mats = [t for name, t in g.tensors.items()
            if name.startswith("blk.") and len(t.shape) == 2 and not QT(t.qtype).name.startswith("F")]
    kd = kinds(mats=tuple({t.qtype for t in mats}), embd=(), acts=())      # compiled for these types only
    facc, work = per_thread((numba.get_num_threads(), R), np.float32), counters(numba.get_num_threads())
    for t in mats:
        if t.qtype in seen:
            continue
        seen.add(t.qtype)
        p = prepare(t.data, t.qtype)
        m, fmt = mat(p), ACT_FORMAT[QT(p.qtype)]
        rate = {}
        wbuf = unpack_scratch(numba.get_num_threads(), p.n_in)
        for N in ns:
            acts = new_acts(N, p.n_in, fmt)
            prepare_x(acts, np.random.default_rng(N).standard_normal((N, p.n_in)).astype(np.float32), fmt)
            out = np.zeros((N, p.d_out), np.float32)
            k = 2 if quick else max(3, 4000 // N)
            _repeat(out, m, acts, facc, wbuf, work, 1, kd)
            rate[N] = 2 * N * p.d_out * p.n_in * k / best(lambda: _repeat(out, m, acts, facc, wbuf, work, k, kd),
                                                            2 if quick else 7) / 1e9
        rows.append((QT(p.qtype).name, f"{p.d_out}x{p.n_in}", rate))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few passes (for tests)")
    ap.add_argument("--reuse", type=list_of(count), default="1,2,4")
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--ns", type=list_of(count), default="1,4,8,16,64")
    a = ap.parse_args(argv)
    with one_line_errors():                                  # part 2's model, before part 1 runs
        g = GGUFFile(resolve(a.model))
    numba.set_num_threads(1)
    roof = limits()["int8_dot_1t_gops"]
    w = aligned((16 << 10,), np.uint8)
    w[:] = np.arange(w.size) % 251
    x = (np.arange(4 * 4 * QUADS) % 7 - 3).astype(np.int8)
    out = np.zeros(16, np.int32)
    n = 200 if a.quick else 20000
    print(f"vpdpbusd alone, one thread, L1 (roof {roof:.0f} GOP/s, lumen.profile --machine):")
    rates = {}
    for reuse in [0] + a.reuse:
        f = make_dot(reuse)
        f(out, w, x, 1)
        rates[reuse] = 2 * w.size * n / best(lambda: f(out, w, x, n), 3 if a.quick else 7) / 1e9
        what = "quads in registers" if reuse == 0 else f"each quad broadcast from memory for {reuse} vector(s)"
        print(f"  {what:>48}: {rates[reuse]:6.0f} GOP/s ({100 * rates[reuse] / roof:3.0f}% of roof)")
    ns = [1, 8] if a.quick else a.ns
    print(f"\n{a.model}: tile kernels, one thread, one matrix in cache, GOP/s (share of roof) at N =",
          " / ".join(map(str, ns)))
    for qt, shape, rate in kernel_rates(g, ns, a.quick):
        print(f"  {qt:>5} {shape:>10}: " + " / ".join(f"{rate[N]:.0f} ({100 * rate[N] / roof:.0f}%)" for N in ns))
    r1 = min(rates, key=lambda r: (r != 1, r))
    costly = rates[r1] < 0.75 * rates[0]
    verdict(f"a broadcast from memory used once gives {rates[r1] / rates[0]:.2f}x the register rate"
            + "".join(f", used {r} times {rates[r] / rates[0]:.2f}x" for r in rates if r > 1)
            + (": a broadcast costs a port slot, so reuse each one" if costly else ": broadcasts are nearly free here"))


if __name__ == "__main__":
    main()
