"""How many threads a step runs on: as many as the machine has cores left over, measured while it runs.

A decode step is 121 fork-join parallel regions for SmolLM2 (lumen.model.forward). Each ends at a barrier, so it
runs at the pace of its slowest thread: when another process wants a core, the OS takes it from one of our threads
for a scheduler slice and the other waits: beside one busy process on 2 cores, 2 threads decode at a fraction of
what 1 thread does (profiling/shared_machine.py). A server's own event loop and a client on the same cores are
such a neighbour too. So the number of threads follows what others use:

    others = (CPU time of every allowed core, from /proc/stat) - (CPU time of our compute threads)
             over the last SLOW_S, in cores
    wait   = the time our compute threads spent runnable but not running, over the last WINDOW_S, in cores
    fewer threads when others > (cores - threads) + DOWN, or wait > WAIT_DOWN in WAIT_WINDOWS readings in a row,
    more when others < (cores - threads - 1) + UP in UP_WINDOWS readings in a row

Our compute threads are the calling thread and the OpenMP workers of its parallel regions (their run time and
wait from /proc/self/task/<tid>/schedstat, in ns), so the server's event loop counts as a neighbour, as it is.
/proc/stat counts in clock ticks (10 ms), too coarse for a short window, so `others` spans SLOW_S; `wait` is
exact, so a busy neighbour that arrives costs about WAIT_WINDOWS x WINDOW_S at the old count. The thresholds sit
between what a busy neighbour reads (wait and others near a core) and what a sleeping loop or the server's own
event loop and client read (a few tenths at most; profiling/shared_machine.py prints both). Reading the files
every WINDOW_S costs tens of microseconds; between readings `threads()` is a clock read and a compare. The thread
count never changes a result: every kernel gives the same bits on any number of threads (tests/test_determinism).

A pause (no step for over PAUSE_S: a server between requests, a benchmark between repetitions; a long step is not
one, `done` marks each step's end) is no reading of now: a neighbour that ran in it may have left (a benchmark's
other engine), or may still be there, and the first steps after it run on whatever count they are given before
the readings can act. So after a pause:

    if others used more than DOWN over the pause, and runnable_others() (tasks runnable this instant that are not
    ours: /proc/loadavg's running count less this process's threads in state R, the fewest of 3 readings 1 ms
    apart) says someone still does: as many threads as that instant count leaves (a sleeping loop or a kernel
    thread is runnable for a moment; read three times apart, and only after a pause others were busy in, it does
    not trip this)
    otherwise, after a pause of over RESET_S: every thread again (what held one back may be gone)

Beside a busy process this rule keeps the first steps after each pause on the core that is free, where starting
again on every thread made them wait for the neighbour (profiling/shared_machine.py part 3 measures both).

`Governor(max_threads, adaptive=False)` (or LUMEN_FIXED_THREADS=1, `--fixed-threads`) keeps max_threads always.
Either way never more than the CPUs the process can compute on (lumen.cpu.usable_cpus: its affinity, a cgroup CPU
quota), and it says so: Numba starts as many threads as NUMBA_NUM_THREADS asks, whatever the process may use.
Where /proc is missing (not Linux) it keeps max_threads too.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time

from ..cpu import allowed_cpus, cpu_quota, usable_cpus

WINDOW_S = 0.05       # seconds between readings of our threads' wait
SLOW_S = 0.2          # seconds over which others' demand is read
DOWN = 0.35           # cores of others' demand beyond the free ones before a thread is given up
WAIT_DOWN = 0.45      # cores' worth of waiting for a core (our threads, summed), in WAIT_WINDOWS readings in a row,
WAIT_WINDOWS = 2      # before a thread is given up without waiting for the slow reading
UP = 0.10             # others' demand below the free cores less one by this: a thread is taken back ...
UP_WINDOWS = 2        # ... after this many SLOW_S readings in a row
PAUSE_S = 0.2         # a reading over a longer interval (no step ran) is no reading of now: a baseline only (read
                      # over pauses, a neighbour that had left, or a benchmark's other engine, held the next steps
                      # at one thread)
RESET_S = 1.0         # after a pause longer than this, start again from max_threads
PROBES = 3            # after a pause others were busy in: readings of who is runnable now (runnable_others) ...
PROBE_GAP_S = 0.001   # ... this far apart: read back to back they catch transients (a task that just exited)
log = logging.getLogger("lumen.engine")
_WARNED: set[tuple[int, int]] = set()   # (threads asked, usable CPUs) already said to be too many
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_seconds(cpus: list[int]) -> float | None:
    """CPU seconds spent not idle on `cpus` since boot (user, nice, system, irq, softirq; not idle, iowait or
    steal), or None where /proc/stat cannot be read."""
    want = {f"cpu{c}" for c in cpus}
    total = 0
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu"):
                    break
                parts = line.split()
                if parts[0].decode() in want:
                    v = [int(x) for x in parts[1:8]]
                    total += v[0] + v[1] + v[2] + v[5] + v[6]
    except OSError:
        return None
    return total / _HZ


def runnable() -> tuple[int, int]:
    """(tasks runnable on the machine this instant, threads of this process among them): /proc/loadavg's
    running count and the threads of /proc/self/task in state R. Raises OSError where /proc cannot be read."""
    with open("/proc/loadavg", "rb") as f:
        running = int(f.read().split()[3].split(b"/")[0])
    mine = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat", "rb") as f:
                st = f.read()
        except OSError:                               # a thread that ended meanwhile
            continue
        mine += st[st.rindex(b")") + 2:st.rindex(b")") + 3] == b"R"
    return running, mine


def runnable_others(cpus: list[int]) -> int | None:
    """Tasks runnable right now that are not threads of this process (`runnable`), the fewest of PROBES readings
    PROBE_GAP_S apart (about 50 us each, 2 ms in all): a neighbour that computes is runnable at every one, a kernel
    thread's or a sleeping loop's moment at one at most. None where /proc cannot be read, or where `cpus` are not
    all the machine's (the count is the whole machine's)."""
    if len(cpus) != (os.cpu_count() or 0):
        return None
    best = None
    for i in range(PROBES):
        if i:
            time.sleep(PROBE_GAP_S)
        try:
            running, mine = runnable()
        except (OSError, ValueError, IndexError):
            return None
        best = running - mine if best is None else min(best, running - mine)
    return max(0, best)


def schedstat(tids: list[int]) -> tuple[float, float, int]:
    """Summed over the threads `tids` of this process: seconds run, seconds waited for a core (runnable, not
    running), times switched in (/proc/self/task/<tid>/schedstat; a gone thread counts 0)."""
    run = wait = n = 0
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/schedstat", "rb") as f:
                a, b, c = f.read().split()[:3]
            run, wait, n = run + int(a), wait + int(b), n + int(c)
        except (OSError, ValueError):
            pass
    return run / 1e9, wait / 1e9, n


class Governor:
    """The thread count of each step, from the cores that others leave us (see the module docstring)."""

    def __init__(self, max_threads: int, adaptive: bool = True):
        self.max = max_threads
        self.n = max_threads
        self.cpus = allowed_cpus()
        # threads beyond the CPUs this process can compute on (NUMBA_NUM_THREADS or --threads over a taskset, a
        # container's cpuset or CPU quota) wait for one another at every barrier: 2 threads on 1 CPU decoded at a
        # quarter of 1 thread's rate. `threads` never gives more than `usable`.
        self.usable = usable_cpus()
        if max_threads > self.usable and (max_threads, self.usable) not in _WARNED:     # once a process
            _WARNED.add((max_threads, self.usable))
            log.warning("%d threads asked, but this process can compute on %d CPU%s (affinity %d of %d, CPU quota "
                        "%s): its steps run on %d", max_threads, self.usable, "s" * (self.usable != 1),
                        len(self.cpus), os.cpu_count() or 0, cpu_quota() or "none", self.usable)
        self.adaptive = (adaptive and max_threads > 1 and os.environ.get("LUMEN_FIXED_THREADS", "0") in ("", "0")
                         and busy_seconds(self.cpus) is not None)
        self.others = 0.0                     # the last reading: others' demand, in cores
        self.wait = 0.0                       # ... our compute threads' wait for a core, in cores
        self.switches_per_step = 0.0          # ... their context switches per step (barrier sleeps)
        self.changes = 0                      # how often n changed
        self.steps = 0
        self._tids: dict[int, list[int]] = {}      # calling thread ident -> its compute threads' tids
        self._last: tuple | None = None            # the last reading: (time, busy, ours, wait, switches, steps,
                                                   # calling thread)
        self._slow: tuple | None = None            # the reading others' demand is measured from
        self._ups = 0
        self._waits = 0
        self._end: float | None = None             # when the last step ended (`done`)

    def threads(self) -> int:
        """The thread count for the step the calling thread is about to run (set in Numba for that thread)."""
        self.steps += 1
        if self.adaptive:
            now = time.monotonic()
            if self._last is None or now - self._last[0] >= WINDOW_S:
                self._read(now)
        import numba
        n = min(self.n, self.usable)
        if numba.get_num_threads() != n:      # (read, not remembered: another engine's steps in this thread, or
            numba.set_num_threads(n)          # the caller, may have set another count since; ~1 us)
        return n

    def done(self) -> None:
        """The step the last `threads` was for has ended: the time until the next one is a pause, not a step."""
        if self.adaptive:
            self._end = time.monotonic()

    def _compute_tids(self) -> list[int]:
        ident = threading.get_ident()
        tids = self._tids.get(ident)
        if tids is None:
            from ..kernels.work import compute_thread_ids, numba_threads
            with numba_threads(self.max):
                tids = compute_thread_ids(self.max)
            tids = sorted(set(tids) | {threading.get_native_id()})
            if len(self._tids) >= 8:                  # threads come and go (tests, executors): keep a few
                self._tids.clear()
            self._tids[ident] = tids
        return tids

    def _read(self, now: float) -> None:
        busy = busy_seconds(self.cpus)
        ours, wait, switches = schedstat(self._compute_tids())
        if busy is None:
            return
        snap = (now, busy, ours, wait, switches, self.steps, threading.get_ident())
        last, self._last = self._last, snap
        # the time no step ran before this one (a long step since the last reading is a reading, not a pause:
        # counted as a pause, a prefill of 0.2 s or more a step never let a thread be taken back)
        idle = 0.0 if last is None else now - (last[0] if self._end is None or self._end < last[0] else self._end)
        if last is None or idle > PAUSE_S or last[6] != snap[6]:
            # the first reading, after a pause, or of another calling thread's compute threads: a baseline
            self._slow = snap
            if last is not None and last[6] == snap[6]:
                self._after_pause(idle, max(0.0, ((busy - last[1]) - (ours - last[2])) / (now - last[0])))
            return
        dt = now - last[0]
        self.wait = max(0.0, (wait - last[3]) / dt)
        self.switches_per_step = (switches - last[4]) / max(1, self.steps - last[5])
        slow = now - self._slow[0] >= SLOW_S
        if slow:
            s, self._slow = self._slow, snap
            self.others = max(0.0, ((busy - s[1]) - (ours - s[2])) / (now - s[0]))
        self.decide(self.others, self.wait, slow)

    def _after_pause(self, pause: float, others: float) -> int:
        """The count for the first step after a pause of `pause` s over which others used `others` cores (module
        docstring). Returns the new thread count."""
        n = self.n
        now = runnable_others(self.cpus) if others > DOWN else None
        if now is not None and now > 0:
            # someone used a core in the pause and still runs: a short step at every thread would wait on it at
            # each barrier
            self.others = float(now)
            target = self._target(len(self.cpus), self.others, DOWN)
            self.n = target if pause > RESET_S else min(self.n, target)
        elif pause > RESET_S:
            # what held a thread back may be gone: start from all of them. The wait readings give one up again
            # within WAIT_WINDOWS x WINDOW_S if not, but a long step (a prefill) runs on what it is given: pp512
            # ran at 0.55x on an idle machine at the count a neighbour had left behind (a benchmark's other
            # engine, which runs in our pauses), while at 2 threads beside a busy neighbour it keeps 0.93x
            self.n = self.max
        if self.n != n:
            self._ups = self._waits = 0
            self.changes += 1
            log.debug("threads %d -> %d: after a %.1f s pause (others used %.2f cores in it, %s now)", n, self.n,
                      pause, others, "none" if now is None else now)
        return self.n

    def decide(self, others: float, wait: float = 0.0, slow: bool = True) -> int:
        """Apply one reading: others' demand and our threads' wait for a core (cores); slow: others is a new
        SLOW_S reading (only those count towards taking a thread back). Returns the new thread count."""
        cores, n = len(self.cpus), self.n
        down = self._target(cores, others, DOWN) if slow else n     # a fast reading's `others` is the last slow one
        self._waits = self._waits + 1 if wait > WAIT_DOWN else 0
        if self._waits >= WAIT_WINDOWS:
            down = min(down, max(1, self.n - 1))
        up = self._target(cores, others, UP)
        if down < self.n:
            self.n, self._ups, self._waits = down, 0, 0
            self.changes += 1
        elif slow and up > self.n:
            self._ups += 1
            if self._ups >= UP_WINDOWS:
                self.n, self._ups = up, 0
                self.changes += 1
        elif slow:
            self._ups = 0
        if self.n != n:
            log.debug("threads %d -> %d: others use %.2f of %d cores (our threads waited %.2f, %.1f switches a "
                      "step)", n, self.n, others, cores, self.wait, self.switches_per_step)
        return self.n

    def _target(self, cores: int, others: float, margin: float) -> int:
        return max(1, min(self.max, cores - math.ceil(max(0.0, others - margin))))
