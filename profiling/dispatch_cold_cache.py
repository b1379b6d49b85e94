"""Is the decode step's dispatch + return time (lumen.profile's "dispatch" and "return") work, or cache misses?

    python profiling/dispatch_cold_cache.py [--quick] [--model smollm2-135m] [--calls 300]

Three timings through the compiled entry point the runner calls (no dispatcher), in time-stamp-counter ticks:
  - a probe taking the forward's own arguments (the bundles: arch, weights, KV, batch, scratch, logits) that
    only writes two ticks, with warm caches;
  - the same probe with a read of as many bytes as a decode step reads (Weights.decode_bytes) before each call,
    which is what a decode step leaves in the caches;
  - the forward itself (one decode token), from the call to its first op tick and from its last op tick back.
Medians over --calls calls. If the cold probe costs what the forward's entry costs, dispatch is the unboxing
and reference counting of the argument arrays missing the caches, not code the forward runs.
"""
from __future__ import annotations

import argparse
import statistics

import numba
import numpy as np
from numba import njit

import lumen
from lumen.model.forward import Batch, forward
from lumen.timer import tick_rate, ticks
from verdict import count, one_line_errors, thread_count, verdict


@njit(nogil=True)
def probe(arch, w, kv, batch, scr, logits, prof):
    t = scr.times
    t[t.shape[0] - 1] = ticks()
    t[t.shape[0] - 2] = ticks()


@njit(nogil=True)
def read_all(words):
    s = np.uint64(0)
    for i in range(0, words.shape[0], 8):   # one word per 64-byte line
        s += words[i]
    return s


def count_arrays(x) -> int:
    """Arrays in x and in the tuples (bundles) nested in it."""
    if isinstance(x, np.ndarray):
        return 1
    return sum(count_arrays(y) for y in x) if isinstance(x, tuple) else 0


def entry(f, args):
    """The compiled entry point of dispatcher f for args (what lumen.engine.runner calls)."""
    f(*args)
    return f.overloads[tuple(f.typeof_pyval(a) for a in args)].entry_point


def timed(call, times, rate, calls, before=None) -> tuple[float, float]:
    """Medians (us): from the Python call to the first tick (times[-1]), from the last (times[-2]) back."""
    pre, post = [], []
    for _ in range(calls):
        if before is not None:
            before()
        c0 = ticks()
        call()
        c1 = ticks()
        pre.append((int(times[-1]) - c0) / rate * 1e6)
        post.append((c1 - int(times[-2])) / rate * 1e6)
    return statistics.median(pre), statistics.median(post)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--calls", type=count, default=300)
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--quick", action="store_true", help="20 calls (for tests)")
    a = ap.parse_args(argv)
    calls = 20 if a.quick else a.calls
    with one_line_errors():
        m = lumen.load(a.model, ctx=256, threads=a.threads)
    m.prefill(np.arange(10, 74))                       # a context of 64 tokens, its KV in the cache
    r = m.runner
    r.set_tokens(0, [100], 64, 0)                       # one decode token at position 64 of the sequence in row 0
    r.set_out_rows([0])
    batch = Batch(r._tokens[:1], r._positions[:1], r._seqs[:1], r._slots[:1], r.table, r._out_rows[:1])
    args = (r.arch, r.w, r.kv, batch, r.scr, r.logits_rows(1), True)
    n_arrays = count_arrays(args)
    rate = tick_rate()
    words = np.ones(m.weights.decode_bytes // 8, np.uint64)
    read_all(words)
    e_probe, e_fwd = entry(probe, args), entry(forward, args)
    t = r.scr.times
    warm = timed(lambda: e_probe(*args), t, rate, calls)
    cold = timed(lambda: e_probe(*args), t, rate, calls, before=lambda: read_all(words))
    fwd = timed(lambda: e_fwd(*args), t, rate, calls)
    print(f"{'':36s} {'call -> first tick':>19s} {'last tick -> back':>18s}")
    for name, (pre, post) in (("probe, warm caches", warm), (f"probe, after reading {words.nbytes >> 20} MiB", cold),
                              ("forward (one decode token)", fwd)):
        print(f"{name:36s} {pre:16.2f} us {post:15.2f} us")
    conclusion = ("cache misses, not work" if cold[0] >= 0.7 * fwd[0] else
               "not explained by cold caches alone")
    verdict(f"the forward's entry takes {fwd[0]:.1f} us to its first op and {fwd[1]:.1f} us back after its "
            f"last; a probe with the same arguments ({n_arrays} arrays in the bundles) {warm[0]:.1f} / {warm[1]:.1f} us "
            f"with warm caches and {cold[0]:.1f} / {cold[1]:.1f} us after reading {words.nbytes >> 20} MiB -> the "
            f"entry cost is {conclusion} (medians of {calls} calls, {numba.get_num_threads()} thread(s))")


if __name__ == "__main__":
    main()
