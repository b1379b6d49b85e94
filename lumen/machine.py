"""This machine's limits, measured once with Numba kernels and cached: the ceilings of the roofline.

    from lumen.machine import limits
    limits()   # {'bw_1t_gbps', 'bw_gbps', 'fma_gflops', 'int8_dot_gops', 'threads', 'cpu', 'cores', ...}

- bw_1t_gbps / bw_gbps: memory read bandwidth, one thread / all threads: a vectorized f32 sum streaming a ~1 GB
  array (best of several passes).
- fma_1t_gflops / fma_gflops: f32 FMA throughput: 128 independent accumulators per thread (16 ymm registers,
  enough to cover the FMA latency on both pipes), 2 FLOP per multiply-add. The roof of every op but the matmuls.
- int8_dot_1t_gops / int8_dot_gops: the matmuls' roof. u8 x i8 dot products into int32 lanes with the building
  block of the matmul tile kernels (lumen.kernels.simd._dpbusd: vpdpbusd with AVX512-VNNI, 4 multiply-adds per
  int32 lane), 16 independent accumulators, weights loaded from a 16 KB block in L1 as the tiles load them,
  activations broadcast in registers; 2 ops per multiply-add, the unit the profiler counts matmul work in.
  Measured on 256-bit and on 512-bit vectors (int8_dot_widths); the roof is the faster (int8_dot_isa names it),
  whichever width the tiles use. The block starts on a cache line: a load across two lines costs two (here 378
  -> 299 GOP/s for 256-bit loads at offset 16, 667 -> 318 for 512-bit ones). Without AVX512-VNNI (or with
  LUMEN_NO_VNNI=1) the same block compiles to the portable vector IR the tiles then run, and that is measured.
  The tiles also spend instructions on unpacking, zero points and the float epilogue, so a matmul reaches a part
  of this, never more.
- load_avg: the 1-minute load average when the measurement began (None where unknown): other work on the cores
  lowers every figure, and `python -m lumen.profile --machine` says so when it was busy.
- l1d_bytes / l2_bytes / l3_bytes: the data cache sizes of one core (sysfs; 0 when unknown). An op whose bytes
  per call fit in a cache can read faster than bw_gbps, which streams from memory.

These are what Numba code reaches here, not the vendor's peak. The result is cached as JSON in
`$LUMEN_HOME/machine.json` and is reused only on the same CPU (machine_key(): the CPU key of lumen.cpu, which
holds the family and model numbers, the CPU count and the ISA flags, and the vendor and stepping; a model name
such as "AMD EPYC" is shown for a Zen 4 and a Zen 5 guest alike), and only when written by this VERSION of the
kernels, on as many threads as this process can compute on. A cache without that key (written before it
existed) is measured again.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu import cpu_info, cpu_key, cpu_model, read_cpuinfo, usable_cpus
from .errors import LumenError
from .kernels import ir as kir
from .kernels import simd
from .model.store import lumen_home
from .paths import _flock

VERSION = 4  # bump when a kernel below changes what it measures (2: int8 dot; 3: aligned; 4: 256 and 512 bits)
FMA_W = 128  # accumulators per thread (f32)
DOT_WIDTHS = (256, 512)  # vector bits of the int8 dot: the tiles use one, the roof is the faster
DOT_ACC = 16  # independent int32 vector accumulators (covers vpdpbusd's latency on two pipes)
DOT_RUN = 32  # weight vectors per unrolled run (1 KB at 256 bits, 2 KB at 512)
DOT_BYTES = 16 << 10  # weight bytes the int8 dot cycles over (L1 on any AVX512 core)


# ---- kernels ----
@njit(fastmath=True, cache=True, nogil=True, no_cfunc_wrapper=True)
def sum_kernel(a):
    """sum of a (n,) f32: a streaming read (fastmath lets LLVM split the sum over vector accumulators)."""
    s = np.float32(0)
    for i in range(a.size):
        s += a[i]
    return s


@njit(fastmath=True, cache=True, nogil=True, no_cfunc_wrapper=True)
def fma_kernel(n, m, c):
    """n rounds of acc = acc * m + c over FMA_W independent f32 accumulators; returns their sum."""
    acc = np.zeros(FMA_W, np.float32)
    for j in range(FMA_W):
        acc[j] = j * np.float32(1e-3)
    for _ in range(n):
        for j in range(FMA_W):
            acc[j] = acc[j] * m + c
    return acc.sum()


def _make_int8_dot(bits: int):
    """The intrinsic dot(out, w, x, n): out[:bits / 32] (i32) = per lane, over n passes of w (u8, a multiple of
    DOT_RUN vectors) read as bits-wide vectors, the u8 x i8 dot of each vector's 4 bytes per lane with one 4-byte
    quad of x (32,) i8 broadcast (quad j % 8 for vector j), into DOT_ACC accumulators in turn (simd._dpbusd)."""
    lanes, vbytes = bits // 32, bits // 8
    vt = ir.VectorType(kir.I32, lanes)

    def codegen(context, builder, sig, args):
        out_v, w_v, x_v, n_v = args
        ta = sig.args
        i64 = ir.IntType(64)
        wp = kir.ptr(context, builder, ta[1], w_v, kir.I8)
        xp = kir.ptr(context, builder, ta[2], x_v, kir.I8)
        nitems = context.make_array(ta[1])(context, builder, w_v).nitems
        runs = builder.udiv(nitems, ir.Constant(i64, vbytes * DOT_RUN))
        xb = []
        for k in range(8):
            q = builder.load(builder.bitcast(builder.gep(xp, [ir.Constant(i64, 4 * k)]), kir.I32.as_pointer()),
                             align=1)
            v = builder.insert_element(ir.Constant(vt, ir.Undefined), q, ir.Constant(kir.I32, 0))
            xb.append(builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(vt, [0] * lanes)))
        slots = [cgutils.alloca_once_value(builder, ir.Constant(vt, None)) for _ in range(DOT_ACC)]
        with cgutils.for_range(builder, n_v):
            with cgutils.for_range(builder, runs) as run:
                base = builder.gep(wp, [builder.mul(run.index, ir.Constant(i64, vbytes * DOT_RUN))])
                acc = [builder.load(s) for s in slots]
                for j in range(DOT_RUN):
                    wj = builder.load(builder.bitcast(builder.gep(base, [ir.Constant(i64, vbytes * j)]),
                                                      vt.as_pointer()), align=1)
                    acc[j % DOT_ACC] = simd._dpbusd(builder, acc[j % DOT_ACC], wj, xb[j % 8])
                for s, a in zip(slots, acc):
                    builder.store(a, s)
        total = builder.load(slots[0])
        for s in slots[1:]:
            total = builder.add(total, builder.load(s))
        op = kir.ptr(context, builder, ta[0], out_v, kir.I32)
        builder.store(total, builder.bitcast(op, vt.as_pointer()), align=4)
        return context.get_dummy_value()

    def typer(typingctx, out, w, x, n):
        return types.void(out, w, x, types.intp), codegen

    typer.__name__ = f"int8_dot_{bits}"
    return intrinsic(typer)


_dot256, _dot512 = _make_int8_dot(256), _make_int8_dot(512)


@njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def int8_dot_256(out, w, x, n):
    """n passes of int8 dots over w (k,) u8 (k a multiple of 1 KB; L1-resident, 64-byte aligned) and x (32,) i8
    in 256-bit vectors, summed per lane into out[:8] i32: 2 k n ops."""
    _dot256(out, w, x, n)


@njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def int8_dot_512(out, w, x, n):
    """As int8_dot_256 in 512-bit vectors (k a multiple of 2 KB), into out[:16]."""
    _dot512(out, w, x, n)


INT8_DOT = {256: int8_dot_256, 512: int8_dot_512}


def int8_isa(bits: int) -> str:
    return (f"vpdpbusd, {bits}-bit (AVX512-VNNI)" if simd.VNNI
            else f"portable vector IR, {bits}-bit (no AVX512-VNNI: the tile kernels run this too)")


# ---- measuring ----
def machine_key(cpuinfo: dict | None = None) -> str:
    """The CPU the limits hold for: lumen.cpu's key (model name, family and model, CPU count, ISA flags), then the
    vendor and stepping where /proc/cpuinfo (or `cpuinfo`, its fields) gives them. Elsewhere the key has what the
    platform module gives (on Windows its processor string names family, model and stepping)."""
    info = read_cpuinfo() if cpuinfo is None else cpuinfo
    extra = " ".join(f"{name} {info[field]}" for field, name in (("vendor_id", "vendor"), ("stepping", "stepping"))
                     if info.get(field))
    return cpu_key(cpu_info(info)) + (f" | {extra}" if extra else "")


def _best(fn, reps: int) -> float:
    """Shortest wall time of `reps` calls."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def split(a: np.ndarray, n: int) -> list:
    """a cut into n contiguous parts (the last may be shorter): one per thread of a parallel read."""
    step = (a.size + n - 1) // n
    return [a[i * step:(i + 1) * step] for i in range(n)]


