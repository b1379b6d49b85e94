"""The timer layer: every op of every layer of every step, with the work it did.

    with lumen.profile() as prof:
        for tok in model.generate("...", max_tokens=32):
            pass
    prof.by_op("decode")        # op -> Agg(calls, seconds, bytes, flops)
    prof.coverage()             # per step: share of the step's wall time attributed to ops

The compiled forward writes a time-stamp-counter tick after each op into a preallocated array (lumen/forward.py),
so ops inside the fused Numba function are timed individually. Around it, Python-side timestamps (in the same
tick clock) time the glue: preparing and dispatching the call ("dispatch") and returning from it ("return"). The
generate loop adds "sample" and "detokenize". A step is one prefill chunk or one decode token; what its wall time
holds beyond the recorded ops is reported as "unattributed".
"""
from __future__ import annotations

import json
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import LumenError
from .timer import tick_rate, ticks

PHASES = ("prefill", "decode")
_ACTIVE: ContextVar["Profiler | None"] = ContextVar("lumen_profiler", default=None)


def active() -> "Profiler | None":
    """The profiler of the innermost `with lumen.profile()`, or None."""
    return _ACTIVE.get()


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
    pos0: int
    wall_s: float = 0.0


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
class Profiler:
    records: list[Record] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    _open: Step | None = None
    _t0: int = 0
    _paused_at: int = 0
    _excluded: int = 0
    _last: int = 0      # tick where the last recorded segment of the open step ended
    _paused: bool = False

    # ---- recording (called by Model and generate) ----
    def begin_step(self, phase: str, n_tokens: int, pos0: int) -> None:
        self._open = Step(len(self.steps), phase, n_tokens, pos0)
        self._excluded = 0
        self._t0 = self._last = ticks()

    def end_step(self, at: int | None = None) -> None:
        """Close the step at tick `at` (now by default)."""
        st = self._open
        if st is None:
            return
        if self._paused:  # closed while paused (generate returned to its consumer): the step ended at the pause
            at, self._paused = self._paused_at, False
        st.wall_s = ((ticks() if at is None else at) - self._t0 - self._excluded) / tick_rate()
        self.steps.append(st)
        self._open = None

    def pause(self, at: int | None = None) -> None:
        """Stop the step's clock (while generate yields to its consumer, or the profiler does its bookkeeping)."""
        self._paused_at = ticks() if at is None else at
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._last = ticks()
        self._excluded += self._last - self._paused_at

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

    def record_forward(self, c_exit: int, times: np.ndarray, costs) -> None:
        """Records of one forward call: `times` holds the kernel's op ticks (start tick in the last slot), c_exit
        the tick taken in Python after the call; costs[slot] = (layer, op, bytes, flops). "dispatch" is the Python
        glue and Numba dispatch from the end of the step's previous segment to the kernel's first tick."""
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
    """Profile every forward step (and the generate loop's sampling and detokenizing) run inside the block."""
    from .forward import TIMERS
    if not TIMERS:
        raise LumenError("the op timers are compiled out (LUMEN_TIMERS=0); unset it to profile")
    tick_rate()  # calibrate the clock now, not inside the first step
    p = Profiler()
    token = _ACTIVE.set(p)
    try:
        yield p
    finally:
        _ACTIVE.reset(token)


