"""llama-bench-style throughput of one model: prompt processing (pp) and token generation (tg), in tokens/s.

    python -m lumen.bench [single] --model smollm2-135m -p 512 -n 128 -r 5 [--threads T] [--json F]
        [--compare llama.cpp] [--llama-bench PATH [--llama-args "--repack 0"]] [--corunner sleep,busy]

Tests (each repeated r times, mean ± stdev of the per-repetition t/s, warm-up excluded):
    pp{p}   one batched prefill of p tokens into a fresh cache (n_batch = p, so it is a single forward call)
    tg{n}   n single-token decodes after a 1-token prompt (fresh cache), timed together
    pp32, tg32  always added (the sizes the original Lumen measurements used); `--small 0` leaves them out,
                `--small K` uses K instead of 32
Token ids are fixed pseudo-random ids of the vocabulary (seed 0), the same for every engine, as llama-bench does.
For tg it also reports the achieved weight bandwidth as the field defines it, GB/s = the GGUF's tensor bytes x
tok/s, the same bytes for every engine (so a smaller packed layout cannot lower it), and its share of the machine's
memory read bandwidth (lumen.machine, at the run's thread count), and the peak RSS of the process. The bytes
Lumen's packed weights hold are printed beside the GGUF's.

Comparison, interleaved repetition by repetition (Lumen rep 1, llama.cpp rep 1, Lumen rep 2, ...), so both see
the same machine load; every figure gets the ratio Lumen/llama.cpp (of the means, and the median of the
per-repetition ratios):
- `--llama-bench PATH` (or $LLAMA_BENCH with --compare llama.cpp): llama.cpp's native `llama-bench`, one process
  per repetition and test (`-r 1`, its own warm-up run, same thread count, its default batch sizes), the
  strongest llama.cpp figure (no Python per token), with its defaults (weight repacking on). Build it from the
  llama-cpp-python 0.3.36 sdist with the vector extensions the CPU reports and AMX off: on guests whose OS does
  not grant the AMX tiles, a build with them dies with an illegal instruction in the repacking. `--llama-args`
  passes extra flags.
- `--compare llama.cpp` without the binary: llama-cpp-python on the same GGUF in this process (CPU only, flash
  attention off, n_batch = n_ubatch = 512, weight repacking off: see tests/data/make_gemma3_longctx.py). The
  Lumen peak RSS is taken before llama.cpp loads.
Beside co-runners (a user's machine is never idle): `--corunner sleep,busy` runs every repetition idle and
beside each co-runner in turn (lumen.bench.corunner: a process that sleeps 1 ms in a loop; one that spins a Python
loop), and prints each engine's figures beside each, with their ratio to the same engine's idle figure in the
same repetition. Lumen runs with its thread governor (lumen.engine.threads) unless --fixed-threads.
When comparing, the machine's read bandwidth is measured in the same session (lumen.machine.measure, once per
repetition, median), so the share of bandwidth and the engines see the same machine.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .corunner import corunner, parse_kinds, ratio_rows, render_ratios
from .tools import ToolNotFound, find_tool, refuse, split_args
from ..commands import Parser, check_writable, prog, trained_context_only
from ..engine.config import THREAD_FLAGS, EngineConfig

SMALL = 32          # the extra pp/tg size (what the original Lumen measurements used)
LLAMA_BATCH = 512   # llama.cpp's n_batch = n_ubatch (llama-bench's default)
COMPARE_HINT = "pip install llama-cpp-python to compare"


@dataclass(frozen=True)
class Test:
    kind: str   # "pp" or "tg"
    size: int

    @property
    def name(self) -> str:
        return f"{self.kind}{self.size}"


def make_tests(p: int, n: int, small: int) -> list[Test]:
    """pp{p}, tg{n}, then pp{small}, tg{small} unless small is 0 or already listed."""
    tests = [Test("pp", p), Test("tg", n)]
    if small:
        tests += [t for t in (Test("pp", small), Test("tg", small)) if t not in tests]
    return tests


def token_ids(end: int, count: int, seed: int = 0) -> np.ndarray:
    """count fixed pseudo-random token ids (count,) i64 below end, avoiding the first 4 ids (usually control
    tokens). end: lumen.engine.admission.prompt_id_end, not the embedding's rows (the engine refuses a padding
    row's id)."""
    return np.random.default_rng(seed).integers(4, end, size=count, dtype=np.int64)


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MB (Linux reports ru_maxrss in KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- engines: time one pp or tg run

class LumenEngine:
    name = "Lumen"

    def __init__(self, path, threads: int | None, ctx: int, n_batch: int, adaptive_threads: bool = True):
        from ..llm import Model
        self.model = Model(path, ctx=ctx, threads=threads, n_batch=n_batch, adaptive_threads=adaptive_threads)
        self.threads = self.model.threads
        self.n_vocab = self.model.config.n_vocab
        self.weight_bytes = gguf_tensor_bytes(path)
        self.pack_bytes = self.model.weights.decode_bytes

    def warmup(self, ids: np.ndarray) -> float:
        t = time.perf_counter()
        self.model.warmup()
        self.pp(ids[:min(8, ids.size)])
        self.tg(int(ids[0]), 2)
        return time.perf_counter() - t

    def pp(self, ids: np.ndarray) -> float:
        """Seconds of one prefill of ids into a fresh cache."""
        self.model.reset()
        t = time.perf_counter()
        self.model.prefill(ids)
        return time.perf_counter() - t

    def tg(self, tok: int, n: int) -> float:
        """Seconds of n single-token decodes after a 1-token prompt (the prompt is not timed)."""
        m = self.model
        m.reset()
        m.prefill([tok])
        t = time.perf_counter()
        for _ in range(n):
            m.decode(tok)
        return time.perf_counter() - t


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, path, threads: int, ctx: int):
        import llama_cpp.llama_cpp as lc  # ImportError: the caller prints COMPARE_HINT
        from llama_cpp import Llama

        default_params = lc.llama_model_default_params

        def params_without_extra_bufts():
            p = default_params()
            p.use_extra_bufts = False  # repacked/AMX weight buffers segfault on decode on this machine
            return p

        lc.llama_model_default_params = params_without_extra_bufts  # Llama() has no argument for this field
        try:
            self.llm = Llama(str(path), n_gpu_layers=0, n_ctx=ctx, n_batch=LLAMA_BATCH, n_ubatch=LLAMA_BATCH,
                             n_threads=threads, n_threads_batch=threads, flash_attn=False, verbose=False)
        finally:
            lc.llama_model_default_params = default_params
        self.threads = threads
        self.n_vocab = self.llm.n_vocab()
        self.weight_bytes = gguf_tensor_bytes(path)

    def warmup(self, ids: np.ndarray) -> float:
        t = time.perf_counter()
        self.pp(ids[:min(8, ids.size)])
        self.tg(int(ids[0]), 2)
        return time.perf_counter() - t

    def pp(self, ids: np.ndarray) -> float:
        self.llm.reset()  # n_tokens = 0; eval drops the cache past it
        t = time.perf_counter()
        self.llm.eval([int(i) for i in ids])
        return time.perf_counter() - t

    def tg(self, tok: int, n: int) -> float:
        llm = self.llm
        llm.reset()
        llm.eval([tok])
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
        return time.perf_counter() - t


