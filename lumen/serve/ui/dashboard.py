"""What GET /dashboard/data answers: the server's state now, rates and latency percentiles over the last minute,
and the recent steps' shapes and time split. Counts and seconds only: no request ids, prompts or outputs.

It reads two things:
- the server's Prometheus registry (lumen.serve.metrics.Metrics.registry), through prometheus_client's public
  `collect()`: the gauges the engine reports when scraped (running, waiting, KV use) and the counters and
  histograms the server observes (tokens, TTFT, ITL, prefix cache, speculative tokens). Rates and percentiles
  over a window are differences of two readings, as Prometheus' rate() and histogram_quantile() take them;
  the readings are taken when the page polls (and one when the server starts), so the window is the last
  minute once a page has been open that long, and since the oldest reading before that (`window_s` says which).
- a StepTap's ring of recent steps (lumen.serve.ui.steps), which each poll keeps recording for a few seconds.

On Ray (lumen.serve.ray) the registry holds every replica's series with a `replica` label: the figures are the
application's (summed; KV use over all blocks) and, under `replicas`, each replica's. A replica of another pool (a
`pool` label: the prefill replicas beside the decode replicas) adds its gauges (running, KV, threads) to the
application's, not its counters and histograms: the decode replicas answer the same requests again, so its tokens
and first tokens (the prefill's, not the client's) would count twice. No StepTap there: the engines step in the
replicas.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque

from .steps import GROUPS, StepTap

WINDOW_S = 60.0           # percentiles and rates over this
RATE_S = 3.0              # output tok/s over about this (the newest reading at least this old)
RATE_MAX_S = 12.0         # ... and at most this old: an older one (no page polled since) says nothing of now
STEPS_S = 10.0            # steps shown: those of the last STEPS_S seconds, at most MAX_STEPS
MAX_STEPS = 120
# what is read from the registry (without the model_name label)
COUNTERS = ("lumen:generation_tokens_total", "lumen:prompt_tokens_total", "lumen:prefix_cache_queries_total",
            "lumen:prefix_cache_hits_total", "lumen:spec_decode_num_draft_tokens_total",
            "lumen:spec_decode_num_accepted_tokens_total", "lumen:spec_decode_num_verify_steps_total",
            "lumen:num_preemptions_total")
GAUGES = ("lumen:num_requests_running", "lumen:num_requests_waiting", "lumen:kv_cache_usage_perc",
          "lumen:kv_cache_total_blocks", "lumen:compute_threads", "lumen:compute_threads_max")
HISTOGRAMS = {"ttft": "lumen:time_to_first_token_seconds", "itl": "lumen:inter_token_latency_seconds"}


class Part:
    """Counters and gauges by name, and each histogram's cumulative buckets by upper bound, summed over samples."""

    def __init__(self):
        self.values: dict[str, float] = {}
        self.bounds: dict[str, dict[float, float]] = {k: {} for k in HISTOGRAMS}

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def buckets(self, key: str) -> list[tuple[float, float]]:
        return sorted(self.bounds[key].items())


