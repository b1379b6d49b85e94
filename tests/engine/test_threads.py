"""Speed that holds on a shared machine: the thread governor, the matmul regions' work distribution, the
OpenMP pool release and the benchmarks' co-runners.

The performance itself is measured by benchmarks (`lumen.bench single|batch --corunner sleep,busy`,
profiling/shared_machine.py); here: that each part decides and computes what it should.
"""
import hashlib
import os
import subprocess
import sys
import threading
import time

import numba
import numpy as np
import pytest

import lumen
from lumen.bench.corunner import corunner, parse_kinds, ratio_rows
from lumen.cpu import allowed_cpus
from lumen.engine import threads as T
from lumen.engine.threads import Governor, busy_seconds, schedstat
from lumen.kernels import work
from lumen.kernels.matmul import Packed, matmul_batched, prepare
from lumen.format.quants import QT, quant_info

MAX = numba.config.NUMBA_NUM_THREADS


def _gov(max_threads=2, cores=2):
    g = Governor(max_threads, adaptive=True)
    g.cpus = list(range(cores))
    return g


# ---- the governor's rule, on readings given to it

def test_busy_neighbour_takes_a_thread_and_gives_it_back():
    g = _gov()
    assert g.n == 2
    assert g.decide(1.0) == 1              # one busy process on 2 cores: one thread
    assert g.decide(1.0) == 1
    assert g.decide(0.0) == 1              # the neighbour left: one reading is not enough to grow ...
    assert g.decide(0.0) == 2              # ... UP_WINDOWS in a row are
    assert g.changes == 2


def test_light_neighbour_keeps_every_thread():
    g = _gov()
    for others in (0.02, 0.1, 0.2, 0.25, 0.0, 0.34):   # a sleeping loop, a server's own loop: below DOWN
        assert g.decide(others) == 2
    assert g.changes == 0


def test_hysteresis_between_down_and_up():
    g = _gov()
    assert g.decide(0.4) == 1              # beyond DOWN: give one up
    for _ in range(5):
        assert g.decide(0.15) == 1         # between UP and DOWN: stay
    assert g.decide(0.05) == 1
    assert g.decide(0.05) == 2


def test_waiting_for_a_core_gives_a_thread_up_at_once():
    g = _gov()
    assert g.decide(0.0, wait=0.1, slow=False) == 2      # a sleeping loop's wake-ups: a little waiting
    assert g.decide(0.0, wait=0.35, slow=False) == 2     # a server at concurrency 16: its loop and client
    assert g.decide(0.0, wait=0.6, slow=False) == 2      # one reading of a busy neighbour (or a spike) ...
    assert g.decide(0.0, wait=0.6, slow=False) == 1      # ... two in a row: our threads wait half a core
    assert g.decide(0.0, wait=0.0, slow=False) == 1      # fast readings never take one back ...
    assert g.decide(0.0, wait=0.0, slow=False) == 1
    assert g.decide(0.0) == 1 and g.decide(0.0) == 2     # ... two slow ones in a row do


def test_fast_readings_never_act_on_an_old_reading_of_others():
    g = _gov()
    assert g.decide(1.0) == 1                            # a neighbour, then it leaves
    g.n = 2                                              # (as after taking the thread back)
    assert g.decide(1.0, wait=0.0, slow=False) == 2      # the stale value of others moves nothing


def test_after_a_long_pause_every_thread_again(monkeypatch):
    monkeypatch.setattr(T, "runnable_others", lambda cpus: 0)    # nobody runs now (this host may be busy)
    g = _gov()
    g.adaptive = True
    g.threads()                                          # a first reading: a baseline
    g.decide(1.0)
    assert g.n == 1
    g._last = (g._last[0] - 2 * T.RESET_S,) + g._last[1:]   # the last reading is old now
    assert g.threads() == 2


def _probe(monkeypatch, value):
    calls = []
    monkeypatch.setattr(T, "runnable_others", lambda cpus: calls.append(cpus) or value)
    return calls


def test_after_a_pause_a_neighbour_that_still_runs_keeps_its_core(monkeypatch):
    calls = _probe(monkeypatch, 1)
    g = _gov()
    assert g._after_pause(2 * T.RESET_S, 1.0) == 1       # busy through the pause, runnable now: one thread
    assert g.others == 1.0 and len(calls) == 1
    assert g._after_pause(2 * T.RESET_S, 1.0) == 1       # and not every thread again after the next pause
    assert g.decide(0.0) == 1 and g.decide(0.0) == 2     # it left: taken back as after any reading
    g = _gov(max_threads=4, cores=4)
    assert g._after_pause(0.5, 1.0) == 3                 # a short pause: never more than it had ...
    g.n = 2
    assert g._after_pause(0.5, 1.0) == 2                 # ... only fewer
    assert g._after_pause(2 * T.RESET_S, 1.0) == 3       # a long one: what the instant count leaves


