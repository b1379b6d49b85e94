"""Where does a first run's compile time go, and why does a second model compile again?

    python profiling/compile_profile.py [--quick] [--models smollm2-135m gemma3-270m ...] [--cache DIR] [--top 15]

Each model runs in a fresh process (a short generate: the prefill, decode and sampling paths a first run takes),
one after another on one Numba cache (a new empty directory unless --cache), with a listener on Numba's
"numba:compile" and "numba:run_pass" events (numba.core.event). Per model it reports:
  - wall time of load + generate, and the seconds spent compiling (outermost compile events);
  - per compiled function and signature: seconds inclusive (its callees compiled during its typing included) and
    exclusive, and the cache hits and misses of every dispatcher that ran;
  - per compiler pass, exclusive seconds (the LLVM work is in NativeLowering / the parfor lowering);
  - for a later model, every function that compiles again and how its signature differs from the ones already
    in the cache: argument by argument, down into the bundles' fields (array dtype, ndim, layout, readonly,
    tuple lengths, literal values, structured dtypes).
The VERDICT line names the share of the first model's compile time the top function takes, and what the last
model compiled again. --quick: SmolLM2 alone, twice, on Lumen's own compile cache (the second run must compile
nothing; the first too when the cache is warm).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from verdict import checked_model, count          # (imports nothing of Lumen: the child records its compiles)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The capital of France is"


# ---------------------------------------------------------------- child: one model, events recorded

def child(model: str, out_path: str, tokens: int) -> None:
    from numba.core import event
    frames = []          # open pass events: [name, t0, seconds of the passes nested in it]
    cstack = []          # open compile events: [t0, seconds of the compiles nested in it]
    compiles = []        # (qualname, signature strings, described signature, inclusive s, exclusive s, depth)
    passes = defaultdict(float)

    class Compiles(event.Listener):
        def on_start(self, ev):
            cstack.append([time.perf_counter(), 0.0])

        def on_end(self, ev):
            t0, inner = cstack.pop()
            dt = time.perf_counter() - t0
            if cstack:
                cstack[-1][1] += dt
            d = ev.data["dispatcher"]
            compiles.append((f"{d.py_func.__module__}.{d.py_func.__qualname__}", [str(a) for a in ev.data["args"]],
                             [_describe(a) for a in ev.data["args"]], dt, dt - inner, len(cstack)))

    class Passes(event.Listener):
        def on_start(self, ev):
            frames.append([ev.data["name"].split(" [")[0], time.perf_counter(), 0.0])

        def on_end(self, ev):
            name, t0, inner = frames.pop()
            dt = time.perf_counter() - t0
            if frames:
                frames[-1][2] += dt
            passes[name] += dt - inner

    t0 = time.perf_counter()
    with event.install_listener("numba:compile", Compiles()), event.install_listener("numba:run_pass", Passes()):
        import lumen
        m = lumen.load(model, ctx=256, threads=2)
        text = "".join(t.text for t in m.generate(PROMPT, max_tokens=tokens))
    wall = time.perf_counter() - t0
    from numba.core.registry import CPUDispatcher  # noqa: F401 (the dispatchers below are its instances)
    import gc
    stats = []
    for o in gc.get_objects():
        if type(o).__name__ == "CPUDispatcher" and hasattr(o, "_cache_hits"):
            h, mi = sum(o._cache_hits.values()), sum(o._cache_misses.values())
            if h or mi:
                stats.append((f"{o.py_func.__module__}.{o.py_func.__qualname__}", h, mi))
    with open(out_path, "w") as f:
        json.dump(dict(model=model, wall=wall, text=text, passes=passes, stats=stats,
                       compiles=[dict(fn=c[0], sig=c[1], desc=c[2], incl=c[3], excl=c[4], depth=c[5])
                                 for c in compiles]), f)


def _describe(t):
    """A Numba type as a nested dict of what makes two signatures differ."""
    from numba.core import types
    if isinstance(t, types.BaseNamedTuple):
        return {"namedtuple": t.instance_class.__name__,
                "fields": {f: _describe(ft) for f, ft in zip(t.fields, t.types)}}
    if isinstance(t, types.Array):
        dtype = (f"Record({','.join(t.dtype.fields)})" if isinstance(t.dtype, types.Record) else str(t.dtype))
        return {"array": dtype, "ndim": t.ndim, "layout": t.layout, "readonly": not t.mutable,
                "aligned": t.aligned}
    if isinstance(t, (types.UniTuple, types.Tuple)):
        return {"tuple": len(t), "items": [_describe(x) for x in t]}
    if isinstance(t, types.Literal):
        return {"literal": repr(t.literal_value), "of": str(t.literal_type)}
    return str(t)


def _diff(a, b, path="") -> list[str]:
    """Where the described types a and b differ, as 'path: a -> b' lines."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: {_short(a)} -> {_short(b)}"]
        out = []
        for k in a:
            sub = f"{path}.{k}" if k not in ("fields", "items") else path
            out += _diff(a[k], b[k], sub)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [x for i, (p, q) in enumerate(zip(a, b)) for x in _diff(p, q, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {_short(a)} -> {_short(b)}"]


def _short(x, n=90) -> str:
    s = json.dumps(x) if not isinstance(x, str) else x
    return s if len(s) <= n else s[:n - 3] + "..."


def _sig_diff(sig_a, sig_b) -> list[str]:
    out = []
    for i, (a, b) in enumerate(zip(sig_a, sig_b)):
        out += _diff(a, b, f"arg{i}")
    if len(sig_a) != len(sig_b):
        out.append(f"{len(sig_a)} args -> {len(sig_b)}")
    return out


# ---------------------------------------------------------------- parent: models in turn, one cache

def run_model(model: str, cache: str, tokens: int) -> dict:
    out = tempfile.mktemp(suffix=".json", prefix="compile-profile-")
    env = dict(os.environ, **({"NUMBA_CACHE_DIR": cache} if cache else {}))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, out, str(tokens)], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"error: the run of {model} failed:\n{r.stderr[-3000:]}")
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data