class LlamaBenchEngine:
    """llama.cpp's native llama-bench: one process per timed run (`-r 1`; it warms up itself first)."""
    name = "llama-bench"

    def __init__(self, binary: str, path, threads: int, extra: list[str], n_vocab: int):
        self.binary, self.path, self.threads, self.extra = binary, str(path), threads, list(extra)
        self.n_vocab = n_vocab
        self.weight_bytes = gguf_tensor_bytes(path)

    def _run(self, p: int, n: int) -> float:
        """Seconds of one llama-bench test (pp p or tg n), from its JSON avg_ns."""
        cmd = [self.binary, "-m", self.path, "-t", str(self.threads), "-r", "1", "-p", str(p), "-n", str(n),
               "-o", "json", *self.extra]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        try:
            rows = json.loads(r.stdout)
            return float(rows[0]["avg_ns"]) / 1e9
        except (ValueError, IndexError, KeyError, TypeError):
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"llama-bench failed (exit {r.returncode}): {' | '.join(tail) or 'it printed nothing'}") from None

    def warmup(self, ids: np.ndarray) -> float:
        t = time.perf_counter()
        self._run(8, 0)
        return time.perf_counter() - t

    def pp(self, ids: np.ndarray) -> float:
        return self._run(ids.size, 0)

    def tg(self, tok: int, n: int) -> float:
        return self._run(0, n)


