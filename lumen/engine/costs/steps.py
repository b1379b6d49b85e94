"""What a step costs on this machine, measured: the numbers the engine schedules by.

StepCosts   every engine step's wall time, folded into an exponential average per token count and per recent
            (rows, tokens) shape (what speculative decoding weighs its drafts against,
            lumen.engine.speculative.choose_k, and what the paced budget paces by).
CostModel   step time as a function of the step's shape, fitted to measurements:

                t(T, S, K) = f + b * max(0, T - T*) + c * S + d * K

            T tokens in the step, S sequences, K keys attention reads (summed over the tokens). Below the knee T*
            a step costs the floor f whatever its size: it reads the weights once (bandwidth-bound); past T* each
            token adds b (compute-bound). c is the per-sequence cost (sampling, bookkeeping), d the KV reads.
            T* is chosen by a grid search, (f, b, c, d) by least squares on the relative error, all >= 0.
            `calibrate` measures a grid of step shapes through the runner (~30 s, only when the measured-cost
            scheduler is on); the result is cached in $LUMEN_HOME/costs, keyed by the model file, the machine,
            the compiled code and the thread count. Online, every engine step is compared with its prediction:
            the ratio's exponential average scales the predictions (drift: the machine got busier or quieter),
            and the model is refitted on the recent steps every REFIT steps.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

EXACT = 32


def bucket(n_tokens: int) -> int:
    if n_tokens <= EXACT:
        return n_tokens
    return 1 << (n_tokens - 1).bit_length()


class StepCosts:
    """Step wall times by shape: an exponential average per token count (bucketed: exact up to 32, then powers of
    two) over all steps, and per (rows, token count) for the SHAPES shapes measured most recently (rows: the
    sequences in the step). predict(n, rows) answers from the shape's own average when it was measured, else from
    the token count's, else from `fallback` (a fitted cost model, when the engine has one), else interpolates
    linearly between the nearest measured token counts (extrapolating from the last two); with fewer than two
    measured counts and no fallback it returns None (the caller explores). One slow step (a pause of the process,
    a neighbour's burst) moves an average by at most `weight` times itself, so it cannot make a small step look
    like a large one for the many steps an average takes to forget it; a lasting change still shows within a few
    steps."""
    SHAPES = 64

    def __init__(self, weight: float = 0.2, fallback=None):
        """fallback: (n_tokens, rows) -> seconds, e.g. a CostModel's prediction (None: none)."""
        self.weight = weight
        self.fallback = fallback
        self.ema: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self.shapes: OrderedDict[tuple[int, int], float] = OrderedDict()   # (rows, bucket) -> seconds, LRU
        self._keys: list[int] = []

    def add(self, n_tokens: int, seconds: float, rows: int | None = None) -> None:
        b = bucket(n_tokens)
        if b in self.ema:
            self.ema[b] += self.weight * (min(seconds, 2.0 * self.ema[b]) - self.ema[b])
            self.count[b] += 1
        else:
            self.ema[b] = seconds
            self.count[b] = 1
            bisect.insort(self._keys, b)
        if rows is not None:
            key = (rows, b)
            old = self.shapes.pop(key, None)
            self.shapes[key] = seconds if old is None else old + self.weight * (min(seconds, 2.0 * old) - old)
            if len(self.shapes) > self.SHAPES:
                self.shapes.popitem(last=False)

    def predict(self, n_tokens: int, rows: int | None = None) -> float | None:
        b = bucket(n_tokens)
        if rows is not None and (rows, b) in self.shapes:
            return self.shapes[(rows, b)]
        if b in self.ema:
            return self.ema[b]
        if self.fallback is not None:
            return self.fallback(n_tokens, rows or 1)
        ks = self._keys
        if len(ks) < 2:
            return None
        i = bisect.bisect_left(ks, b)
        lo, hi = (ks[0], ks[1]) if i == 0 else (ks[-2], ks[-1]) if i == len(ks) else (ks[i - 1], ks[i])
        t_lo, t_hi = self.ema[lo], self.ema[hi]
        return max(1e-9, t_lo + (t_hi - t_lo) * (b - lo) / (hi - lo))

    def at_least(self, n_tokens: int) -> float | None:
        """predict(n_tokens), but no more than the line between the nearest measured buckets below and above it
        say: a step's time rises with its tokens no faster than linearly (flat, then linear past the knee), so a
        bucket whose few steps ran slow (a first call, a neighbour's burst) and that nothing else re-measures
        cannot keep every chunk of that size out for good."""
        p = self.predict(n_tokens)
        b, ks = bucket(n_tokens), self._keys
        i = bisect.bisect_left(ks, b)
        lo = i - 1
        hi = i + 1 if i < len(ks) and ks[i] == b else i
        if p is None or lo < 0 or hi >= len(ks):
            return p
        k0, k1 = ks[lo], ks[hi]
        line = self.ema[k0] + (self.ema[k1] - self.ema[k0]) * (b - k0) / (k1 - k0)
        return min(p, max(line, self.ema[k0]))

    def clear(self) -> None:
        """Forget every step: after a warm-up, whose steps timed compiling and loading kernels, not serving."""
        self.ema.clear()
        self.count.clear()
        self._keys.clear()

    def at_most(self, n_tokens: int) -> float | None:
        """A bound on a step of n_tokens that holds when some buckets read high: a step costs no more than a
        larger one, so the least of predict(n_tokens) and every larger bucket's average."""
        p = self.predict(n_tokens)
        i = bisect.bisect_left(self._keys, bucket(n_tokens))
        larger = [self.ema[k] for k in self._keys[i:]]
        return min([p, *larger]) if p is not None else (min(larger) if larger else None)

    def known(self, n_tokens: int, rows: int | None = None) -> bool:
        """Whether steps of n_tokens (and of `rows` sequences, when given) were measured."""
        b = bucket(n_tokens)
        return (rows, b) in self.shapes if rows is not None else b in self.ema


@dataclass
class Fit:
    knee: float                  # T*: tokens where steps turn compute-bound
    floor: float                 # f: seconds of a step below the knee
    per_token: float             # b: seconds per token past the knee
    per_seq: float               # c
    per_key: float               # d: seconds per key read by attention
    rel_err_median: float = 0.0  # on the samples it was fitted to
    n: int = 0

    def predict(self, T: float, S: float, K: float) -> float:
        return self.floor + self.per_token * max(0.0, T - self.knee) + self.per_seq * S + self.per_key * K

    def describe(self) -> str:
        return (f"t = {self.floor * 1e3:.2f} ms + {self.per_token * 1e6:.1f} us x max(0, T - {self.knee:.0f}) + "
                f"{self.per_seq * 1e6:.1f} us x S + {self.per_key * 1e9:.2f} ns x K   (median error "
                f"{100 * self.rel_err_median:.1f}% over {self.n} steps)")


KNEES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def fit(samples: list[tuple[int, int, int, float]]) -> Fit:
    """Fit the model to (T, S, K, seconds) samples (see the module docstring)."""
    a = np.asarray(samples, dtype=np.float64)
    T, S, K, t = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    w = 1.0 / t                                   # relative error: each step counts alike, short or long
    best = None
    for knee in KNEES:
        cols = [np.ones_like(T), np.maximum(0.0, T - knee), S, K]
        keep = [0, 1, 2, 3]
        for _ in range(4):                        # drop a column whose coefficient comes out negative, refit
            X = np.stack([cols[j] for j in keep], 1) * w[:, None]
            coef, *_ = np.linalg.lstsq(X, t * w, rcond=None)
            neg = [keep[i] for i, c in enumerate(coef) if c < 0 and keep[i] != 0]
            if not neg:
                break
            keep = [j for j in keep if j not in neg]
        full = np.zeros(4)
        full[keep] = coef
        pred = np.stack(cols, 1) @ full
        err = float(np.median(np.abs(pred - t) / t))
        score = float(np.mean(((pred - t) / t) ** 2))
        if best is None or score < best[0]:
            best = (score, Fit(float(knee), *map(float, full), rel_err_median=err, n=len(t)))
    return best[1]


# ---------------------------------------------------------------- calibration: a grid of step shapes

@dataclass
class Shape:
    decodes: int                 # sequences with one token each, at context `ctx`
    ctx: int
    prefill: int = 0             # plus one sequence's prefill chunk of this many tokens (at position 0)

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefill

    @property
    def seqs(self) -> int:
        return self.decodes + (1 if self.prefill else 0)

    @property
    def keys(self) -> int:
        return self.decodes * (self.ctx + 1) + self.prefill * (self.prefill + 1) // 2


def grid(max_tokens: int, max_seqs: int, max_ctx: int, tiny: bool = False) -> list[Shape]:
    """The step shapes calibration measures: decodes of 1 .. max_seqs sequences at a short and a long context,
    prefill chunks up to max_tokens, and decodes with a prefill chunk riding along."""
    if tiny:
        shapes = [Shape(1, 16), Shape(2, 16), Shape(0, 0, 16), Shape(0, 0, min(64, max_tokens)), Shape(2, 16, 16)]
        return [s for s in shapes if s.tokens <= max_tokens and s.seqs <= max_seqs]     # what the runner holds
    seqs = [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= max_seqs]
    chunks = [c for c in (8, 32, 64, 128, 256, 512, 1024, 2048) if c <= max_tokens]
    ctxs = sorted({min(64, max_ctx - 1), min(1024, max_ctx - 1)})
    out = [Shape(s, c) for c in ctxs for s in seqs if s <= max_tokens]
    out += [Shape(0, 0, c) for c in chunks]
    out += [Shape(d, ctxs[0], c) for d in seqs[:4] for c in chunks[1::2] if d + c <= max_tokens and d + 1 <= max_seqs]
    return out


def measure(runner, shape: Shape, rng, repeats: int = 3) -> float:
    """Median seconds of a forward step of this shape through the runner (its pool's blocks are scribbled on:
    call before serving)."""
    from ...kernels.attention import BLOCK
    nb = runner.n_blocks
    per = -(-(shape.ctx + 1) // BLOCK) if shape.decodes else 0
    i, rows = 0, []
    for s in range(shape.decodes):                # each decode its own blocks while the pool lasts
        runner.table[s, :per] = (np.arange(per) + s * per) % nb
        i = runner.set_tokens(i, [int(rng.integers(4, 1000))], shape.ctx, s)
        rows.append(i - 1)
    if shape.prefill:
        r = shape.decodes
        pb = -(-shape.prefill // BLOCK)
        runner.table[r, :pb] = (np.arange(pb) + shape.decodes * per) % nb
        i = runner.set_tokens(i, rng.integers(4, 1000, shape.prefill).tolist(), 0, r)
        rows.append(i - 1)
    runner.set_out_rows(rows)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(i, len(rows))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


@dataclass(frozen=True)
class CostKey:
    """What a measured cost table depends on besides the machine and the compiled code: the model file, the
    thread count and the engine's shape."""
    model_path: Path
    threads: int
    max_tokens: int
    max_seqs: int
    max_model_len: int


def cache_key(key: CostKey) -> str:
    """Model file, machine, compiled code, threads, engine shape: a change to any measures again."""
    from ...paths import compile_cache_dir as _compile_cache_dir
    from ...machine import machine_key       # the CPU's family and model too: a name can be shared (AMD EPYC)
    p = Path(key.model_path)
    st = p.stat()
    h = hashlib.sha256(f"{p.resolve()} {st.st_size} {st.st_mtime_ns} | {machine_key()} | "
                       f"{Path(_compile_cache_dir()).name} | threads {key.threads} | "
                       f"{key.max_tokens} {key.max_seqs} {key.max_model_len}".encode())
    return h.hexdigest()[:20]


def cache_path(key: CostKey) -> Path:
    from ...model.store import lumen_home
    return lumen_home() / "costs" / f"{Path(key.model_path).stem}-{cache_key(key)}.json"


@dataclass
class CostModel:
    fit: Fit
    samples: list = field(default_factory=list)    # (T, S, K, seconds) the fit came from
    source: str = "measured"
    drift: float = 1.0                              # measured / predicted, exponential average
    recent: list = field(default_factory=list)      # recent engine steps (T, S, K, seconds)
    steps: int = 0

    DRIFT_WEIGHT = 0.05
    REFIT = 256
    KEEP = 1024

    def predict(self, T: float, S: float, K: float) -> float:
        return self.fit.predict(T, S, K) * self.drift

    def observe(self, T: int, S: int, K: int, seconds: float) -> None:
        """Fold one engine step in: the drift average, and every REFIT steps a refit on calibration + recent."""
        pred = self.fit.predict(T, S, K)
        if pred > 0 and seconds > 0:
            self.drift = math.exp((1 - self.DRIFT_WEIGHT) * math.log(self.drift)
                                  + self.DRIFT_WEIGHT * math.log(seconds / pred))
        self.recent.append((T, S, K, seconds))
        if len(self.recent) > self.KEEP:
            del self.recent[:len(self.recent) - self.KEEP]
        self.steps += 1
        if self.steps % self.REFIT == 0:
            self.fit = fit(self.samples + self.recent)
            self.drift = 1.0

    @property
    def drifting(self) -> bool:
        return abs(math.log(self.drift)) > math.log(1.2)

    def table(self) -> list[dict]:
        return [{"tokens": T, "seqs": S, "keys": K, "ms": t * 1e3, "predicted_ms": self.fit.predict(T, S, K) * 1e3}
                for T, S, K, t in self.samples]

    def to_json(self) -> dict:
        return {"fit": asdict(self.fit), "samples": self.samples, "source": self.source}


def calibrate(runner, key: CostKey, *, tiny: bool = False, use_cache: bool = True, repeats: int = 3) -> CostModel:
    """The cost model of the engine whose runner and key these are: from the cache when it was measured for
    this model, machine, code, threads and shape, else measured now over the grid through the runner (its pool
    is scribbled on: call before serving) and cached."""
    path = cache_path(key) if not tiny else None
    if use_cache and path is not None and path.is_file():
        try:
            d = json.loads(path.read_text())
            return CostModel(Fit(**d["fit"]), [tuple(s) for s in d["samples"]], source=f"cache {path}")
        except (OSError, ValueError, KeyError, TypeError):
            pass                                  # unreadable: measure again
    r = runner
    rng = np.random.default_rng(0)
    shapes = grid(key.max_tokens, key.max_seqs, key.max_model_len, tiny)
    for s in shapes[:2]:                          # warm-up
        measure(r, s, rng, 1)
    samples = [(s.tokens, s.seqs, s.keys, measure(r, s, rng, repeats)) for s in shapes]
    r.table[:] = 0
    model = CostModel(fit(samples), samples)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(model.to_json()))
            os.replace(tmp, path)
        except OSError:
            pass                                  # an unwritable home only means measuring next time too
    return model
