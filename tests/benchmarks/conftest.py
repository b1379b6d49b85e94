"""Benchmark regression gates: machinery. See README.md in this folder for the commands.

Every case is timed against a reference kernel of the same kind (memory-bound or compute-bound), interleaved
pair by pair in the same session: ref batch, case batch, ref batch, case batch, ... The normalised figure of a
case is the median over rounds of (case time per call) / (reference time per call). Machine load slows both
sides of a pair alike, so this ratio moves far less than either time. The gate fails a case whose normalised
figure exceeds its committed baseline (baseline.json) by more than THRESHOLD.

Environment:
    LUMEN_BENCH=1          run the gates (otherwise every test here is skipped, so `pytest` over tests/ skips them)
    LUMEN_BENCH_SMOKE=1    run only the smoke cases, with fewer rounds (< 60 s; what CI runs); implies LUMEN_BENCH
    LUMEN_BENCH_WRITE=1    measure and (re)write baseline.json for the cases run, instead of gating
    LUMEN_BENCH_OUT=FILE   also write every measured figure (per-round ratios) to FILE as JSON
    LUMEN_BENCH_INJECT=F   inject a slowdown: after each benchmarked call, spin for F x that call's own duration
                           (F = 0.25 makes every case 25% slower; used to show the gate catches it)
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import numba
import numpy as np
import pytest
from numba import njit, prange

HERE = Path(__file__).parent
BASELINE = HERE / "baseline.json"
SMOKE = os.environ.get("LUMEN_BENCH_SMOKE") == "1"
ENABLED = SMOKE or os.environ.get("LUMEN_BENCH") == "1"
WRITE = os.environ.get("LUMEN_BENCH_WRITE") == "1"
INJECT = float(os.environ.get("LUMEN_BENCH_INJECT") or 0)
THRESHOLD = 1.10        # fail when normalised figure > baseline x THRESHOLD (chosen from measured spread: README)
SMOKE_THRESHOLD = 1.10  # same threshold and three strikes; only the rounds are fewer
WRITE_REPEATS = 3       # the baseline is the median of this many measurements per case, PAUSE_S apart
ROUNDS = 3 if SMOKE else 9
THREADS = int(os.environ.get("LUMEN_BENCH_THREADS") or 1)  # numba threads for every case (README: why 1)
METRIC = os.environ.get("LUMEN_BENCH_METRIC", "cpu")  # gate on process CPU time ("cpu") or wall time ("wall")
ATTEMPTS = 3            # a case fails only when over the limit this many times in a row
PAUSE_S = (3.0, 10.0)   # before the 2nd and 3rd of those measurements (neighbour bursts last seconds to minutes)
LONG_ROUNDS = 3 if SMOKE else 5  # rounds for cases whose single call outlasts BATCH_S
BATCH_S = 0.012         # each side of a pair runs about this long (the case repeated k times)

# ---------------------------------------------------------------- reference kernels


@njit(parallel=True, fastmath=True, cache=True)
def ref_mem_kernel(a):
    """Sum of a (n_chunks, chunk) f32, parallel over chunks: streams the array from DRAM (read bandwidth)."""
    acc = np.zeros(a.shape[0], np.float32)
    for i in prange(a.shape[0]):
        s = np.float32(0)
        for j in range(a.shape[1]):
            s += a[i, j]
        acc[i] = s
    return acc.sum()


@njit(parallel=True, fastmath=True, cache=True)
def ref_compute_kernel(out, a, x, reps):
    """out (rows,) = reps x (a (rows, n) @ x (n,)), parallel over rows; a fits in L2: FMA throughput."""
    for i in prange(a.shape[0]):
        s = np.float32(0)
        for _ in range(reps):
            for j in range(a.shape[1]):
                s += a[i, j] * x[j]
        out[i] = s


class References:
    """The two reference kernels, sized per case so one reference call is like one case call:
    mem:     a streaming sum over as many bytes as the case reads (in cache if the case's data is, else DRAM);
    compute: the L2-resident FMA loop, repeated so that one call takes about as long as one case call."""

    def __init__(self):
        self.mem_a = np.random.default_rng(0).random(64 * 1024 * 1024, dtype=np.float32)  # (64 Mi,) 256 MB
        self.cmp_a = np.random.default_rng(1).random((64, 1024), dtype=np.float32)        # (64, 1024) 256 KB
        self.cmp_x = np.random.default_rng(2).random(1024, dtype=np.float32)
        self.cmp_out = np.empty(64, np.float32)
        ref_mem_kernel(self.mem_a[:1024].reshape(8, 128))
        ref_compute_kernel(self.cmp_out, self.cmp_a, self.cmp_x, 1)

    def fn(self, kind: str, param: int):
        """kind "mem": param = bytes to stream; "compute": param = repetitions of the 64x1024 mat-vec."""
        if kind == "mem":
            n = max(64 * 256, min(param // 4, self.mem_a.size)) // 64 * 64
            a = self.mem_a[:n].reshape(64, n // 64)     # (64 chunks, n/64) f32
            return lambda: ref_mem_kernel(a)
        return lambda: ref_compute_kernel(self.cmp_out, self.cmp_a, self.cmp_x, param)

    def compute_param(self, t_call: float) -> int:
        """Repetitions for a compute reference call lasting about t_call seconds."""
        t1 = min(time_batch(self.fn("compute", 16), 20)[0] for _ in range(3)) / 16
        return max(1, round(t_call / t1))


# ---------------------------------------------------------------- timing


def _spin_until(clock, t_end: float) -> None:
    while clock() < t_end:
        pass


def time_batch(fn, k: int, inject: float = 0.0) -> tuple[float, float]:
    """(wall, process CPU) seconds per call of fn, over k back-to-back calls. inject: after each call, spin on
    the metric's clock for inject x that call's own duration on it (wall: perf_counter, cpu: process_time)."""
    clock = time.process_time if METRIC == "cpu" else time.perf_counter
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(k):
        t = clock()
        fn()
        if inject:
            t1 = clock()
            _spin_until(clock, t1 + inject * (t1 - t))
    return (time.perf_counter() - w0) / k, (time.process_time() - c0) / k


def calibrate(fn, target_s: float = BATCH_S) -> tuple[int, float]:
    """(calls per batch so a batch lasts about target_s, wall seconds of one call); fn already warm. One timing
    for calls longer than target_s, the best of three otherwise."""
    t = time_batch(fn, 1)[0]
    if t < target_s:
        t = min(t, *(time_batch(fn, 1)[0] for _ in range(2)))
    return max(1, math.ceil(target_s / max(t, 1e-7))), t


class Gate:
    """Measures cases and gates them against baseline.json; collects everything for the session report."""

    def __init__(self):
        self.refs = None
        self.baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {"cases": {}}
        self.results = {}

    def measure(self, case_id: str, kind: str, fn, nbytes: int = 0, rounds: int = ROUNDS) -> dict:
        """Time fn against its reference, interleaved. nbytes: bytes one call reads (kind "mem")."""
        if self.refs is None:
            self.refs = References()
        fn()  # warm: JIT compile / load from cache
        base = self.baseline["cases"].get(case_id)
        if base and not WRITE:  # the same workload as the baseline's
            k, param = base["k"], base["ref_param"]
        else:
            k, t_call = calibrate(fn)
            param = nbytes if kind == "mem" else self.refs.compute_param(t_call)
        ref = self.refs.fn(kind, param)
        ref()
        k_ref = calibrate(ref)[0]
        if k == 1 and k_ref == 1 and rounds > LONG_ROUNDS:  # calls longer than a batch: fewer, longer rounds
            rounds = LONG_ROUNDS
        wall, cpu = [], []  # per round: (case, reference) seconds per call
        for _ in range(rounds):
            rw, rc = time_batch(ref, k_ref)
            cw, cc = time_batch(fn, k, INJECT)
            wall.append((cw, rw))
            cpu.append((cc, rc))
        res = {"kind": kind, "k": k, "ref_param": param, "k_ref": k_ref,
               "case_s_median": statistics.median(c for c, _ in wall),
               "ref_s_median": statistics.median(r for _, r in wall)}
        for name, pairs in (("wall", wall), ("cpu", cpu)):
            ratios = [c / r for c, r in pairs]
            res[f"norm_{name}"] = statistics.median(ratios)  # median of the paired ratios
            res[f"norm_{name}_min"] = min(c for c, _ in pairs) / min(r for _, r in pairs)  # ratio of the minima
            res[f"ratios_{name}"] = ratios
        res["norm"] = res[f"norm_{METRIC}"]
        res["spread"] = (max(res[f"ratios_{METRIC}"]) - min(res[f"ratios_{METRIC}"])) / res["norm"]
        self.results[case_id] = res
        return res

    def write_median(self, case_id: str, res: dict, remeasure) -> None:
        """Write mode: measure WRITE_REPEATS times in all; keep the measurement whose gate figure is the median."""
        runs = [res] + [(time.sleep(PAUSE_S[0]), remeasure())[1] for _ in range(WRITE_REPEATS - 1)]
        med = sorted(runs, key=lambda r: r["norm"])[len(runs) // 2]
        med["write_norms"] = [r["norm"] for r in runs]
        self.results[case_id] = med

    def check(self, case_id: str, res: dict, remeasure) -> None:
        """Fail when the case is over the limit on ATTEMPTS measurements in a row, PAUSE_S apart (a neighbour's
        burst of load can bias a measurement; a real slowdown biases all of them). remeasure() -> new res."""
        if WRITE:
            return self.write_median(case_id, res, remeasure)
        base = self.baseline["cases"].get(case_id)
        if base is None:
            pytest.skip(f"{case_id}: no baseline (write one: see tests/benchmarks/README.md)")
        base = dict(base, norm=base[f"norm_{METRIC}"])
        limit = base["norm"] * (SMOKE_THRESHOLD if SMOKE else THRESHOLD)
        rels = []
        for attempt in range(ATTEMPTS):
            if attempt:
                time.sleep(PAUSE_S[attempt - 1])
                res = remeasure()
            res["baseline"], res["rel"] = base["norm"], res["norm"] / base["norm"]
            for m in ("norm_wall", "norm_cpu", "norm_wall_min", "norm_cpu_min"):
                res[f"rel_{m}"] = res[m] / base[m]
            rels.append(res["rel"])
            res["attempt_rels"] = list(rels)
            if res["norm"] <= limit:
                return
        assert False, (
            f"{case_id} is {100 * (min(rels) - 1):.0f}% slower than baseline on each of {ATTEMPTS} measurements "
            f"(normalised / baseline: {', '.join(f'{r:.3f}' for r in rels)}; limit x{limit / base['norm']:.2f}); "
            f"case {1e3 * res['case_s_median']:.3f} ms/call, {kind_name(res['kind'])} reference "
            f"{1e3 * res['ref_s_median']:.3f} ms/call")


def kind_name(kind: str) -> str:
    return {"mem": "memory-bound", "compute": "compute-bound"}[kind]


_GATE = Gate()


@pytest.fixture(scope="session")
def gate() -> Gate:
    return _GATE


# ---------------------------------------------------------------- pytest hooks


def pytest_configure(config):
    if ENABLED:
        numba.set_num_threads(THREADS)
    config.addinivalue_line("markers", "smoke: the few benchmark cases LUMEN_BENCH_SMOKE=1 runs")
    # the gate times cases itself; pytest-benchmark's fixture only records them (and times them when enabled)
    config.addinivalue_line("filterwarnings", "ignore:Benchmark fixture was not used")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not str(item.fspath).startswith(str(HERE)):
            continue
        if not ENABLED:
            item.add_marker(pytest.mark.skip(reason="benchmark gates: set LUMEN_BENCH=1 (see tests/benchmarks/README.md)"))
        elif SMOKE and item.get_closest_marker("smoke") is None:
            item.add_marker(pytest.mark.skip(reason="not a smoke case (LUMEN_BENCH_SMOKE=1)"))


def pytest_sessionfinish(session, exitstatus):
    if not _GATE.results:
        return
    if WRITE:
        cases = _GATE.baseline.setdefault("cases", {})
        for cid, r in _GATE.results.items():
            cases[cid] = {"norm": r["norm"], "metric": METRIC, "k": r["k"], "ref_param": r["ref_param"],
                          "kind": r["kind"], "spread": round(r["spread"], 4),
                          **{m: r[m] for m in ("norm_wall", "norm_cpu", "norm_wall_min", "norm_cpu_min")},
                          "case_ms": round(1e3 * r["case_s_median"], 4)}
        _GATE.baseline["meta"] = {
            "written": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": THREADS, "metric": METRIC,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus", "rounds": ROUNDS,
            "note": "norm = median over rounds of (case s/call) / (reference s/call), reference timed interleaved"}
        BASELINE.write_text(json.dumps(_GATE.baseline, indent=1, sort_keys=True) + "\n")
    out = os.environ.get("LUMEN_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps({"inject": INJECT, "smoke": SMOKE, "results": _GATE.results}, indent=1))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _GATE.results:
        return
    tr = terminalreporter
    tr.section("lumen benchmark gates (normalised = case / same-kind reference, median of interleaved rounds)")
    tr.write_line(f"gate metric: {METRIC}; vs base columns: wall median, wall min, cpu median, cpu min")
    tr.write_line(f"{'case':56s} {'kind':7s} {'ms/call':>8s} {'norm':>8s} {'spread':>7s}  {'w-med':>6s} {'w-min':>6s} "
                  f"{'c-med':>6s} {'c-min':>6s}  attempts (gate figure / baseline)")
    for cid, r in _GATE.results.items():
        rels = [f"{r[f'rel_{m}']:.3f}" if f"rel_{m}" in r else "-" for m in
                ("norm_wall", "norm_wall_min", "norm_cpu", "norm_cpu_min")]
        tr.write_line(f"{cid:56s} {r['kind']:7s} {1e3 * r['case_s_median']:8.3f} {r['norm']:8.4g} "
                      f"{100 * r['spread']:6.1f}%  " + " ".join(f"{x:>6s}" for x in rels)
                      + "  " + " ".join(f"{x:.3f}" for x in r.get("attempt_rels", [])))
    if WRITE:
        tr.write_line(f"baseline written: {BASELINE}")
