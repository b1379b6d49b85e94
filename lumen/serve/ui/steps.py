"""The engine's recent steps for the dashboard: each step's shape and where its time went, recorded only while a
dashboard looks.

The engine already reports every step to the profiler of its thread (lumen.profile: `begin_step`, `describe`,
`lap`, `record_forward`, `end_step`); outside a profile that is `NULL`, whose methods do nothing, and the
compiled forward skips its op timers. A `StepTap` wraps the engine thread's `engine.step()`:

    outs = engine.step() if tap is None else tap.step(engine)        # lumen.serve.worker's loop

While no dashboard has polled for `hold_s` seconds, `tap.step` is `engine.step()` behind one clock read. While
one has, the step runs under a `StepRecorder`: a profiler that keeps no per-op records but folds each step into
one `StepRecord` (shape + seconds per op group) in a bounded ring, so it costs a few numpy calls per step and
memory bounded by `keep` steps. A `--profile` run's profiler is left alone (the dashboard then shows no split).

No request ids, prompts or outputs are kept: a record is counts and seconds.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from ...timer import StepClock, active as profiler_active, recording, tick_rate, ticks

# op groups, in display order; an op the table does not know counts as "python" (it is a lap of Python code)
GROUPS = ("attention", "matmul", "head", "elementwise", "draft", "sampling", "python")
GROUP_OF = {"attention": "attention",
            "qkv": "matmul", "o": "matmul", "gate_up": "matmul", "down": "matmul",
            "output_norm": "head", "output": "head",
            "embed": "elementwise", "attn_norm": "elementwise", "qk_norm": "elementwise", "rope": "elementwise",
            "kv_store": "elementwise", "post_attn_norm": "elementwise", "attn_residual": "elementwise",
            "ffn_norm": "elementwise", "act": "elementwise", "post_ffn_norm": "elementwise",
            "ffn_residual": "elementwise",
            "sample": "sampling",
            "schedule": "python", "prepare": "python", "dispatch": "python", "return": "python",
            "detokenize": "python"}
_G = {g: i for i, g in enumerate(GROUPS)}
_PY, _DRAFT = _G["python"], _G["draft"]


@dataclass(frozen=True)
class StepRecord:
    t: float                 # time.time() at the step's end
    phase: str               # "decode", "prefill" or "mixed"
    n_tokens: int            # tokens the forward pass ran
    n_seqs: int              # sequences in the batch
    kv_tokens: int           # KV tokens attention read (summed over the step's sequences)
    wall_s: float
    split: tuple             # seconds per GROUPS entry; wall_s - sum(split) went unattributed


class StepRecorder(StepClock):
    """A profiler (the protocol of lumen.profile.Profiler) that folds each step into one StepRecord. Forward calls
    before the step's last are a draft model's (lumen.engine.speculative runs it before the target's forward):
    their time counts as "draft"."""
    enabled = True

    def __init__(self, keep: int = 512):
        self.ring: deque[StepRecord] = deque(maxlen=keep)
        self._slot_groups: dict[int, np.ndarray] = {}        # timer slots -> group index of each slot
        self._open = None
        self._split = np.zeros(len(GROUPS))
        self._forwards: list[np.ndarray] = []                  # per forward call of the open step: its split
        self._t0 = self._last = self._excluded = self._paused_at = 0
        self._paused = False

    @property
    def in_step(self) -> bool:
        return self._open is not None

    def begin_step(self, phase: str, n_tokens: int = 0, n_seqs: int = 1, kv_tokens: int = 0) -> None:
        self._open = [phase, n_tokens, n_seqs, kv_tokens]
        self._split[:] = 0
        self._forwards = []
        self._excluded, self._paused = 0, False
        self._t0 = self._last = ticks()

    def describe(self, phase: str, n_tokens: int, n_seqs: int, kv_tokens: int, requests: tuple = ()) -> None:
        self._open = [phase, n_tokens, n_seqs, kv_tokens]           # the request ids are not kept

    def lap(self, op: str) -> int:
        now = ticks()
        self.add(op, (now - self._last) / tick_rate())
        self._last = now
        return now

    def add(self, op: str, seconds: float, layer: int = -1, nbytes: int = 0, flops: int = 0) -> None:
        if self._open is not None:
            self._split[_G.get(GROUP_OF.get(op, "python"), _PY)] += seconds

    def record_forward(self, runner, batch, own: bool) -> None:
        """The forward call that just returned: runner.scr.times holds its op ticks (the start tick in the last
        slot), read as lumen.profile.Profiler reads them; the bookkeeping is kept out of the step's time."""
        c_exit = ticks()
        if own:                                  # a forward outside an engine step: a step of its own
            self._record(runner, batch, c_exit)
            return self.end_step(at=c_exit)
        self.pause(at=c_exit)
        self._record(runner, batch, c_exit)
        self.resume()

    def _record(self, runner, batch, c_exit: int) -> None:
        times = runner.scr.times
        groups = self._slot_groups.get(len(times))
        if groups is None:
            groups = self._slot_groups[len(times)] = _groups_of_slots(runner, batch)
        rate = tick_rate()
        start = int(times[-1])
        op_ticks = np.diff(times[:-1], prepend=start)            # slot i: times[i] - times[i-1] (start before 0)
        split = np.bincount(groups, weights=op_ticks, minlength=len(GROUPS)) / rate
        split[_PY] += ((start - self._last) + (c_exit - int(times[-2]))) / rate     # dispatch + return
        self._forwards.append(split)
        self._last = c_exit

    def end_step(self, at: int | None = None) -> None:
        if self._open is None:
            return
        if self._paused:
            at, self._paused = self._paused_at, False
        wall = ((ticks() if at is None else at) - self._t0 - self._excluded) / tick_rate()
        split = self._split.copy()
        if self._forwards:
            split += self._forwards[-1]                          # the target's forward
            for f in self._forwards[:-1]:                        # the draft model's
                split[_DRAFT] += f.sum()
        phase, n_tokens, n_seqs, kv_tokens = self._open
        self.ring.append(StepRecord(time.time(), phase, int(n_tokens), int(n_seqs), int(kv_tokens), wall,
                                    tuple(float(x) for x in split)))
        self._open = None

    def cancel_step(self) -> None:
        self._open, self._paused = None, False


def _groups_of_slots(runner, batch) -> np.ndarray:
    """The group index of every timer slot but the last (the start tick), from the profiler's own slot table
    (lumen.profile.costs.forward_costs names each slot's op)."""
    from ...profile.costs import forward_costs
    return np.array([_G[GROUP_OF.get(op, "python")] for _, op, _, _ in forward_costs(runner, batch)], np.intp)


class StepTap:
    """Runs the engine's steps, under a StepRecorder while a dashboard has looked within `hold_s` seconds."""

    def __init__(self, hold_s: float = 5.0, keep: int = 512):
        from ...model.forward import TIMERS
        self.hold_s = hold_s
        self.recorder = StepRecorder(keep)
        self.timers = TIMERS                     # LUMEN_TIMERS=0 compiles the op timers out: nothing to record
        self._until = 0.0                        # time.monotonic() until which steps are recorded

    def look(self) -> None:
        """A dashboard looked: record the steps of the next hold_s seconds."""
        self._until = time.monotonic() + self.hold_s

    @property
    def recording(self) -> bool:
        return self.timers and time.monotonic() < self._until

    def step(self, engine) -> list:
        """engine.step(), recorded while a dashboard looks (and no other profile records this thread)."""
        if not self.recording or profiler_active().enabled:
            return engine.step()
        with recording(self.recorder):
            return engine.step()

    def recent(self, since: float = 0.0) -> list[StepRecord]:
        """The recorded steps that ended after `since` (time.time()), oldest first."""
        return [r for r in list(self.recorder.ring) if r.t > since]