class Reading:
    """One collect() of the registry: every series summed (`total`) and, for the series with a `replica` label (a
    Ray application's registry, lumen.serve.ray.metrics), summed per replica (`replicas`)."""

    def __init__(self, registry):
        self.t = time.monotonic()
        self.total = Part()
        self.replicas: dict[str, Part] = {}
        self.pools: dict[str, str] = {}                   # replica -> its pool label, where it has one
        hist_of = {f"{name}_bucket": key for key, name in HISTOGRAMS.items()}
        for family in registry.collect():
            for s in family.samples:
                key = hist_of.get(s.name)
                if key is None and s.name not in COUNTERS and s.name not in GAUGES:
                    continue
                replica, pool = s.labels.get("replica"), s.labels.get("pool") or None
                if replica and pool:
                    self.pools[replica] = pool
                total = self.total if pool is None or s.name in GAUGES else None    # (see the module docstring)
                for part in (total, self.replicas.setdefault(replica, Part()) if replica else None):
                    if part is None:
                        continue
                    if key is not None:
                        le = float(s.labels["le"])
                        part.bounds[key][le] = part.bounds[key].get(le, 0.0) + s.value
                    else:
                        part.values[s.name] = part.values.get(s.name, 0.0) + s.value

    def part(self, replica: str | None) -> Part:
        """The replica's sums (an empty Part if it had none yet), or the total's (None)."""
        return self.total if replica is None else self.replicas.get(replica, Part())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: the q-quantile of cumulative (upper bound, count) buckets, linear within
    a bucket; the highest finite bound when it falls in +Inf; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lo_bound
            if count == lo_count:
                return bound
            return lo_bound + (bound - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = bound, count
    return lo_bound


def _delta(new: list, old: list) -> list:
    if len(old) != len(new):                       # no older reading of this histogram: everything is new
        return new
    return [(b, c - oc) for (b, c), (_, oc) in zip(new, old)]


class Dashboard:
    """The data endpoint's state: readings of the registry (one per poll, at most every 0.5 s, the last
    WINDOW_S seconds and one before) and the tap of recent steps."""

    def __init__(self, registry, tap: StepTap | None, *, model_id: str, speculative: str | None = None):
        self.registry, self.tap, self.model_id, self.speculative = registry, tap, model_id, speculative
        self._readings: deque[Reading] = deque([Reading(registry)])
        self._lock = threading.Lock()

    def _read(self) -> tuple[Reading, Reading, Reading | None]:
        """(now, the reading about WINDOW_S ago or the oldest, the reading to take the output rate from: the newest
        between RATE_S and RATE_MAX_S old, else the newest at least 0.5 s old (a page began polling), else None: no
        reading of the last RATE_MAX_S seconds but this one, as at the first poll of a server up for minutes)."""
        with self._lock:
            now = Reading(self.registry)
            rs = self._readings
            if now.t - rs[-1].t >= 0.5:
                rs.append(now)
            while len(rs) > 1 and now.t - rs[1].t >= WINDOW_S:
                rs.popleft()                       # rs[0]: the newest reading at least WINDOW_S old, or the oldest
            window = rs[0]
            recent = [r for r in rs if 0.5 <= now.t - r.t <= RATE_MAX_S]
            rate = next((r for r in reversed(recent) if now.t - r.t >= RATE_S), recent[-1] if recent else None)
            return now, window, rate

    def data(self) -> dict:
        if self.tap is not None:
            self.tap.look()
        now, win, rate = self._read()
        out = {"model": self.model_id, "time": time.time(), "window_s": round(now.t - win.t, 1),
               **self._summary(now, win, rate, None)}
        if now.replicas:                           # a Ray application: each replica's, and KV use over all blocks
            reps = out["replicas"] = [{"replica": r, **({"pool": now.pools[r]} if r in now.pools else {}),
                                       **self._summary(now, win, rate, r)} for r in sorted(now.replicas)]
            blocks = sum(r["kv_blocks"] for r in reps)
            out["kv_usage"] = sum(r["kv_usage"] * r["kv_blocks"] for r in reps) / blocks if blocks else 0.0
        out["steps"] = self._steps()
        return out

    def _summary(self, now: Reading, win: Reading, rate: Reading | None, replica: str | None) -> dict:
        """The figures of one replica (or of the whole server: None) from the three readings (output_tps: None
        without a rate reading)."""
        n, w = now.part(replica), win.part(replica)
        d = lambda name, old: n.get(name) - old.get(name)            # noqa: E731
        pct = {}
        for key in HISTOGRAMS:
            b = _delta(n.buckets(key), w.buckets(key))
            pct[key] = {"count": int(b[-1][1]) if b else 0,
                        **{f"p{int(q * 100)}": _ms(quantile(q, b)) for q in (0.5, 0.9, 0.99)}}
        queries = d("lumen:prefix_cache_queries_total", w)
        drafted_all = n.get("lumen:spec_decode_num_draft_tokens_total")
        spec = None
        if self.speculative or drafted_all:
            drafted = d("lumen:spec_decode_num_draft_tokens_total", w)
            accepted = d("lumen:spec_decode_num_accepted_tokens_total", w)
            spec = {"drafted": int(drafted), "accepted": int(accepted),
                    "acceptance": accepted / drafted if drafted else None, "default": self.speculative}
        return {
            "output_tps": None if rate is None else
            d("lumen:generation_tokens_total", rate.part(replica)) / (now.t - rate.t),
            "running": int(n.get("lumen:num_requests_running")),
            "waiting": int(n.get("lumen:num_requests_waiting")),
            "kv_usage": n.get("lumen:kv_cache_usage_perc"),
            "kv_blocks": int(n.get("lumen:kv_cache_total_blocks")),
            "threads": int(n.get("lumen:compute_threads")),
            "threads_max": int(n.get("lumen:compute_threads_max")),
            "generation_tokens": int(n.get("lumen:generation_tokens_total")),
            "preemptions": int(n.get("lumen:num_preemptions_total")),
            "prefix_hit_rate": d("lumen:prefix_cache_hits_total", w) / queries if queries else None,
            "ttft_ms": pct["ttft"],
            "itl_ms": pct["itl"],
            "speculative": spec,
        }

    def _steps(self) -> dict:
        """The recent steps (oldest first) and their mean split by phase, in milliseconds."""
        if self.tap is None or not self.tap.timers:
            return {"available": False, "groups": list(GROUPS), "recent": [], "split": {},
                    "note": "the op timers are compiled out (LUMEN_TIMERS=0)" if self.tap else
                    "no engine in this process (Ray replicas: steps are not collected)"}
        recs = self.tap.recent(time.time() - STEPS_S)[-MAX_STEPS:]
        split: dict[str, dict] = {}
        for r in recs:
            s = split.setdefault("decode" if r.phase == "decode" else "prefill", {"steps": 0, "wall_ms": 0.0,
                                                                                  "ms": [0.0] * len(GROUPS)})
            s["steps"] += 1
            s["wall_ms"] += r.wall_s * 1e3
            for i, x in enumerate(r.split):
                s["ms"][i] += x * 1e3
        for s in split.values():                   # means per step
            n = s["steps"]
            s["wall_ms"] /= n
            s["ms"] = [x / n for x in s["ms"]]
            s["unattributed_ms"] = max(0.0, s["wall_ms"] - sum(s["ms"]))
        return {"available": True, "groups": list(GROUPS), "split": split,
                "recent": [{"t": round(r.t, 3), "phase": r.phase, "tokens": r.n_tokens, "seqs": r.n_seqs,
                            "kv_tokens": r.kv_tokens, "wall_ms": round(r.wall_s * 1e3, 3)} for r in recs]}


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 2)