def find_llama_bench(path: str | None) -> str | None:
    """The llama-bench binary: path, else $LLAMA_BENCH (either looked up on PATH when a bare name), else
    `llama-bench` on PATH; None if there is none. A wrong given path raises ToolNotFound."""
    return find_tool("llama-bench", "--llama-bench", path, "LLAMA_BENCH")


def gguf_tensor_bytes(path) -> int:
    """Bytes of every tensor in the GGUF file: what a decode step reads by the field's definition."""
    from ..format.gguf import GGUFFile
    return sum(t.data.nbytes for t in GGUFFile(path).tensors.values())


def session_bandwidth(threads: int) -> dict:
    """The machine's memory read bandwidth now (lumen.machine.measure: a vectorized sum over 1 GB, best of 3),
    at `threads` threads and at 1: {'bw_gbps', 'bw_1t_gbps'} (the compute peaks are not measured)."""
    from ..machine import measure
    d = measure(reps=3, fma_rounds=1, dot_rounds=1, threads=threads)
    return {"bw_gbps": d["bw_gbps"], "bw_1t_gbps": d["bw_1t_gbps"]}


def load_llama_cpp(path, threads: int, ctx: int, err=None):
    """A LlamaCppEngine, or None (with a message on err) when llama_cpp cannot be imported."""
    try:
        importlib.import_module("llama_cpp")
    except ImportError as e:
        print(f"llama_cpp is not importable ({e}): {COMPARE_HINT}. Running Lumen only.", file=err or sys.stderr)
        return None
    return LlamaCppEngine(path, threads, ctx)


# ---------------------------------------------------------------- running and summarising

@dataclass
class Figure:
    """One reported quantity of one engine: per-repetition values."""
    test: str
    unit: str
    values: dict = field(default_factory=dict)  # engine name -> [value per repetition]


def mean_std(v: list) -> tuple[float, float]:
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


def run(engines: list, tests: list[Test], reps: int, ids: np.ndarray, on_rep=None, each_rep=None) -> list[Figure]:
    """Time every test `reps` times on every engine, interleaved: rep r of test t runs on each engine in turn.
    each_rep(r), if given, runs at the start of every repetition (the session's bandwidth measurement). Returns
    the t/s figures, and a GB/s figure (the engine's weight_bytes x t/s) after each tg test."""
    figs = {t.name: Figure(t.name, "t/s", {e.name: [] for e in engines}) for t in tests}
    for r in range(reps):
        if each_rep is not None:
            each_rep(r)
        for t in tests:
            for e in engines:
                s = e.pp(ids[:t.size]) if t.kind == "pp" else e.tg(int(ids[0]), t.size)
                figs[t.name].values[e.name].append(t.size / s)
            if on_rep is not None:
                on_rep(r, t)
    out = []
    for t in tests:
        out.append(figs[t.name])
        if t.kind == "tg":
            out.append(Figure(t.name, "GB/s", {e.name: [v * e.weight_bytes / 1e9 for v in figs[t.name].values[e.name]]
                                               for e in engines}))
    return out