def test_after_a_pause_a_neighbour_that_left_or_barely_ran_is_not_waited_for(monkeypatch):
    calls = _probe(monkeypatch, 0)
    g = _gov()
    g.n = 1
    assert g._after_pause(2 * T.RESET_S, 1.0) == 2       # busy in the pause, gone now (a benchmark's other
    assert len(calls) == 1                               # engine): every thread
    calls = _probe(monkeypatch, 1)
    g = _gov()
    assert g._after_pause(2 * T.RESET_S, 0.05) == 2      # a sleeping loop, caught runnable by chance: the pause
    assert calls == []                                   # says it is light, so the instant is not even read
    g.n = 1
    assert g._after_pause(0.5, 0.05) == 1                # a short pause changes nothing by itself
    _probe(monkeypatch, None)                            # no reading of the instant (part of a machine): as
    g = _gov()                                           # before, every thread after a long pause
    g.n = 1
    assert g._after_pause(2 * T.RESET_S, 1.0) == 2


def test_the_instant_count_sees_a_neighbour_and_not_our_threads():
    cpus = allowed_cpus()
    try:
        T.runnable()
    except OSError:
        pytest.skip("no /proc")
    assert T.runnable_others(cpus[:-1] if len(cpus) > 1 else []) is None    # part of the machine: no reading
    if len(cpus) != os.cpu_count():
        pytest.skip("this process may not use every CPU")
    with corunner("busy", seconds=10):
        time.sleep(0.1)
        assert T.runnable_others(cpus) >= 1              # the spinning process, every time it is read
    stop = threading.Event()
    spin = threading.Thread(target=_spin_nogil, args=(stop,))
    spin.start()
    try:
        time.sleep(0.05)
        mine = [T.runnable()[1] for _ in range(20)]
    finally:
        stop.set()
        spin.join()
    assert max(mine) >= 2, mine                          # the reader and the spinning thread are ours


@numba.njit(nogil=True)
def _spin_n(n):
    x = 0
    for i in range(n):
        x = (x * 31 + i) % 1000003
    return x


def _spin_nogil(stop):
    while not stop.is_set():
        _spin_n(2_000_000)                               # a few ms without the GIL: runnable (R) meanwhile


def _fake_proc(monkeypatch, g):
    """The governor's /proc readings from a dict: busy (all CPUs) and ours (our threads' run), in seconds."""
    proc = {"busy": 0.0, "ours": 0.0}
    monkeypatch.setattr(T, "busy_seconds", lambda cpus: proc["busy"])
    monkeypatch.setattr(T, "schedstat", lambda tids: (proc["ours"], 0.0, 0))
    monkeypatch.setattr(T, "runnable_others", lambda cpus: 0)
    g._compute_tids = lambda: []
    return proc


def test_a_long_step_is_a_reading_and_only_the_time_between_steps_a_pause(monkeypatch):
    g = _gov()
    proc = _fake_proc(monkeypatch, g)
    g._read(100.0)                                       # a baseline
    assert g.decide(1.0) == 1                            # a neighbour held a thread; then it left
    t = 100.0
    for _ in range(2):                                   # prefills of 0.5 s on our thread, 10 ms apart
        proc["busy"] += 0.5
        proc["ours"] += 0.5
        g._end = t + 0.5
        t += 0.51
        g._read(t)
    assert g.n == 2 and g.others == 0.0                  # two slow readings: taken back (before, each long
                                                         # step read as a pause, and it never was)
    g = _gov()
    proc = _fake_proc(monkeypatch, g)
    g._read(200.0)
    g.n = 1
    g._end = 200.1
    g._read(200.4)                                       # 0.3 s without a step: a pause, a baseline only
    assert g.n == 1 and g.others == 0.0
    g._end = 200.5
    g._read(200.5 + 2 * T.RESET_S)                       # a long pause: every thread again
    assert g.n == 2


def test_many_cores_give_up_what_others_use():
    g = _gov(max_threads=8, cores=8)
    assert g.decide(2.9) == 5              # 8 - ceil(2.9 - DOWN)
    assert g.decide(0.0) == 5
    assert g.decide(0.0) == 8              # back up in one move once it is all free
    assert g.decide(100.0) == 1            # never below one


def test_fixed_threads_never_change(monkeypatch):
    g = Governor(2, adaptive=False)
    assert not g.adaptive
    monkeypatch.setenv("LUMEN_FIXED_THREADS", "1")
    assert not Governor(2).adaptive
    assert not Governor(1).adaptive        # nothing to choose