def on_threads(calls: list) -> None:
    """Run the zero-argument callables at once, one Python thread each (the kernels release the GIL), so each
    thread runs exactly the single-thread kernel's code."""
    ts = [threading.Thread(target=f) for f in calls]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def aligned(shape: tuple, dtype, align: int = 64) -> np.ndarray:
    """A zeroed array whose data starts on an `align`-byte boundary (a cache line)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.zeros(n + align, np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + n].view(dtype).reshape(shape)


def cache_sizes() -> dict:
    """Data cache bytes of one core per level, from sysfs: {'l1d_bytes', 'l2_bytes', 'l3_bytes'} (0: unknown)."""
    out = {"l1d_bytes": 0, "l2_bytes": 0, "l3_bytes": 0}
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = int((d / "level").read_text()), (d / "type").read_text().strip()
            size = (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or level not in (1, 2, 3):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        try:
            out[f"l{level}{'d' if level == 1 else ''}_bytes"] = int(size.rstrip("KMG")) * unit
        except ValueError:
            pass
    return out


def measure(bw_bytes: int = 1 << 30, reps: int = 5, fma_rounds: int = 4_000_000, dot_rounds: int = 500_000,
            threads: int | None = None) -> dict:
    """Measure the limits now: about 10 s at the default sizes (a quiet machine); smaller sizes for tests. The
    all-thread figures run on `threads`, by default the CPUs this process can compute on (lumen.cpu.usable_cpus:
    under taskset -c 0 two threads on one CPU measured a share of it, cached as the machine's)."""
    threads = threads or usable_cpus()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None   # 1-minute average, before measuring
    out = {"cpu": cpu_model(), "cpu_key": machine_key(), "cores": os.cpu_count(), "threads": threads,
           "version": VERSION, **cache_sizes()}
    a = np.ones(max(bw_bytes // 4, 1024 * threads), np.float32)  # (n,) f32; allocating faults the pages in
    parts = split(a, threads)
    m, c = np.float32(0.999), np.float32(1e-3)
    w = aligned((threads, DOT_BYTES), np.uint8)                                              # (threads, 16 KB)
    w[:] = (np.arange(threads * DOT_BYTES) % 251).reshape(threads, DOT_BYTES)
    x = (np.arange(32) % 7 - 3).astype(np.int8)                                             # (32,) i8
    acc = aligned((threads, 32), np.int32)  # (threads, 32): a row of two cache lines per thread, 8 or 16 written
    sum_kernel(a[:1024]), fma_kernel(1, m, c)                               # compile (or load) outside the timing
    for kern in INT8_DOT.values():
        kern(acc[0], w[0], x, 1)

    out["bw_1t_gbps"] = a.nbytes / _best(lambda: sum_kernel(a), reps) / 1e9
    out["bw_gbps"] = a.nbytes / _best(lambda: on_threads([lambda p=p: sum_kernel(p) for p in parts]), reps) / 1e9
    a = parts = None                          # (the bandwidth arrays: freed before the FMA runs)
    flops = 2 * FMA_W * fma_rounds
    out["fma_1t_gflops"] = flops / _best(lambda: fma_kernel(fma_rounds, m, c), reps) / 1e9
    out["fma_gflops"] = flops * threads / _best(
        lambda: on_threads([lambda: fma_kernel(fma_rounds, m, c)] * threads), reps) / 1e9
    ops = 2 * DOT_BYTES * dot_rounds
    widths = {}
    for bits, kern in INT8_DOT.items():
        one = ops / _best(lambda: kern(acc[0], w[0], x, dot_rounds), reps) / 1e9
        every = ops * threads / _best(
            lambda: on_threads([lambda t=t: kern(acc[t], w[t], x, dot_rounds) for t in range(threads)]), reps) / 1e9
        widths[str(bits)] = {"1t_gops": one, "gops": every}
    best = max(widths, key=lambda b: widths[b]["1t_gops"])
    out["int8_dot_1t_gops"], out["int8_dot_gops"] = widths[best]["1t_gops"], widths[best]["gops"]
    out["int8_dot_isa"] = int8_isa(int(best))
    out["int8_dot_widths"] = widths
    out["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    out["load_avg"] = load                   # other work on the cores, which the figures then share
    return out


def cache_path() -> Path:
    return lumen_home() / "machine.json"


KEYS = ("bw_1t_gbps", "bw_gbps", "fma_1t_gflops", "fma_gflops", "int8_dot_1t_gops", "int8_dot_gops", "int8_dot_isa",
        "int8_dot_widths", "threads", "cpu", "cores", "measured_at")  # what the readers of the limits use


def _rate(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


def _stale(d) -> str | None:
    """Why a cache read back cannot be used here (None: it can)."""
    if isinstance(d, dict) and d.get("version") != VERSION:
        return "was measured by an older version of these kernels"
    if (not isinstance(d, dict) or not all(k in d for k in KEYS)
            or not all(_rate(d[k]) for k in KEYS if k.endswith(("_gbps", "_gops", "_gflops", "threads", "cores")))
            or not isinstance(d["int8_dot_widths"], dict)
            or not all(isinstance(r, dict) and _rate(r.get("1t_gops")) and _rate(r.get("gops"))
                       for r in d["int8_dot_widths"].values())):
        return "is unreadable"
    if str(d["int8_dot_isa"]).startswith("portable" if simd.VNNI else "vpdpbusd"):   # int8_isa() of the other
        return (f"was measured for {'the portable' if simd.VNNI else 'the AVX512-VNNI'} int8 dot, not the one this "
                f"build's tiles run (LUMEN_NO_VNNI)")
    if "cpu_key" not in d:
        return "does not name the CPU's family and model (written by an older Lumen)"
    if d["cpu_key"] != machine_key() or d.get("cores") != os.cpu_count():
        return f"was measured on another CPU ({d['cpu_key']}; this one is {machine_key()})"
    if d["threads"] != usable_cpus():
        return (f"was measured on {d['threads']} threads, and this process can compute on {usable_cpus()} CPUs "
                f"(its affinity or CPU quota)")
    return None


def _read(path: Path) -> tuple[dict | None, str]:
    """(the cached limits, "") if the cache at path holds for this machine, else (None, why not)."""
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "is missing"
    except (OSError, ValueError):                   # (UnicodeDecodeError is a ValueError)
        return None, "is unreadable"
    why = _stale(d)
    return (d, "") if why is None else (None, why)


def limits(measure_if_missing: bool = True, remeasure: bool = False) -> dict:
    """The cached limits of this machine; measured (and cached) when the cache is missing, stale or corrupt.
    Processes measure one at a time (an flock in $LUMEN_HOME): two at once on the same cores would each record
    a share of the machine, and one that waited reads what the other measured instead of measuring again."""
    path = cache_path()
    if not remeasure:
        d, why = _read(path)
        if d is not None:
            return d
        if not measure_if_missing:
            raise LumenError(f"the machine limits cache {path} {why}; run `python -m lumen.profile --machine`")
        print(f"note: the machine limits cache {path} {why}; measuring this machine (about 10 s)...",
              file=sys.stderr, flush=True)
    with _flock(str(path.parent), shared=False, name="machine.lock"):
        if not remeasure:
            d, _ = _read(path)
            if d is not None:                       # measured by another process while this one waited
                return d
        d = measure()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")    # whole or not at all: a reader at the same
        try:                                                        # time, or a kill mid-write, never sees half
            tmp.write_text(json.dumps(d, indent=1))
            os.replace(tmp, path)
        except OSError as e:
            print(f"warning: could not cache the machine limits in {path}: {e.strerror}", file=sys.stderr)
        finally:
            tmp.unlink(missing_ok=True)
    return d