def run_beside(engines: list, tests: list[Test], reps: int, ids: np.ndarray, kinds: list[str], each_rep=None):
    """`run` once per repetition idle and once beside each co-runner (lumen.bench.corunner), interleaved:
    (the idle figures, {kind: {(test, engine): per-repetition t/s}} with kind "none" the idle ones)."""
    idle: list[Figure] = []
    values: dict = {k: {} for k in ["none", *kinds]}
    for r in range(reps):
        for kind in ["none", *kinds]:
            with corunner(kind, seconds=3600):
                figs = run(engines, tests, 1, ids, each_rep=(lambda _, r=r: each_rep(r)) if each_rep and kind == "none"
                           else None)
            for f in figs:
                if f.unit == "t/s":
                    for name, v in f.values.items():
                        values[kind].setdefault((f.test, name), []).extend(v)
            if kind == "none":
                if not idle:
                    idle = figs
                else:
                    for old, new in zip(idle, figs):
                        for name in old.values:
                            old.values[name].extend(new.values[name])
    return idle, values


def summarise(figs: list[Figure], engines: list) -> list[dict]:
    rows = []
    for f in figs:
        row = {"test": f.test, "unit": f.unit}
        for name, v in f.values.items():
            m, s = mean_std(v)
            row[name] = {"values": v, "mean": m, "std": s, "median": statistics.median(v)}
        if len(engines) == 2:
            a, b = (f.values[e.name] for e in engines)
            row["ratio"] = row[engines[0].name]["mean"] / row[engines[1].name]["mean"]
            row["ratio_median_paired"] = statistics.median(x / y for x, y in zip(a, b))
        rows.append(row)
    return rows


def machine_limits() -> dict | None:
    """lumen.machine.limits() if that module exists and works, else None."""
    try:
        from ..machine import limits
        return limits(measure_if_missing=True)
    except Exception:  # noqa: BLE001 - optional: any failure means "no limits to compare against"
        return None


def render(rows: list[dict], engines: list, info: dict, console) -> None:
    from rich.table import Table
    names = [e.name for e in engines]
    title = (f"{info['model']}  |  {info['threads']} threads  |  {info['reps']} reps  |  "
             f"warm-up excluded ({', '.join(f'{k} {v:.1f} s' for k, v in info['warmup_s'].items())})")
    table = Table(title=title)
    table.add_column("test")
    table.add_column("unit")
    for n in names:
        table.add_column(f"{n}", justify="right", no_wrap=True)
    if len(names) == 2:
        table.add_column("ratio", justify="right")
        table.add_column("paired", justify="right")
    bw = info.get("bw_gbps")
    if bw:
        table.add_column("% bw", justify="right", no_wrap=True)
    for r in rows:
        cells = [r["test"], r["unit"]] + [f"{r[n]['mean']:.2f} ± {r[n]['std']:.2f}" for n in names]
        if len(names) == 2:
            cells += [f"{r['ratio']:.3f}", f"{r['ratio_median_paired']:.3f}"]
        if bw:
            cells.append(" | ".join(f"{100 * r[n]['mean'] / bw:.0f}%" for n in names) if r["unit"] == "GB/s" else "")
        table.add_row(*cells)
    console.print(table)
    console.print("figures are mean ± stdev over repetitions"
                  + (f"; ratio = {names[0]}/{names[1]} of the means, paired = median of the per-repetition ratios"
                     if len(names) == 2 else "")
                  + ("; GB/s = the GGUF's tensor bytes x tok/s; % bw = that / the machine's read bandwidth"
                     + (" (" + " | ".join(names) + ")" if len(names) > 1 else "") if bw else
                     "; GB/s = the GGUF's tensor bytes x tok/s"), markup=False)
    console.print(f"bytes per decode step: GGUF tensors {info['gguf_bytes'] / 1e6:.1f} MB; Lumen's packed weights "
                  f"{info['pack_bytes'] / 1e6:.1f} MB ({info['pack_bytes'] / info['gguf_bytes']:.3f}x)", markup=False)
    if bw:
        how = (f"measured in this session, median of {info['bw_samples']}" if info.get("bw_samples")
               else "lumen.machine's cached measurement")
        console.print(f"machine read bandwidth: {bw:.1f} GB/s at {info['threads']} threads, "
                      f"{info.get('bw_1t_gbps') or float('nan'):.1f} GB/s one thread ({how})", markup=False)
    else:
        console.print("machine limits unavailable", markup=False)
    console.print(f"peak RSS: Lumen {info['rss_lumen_mb']:.0f} MB (before llama.cpp loads); "
                  f"process {info['rss_peak_mb']:.0f} MB; load average {info['load_avg']}", markup=False)


