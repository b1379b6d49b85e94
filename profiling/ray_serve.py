"""Lumen on Ray Serve against one process, and the prefix-aware router against Ray's power of two choices.

    python profiling/ray_serve.py throughput [--repeats 2]   2 replicas x 1 thread vs 1 process x 2 threads,
                                                            output tok/s at concurrency 16 (lumen.bench serve)
    python profiling/ray_serve.py overhead [--repeats 2]     TPOT at concurrency 1: 1 replica x 2 threads on Ray
                                                            (--min/--max-replicas 1 forces the Ray path) vs one
                                                            process x 2 threads
    python profiling/ray_serve.py prefix --request-rate R | --concurrency C [--kv-cache-mb MB]
                                                            8 system prompts of ~1000 tokens, 64 requests (Poisson
                                                            arrivals or a closed loop), 2 replicas x 1 thread: mean
                                                            TTFT and prefix-cache hit rate, --router prefix vs pow2
    python profiling/ray_serve.py startup                    launch -> /health 200 -> first completion

Each run starts its server(s) as `python -m lumen.serve` on a free port of 127.0.0.1 and stops them (SIGINT);
pairs run back to back, alternating which goes first. Results as JSON lines (--json FILE appends).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from verdict import count, positive

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m lumen.serve ARGS` on a free port; up when /health answers 200."""

    def __init__(self, args: list[str], log: Path, timeout: float = 240.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.t0 = time.perf_counter()
        self.p = subprocess.Popen([sys.executable, "-m", "lumen.serve", "--model", MODEL, *args, "--port",
                                   str(self.port)], stdout=log.open("w"), stderr=subprocess.STDOUT)
        while True:
            if self.p.poll() is not None:
                raise RuntimeError(f"the server exited: see {log}")
            if time.perf_counter() - self.t0 > timeout:
                self.stop()
                raise RuntimeError(f"the server did not come up in {timeout} s: see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.ready_s = time.perf_counter() - self.t0

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(90)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def metrics_sum(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"lumen:{name}{{") or line.startswith(f"lumen:{name} "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def bench(url: str, **kw) -> dict:
    from lumen.bench.serve import Load, run
    return asyncio.run(run(Load(url=url, **kw)))


# ---- throughput and overhead: lumen.bench serve, as the README's serving table
SINGLE = ["--threads", "2", "--max-num-seqs", "16"]


def throughput(repeats: int, log: Path) -> list[dict]:
    configs = {"1 process x 2 threads": SINGLE,
               "2 replicas x 1 thread": ["--replicas", "2", "--threads", "1", "--max-num-seqs", "16"]}
    return _pairs(configs, repeats, log, dict(num_prompts=64, max_concurrency=16, input_len=100, output_len=128,
                                              ignore_eos=True))


def overhead(repeats: int, log: Path) -> list[dict]:
    configs = {"1 process x 2 threads": SINGLE,
               "Ray, 1 replica x 2 threads": ["--min-replicas", "1", "--max-replicas", "1", *SINGLE]}
    return _pairs(configs, repeats, log, dict(num_prompts=12, max_concurrency=1, input_len=100, output_len=128,
                                              ignore_eos=True))


def _pairs(configs: dict, repeats: int, log: Path, load: dict) -> list[dict]:
    out = []
    names = list(configs)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            with Server(configs[name], log) as s:
                res = bench(s.url, **load)
            row = {"config": name, "repeat": r, "load": os.getloadavg()[0], "output_tok_s": res["output_throughput"],
                   "ttft_ms_mean": res["ttft_ms"]["mean"], "tpot_ms_mean": res["tpot_ms"]["mean"],
                   "tpot_ms_p50": res["tpot_ms"]["p50"], "failed": res["failed"]}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


# ---- prefix-aware routing
def shared_prefix_requests(n_system: int = 8, n_requests: int = 64, system_len: int = 1000, seed: int = 0):
    """(token ids, system index) x n_requests: n_system system prompts of system_len tokens (texts of the
    committed prompt set, each from another offset), each followed by a distinct question, in random order."""
    from lumen.bench.offline import load_prompts
    from lumen.model.parts import build_tokenizer, open_gguf
    from lumen.model.store import resolve
    tok = build_tokenizer(open_gguf(resolve(MODEL))[0].metadata)
    texts = [it["prompt"] for it in load_prompts()]
    corpus = tok.encode(" ".join(texts), add_bos=False, special=False)
    bos = [tok.bos_id] if tok.add_bos_default and tok.bos_id is not None else []
    systems = [bos + corpus[(k * 997) % (len(corpus) - system_len):][:system_len - len(bos)] for k in range(n_system)]
    reqs = []
    for j in range(n_requests):
        question = tok.encode(f" Question {j}: what does part {j % 13} of this say about {texts[j % len(texts)][:60]}?",
                              add_bos=False, special=False)
        reqs.append((systems[j % n_system] + question, j % n_system))
    random.Random(seed).shuffle(reqs)
    return reqs


async def send_all(url: str, reqs, concurrency: int | None, max_tokens: int, rate: float | None = None,
                   seed: int = 0) -> list:
    """Every request, streamed: at most `concurrency` at once, or arriving as a Poisson process of `rate`/s."""
    from lumen.bench.serve import send
    gate = asyncio.Semaphore(concurrency or len(reqs))
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        async def one(ids):
            async with gate:
                return await send(client, "/v1/completions", {
                    "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}})
        tasks = []
        for ids, _ in reqs:
            tasks.append(asyncio.create_task(one(ids)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def prefix(repeats: int, log: Path, kv_cache_mb: float, concurrency: int | None, max_tokens: int,
           rate: float | None) -> list[dict]:
    from lumen.kernels.attention import BLOCK
    reqs = shared_prefix_requests()
    first: set[int] = set()
    could = 0                                    # prompt tokens that could hit: all but each system's first
    for ids, k in reqs:
        shared = 1000 // BLOCK * BLOCK
        if k in first:
            could += shared
        first.add(k)
    out = []
    for r in range(repeats):
        for router in (["prefix", "pow2"] if r % 2 == 0 else ["pow2", "prefix"]):
            args = ["--replicas", "2", "--threads", "1", "--max-num-seqs", "8", "--kv-cache-mb", str(kv_cache_mb),
                    "--max-model-len", "1200", "--router", router]
            with Server(args, log) as s:
                warm = asyncio.run(send_all(s.url, [(list(range(1, 40)), 0)] * 2, 2, 2))   # both replicas
                assert all(o.ok for o in warm)
                h0, q0 = metrics_sum(s.url, "prefix_cache_hits_total"), metrics_sum(s.url, "prefix_cache_queries_total")
                t0 = time.perf_counter()
                res = asyncio.run(send_all(s.url, reqs, concurrency, max_tokens, rate))
                took = time.perf_counter() - t0
                time.sleep(2.5)                      # the replicas' next report (every second)
                hits = metrics_sum(s.url, "prefix_cache_hits_total") - h0
                queries = metrics_sum(s.url, "prefix_cache_queries_total") - q0
                preempted = metrics_sum(s.url, "num_preemptions_total")
                decisions = {line.split('decision="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                             for line in httpx.get(s.url + "/metrics").text.splitlines()
                             if line.startswith("lumen:router_decisions_total{")}
            ok = [o for o in res if o.ok]
            ttft = sorted(o.ttft for o in ok)
            row = {"router": router, "repeat": r, "load": os.getloadavg()[0], "completed": len(ok),
                   "ttft_ms_mean": 1e3 * sum(ttft) / len(ttft), "ttft_ms_p50": 1e3 * ttft[len(ttft) // 2],
                   "ttft_ms_p90": 1e3 * ttft[int(len(ttft) * 0.9)], "duration_s": took,
                   "hit_tokens": hits, "query_tokens": queries, "could_hit_tokens": could,
                   "hit_share_of_could": hits / could, "preemptions": preempted, "decisions": decisions, "kv_cache_mb": kv_cache_mb, "concurrency": concurrency, "request_rate": rate}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def startup(log: Path) -> list[dict]:
    t0 = time.perf_counter()
    with Server(["--replicas", "2", "--threads", "1"], log) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=60)
        first = time.perf_counter() - t0
        row = {"ready_s": s.ready_s, "first_request_s": first, "status": r.status_code,
               "load": os.getloadavg()[0]}
    row["stopped_s"] = time.perf_counter() - t0 - first
    print(json.dumps(row), flush=True)
    return [row]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["throughput", "overhead", "prefix", "startup"])
    ap.add_argument("--repeats", type=count, default=2)
    ap.add_argument("--kv-cache-mb", type=positive, default=160.0,
                    help="prefix: each replica's KV pool (160 MB: ~7,000 tokens, about 6 of the 8 system prompts)")
    ap.add_argument("--concurrency", type=count, default=None, help="prefix: requests in flight at most")
    ap.add_argument("--request-rate", type=positive, default=None, help="prefix: Poisson arrivals, requests/s")
    ap.add_argument("--max-tokens", type=count, default=16)
    ap.add_argument("--log", default="/tmp/lumen-ray-serve.log")
    ap.add_argument("--json", help="append the rows to this file")
    a = ap.parse_args(argv)
    log = Path(a.log)
    if a.what == "prefix":
        if (a.concurrency is None) == (a.request_rate is None):
            ap.error("prefix: give --concurrency or --request-rate")
        rows = prefix(a.repeats, log, a.kv_cache_mb, a.concurrency, a.max_tokens, a.request_rate)
    elif a.what == "startup":
        rows = startup(log)
    else:
        rows = {"throughput": throughput, "overhead": overhead}[a.what](a.repeats, log)
    if a.json:
        with open(a.json, "a") as f:
            for row in rows:
                f.write(json.dumps(dict(row, what=a.what)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