def test_threads_sets_numba_for_the_calling_thread():
    if MAX < 2:
        pytest.skip("needs 2 threads")
    g = Governor(MAX, adaptive=False)
    numba.set_num_threads(1)
    assert g.threads() == MAX and numba.get_num_threads() == MAX
    g.n = 1
    assert g.threads() == 1 and numba.get_num_threads() == 1
    seen = []
    t = threading.Thread(target=lambda: seen.append((g.threads(), numba.get_num_threads())))
    t.start()
    t.join()
    assert seen == [(1, 1)]                # set again on a thread that had not been told
    numba.set_num_threads(MAX)


def test_two_governors_in_one_thread_each_get_their_count():
    """The governor remembered the count it had last set in a thread and set it only when that changed: an engine
    of 1 thread stepped in between, and an engine of 2 ran its later steps on 1 in that thread."""
    if MAX < 2 or T.usable_cpus() < 2:
        pytest.skip("needs 2 threads")
    two, one = Governor(2, adaptive=False), Governor(1, adaptive=False)
    try:
        assert two.threads() == 2 and numba.get_num_threads() == 2
        assert one.threads() == 1 and numba.get_num_threads() == 1
        assert two.threads() == 2 and numba.get_num_threads() == 2
        numba.set_num_threads(1)                        # the caller's own setting, between two steps
        assert two.threads() == 2 and numba.get_num_threads() == 2
    finally:
        numba.set_num_threads(MAX)


def test_readings_come_from_proc():
    cpus = allowed_cpus()
    b0 = busy_seconds(cpus)
    if b0 is None:
        pytest.skip("no /proc/stat")
    tids = work.compute_thread_ids(numba.get_num_threads())
    assert threading.get_native_id() in tids and len(tids) == numba.get_num_threads()
    r0, w0, n0 = schedstat(tids)
    x = 0
    t = time.thread_time()
    while time.thread_time() - t < 0.05:   # spin on this thread: its run time grows
        x += 1
    r1, w1, n1 = schedstat(tids)
    assert r1 - r0 >= 0.04 and w1 >= w0 and n1 >= n0
    assert busy_seconds(cpus) >= b0


def test_a_busy_neighbour_is_read_as_one(monkeypatch):
    """The reading itself, end to end: a spinning process beside this one reads as about one core of others'
    demand (it gets one core of two), which the rule turns into one thread."""
    if len(allowed_cpus()) != 2 or busy_seconds(allowed_cpus()) is None:
        pytest.skip("written for 2 cores with /proc")
    g = Governor(2)
    g.threads()
    with corunner("busy", seconds=10):
        time.sleep(0.2)
        g._read(time.monotonic())          # after a pause: a baseline
        for _ in range(3):                 # then readings over intervals where only the neighbour ran
            time.sleep(0.1)
            g._read(time.monotonic())
    assert g.others > 0.6, g.others
    assert g.n == 1


# ---- the matmul regions: who computes a tile never changes its bits