def report(d: dict, seen: dict, top: int) -> list[str]:
    """Print one model's figures; returns the names of the functions compiled again (seen before)."""
    outer = [c for c in d["compiles"] if c["depth"] == 0]
    total = sum(c["incl"] for c in outer)
    misses = sum(s[2] for s in d["stats"])
    hits = sum(s[1] for s in d["stats"])
    print(f"\n== {d['model']}: wall {d['wall']:.1f} s, compiling {total:.1f} s; {len(d['compiles'])} compiles, "
          f"cache hits {hits}, misses {misses}; text {d['text']!r}")
    by_fn = defaultdict(lambda: [0.0, 0.0, 0])
    for c in d["compiles"]:
        e = by_fn[c["fn"]]
        e[0] += c["excl"]
        e[1] = max(e[1], c["incl"])
        e[2] += 1
    print(f"  {'function':58s} {'excl s':>7s} {'incl s':>7s} {'sigs':>4s}")
    for fn, (ex, inc, n) in sorted(by_fn.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {fn[-58:]:58s} {ex:7.2f} {inc:7.2f} {n:4d}")
    ps = sorted(d["passes"].items(), key=lambda kv: -kv[1])[:6]
    print("  passes (exclusive s): " + ", ".join(f"{k} {v:.1f}" for k, v in ps))
    again = []
    for c in d["compiles"]:
        if c["fn"] in seen:
            again.append(c["fn"])
            diffs = []
            for old in seen[c["fn"]]:
                dd = _sig_diff(old, c["desc"])
                if not diffs or len(dd) < len(diffs):
                    diffs = dd
            print(f"  compiled again: {c['fn']} ({c['excl']:.2f} s excl, {c['incl']:.2f} s incl); differs from the "
                  f"cached signature{'s' if len(seen[c['fn']]) > 1 else ''} in:")
            for line in diffs[:8] or ["(same signature: a cache index miss)"]:
                print(f"      {line}")
            if len(diffs) > 8:
                print(f"      ... {len(diffs) - 8} more")
    for c in d["compiles"]:
        seen.setdefault(c["fn"], []).append(c["desc"])
    return again


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python profiling/compile_profile.py", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="SmolLM2 twice on Lumen's own compile cache")
    p.add_argument("--models", nargs="+", default=None,
                   help="registry names or .gguf paths, run in this order on one cache (default: smollm2-135m, "
                        "gemma3-270m, smollm2-135m again)")
    p.add_argument("--cache", default=None,
                   help="Numba cache directory to use (default: a new empty one; with --quick, Lumen's own)")
    p.add_argument("--tokens", type=count, default=8, help="tokens each run generates")
    p.add_argument("--top", type=count, default=15, help="functions listed per model")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child[0], a.child[1], int(a.child[2]))
        return 0
    models = a.models or (["smollm2-135m", "smollm2-135m"] if a.quick else
                          ["smollm2-135m", "gemma3-270m", "smollm2-135m"])
    for m in models:                                # every one before the first runs
        checked_model(m)
    own = a.cache is None and not a.quick
    cache = a.cache or (tempfile.mkdtemp(prefix="lumen-compile-profile-") if own else None)
    where = cache or "Lumen's own"
    print(f"Numba cache: {where}; load {open('/proc/loadavg').read().split()[0]}")
    try:
        seen: dict = {}
        results = []
        for m in models:
            d = run_model(m, cache, a.tokens)
            results.append((d, report(d, seen, a.top)))
    finally:
        if own:
            import shutil
            shutil.rmtree(cache, ignore_errors=True)
    first, last = results[0][0], results[-1][0]
    outer = lambda d: sum(c["incl"] for c in d["compiles"] if c["depth"] == 0)  # noqa: E731
    tops = sorted(((c["incl"], c["fn"]) for c in first["compiles"] if c["depth"] == 0), reverse=True)
    top_s, top_fn = tops[0] if tops else (0.0, "nothing")
    again = sorted(set(results[-1][1]))
    share = (f", {top_s / outer(first):.0%} of it in {top_fn.rsplit('.', 1)[-1]} and its callees"
             if outer(first) > 0 else "")
    print(f"\nVERDICT: the first {first['model']} run compiles {outer(first):.1f} s of its {first['wall']:.1f} s"
          f"{share}; {last['model']} after it compiles {outer(last):.1f} s"
          + (f" again ({len(again)} functions: {', '.join(f.rsplit('.', 1)[-1] for f in again[:6])}"
             f"{', ...' if len(again) > 6 else ''})" if again else " (nothing compiles again)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
