"""The serving profile: where every millisecond of a request's TTFT and of its inter-token gaps went.

Inputs: the profiler's engine steps (each with its start and end on the requests' clock, the requests that ran
in it, and its segments: schedule, prepare, forward (dispatch, every op, return), sample, detokenize) and one
`Trace` per request: arrival, when each token was made, and when each was sent to the client (the server records
that; offline, made = sent).

A request's interval [a, b] is split into parts:
    queue        before its first step (admission waits for a free slot, a block or the budget)
    schedule, prepare, forward, sample, detokenize
                 the segments of the steps it ran in (the whole step: it waits for all of the step's work)
    unattributed the steps' time between their segments
    profiling    the profiler's own bookkeeping inside those steps (costing each op of a new batch shape takes
                 milliseconds): time the step took only because it was profiled
    other steps  steps it did not run in after admission (its prefill chunk did not fit the budget, preemption)
    between steps  time covered by no step (the engine loop, waiting for work)
    send         from the step that made the token to the bytes leaving the server (SSE, JSON)
TTFT is [arrival, first token sent]; an ITL is [token k sent, token k+1 sent]. A request not streamed (all its
tokens sent at once) has no ITL: its gaps of 0 are not gaps a client saw, and its TTFT (the whole response) is
split up to its last token made, "send" being only the rest. `report` gives p50 and p99 of
each and the mean split of the requests at those percentiles, and checks coverage (the parts add up to the wall
time) and that no catch-all ("between steps", the steps' unattributed time) holds much.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

SEGMENTS = ("schedule", "prepare", "forward", "sample", "detokenize")
PARTS = ("queue",) + SEGMENTS + ("unattributed", "profiling", "other steps", "between steps", "send")
CATCH_ALL = ("unattributed", "between steps")


@dataclass
class Trace:
    request_id: str
    arrival: float
    made: list = field(default_factory=list)     # when each token was made (perf_counter)
    sent: list | None = None                     # when each was sent (None: as made)

    @property
    def sent_times(self) -> list:
        return self.made if self.sent is None else self.sent


def trace_of(out) -> Trace:
    """A request's trace from its final RequestOutput (offline: tokens are sent as they are made)."""
    m = out.metrics
    made = []
    if m.first_token is not None:
        t = m.first_token
        made.append(t)
        for gap in m.itl:
            t += gap
            made.append(t)
    return Trace(out.request_id, m.arrival, made)


def step_segments(prof) -> list[dict]:
    """Per engine step: its times, requests and seconds per segment (forward = dispatch + ops + return)."""
    seg: dict[int, dict] = {}
    for r in prof.records:
        d = seg.setdefault(r.step, dict.fromkeys(SEGMENTS, 0.0))
        d[r.op if r.op in SEGMENTS else "forward"] += r.seconds
    out = []
    for st in prof.steps:
        d = seg.get(st.step, dict.fromkeys(SEGMENTS, 0.0))
        wall = max(st.t1 - st.t0, 1e-12)                 # on the clock; wall_s leaves out the profiler's pauses
        d = dict(d, unattributed=max(0.0, st.wall_s - sum(d.values())))
        d["profiling"] = max(0.0, wall - sum(d.values()))
        out.append({"t0": st.t0, "t1": st.t1, "wall": wall, "requests": set(st.requests), "parts": d})
    out.sort(key=lambda s: s["t0"])
    return out


def split(steps: list[dict], starts: list[float], rid: str, a: float, b: float, admitted: float) -> dict:
    """Parts of [a, b] for request rid (admitted at `admitted`: time before it is queue)."""
    parts = dict.fromkeys(PARTS, 0.0)

    def idle(lo: float, hi: float) -> None:      # time no step covers
        if hi > lo:
            q = max(0.0, min(hi, admitted) - lo)
            parts["queue"] += q
            parts["between steps"] += (hi - lo) - q
    cursor = a
    i = max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(steps) and steps[i]["t0"] < b:
        s = steps[i]
        i += 1
        lo, hi = max(cursor, s["t0"]), min(b, s["t1"])
        if hi <= lo:
            continue
        idle(cursor, lo)
        over = hi - lo
        if rid in s["requests"]:
            for k, v in s["parts"].items():
                parts[k] += over * v / s["wall"]
        elif hi <= admitted:
            parts["queue"] += over
        else:
            parts["other steps"] += over
        cursor = hi
    idle(cursor, b)
    return parts


