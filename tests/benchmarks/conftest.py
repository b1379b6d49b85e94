"""Benchmark regression gates: machinery. See README.md in this folder for the commands and the measurements.

Each case is a runner `run(k)` doing k repetitions of its work, almost all of it in compiled code: a kernel case
replays the Numba calls its public entry point makes (recorded once, then looped inside one compiled function, so
the Python wrapper and Numba's argument dispatch are not timed); the decode step and the prefill call the Model
methods. It is timed against a reference (an L2-resident int16 multiply-add loop, compiled; for a case that reads
its bytes from memory, a plain int8 matvec over as many bytes), interleaved batch by batch: ref batch, case batch,
ref batch, case batch, ... The normalised figure of a case is the median over rounds of (case CPU s per call) /
(reference CPU s per pass). Machine load slows both sides of a pair alike, so this ratio moves far less than
either time. Each round of a kernel case runs on its own copy of the case's arrays (their placement in memory
moves the figure by several %). The gate fails a case whose normalised figure exceeds its committed baseline x
THRESHOLD on a majority of up to ATTEMPTS measurements (a first one clearly under the limit passes at once).

One baseline per CPU: baseline.json maps a CPU key (cpu_key(): the model name, the family and model numbers of
/proc/cpuinfo, the CPU count and the vector ISA flags that decide kernel speed) to that CPU's cases. A run gates against the entry of
its own CPU and says which one; on a CPU with no entry every case is skipped with a message saying how to record
one. Figures are never compared against another CPU's baseline (on an AMD EPYC the smoke cases read 0.46-0.77 of
the Intel Xeon's, so a 25% regression would pass there unseen).

Environment:
    LUMEN_BENCH=1          run the gates (otherwise every test here is skipped, so `pytest` over tests/ skips them)
    LUMEN_BENCH_SMOKE=1    run only the smoke cases (what .ci/run runs); implies LUMEN_BENCH
    LUMEN_BENCH_WRITE=1    measure and (re)write this CPU's baseline for the cases run, instead of gating: the run
                           starts WRITE_PASSES - 1 more pytest processes with the same arguments, one after the
                           other, and each case's baseline is the median of the WRITE_PASSES processes' figures
    LUMEN_BENCH_CPU=KEY    gate against (or write) the baseline of CPU key KEY instead of this CPU's own
    LUMEN_BENCH_OUT=FILE   also write every measured figure (per-round ratios) to FILE as JSON
    LUMEN_BENCH_INJECT=F   inject a slowdown: after each timed batch, spin for F x that batch's own duration on
                           the gate's clock, inside the timed window (F = 0.25: every case 25% slower)
    LUMEN_BENCH_THREADS=N  Numba threads for every case (default 1; README: why)
    LUMEN_BENCH_METRIC=M   "cpu" (process CPU time, default) or "wall"
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

import numba
import numpy as np
import pytest
from numba import njit
from numba.core.dispatcher import Dispatcher

from lumen.cpu import cpu_info, cpu_key  # the CPU key of a baseline (lumen/cpu.py)

HERE = Path(__file__).parent
BASELINE = HERE / "baseline.json"
SMOKE = os.environ.get("LUMEN_BENCH_SMOKE") == "1"
ENABLED = SMOKE or os.environ.get("LUMEN_BENCH") == "1"
WRITE = os.environ.get("LUMEN_BENCH_WRITE") == "1"
INJECT = float(os.environ.get("LUMEN_BENCH_INJECT") or 0)
THRESHOLD = 1.12        # fail when normalised figure > baseline x THRESHOLD (chosen from measured spread: README)
WRITE_PASSES = 3        # write mode: the baseline is the median of this many processes' figures per case
WRITE_CHILD = os.environ.get("LUMEN_BENCH_WRITE_CHILD")  # set in those extra processes: the first one's figures
THREADS = int(os.environ.get("LUMEN_BENCH_THREADS") or 1)
METRIC = os.environ.get("LUMEN_BENCH_METRIC", "cpu")
ATTEMPTS = 5            # a case not clearly under the limit is measured up to this many times; the majority decides
CLEAR = 1.05            # "clearly under": first figure <= baseline x THRESHOLD / CLEAR passes at once
PAUSE_S = (3.0, 10.0, 10.0, 10.0)  # before the 2nd, 3rd, ... of those (neighbour bursts last seconds to minutes)
WRITE_PAUSE_S = 10.0    # write mode: between the passes
ROUNDS = 11             # interleaved (reference, case) pairs per measurement
COPIES = ROUNDS         # replicas of a kernel case's arrays (and the reference's): one per round
COPY_MAX_BYTES = 16 << 20  # larger arrays (the two output heads' weights) are shared by the replicas
LONG_ROUNDS = 3         # rounds for cases whose single call outlasts BATCH_S
BATCH_S = 0.015         # each side of a pair runs about this long

# ---------------------------------------------------------------- reference


@njit(fastmath=True, cache=True)
def ref_kernel(acc, q, x, reps):
    """acc (R,) i16 += reps passes of q (G, 32, R) i8 . x (G*32,) i8 with int16 multiply-adds: the inner loop of
    the quantized tile kernels, on 128 KB that stay in L2. One pass = 64 x 32 x 64 multiply-adds."""
    G = q.shape[0]
    for _ in range(reps):
        for g in range(G):
            for j in range(16):
                xl = np.int16(x[32 * g + j])
                xh = np.int16(x[32 * g + j + 16])
                for r in range(q.shape[2]):
                    acc[r] = np.int16(acc[r] + np.int16(q[g, j, r]) * xl + np.int16(q[g, j + 16, r]) * xh)


@njit(fastmath=True, cache=True)
def matvec_kernel(w, x, out, reps):
    """out (R,) i32 = reps passes of w (R, K) i8 . x (K,) i8: a plain int8 matrix-vector product, one read of every
    byte of w with a little integer work per byte, as a quantized N = 1 matmul does (not Lumen's kernels)."""
    for _ in range(reps):
        for r in range(w.shape[0]):
            acc = np.int32(0)
            for k in range(w.shape[1]):
                acc += np.int32(w[r, k]) * np.int32(x[k])
            out[r] = acc


class Reference:
    """run(k): k passes of ref_kernel, in one compiled call; next() moves to the next of COPIES replicas."""
    name = "int16 L2"

    def __init__(self):
        rng = np.random.default_rng(0)
        q = rng.integers(-16, 16, (64, 32, 64)).astype(np.int8)   # (G=64, 32, R=64) 128 KB
        x = rng.integers(-127, 128, 64 * 32).astype(np.int8)      # (G*32,)
        self.replicas = [(np.zeros(64, np.int16), q.copy(), x.copy()) for _ in range(COPIES)]  # acc (R,) i16
        self.i = 0
        self(1)

    def next(self) -> None:
        self.i = (self.i + 1) % len(self.replicas)

    def __call__(self, k: int) -> None:
        ref_kernel(*self.replicas[self.i], k)


class MemoryReference:
    """run(k): k passes of matvec_kernel over a matrix of `nbytes` (rounded up to MiB), for a case that reads about
    as many bytes per call from memory (the decode step reads the whole model). The int16 loop stays in L2 and
    does not see how fast this guest's memory and last-level cache are at the moment, which differs from host to
    host and minute to minute; a pure streaming read sees it, but differently from a case that also computes
    (README, 3a: measured)."""

    K = 4096

    def __init__(self, nbytes: int):
        mib = -(-nbytes // (1 << 20))
        self.name = f"int8 matvec {mib} MiB"
        rng = np.random.default_rng(0)
        self.w = rng.integers(-128, 128, (mib << 20) // self.K * self.K, dtype=np.int8).reshape(-1, self.K)
        self.x = rng.integers(-128, 128, self.K, dtype=np.int8)
        self.out = np.zeros(self.w.shape[0], np.int32)
        self(1)

    def next(self) -> None:
        pass

    def __call__(self, k: int) -> None:
        matvec_kernel(self.w, self.x, self.out, k)


# ---------------------------------------------------------------- case runners

_LOOPS: dict = {}


def _loop(d, n: int):
    """A compiled loop calling dispatcher d k times with one tuple of n arguments (compiled once per dispatcher
    and n). The arguments are spelled out, args[0], ..., args[n-1]: Numba refuses `d(*args)` when d is inlined
    (`njit(inline="always")`, as matmul's act_rows is)."""
    if (d, n) not in _LOOPS:
        ns = {"d": d}
        exec(f"def loop(k, args):\n    for _ in range(k):\n        d({', '.join(f'args[{i}]' for i in range(n))})\n",
             ns)
        _LOOPS[d, n] = njit(ns["loop"])
    return _LOOPS[d, n]


def _replica(args: tuple, memo: dict) -> tuple:
    """args with every array of at most COPY_MAX_BYTES replaced by a fresh copy (same dtype, layout and
    writeability; an array passed to several calls maps to one copy through memo)."""
    out = []
    for a in args:
        if isinstance(a, np.ndarray) and a.nbytes <= COPY_MAX_BYTES:
            if id(a) not in memo:
                c = a.copy(order="K")
                c.setflags(write=a.flags.writeable)
                memo[id(a)] = c
            a = memo[id(a)]
        out.append(a)
    return tuple(out)


class Replay:
    """run(k): the compiled work of fn(*args), k times. fn (a public entry point such as matvec) is called once
    with every Numba dispatcher in its module's namespace replaced by a recorder; the recorded calls are then
    replayed in order, each inside a compiled loop. So only compiled work is timed (the forward pass calls the
    same kernels from compiled code), and no kernel signature is written here. If fn calls no Numba function
    from Python (or passes one keyword arguments), run(k) calls fn itself k times.

    run.next() moves to the next of `copies` replicas of the arrays (the original first): where a few MB of
    weights land in physical memory decides their L2 conflicts, and so the speed of a cache-resident kernel by
    several % (README); the gate times each round on another replica, so a figure averages over placements."""

    def __init__(self, fn, *args, copies: int = 1):
        ns = fn.__globals__
        saved = {name: obj for name, obj in ns.items() if isinstance(obj, Dispatcher)}
        calls = []

        def recorder(d):
            def call(*a, **kw):
                calls.append((d, a, kw))
                return d(*a, **kw)
            return call
        try:
            ns.update({name: recorder(d) for name, d in saved.items()})
            fn(*args)
        finally:
            ns.update(saved)
        self.fn, self.args = fn, args
        if any(kw for _, _, kw in calls):  # keyword arguments do not go through the compiled loop: time fn itself
            calls = []
        self.names = [d.__name__ for d, _, _ in calls] or [fn.__name__]
        self.replicas = [[(_loop(d, len(a)), a) for d, a, _ in calls]]
        self.copies = copies
        self.new_copies()

    def new_copies(self) -> None:
        """Fresh replicas (new placements) for the next measurement; the first one keeps the original arrays."""
        del self.replicas[1:]
        for _ in range(self.copies - 1):
            memo = {}
            self.replicas.append([(loop, _replica(a, memo)) for loop, a in self.replicas[0]])
        self.i = 0
        for self.calls in self.replicas:  # compile (first time), and touch every replica
            self(1)
        self.calls = self.replicas[0]

    def next(self) -> None:
        self.i = (self.i + 1) % len(self.replicas)
        self.calls = self.replicas[self.i]

    def __call__(self, k: int) -> None:
        if not self.calls:
            for _ in range(k):
                self.fn(*self.args)
        for loop, a in self.calls:
            loop(k, a)


def python_loop(fn, rounds: int = ROUNDS):
    """run(k) for a case that is a Python call (Model.decode / prefill: one compiled forward per call). rounds:
    for the measurement (one placement of the model only, so more rounds instead of replicas)."""
    def run(k: int) -> None:
        for _ in range(k):
            fn()
    run.rounds = rounds
    return run


# ---------------------------------------------------------------- timing


def _spin_until(clock, t_end: float) -> None:
    while clock() < t_end:
        pass


def time_batch(run, k: int, inject: float = 0.0) -> tuple[float, float]:
    """(wall, process CPU) seconds per repetition of run(k). inject: then spin, inside the timed window, on the
    gate's clock for inject x the batch's own duration on that clock (so the batch takes 1 + inject as long)."""
    clock = time.process_time if METRIC == "cpu" else time.perf_counter
    w0, c0 = time.perf_counter(), time.process_time()
    t = clock()
    run(k)
    if inject:
        t1 = clock()
        _spin_until(clock, t1 + inject * (t1 - t))
    return (time.perf_counter() - w0) / k, (time.process_time() - c0) / k


def per_call(run) -> float:
    """CPU seconds of one repetition (best of three single calls; one if a call is long)."""
    t = time_batch(run, 1)[1]
    if t < BATCH_S:
        t = min(t, *(time_batch(run, 1)[1] for _ in range(2)))
    return max(t, 1e-7)


def legacy_key(key: str) -> str | None:
    """For a key of the first per-CPU format ("model | N CPUs | flags", no identity numbers), the same key; for a
    current one, the first-format key of that CPU (the identity dropped). Entries under a first-format key are
    read and listed, and gated against only on purpose (LUMEN_BENCH_CPU): their key cannot tell two CPUs of the
    same model name apart."""
    parts = key.split(" | ")
    return key if len(parts) == 3 else " | ".join(parts[:1] + parts[2:]) if len(parts) == 4 else None


def load_baselines(path: Path = BASELINE) -> dict:
    """{"cpus": {cpu key: {"cases": {...}, "meta": {...}}}} from baseline.json (empty if it does not exist)."""
    data = json.loads(path.read_text()) if path.exists() else {"cpus": {}}
    if "cpus" not in data:
        raise ValueError(f"{path}: no 'cpus' mapping (a baseline from before the per-CPU format?)")
    return {"cpus": data["cpus"]}


class Gate:
    """Measures cases and gates them against baseline.json; collects everything for the session report."""
    COPY_MAX_BYTES = COPY_MAX_BYTES

    def __init__(self, cpu: dict | None = None, baselines: dict | None = None):
        self.refs = {}  # bytes a case reads from memory (0: none) -> its reference
        self.baselines = load_baselines() if baselines is None else baselines
        self.results = {}
        self.cpu = cpu_info() if cpu is None else cpu
        self.key = os.environ.get("LUMEN_BENCH_CPU") or cpu_key(self.cpu)
        self.key_from = "LUMEN_BENCH_CPU" if os.environ.get("LUMEN_BENCH_CPU") else "this CPU"
        self.baseline = self.baselines["cpus"].get(self.key)   # this CPU's entry (the exact key), or None

    @property
    def cases(self) -> dict:
        return self.baseline["cases"] if self.baseline else {}

    def describe(self) -> str:
        """Which baseline this run gates against (or writes), for the output."""
        if self.baseline is None:
            return f"no baseline for {self.key_from} ({self.key})"
        meta = self.baseline.get("meta", {})
        return (f"baseline of {self.key_from}: {self.key!r} (written {meta.get('written', '?')}, "
                f"{len(self.cases)} cases)")

    def missing_reason(self) -> str:
        """Why the cases are skipped on a CPU with no baseline, and how to record one."""
        known = "; ".join(sorted(self.baselines["cpus"])) or "none"
        same_name = [k for k in sorted(self.baselines["cpus"]) if k != self.key and legacy_key(k) == k
                     and k == legacy_key(self.key)]
        old = (f" An entry recorded before keys named the CPU family and model has this CPU's name and flags, but "
               f"may come from another CPU of that name: {'; '.join(same_name)}; gate against it on purpose with "
               f"LUMEN_BENCH_CPU='<that key>', or record this CPU's." if same_name else "")
        return (f"benchmark gates: no baseline in {BASELINE.name} for {self.key_from} ({self.key}); the baselines "
                f"of other CPUs are not comparable (known: {known}).{old} Record one on this machine, at rest: "
                f"LUMEN_BENCH=1 LUMEN_BENCH_WRITE=1 python -m pytest -q tests/benchmarks (README.md)")

    def reference(self, memory_bytes: int = 0):
        """The int16 L2 loop, or (memory_bytes > 0) an int8 matvec over that many bytes; built once per run each
        (a remeasurement reuses it: a memory reference is up to 170 MiB)."""
        if memory_bytes not in self.refs:
            self.refs[memory_bytes] = MemoryReference(memory_bytes) if memory_bytes else Reference()
        return self.refs[memory_bytes]

    def measure(self, case_id: str, run, memory_bytes: int = 0) -> dict:
        """Time run(k) against the reference, interleaved: the int16 L2 loop, or for a case that reads
        memory_bytes > 0 bytes from memory per call, an int8 matvec over as many. The batch sizes come from the
        baseline when it has this case (a gate run repeats the baseline's workload), else from a calibration."""
        ref = self.reference(memory_bytes)
        if hasattr(run, "new_copies") and self.results.get(case_id):
            run.new_copies()  # a remeasurement: other placements, so the attempts are independent
        run(1)  # warm (compiled loops, caches)
        base = self.cases.get(case_id)
        if WRITE_CHILD:  # a later write pass: the first pass's workload
            base = json.loads(Path(WRITE_CHILD).read_text())["results"].get(case_id)
        if base and (not WRITE or WRITE_CHILD) and "k_ref" in base:
            k, k_ref = base["k"], base["k_ref"]
        else:
            t_call, t_ref = per_call(run), per_call(ref)
            k = max(1, math.ceil(BATCH_S / t_call))
            k_ref = max(1, round(k * t_call / t_ref))  # the reference batch lasts as long as the case batch
        rounds = LONG_ROUNDS if k == 1 else getattr(run, "rounds", ROUNDS)
        wall, cpu = [], []  # per round: (case, reference) seconds per call / per pass
        for _ in range(rounds):
            ref.next()
            if hasattr(run, "next"):
                run.next()
            rw, rc = time_batch(ref, k_ref)
            cw, cc = time_batch(run, k, INJECT)
            wall.append((cw, rw))
            cpu.append((cc, rc))
        res = {"k": k, "k_ref": k_ref, "reference": ref.name,
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

    @staticmethod
    def replay(out: np.ndarray, fn, *args) -> Replay:
        """Replay of fn(*args), checked: the replayed calls write the same `out` as the entry point did."""
        fn(*args)
        expect = out.copy()
        run = Replay(fn, *args, copies=COPIES)
        out[...] = np.nan
        run(1)  # the first replica holds the original arrays
        np.testing.assert_array_equal(out, expect, err_msg=f"replayed calls {run.names} differ from {fn.__name__}")
        return run

    python_loop = staticmethod(python_loop)

    def check(self, case_id: str, res: dict, remeasure) -> None:
        """Pass at once when the first measurement is clearly under the limit (by more than CLEAR); otherwise
        measure again, PAUSE_S apart, until a majority of ATTEMPTS measurements is under the limit (pass) or
        over it (fail). A neighbour's burst can bias a measurement either way (up: a flap; down: a real
        slowdown let through); the majority vote outlasts a burst of up to ATTEMPTS // 2 measurements.
        remeasure() -> new res."""
        if WRITE:
            return
        base = self.cases.get(case_id)
        if base is None or "k_ref" not in base:  # a failure, not a skip: CI must not pass without gating
            pytest.fail(f"{case_id}: not in the {self.describe()} (write it: see tests/benchmarks/README.md)")
        if base.get("reference", Reference.name) != res["reference"]:
            pytest.fail(f"{case_id}: measured against the {res['reference']} reference, its baseline against the "
                        f"{base.get('reference', Reference.name)} one (rewrite it: see tests/benchmarks/README.md)")
        base = dict(base, norm=base[f"norm_{METRIC}"])
        limit = base["norm"] * THRESHOLD
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
            if attempt == 0 and res["norm"] <= limit / CLEAR:
                return
            over = sum(r > THRESHOLD for r in rels)
            if len(rels) - over > ATTEMPTS // 2:
                return
            if over > ATTEMPTS // 2:
                break
        med = statistics.median(rels)
        assert False, (
            f"{case_id} is {100 * (med - 1):.0f}% slower than baseline (over the limit x{THRESHOLD:.2f} on {over} of "
            f"{len(rels)} measurements, normalised / baseline: {', '.join(f'{r:.3f}' for r in rels)}); "
            f"case {1e3 * res['case_s_median']:.4f} ms/call, reference {1e3 * res['ref_s_median']:.4f} ms/pass; "
            f"{self.describe()}"
            + (f"; NOTE: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: memory-bound cases "
               f"(output heads, decode step, prefill) run slow on oversubscribed CPUs (README)"
               if os.getloadavg()[0] > os.cpu_count() else ""))


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
        elif _GATE.baseline is None and not WRITE:
            item.add_marker(pytest.mark.skip(reason=_GATE.missing_reason()))


def pytest_report_header(config):
    if ENABLED:
        return (f"lumen benchmark gates: writing the baseline of {_GATE.key_from} ({_GATE.key})" if WRITE
                else f"lumen benchmark gates against the {_GATE.describe()}")


def _dump(path) -> None:
    Path(path).write_text(json.dumps({"inject": INJECT, "smoke": SMOKE, "threshold": THRESHOLD,
                                      "cpu": _GATE.cpu, "results": _GATE.results}, indent=1))


def _write_passes(session) -> list[dict]:
    """Write mode: run WRITE_PASSES - 1 more pytest processes with this one's arguments (and its batch sizes),
    WRITE_PAUSE_S apart; return every pass's results (this one first). A figure depends on the process (where
    its arrays and the model landed in memory) and on the minute (neighbours), so the baseline takes the
    median of separate processes rather than of repeats in one."""
    import subprocess
    import sys
    import tempfile
    passes = [_GATE.results]
    with tempfile.TemporaryDirectory() as tmp:
        first = Path(tmp) / "pass1.json"
        _dump(first)
        for i in range(2, WRITE_PASSES + 1):
            time.sleep(WRITE_PAUSE_S)
            out = Path(tmp) / f"pass{i}.json"
            env = dict(os.environ, LUMEN_BENCH_WRITE_CHILD=str(first), LUMEN_BENCH_OUT=str(out))
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *session.config.invocation_params.args], env=env, check=True,
                           cwd=session.config.invocation_params.dir, stdout=subprocess.DEVNULL)
            passes.append(json.loads(out.read_text())["results"])
    return passes


def pytest_sessionfinish(session, exitstatus):
    if not _GATE.results:
        return
    out = os.environ.get("LUMEN_BENCH_OUT")
    if WRITE and not WRITE_CHILD:
        passes = _write_passes(session)
        entry = _GATE.baselines["cpus"].setdefault(_GATE.key, {})
        cases = entry.setdefault("cases", {})
        for cid, r in _GATE.results.items():
            norms = {m: [p[cid][m] for p in passes if cid in p] for m in
                     ("norm_wall", "norm_cpu", "norm_wall_min", "norm_cpu_min")}
            r["write_norms"] = norms[f"norm_{METRIC}"]
            cases[cid] = {"metric": METRIC, "k": r["k"], "k_ref": r["k_ref"], "reference": r["reference"],
                          "spread": round(r["spread"], 4),
                          "write_norms": r["write_norms"], **{m: statistics.median(v) for m, v in norms.items()},
                          "case_ms": round(1e3 * r["case_s_median"], 5)}
            cases[cid]["norm"] = cases[cid][f"norm_{METRIC}"]
        entry["meta"] = {
            "written": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": THREADS, "metric": METRIC,
            "cpu": _GATE.cpu, "rounds": ROUNDS, "copies": COPIES, "passes": WRITE_PASSES,
            "note": "norm = median over rounds of (case CPU s/call) / (reference CPU s/pass), reference timed "
                    "interleaved, each round on another copy of the case's arrays; the median of WRITE_PASSES "
                    "separate processes' figures"}
        BASELINE.write_text(json.dumps(_GATE.baselines, indent=1, sort_keys=True) + "\n")
        _GATE.baseline = entry
    if out:
        _dump(out)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    if ENABLED and _GATE.baseline is None and not WRITE:
        tr.section("lumen benchmark gates: NOT GATED")
        tr.write_line(_GATE.missing_reason())
    if not _GATE.results:
        return
    tr.section("lumen benchmark gates (normalised = case / reference, median of interleaved rounds)")
    if not WRITE:
        tr.write_line(f"gated against the {_GATE.describe()}")
    tr.write_line(f"gate metric: {METRIC}, {THREADS} thread(s), limit baseline x {THRESHOLD}; "
                  f"vs base columns: wall median, wall min, cpu median, cpu min")
    tr.write_line(f"{'case':56s} {'ms/call':>9s} {'norm':>8s} {'spread':>7s}  {'w-med':>6s} {'w-min':>6s} "
                  f"{'c-med':>6s} {'c-min':>6s}  attempts (gate figure / baseline)")
    for cid, r in _GATE.results.items():
        rels = [f"{r[f'rel_{m}']:.3f}" if f"rel_{m}" in r else "-" for m in
                ("norm_wall", "norm_wall_min", "norm_cpu", "norm_cpu_min")]
        tr.write_line(f"{cid:56s} {1e3 * r['case_s_median']:9.4f} {r['norm']:8.4g} "
                      f"{100 * r['spread']:6.1f}%  " + " ".join(f"{x:>6s}" for x in rels)
                      + "  " + " ".join(f"{x:.3f}" for x in r.get("attempt_rels", []))
                      + (" write passes / median: " + " ".join(f"{x / statistics.median(r['write_norms']):.3f}"
                                                                for x in r["write_norms"]) if r.get("write_norms") else ""))
    if WRITE and not WRITE_CHILD:
        tr.write_line(f"baseline written: {BASELINE}, entry {_GATE.key!r} (median of {WRITE_PASSES} processes: "
                      f"write_norms)")
