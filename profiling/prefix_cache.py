"""What does a prefix-cache hit save? TTFT of a request whose long prefix another request already computed.

    python profiling/prefix_cache.py [--quick] [--model smollm2-135m] [--prefix 1024] [--suffix 32]

Per repeat, on a fresh engine: request A (prefix + suffix A) runs to its first token, then request B (the same
prefix + suffix B): B's TTFT with the hit, against A's without; also B on an engine with prefix caching off.
Medians over repeats (each repeat uses another random prefix).
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np

import lumen
from lumen import Engine, SamplingParams
from token_ids import random_ids
from verdict import count, one_line_errors, thread_count, verdict


def ttft(engine, ids) -> tuple[float, int]:
    out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))[0]
    return out.metrics.ttft_s, out.metrics.cached_tokens


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--prefix", type=count, default=1024)
    ap.add_argument("--suffix", type=count, default=32)
    ap.add_argument("--budget", type=count, default=512)
    ap.add_argument("--repeats", type=count, default=5)
    ap.add_argument("--quick", action="store_true", help="prefix 128, 2 repeats (for tests)")
    a = ap.parse_args(argv)
    prefix, repeats = (128, 2) if a.quick else (a.prefix, a.repeats)
    with one_line_errors():
        model = lumen.load(a.model, ctx=64, threads=a.threads)
    kw = dict(max_model_len=prefix + a.suffix + 2, max_num_seqs=2, max_num_batched_tokens=a.budget,
              kv_cache_mb=4 * (prefix + a.suffix) * model.runner.kv_bytes_per_block / 16 / 2 ** 20)
    rng = np.random.default_rng(0)
    ttft(Engine(model, **kw), random_ids(rng, 40, model).tolist())   # warm-up
    miss, hit, off, cached = [], [], [], []
    for _ in range(repeats):
        p = random_ids(rng, prefix, model).tolist()
        sa, sb = (random_ids(rng, a.suffix, model).tolist() for _ in range(2))
        eng = Engine(model, **kw)
        miss.append(ttft(eng, p + sa)[0])
        t, c = ttft(eng, p + sb)
        hit.append(t)
        cached.append(c)
        off.append(ttft(Engine(model, enable_prefix_caching=False, **kw), p + sb)[0])
    m, h, o = (statistics.median(v) for v in (miss, hit, off))
    print(f"TTFT without a hit {m * 1e3:.1f} ms, with it {h * 1e3:.1f} ms ({statistics.median(cached):.0f} tokens "
          f"cached), prefix caching off {o * 1e3:.1f} ms")
    verdict(f"a {prefix}-token prefix hit cuts TTFT {m / h:.1f}x ({m * 1e3:.0f} -> {h * 1e3:.0f} ms, "
            f"{a.suffix}-token suffix, budget {a.budget}, medians of {repeats})")


if __name__ == "__main__":
    main()