def breakdown(prof, traces: list[Trace]) -> list[dict]:
    """Per request: TTFT and each ITL, with their parts."""
    steps = step_segments(prof)
    starts = [s["t0"] for s in steps]
    out = []
    for tr in traces:
        if not tr.made:
            continue
        first = next((s["t0"] for s in steps if tr.request_id in s["requests"]), tr.made[0])
        sent = tr.sent_times
        streamed = len(sent) < 2 or sent[-1] > sent[0]
        made = tr.made[0] if streamed else tr.made[-1]     # not streamed: its TTFT holds the steps of every token
        ttft = split(steps, starts, tr.request_id, tr.arrival, made, first)
        ttft["send"] += max(0.0, sent[0] - made)
        itls = []
        for k in range(1, len(tr.made) if streamed else 0):
            p = split(steps, starts, tr.request_id, sent[k - 1], tr.made[k], first) if tr.made[k] > sent[k - 1] \
                else dict.fromkeys(PARTS, 0.0)
            p["send"] += max(0.0, sent[k] - max(tr.made[k], sent[k - 1]))
            itls.append((sent[k] - sent[k - 1], p))
        out.append({"request_id": tr.request_id, "ttft": sent[0] - tr.arrival, "ttft_parts": ttft, "itls": itls,
                    "streamed": streamed})
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def _around(items: list[tuple[float, dict]], q: float, width: float = 2.5) -> tuple[float, dict]:
    """The value at percentile q, and the mean split of the items within +-width percentiles of it."""
    items = sorted(items, key=lambda x: x[0])
    n = len(items)
    lo = max(0, int((q - width) / 100 * (n - 1)))
    hi = min(n - 1, max(lo, int(round((q + width) / 100 * (n - 1)))))
    chosen = items[lo:hi + 1]
    total = sum(w for w, _ in chosen)
    mean = {k: sum(p[k] for _, p in chosen) / len(chosen) for k in PARTS}
    return _pct([w for w, _ in items], q), {k: v / (total / len(chosen)) if total else 0.0 for k, v in mean.items()}


def report(prof, traces: list[Trace]) -> dict:
    """p50 / p99 of TTFT and ITL with their splits (shares of the wall time), and coverage."""
    rows = breakdown(prof, traces)
    ttft = [(r["ttft"], r["ttft_parts"]) for r in rows]
    itl = [x for r in rows for x in r["itls"]]
    cover = []
    for r in rows:
        wall = r["ttft"] + sum(w for w, _ in r["itls"])
        got = sum(r["ttft_parts"].values()) + sum(sum(p.values()) for _, p in r["itls"])
        catch = sum(r["ttft_parts"][k] for k in CATCH_ALL) + sum(p[k] for _, p in r["itls"] for k in CATCH_ALL)
        cover.append((got / wall if wall else 1.0, catch / wall if wall else 0.0))
    out = {"requests": len(rows), "unstreamed": sum(not r["streamed"] for r in rows),
           "coverage_min": min((c for c, _ in cover), default=1.0),
           "catch_all_max": max((c for _, c in cover), default=0.0)}
    for name, items in (("ttft", ttft), ("itl", itl)):
        if not items:
            continue
        for q in (50, 99):
            v, parts = _around(items, q)
            out[f"{name}_p{q}_s"] = v
            out[f"{name}_p{q}_parts"] = parts
    return out


def print_report(rep: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    t = Table(title=f"serving profile: {rep['requests']} requests; coverage min {100 * rep['coverage_min']:.1f}%, "
                    f"largest catch-all {100 * rep['catch_all_max']:.1f}% of a request's time")
    t.add_column("part")
    cols = [k for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99") if f"{k}_s" in rep]
    for k in cols:
        t.add_column(f"{k.replace('_', ' ')} {rep[k + '_s'] * 1e3:.1f} ms", justify="right")
    for part in PARTS:
        t.add_row(part, *[f"{100 * rep[k + '_parts'][part]:.1f}%" for k in cols])
    console.print(t)
    if rep.get("unstreamed"):
        console.print(f"{rep['unstreamed']} of {rep['requests']} requests were not streamed (all their tokens sent "
                      f"in one response): their TTFT is the whole response, and they have no ITL", markup=False)


def save(path, prof, traces: list[Trace]) -> None:
    """The raw material of a serving profile, for `python -m lumen.profile --serving FILE`."""
    data = {"steps": [asdict(s) | {"requests": list(s.requests)} for s in prof.steps],
            "records": [asdict(r) for r in prof.records], "traces": [asdict(t) for t in traces]}
    Path(path).write_text(json.dumps(data))


def load(path):
    """(profiler-like object, traces) from a file written by save(); ValueError naming the file when it is not
    one."""
    from . import Profiler, Record, Step
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the serving profile {path}: {e.strerror or e}") from None
    try:
        d = json.loads(text)
        prof = Profiler()
        prof.steps = [Step(**{**s, "requests": tuple(s["requests"])}) for s in d["steps"]]
        prof.records = [Record(**r) for r in d["records"]]
        return prof, [Trace(**t) for t in d["traces"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        why = f": {e}" if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else ""  # (not Python's words)
        raise ValueError(f"{path}: not a serving profile (write one with `python -m lumen.serve --profile FILE`)"
                         f"{why}") from None


def summary_line(rep: dict) -> str:
    parts = rep.get("ttft_p99_parts", {})
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    return (f"TTFT p50 {rep.get('ttft_p50_s', 0) * 1e3:.0f} ms p99 {rep.get('ttft_p99_s', 0) * 1e3:.0f} ms "
            f"(p99: {', '.join(f'{k} {100 * v:.0f}%' for k, v in top)}); "
            + (f"ITL p50 {rep['itl_p50_s'] * 1e3:.1f} ms p99 {rep['itl_p99_s'] * 1e3:.1f} ms; "
               if "itl_p50_s" in rep else "no ITL (no request streamed); ")
            + f"coverage min {100 * rep['coverage_min']:.1f}%")

