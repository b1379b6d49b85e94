"""The timer layer: every op of every layer of every step, with the work it did. `lumen.profile` is this module,
and calling it opens a profile (the module is callable, so `lumen.profile()` and `import lumen.profile` name one
object; `python -m lumen.profile` is the command line, lumen/profile/__main__.py):

    with lumen.profile() as prof:
        for tok in model.generate("...", max_tokens=32):
            pass
    prof.by_op("decode")        # op -> Agg(calls, seconds, bytes, flops)
    prof.coverage()             # per step: share of the step's wall time attributed to ops

The compiled forward writes a time-stamp-counter tick after each op into a preallocated array
(lumen/model/forward.py), so ops inside the fused Numba function are timed individually. Around it,
Python-side timestamps (in the same tick clock) time the glue: the engine's scheduling ("schedule"), filling the
batch ("prepare"), dispatching the call ("dispatch"), returning from it ("return"), sampling ("sample") and
detokenizing ("detokenize"). A step is one forward pass: a prefill chunk, a decode token, or an engine step
over many sequences (its tokens, sequences and the KV tokens attention reads are recorded); what its wall time
holds beyond the recorded segments is reported as "unattributed".

Without a profile, `active()` returns NULL, a profiler whose methods do nothing, so callers never branch on it.
The hook lives in lumen/timer.py, below the engine that calls it; `profile()` installs a Profiler there.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import LumenError
# NULL, NullProfiler, active: the hook's names, also reachable here as before
from ..timer import NULL, NullProfiler, StepClock, active, recording, tick_rate, ticks  # noqa: F401

PHASES = ("prefill", "decode", "mixed")     # mixed: an engine step with both prefill chunks and decode tokens


@dataclass
class Record:
    step: int
    phase: str
    layer: int          # -1 for ops outside the layer stack
    op: str
    seconds: float
    bytes: int          # weights + KV + activations read and written (estimated from shapes and types)
    flops: int


@dataclass
class Step:
    step: int
    phase: str
    n_tokens: int
    n_seqs: int = 1
    kv_tokens: int = 0  # keys attention reads (per layer, summed over the step's tokens)
    wall_s: float = 0.0
    t0: float = 0.0     # time.perf_counter() at its start and end (the clock of RequestMetrics)
    t1: float = 0.0
    requests: tuple = ()  # the engine requests that ran in it


@dataclass
class Agg:
    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0
    flops: int = 0

    def add(self, r: Record):
        self.calls += 1
        self.seconds += r.seconds
        self.bytes += r.bytes
        self.flops += r.flops

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


@dataclass
class Profiler(StepClock):
    enabled = True
    records: list[Record] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    _open: Step | None = None
    _t0: int = 0
    _paused_at: int = 0
    _excluded: int = 0
    _last: int = 0      # tick where the last recorded segment of the open step ended
    _paused: bool = False

    # ---- recording (called by the runner and the engine) ----
    def begin_step(self, phase: str, n_tokens: int = 0, n_seqs: int = 1, kv_tokens: int = 0) -> None:
        self._open = Step(len(self.steps), phase, n_tokens, n_seqs, kv_tokens, t0=time.perf_counter())
        self._excluded = 0
        self._t0 = self._last = ticks()

    def describe(self, phase: str, n_tokens: int, n_seqs: int, kv_tokens: int, requests: tuple = ()) -> None:
        """Set the open step's shape once it is known (the engine knows it after scheduling). What the step
        recorded before (its "schedule") takes the phase too: a record's phase is its step's."""
        st = self._open
        st.phase, st.n_tokens, st.n_seqs, st.kv_tokens, st.requests = phase, n_tokens, n_seqs, kv_tokens, requests
        for r in reversed(self.records):
            if r.step != st.step:
                break
            r.phase = phase

    def end_step(self, at: int | None = None) -> None:
        """Close the step at tick `at` (now by default)."""
        st = self._open
        if st is None:
            return
        if self._paused:  # closed while paused (generate returned to its consumer): the step ended at the pause
            at, self._paused = self._paused_at, False
        st.wall_s = ((ticks() if at is None else at) - self._t0 - self._excluded) / tick_rate()
        st.t1 = time.perf_counter()
        self.steps.append(st)
        self._open = None

    def cancel_step(self) -> None:
        """Drop the open step (nothing ran in it) and what it recorded."""
        st, self._open, self._paused = self._open, None, False
        if st is not None:
            while self.records and self.records[-1].step == st.step:
                self.records.pop()

    def lap(self, op: str) -> int:
        """Record the Python code that ran since the last segment ended as `op`; returns the tick now. Segments
        are contiguous, so nothing between two timestamps of a step goes unnamed."""
        now = ticks()
        self.add(op, (now - self._last) / tick_rate())
        self._last = now
        return now

    @property
    def in_step(self) -> bool:
        return self._open is not None

    def add(self, op: str, seconds: float, layer: int = -1, nbytes: int = 0, flops: int = 0) -> None:
        st = self._open
        if st is None:
            raise LumenError("profiler: an op was recorded outside a step")
        self.records.append(Record(st.step, st.phase, layer, op, seconds, int(nbytes), int(flops)))

    def record_forward(self, runner, batch, own: bool) -> None:
        """Records of the forward call that just returned (runner.scr.times holds its op ticks); own: the call
        opened its own step, which ends here. The bookkeeping is kept out of the step's time."""
        from .costs import forward_costs
        c_exit = ticks()
        if not own:
            self.pause(at=c_exit)
        self._record_ticks(c_exit, runner.scr.times, forward_costs(runner, batch))
        if own:
            self.end_step(at=c_exit)
        else:
            self.resume()

    def _record_ticks(self, c_exit: int, times: np.ndarray, costs) -> None:
        """`times` holds the kernel's op ticks (start tick in the last slot), c_exit the tick taken in Python
        after the call; costs[slot] = (layer, op, bytes, flops). "dispatch" is the Python glue and Numba dispatch
        from the end of the step's previous segment to the kernel's first tick."""
        rate = tick_rate()
        start = int(times[-1])
        self.add("dispatch", (start - self._last) / rate)
        prev = start
        for slot, (layer, op, nb, fl) in enumerate(costs):
            t = int(times[slot])
            self.add(op, (t - prev) / rate, layer, nb, fl)
            prev = t
        self.add("return", (c_exit - prev) / rate)
        self._last = c_exit

    # ---- reading ----
    def select(self, phase: str | None = None, op: str | None = None, layer: int | None = None) -> list[Record]:
        if phase is not None and phase not in PHASES:
            raise LumenError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        ops = {r.op for r in self.records}
        if op is not None and op not in ops:
            raise LumenError(f"unknown op {op!r}; recorded ops are {', '.join(sorted(ops))}")
        layers = {r.layer for r in self.records}
        if layer is not None and layer not in layers:
            raise LumenError(f"unknown layer {layer}; recorded layers are {min(layers)}..{max(layers)}")
        return [r for r in self.records if (phase is None or r.phase == phase) and (op is None or r.op == op)
                and (layer is None or r.layer == layer)]

    def _group(self, key, phase) -> dict:
        out: dict = {}
        for r in self.select(phase):
            out.setdefault(key(r), Agg()).add(r)
        return out

    def by_op(self, phase: str | None = None) -> dict[str, Agg]:
        return self._group(lambda r: r.op, phase)

    def by_layer(self, phase: str | None = None) -> dict[int, Agg]:
        return self._group(lambda r: r.layer, phase)

    def by_phase(self) -> dict[str, Agg]:
        return self._group(lambda r: r.phase, None)

    def coverage(self, phase: str | None = None) -> list[tuple[int, float, float]]:
        """Per step: (step, wall seconds, attributed share); the rest of the wall time is unattributed."""
        got: dict[int, float] = {}
        for r in self.records:
            got[r.step] = got.get(r.step, 0.0) + r.seconds
        return [(s.step, s.wall_s, got.get(s.step, 0.0) / s.wall_s if s.wall_s > 0 else 1.0)
                for s in self.steps if phase is None or s.phase == phase]

    def unattributed_s(self, phase: str | None = None) -> float:
        return sum(w * (1 - share) for _, w, share in self.coverage(phase))

    def to_json(self, path: str | Path) -> None:
        path = Path(path)
        try:
            path.write_text(json.dumps({"steps": [asdict(s) for s in self.steps],
                                        "records": [asdict(r) for r in self.records]}))
        except OSError as e:
            raise LumenError(f"cannot write the profile to {path}: {e.strerror}") from None


@contextmanager
def profile() -> Iterator[Profiler]:
    """Profile every forward step (and the engine's scheduling, sampling and detokenizing) run inside the block,
    in this thread."""
    from ..model.forward import TIMERS
    if not TIMERS:
        raise LumenError("the op timers are compiled out (LUMEN_TIMERS=0); unset it to profile")
    tick_rate()  # calibrate the clock now, not inside the first step
    with recording(Profiler()) as p:
        yield p


class _CallableModule(sys.modules[__name__].__class__):
    """`lumen.profile()` opens a profile whether `lumen.profile` names this module or the function: the package
    attribute becomes the module as soon as anything imports lumen.profile, so the module answers the call."""

    def __call__(self):
        return profile()


sys.modules[__name__].__class__ = _CallableModule


