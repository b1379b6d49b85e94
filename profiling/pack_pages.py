"""Does where the packed weights live change a decode step? One model's packs three ways, one process, the decode
steps of one engine alternated burst by burst:

    python profiling/pack_pages.py [--quick] [--model qwen2.5-coder-1.5b] [--rows 1] [--bursts 24] [--steps 12]

- mapped        as loaded: the pack-cache file, MAP_PRIVATE (huge pages where the page cache holds 2 MiB folios)
- anon, layout  one anonymous copy of the whole mapping (numpy asks for huge pages), the buffers at the file's offsets
- anon, apart   each buffer its own anonymous copy, wherever the allocator puts it
Prints each one's median step, its median ratio to mapped over bursts paired in time, and the share of its bytes in
huge pages (/proc/self/smaps). "anon, layout" near 1 with "anon, apart" lower says the buffers' placement, not the
kind of page, is what differs; "mapped" with few huge pages, that the file's page cache is in 4 KiB folios.
"""
from __future__ import annotations

import argparse
import mmap
import re
import statistics
import time

import numpy as np

from lumen import Engine, SamplingParams
from verdict import count, one_line_errors, verdict


def mapping_of(a: np.ndarray):
    """The mmap.mmap under a (np.frombuffer's chain), or None."""
    while a is not None and not isinstance(a, mmap.mmap):
        a = a.base if isinstance(a, np.ndarray) else getattr(a, "obj", None)
    return a


def huge_share(arrays) -> float:
    """Of the mappings holding these arrays, the share of resident bytes in huge pages (smaps, Linux; 0 elsewhere)."""
    try:
        text = open("/proc/self/smaps").read()
    except OSError:
        return 0.0
    spans = [(x.ctypes.data, x.ctypes.data + x.nbytes) for x in arrays if x.nbytes]
    rss = huge = 0
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in entry.split(" ", 1)[0].split("-"))
        if any(lo < e and s < hi for s, e in spans):
            kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in entry.splitlines()[1:] if ln.endswith(" kB")}
            rss += kb.get("Rss", 0)
            huge += kb.get("AnonHugePages", 0) + kb.get("FilePmdMapped", 0)
    return huge / rss if rss else 0.0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", type=count, default=1, help="sequences decoding at once (default 1)")
    ap.add_argument("--bursts", type=count, default=24, help="bursts per placement (default 24)")
    ap.add_argument("--steps", type=count, default=12, help="decode steps per burst (default 12)")
    ap.add_argument("--quick", action="store_true", help="SmolLM2, 3 bursts of 3 steps (for tests)")
    a = ap.parse_args(argv)
    model, bursts, steps = ("smollm2-135m", 3, 3) if a.quick else (a.model, a.bursts, a.steps)
    with one_line_errors():                                       # an unknown model, a file that is not a GGUF
        eng = Engine(model, max_num_seqs=a.rows, kv_cache_mb=256, adaptive_threads=False)
    w = eng.runner.w
    packs = w.packs
    mm = mapping_of(packs.q)
    if mm is None:                        # LUMEN_PACK_CACHE=0: the packs are the process's own; nothing to compare
        raise SystemExit("the packs are not mapped from the pack-cache file (is LUMEN_PACK_CACHE=0 set?)")
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=3 * bursts * steps + 8, temperature=0, ignore_eos=True)
    for _ in range(a.rows):
        eng.add_request(rng.integers(100, 5000, 32).tolist(), sp)
    while any(s.num_computed < len(s.prompt_ids) for s in eng.scheduler.running) or eng.num_waiting:
        eng.step()

    whole = np.array(np.frombuffer(mm, np.uint8))                 # one copy of the file: its layout, anonymous
    base = np.frombuffer(mm, np.uint8).ctypes.data
    places = {"mapped": packs,
              "anon, layout": packs._replace(**{
                  n: np.frombuffer(whole.data, b.dtype, b.size, b.ctypes.data - base) if b.size else b
                  for n, b in (("q", packs.q), ("qf", packs.qf), ("s", packs.s))}),
              "anon, apart": packs._replace(q=packs.q.copy(), qf=packs.qf.copy(), s=packs.s.copy())}
    times = {name: [] for name in places}
    for name, p in places.items():                                   # touch each once (first faults, caches)
        eng.runner.w = w._replace(packs=p)
        eng.step()
    for _ in range(bursts):
        for name, p in places.items():
            eng.runner.w = w._replace(packs=p)
            ts = []
            for _ in range(steps):
                t0 = time.perf_counter()
                eng.step()
                ts.append(time.perf_counter() - t0)
            times[name].append(1e3 * statistics.median(ts))
    eng.runner.w = w
    ref = times["mapped"]
    print(f"{model}, {a.rows} row(s), {bursts} bursts of {steps} decode steps")
    print(f"{'packs':14s} {'step ms':>8s} {'/ mapped':>9s} {'in huge pages':>14s}")
    ratio = {}
    for name, t in times.items():
        ratio[name] = statistics.median(x / y for x, y in zip(t, ref))
        share = huge_share([places[name].q, places[name].qf, places[name].s])
        print(f"{name:14s} {statistics.median(t):8.2f} {ratio[name]:8.3f}x {100 * share:13.0f}%")
    others = ", ".join(f"{n} {r:.3f}x" for n, r in ratio.items() if n != "mapped")
    verdict(f"{model} decode at {a.rows} row(s): step time against the mapped pack file: {others}")


if __name__ == "__main__":
    main()