# per model, per (N, n_out): the costs that do not depend on the position. Weak keys: an id() key could be
# reused by a later model and hand it another model's costs.
_STATIC: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def forward_costs(model, N: int, pos0: int, n_out: int) -> list[tuple[int, str, int, int]]:
    """(layer, op, bytes, flops) per timer slot of one forward call of N tokens at pos0, from shapes and types.

    Matmuls: packed weight bytes read + activations in/out, 2*N*d_out*n_in flops. Attention: K and V rows read
    from the f16 cache for every (token, kv head), 2*(hd + hd_v) flops per (query head, key). Elementwise ops:
    their activations in and out."""
    from .forward import LAYER_OPS, MATS, OPS
    c, w = model.config, model.weights
    per_model = _STATIC.setdefault(model, {})
    key = (N, n_out)
    static = per_model.get(key)
    if static is None:
        from .forward import P_DOUT, P_NIN
        pk = w.packs
        nbytes = [(_mat_bytes(pk, i), int(pk.table[i, P_DOUT]), int(pk.table[i, P_NIN]))
                  for i in range(pk.table.shape[0])]
        E, F = c.n_embd, c.n_ff
        qd, kd, vd = c.q_dim, c.kv_dim, c.v_dim
        act = 4 * N
        elem = {"attn_norm": (2 * act * E, 4 * N * E), "qk_norm": (2 * act * (qd + kd) if c.qk_norm else 0,
                                                                     4 * N * (qd + kd) if c.qk_norm else 0),
                "rope": (2 * act * (qd + kd), 3 * N * (qd + kd)), "kv_store": (act * (kd + vd) + 2 * N * (kd + vd), 0),
                "post_attn_norm": (2 * act * E if c.post_norms else 0, 4 * N * E if c.post_norms else 0),
                "attn_residual": (3 * act * E, N * E), "ffn_norm": (2 * act * E, 4 * N * E),
                "act": (3 * act * F, 8 * N * F), "post_ffn_norm": (2 * act * E if c.post_norms else 0,
                                                                   4 * N * E if c.post_norms else 0),
                "ffn_residual": (3 * act * E, N * E)}
        mat_of = {"q": 0, "k": 1, "v": 2, "o": 3, "gate": 4, "up": 5, "down": 6}
        layers = []
        for il in range(c.n_layer):
            row = []
            for op_id in LAYER_OPS:
                op = OPS[op_id]
                if op in mat_of:
                    b, d_out, n_in = nbytes[int(w.mt[il, mat_of[op]])]
                    row.append([il, op, b + act * (n_in + d_out), 2 * N * d_out * n_in])
                elif op == "attention":
                    row.append([il, op, 0, 0])  # filled per pos0
                else:
                    row.append([il, op, *elem[op]])
            layers.append(row)
        emb_rb = int(w.gt[0, 4])
        head_b, head_out, head_in = nbytes[int(w.gt[2, 0])]
        static = ([[-1, "embed", N * emb_rb + act * E, N * E]], layers,
                  [[-1, "output_norm", 2 * 4 * n_out * E, 4 * n_out * E],
                   [-1, "output", head_b + 4 * n_out * (head_in + head_out), 2 * n_out * head_out * head_in]])
        per_model[key] = static
    first, layers, last = static
    out = [tuple(first[0])]
    att_slot = LAYER_OPS.index(OPS.index("attention"))
    for il, row in enumerate(layers):
        win = c.window_of(il)
        keys = sum(min(pos0 + t + 1, win) if win else pos0 + t + 1 for t in range(N))
        kv_bytes = keys * c.n_head_kv * (c.head_dim + c.head_dim_v) * 2   # f16 cache
        row[att_slot][2] = kv_bytes + 4 * N * (c.q_dim + c.n_head * c.head_dim_v)
        row[att_slot][3] = 2 * keys * c.n_head * (c.head_dim + c.head_dim_v)
        out.extend(tuple(r) for r in row)
    out.extend(tuple(r) for r in last)
    return out


def _mat_bytes(pk, i: int) -> int:
    """Bytes of packed matrix i: its values, scales and offsets."""
    from .forward import P_FAM, P_G, P_H, P_NIN, P_OG, P_T
    from .kernels.matmul import F32, Q4, R
    fam, T, G, H, n_in, OG = (int(pk.table[i, k]) for k in (P_FAM, P_T, P_G, P_H, P_NIN, P_OG))
    if fam == F32:
        values = T * n_in * R * 4
    elif fam == Q4:
        values = T * G * 16 * R
    else:
        values = T * G * 32 * R
    return values + T * G * H * R * 4 + T * OG * R * 4