# ---------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    ap = Parser(prog=prog("bench [single]"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m", help="registry name or .gguf path")
    ap.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens of the pp test (default 512)")
    ap.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens of the tg test (default 128)")
    ap.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions of each test (default 5)")
    ap.add_argument("--small", type=int, default=SMALL,
                    help=f"also run pp/tg of this size (default {SMALL}; 0 = off)")
    ap.add_argument("--json", metavar="FILE", help="write every figure, per repetition, to FILE")
    ap.add_argument("--compare", choices=["llama.cpp"],
                    help="also run llama.cpp, interleaved: llama-bench when given (--llama-bench or $LLAMA_BENCH), "
                         "else llama-cpp-python")
    ap.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench binary (implies --compare)")
    ap.add_argument("--llama-args", default="", metavar="ARGS",
                    help='extra llama-bench flags, e.g. "--repack 0" (Xeons without OS-granted AMX tiles)')
    ap.add_argument("--corunner", metavar="KINDS", default=None,
                    help="also measure beside co-runners (sleep, busy; comma-separated), every repetition "
                         "interleaved with the idle one, and print each engine's ratio to its own idle figure")
    EngineConfig.add_cli_args(ap, only=THREAD_FLAGS)
    return ap


def validate(ap: argparse.ArgumentParser, args) -> None:
    """Exit with argparse's usage error (status 2, no traceback) on an impossible setting."""
    import numba
    for flag, v in (("-p", args.n_prompt), ("-n", args.n_gen), ("-r", args.repetitions)):
        if v < 1:
            ap.error(f"{flag} must be at least 1, got {v}")
    if args.small < 0:
        ap.error(f"--small must be 0 (off) or a positive size, got {args.small}")
    from ..llm import MAX_CTX                         # (the run loads the model next: no import to spare)
    for flag, v, hi in (("-p", args.n_prompt, MAX_CTX), ("-n", args.n_gen, MAX_CTX - 1),
                        ("--small", args.small, MAX_CTX - 1)):
        if v > hi:                                    # (said as the context the load refused: "ctx must be ...")
            ap.error(f"{flag} must be at most {hi} (the longest context Lumen holds), got {v}")
    max_t = numba.config.NUMBA_NUM_THREADS
    if args.threads is not None and not 1 <= args.threads <= max_t:
        ap.error(f"--threads must be between 1 and {max_t} (the cores Numba can use), got {args.threads}")
    try:
        args.corunners = parse_kinds(args.corunner)
    except ValueError as e:
        ap.error(str(e))
    if args.json and (why := check_writable(args.json, "the JSON")):      # before the run, not after it
        ap.error(why)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    llama_args = split_args(ap, "--llama-args", args.llama_args)
    validate(ap, args)
    binary = None
    if args.llama_bench or (args.compare and os.environ.get("LLAMA_BENCH")):
        try:
            binary = find_llama_bench(args.llama_bench)
        except ToolNotFound as e:
            refuse(ap, str(e))
    from rich.console import Console

    from ..errors import LumenError
    from ..model.store import resolve
    console = Console()
    tests = make_tests(args.n_prompt, args.n_gen, args.small)
    max_pp = max(t.size for t in tests if t.kind == "pp")
    ctx = max(max_pp, max(t.size for t in tests if t.kind == "tg") + 1, 3)    # (3: the warm-up's 1 + 2 decodes)
    try:
        path = resolve(args.model)
        biggest = "--small" if args.small > max(args.n_prompt, args.n_gen) else "-p or -n"    # what set ctx
        with trained_context_only(f"use a smaller {biggest}"):
            lumen = LumenEngine(path, args.threads, ctx, max_pp, adaptive_threads=args.adaptive_threads)
    except (LumenError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from ..engine.admission import prompt_id_end
    ids = token_ids(prompt_id_end(lumen.model.tokenizer, lumen.n_vocab), max_pp)
    engines = [lumen]
    try:
        warm = {lumen.name: lumen.warmup(ids)}
    except (LumenError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rss_lumen = peak_rss_mb()
    try:
        if binary:
            other = LlamaBenchEngine(binary, path, lumen.threads, llama_args, lumen.n_vocab)
        elif args.compare == "llama.cpp":
            other = load_llama_cpp(path, lumen.threads, ctx + 64)
        else:
            other = None
        if other is not None:
            if other.n_vocab != lumen.n_vocab:
                print(f"error: llama.cpp sees {other.n_vocab} vocabulary entries, Lumen {lumen.n_vocab}",
                      file=sys.stderr)
                return 1
            warm[other.name] = other.warmup(ids)
            engines.append(other)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    bw_samples: list[dict] = []
    if len(engines) > 1:
        def each_rep(r):
            bw_samples.append(session_bandwidth(lumen.threads))
        lim = None
    else:
        each_rep = None
        lim = machine_limits()
        if lim is None:
            print("machine limits unavailable", file=sys.stderr)

    def progress(r, t):
        print(f"\rrep {r + 1}/{args.repetitions} {t.name} done   ", end="", file=sys.stderr, flush=True)

    beside: dict = {}
    try:
        if args.corunners:
            figs, beside = run_beside(engines, tests, args.repetitions, ids, args.corunners, each_rep)
        else:
            figs = run(engines, tests, args.repetitions, ids, on_rep=progress if sys.stderr.isatty() else None,
                       each_rep=each_rep)
    except (LumenError, RuntimeError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    if sys.stderr.isatty():
        print(file=sys.stderr)
    if bw_samples:
        lim = {k: statistics.median(b[k] for b in bw_samples) for k in ("bw_gbps", "bw_1t_gbps")}
    rows = summarise(figs, engines)
    info = {"model": str(args.model), "path": str(path), "threads": lumen.threads, "reps": args.repetitions,
            "tests": [t.name for t in tests], "engines": [e.name for e in engines],
            "weight_bytes": {e.name: e.weight_bytes for e in engines}, "gguf_bytes": lumen.weight_bytes,
            "pack_bytes": lumen.pack_bytes, "warmup_s": warm, "bw_gbps": (lim or {}).get("bw_gbps"),
            "bw_1t_gbps": (lim or {}).get("bw_1t_gbps"), "bw_samples": len(bw_samples),
            "bw_session": bw_samples, "llama_args": args.llama_args if binary else None,
            "load_avg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "rss_lumen_mb": rss_lumen, "rss_peak_mb": peak_rss_mb()}
    render(rows, engines, info, console)
    ratios = ratio_rows(beside, args.corunners) if beside else []
    if ratios:
        render_ratios(ratios, console, f"beside co-runners, {lumen.threads} threads, {args.repetitions} reps "
                                       f"(load average {info['load_avg']})")
    if args.json:
        try:                                             # (checked before the run; a read-only mount, a full disk)
            with open(args.json, "w") as f:
                json.dump({"info": info, "figures": rows, "corunners": ratios}, f, indent=1)
        except OSError as e:
            print(f"error: cannot write the JSON to {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0