@pytest.mark.parametrize("qt", [QT.Q4_1, QT.Q4_K, QT.Q8_0])
def test_distribution_does_not_change_bits(qt):
    rng = np.random.default_rng(0)
    info = quant_info(qt)
    n_in, d_out = 512, 64 * 9 + 5          # 10 tiles, the last one partial
    raw = rng.integers(0, 256, (d_out, n_in // info.block_size * info.type_size), dtype=np.uint8)
    if qt in (QT.Q4_1, QT.Q8_0):           # keep the f16 scales finite
        blk = raw.reshape(d_out, -1, info.type_size)
        blk[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if qt == QT.Q4_1:
            blk[..., 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
    else:
        blk = raw.reshape(d_out, -1, info.type_size)
        blk[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        blk[..., 2:4] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    w = prepare(raw, qt)
    x = rng.standard_normal((5, n_in)).astype(np.float32)
    ref = matmul_batched(np.zeros((5, d_out), np.float32), x, w, qt)
    assert np.isfinite(ref).all()
    hashes = set()
    for static in (True, False):
        for per in (1, 2, 7):
            for threads in sorted({1, MAX}):
                numba.set_num_threads(threads)
                out = _run_with(w, x, static, per)
                hashes.add(hashlib.sha256(out.tobytes()).hexdigest())
    numba.set_num_threads(MAX)
    assert hashes == {hashlib.sha256(ref.tobytes()).hexdigest()}


def _run_with(w: Packed, x, static: bool, per: int):
    from lumen.format.quants import ACT_FORMAT
    from lumen.kernels.kinds import ALL
    from lumen.kernels.layout import R
    from lumen.kernels.matmul import mat, matmul_kernel, new_acts, prepare_x, unpack_scratch
    from lumen.kernels.scratch import per_thread
    acts = new_acts(x.shape[0], w.n_in, ACT_FORMAT[QT(w.qtype)])
    prepare_x(acts, x, ACT_FORMAT[QT(w.qtype)])
    facc = per_thread((MAX, R), np.float32)
    wk = work.counters(MAX, static=static)
    wk[1] = per
    out = np.zeros((x.shape[0], w.d_out), np.float32)
    m = mat(w)
    matmul_kernel((out, out, out), (m, m, m), 1, acts, facc, unpack_scratch(MAX, w.n_in), wk, ALL)
    return out


def test_claims_split_a_share_between_owner_and_thief():
    """The share's word: the owner takes chunks from the front, a thief from the back, never the same one."""
    wk = work.counters(2)
    n = 5
    taken = []
    for own in (True, False, True, False, False, True, True):
        taken.append(int(_claim(wk, 8, n, own)))
    assert taken == [0, 4, 1, 3, 2, -1, -1]


@numba.njit
def _claim(wk, i, n, own):
    return work.claim(wk, i, n, own)


def test_release_threads_then_parallel_work_again():
    m = lumen.load("smollm2-135m", ctx=64)
    a = m.logits([1, 2, 3])
    assert work.release_threads() in (True, False)    # False where the threading layer is not OpenMP
    b = m.logits([1, 2, 3])
    assert np.array_equal(a, b)


# ---- co-runners

def test_corunner_kinds_are_bounded_and_stopped():
    for kind in ("sleep", "busy"):
        with corunner(kind, seconds=5) as p:
            assert p.poll() is None                     # running
        assert p.poll() is not None                     # stopped when the block ends
    with corunner("busy", seconds=0.2) as p:
        p.wait(timeout=5)                               # and bounded by its own deadline
        assert p.returncode == 0
    with corunner("none") as p:
        assert p is None
    from lumen.bench.corunner import SETTLE_S
    assert SETTLE_S > T.RESET_S                          # what runs next starts from a pause the governor resets on
    with corunner("sleep", seconds=5):
        t = time.monotonic()
    assert time.monotonic() - t >= SETTLE_S
    with pytest.raises(ValueError, match="co-runner"):
        with corunner("loud"):
            pass


def test_corunner_flag_parsing_and_ratios():
    assert parse_kinds(None) == [] and parse_kinds("busy, sleep,busy") == ["busy", "sleep"]
    with pytest.raises(ValueError, match="--corunner"):
        parse_kinds("none")
    with pytest.raises(ValueError, match="--corunner"):
        parse_kinds("sleep,noisy")
    values = {"none": {("tg", "Lumen"): [100.0, 200.0, 100.0]},
              "busy": {("tg", "Lumen"): [50.0, 50.0, 90.0]}}
    (row,) = ratio_rows(values, ["busy"])
    assert row["ratio"] == pytest.approx(0.5) and row["median"] == 50.0 and row["idle_median"] == 100.0


# ---- the threading layer and Numba's cache (lumen/kernels/__init__.py)

CALLEE_FROM_CACHE = '''
import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def par(x):
    for i in prange(x.shape[0]):
        x[i] = 2 * x[i] + 1


@njit(cache=True)
def caller(x):
    par(x)
    return x.sum()
'''


def test_a_caller_compiled_beside_a_cached_parallel_callee_runs_in_a_new_process(tmp_path):
    """Numba 0.68 records "launch the threading layer on load" in a function's cache entry only when the parallel
    callee it links was compiled in the same process. Process 1 compiles and caches the callee; process 2 loads
    it from the cache and compiles the caller, whose entry then lacks the record; process 3 loads the caller and
    calls it. Without lumen.kernels launching the layer at import, process 3 dies with SIGSEGV."""
    (tmp_path / "cachedpar.py").write_text(CALLEE_FROM_CACHE)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(tmp_path)}
    steps = ("import numpy as np, cachedpar; cachedpar.par(np.zeros(8))",
             "import numpy as np, cachedpar; cachedpar.par(np.zeros(8)); print(cachedpar.caller(np.zeros(8)))",
             "import lumen.kernels, numpy as np, cachedpar; print(cachedpar.caller(np.arange(8.0)))")
    out = []
    for code in steps:
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{code!r} exited with {r.returncode}: {r.stderr[-2000:]}"
        out.append(r.stdout.strip())
    assert out[1:] == ["8.0", "64.0"]
