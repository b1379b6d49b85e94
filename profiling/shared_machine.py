"""Where does a shared machine take Lumen's speed, and what is left of it? Lumen and llama-bench side by side.

    python profiling/shared_machine.py [--quick] [--model smollm2-135m] [--reps 3] [--llama-bench PATH]
                                       [--no-server]

1. Decode beside neighbours. Parallel regions per decode step (counted by the profiler), then decode tok/s alone,
   beside a process that sleeps 1 ms in a loop and beside one that spins (lumen.bench.corunner), interleaved, for:
   2 threads fixed with the old static split of each matmul region, 2 threads fixed with the share-stealing split
   (lumen.kernels.work), 1 thread, and 2 threads governed (lumen.engine.threads), each timed after 32 untimed
   tokens (the steady state beside a neighbour that stays); and llama-bench tg at 2 and 1 threads beside the same. Time lost per region = (step time beside it - alone) / regions.
2. The server at concurrency 1 (python -m lumen.serve, its load generator lumen.bench.serve in this process, on the
   same cores): per output token, the CPU time of the engine's compute threads (the engine thread, named
   lumen-engine, and the OpenMP workers it starts, which inherit the name), of the event loop (the main thread)
   and of the server's other threads, and of the client; the compute threads' waits for a core and context
   switches per token; TPOT against Model.generate's on the same prompt length, interleaved.
3. The server beside each neighbour, one request at a time with --gap seconds between them (a chat user: every
   request begins after a pause, when the thread governor must tell a neighbour that stays from one that left):
   median TTFT of a new prompt and of one in the prefix cache (a chat's next turn), TPOT, and their ratio to idle.
Ends with a VERDICT line.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import numba
import numpy as np

import lumen
from lumen.bench.corunner import corunner
from lumen.bench.tools import given_tool
from lumen.kernels.work import STATIC
from verdict import count, non_negative, one_line_errors, verdict

KINDS = ("none", "sleep", "busy")


def decode_tps(model, ids, n: int, settle: int = 32) -> float:
    """Decode tok/s over n tokens, timed after `settle` tokens (the thread governor's readings settle on the
    neighbour that is there: the steady state, not its arrival)."""
    t0 = None
    for i, _ in enumerate(model.generate(ids, max_tokens=n + settle, temperature=0, ignore_eos=True)):
        if i == settle:
            t0 = time.perf_counter()
    return n / (time.perf_counter() - t0)


def regions_per_step(model, ids, n: int) -> float:
    from lumen.kernels.policy import split_attention
    from lumen.profile.report import matmul_ops
    mats = matmul_ops()
    model.reset()
    with lumen.profile() as prof:
        model.prefill(ids)
        for _ in range(n):
            model.decode(1)
    steps = [s for s in prof.steps if s.phase == "decode"]
    recs = prof.select("decode")
    split = split_attention(1, len(ids) + 1)
    return sum(r.op in mats or (split and r.op == "attention") for r in recs) / len(steps)


def llama_tg(binary: str, path: str, threads: int, n: int) -> float:
    out = subprocess.run([binary, "-m", path, "-p", "0", "-n", str(n), "-t", str(threads), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, timeout=600)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def part1(model, path, reps: int, n: int, binary: str | None) -> dict:
    ids = np.random.default_rng(0).integers(0, model.config.n_vocab, 8).tolist()
    gov, work = model.runner.governor, model.runner.scr.mm.work
    hi = gov.max
    configs = {"2 fixed, static split": (hi, False, True), "2 fixed, stealing": (hi, False, False),
               "1 thread": (1, False, False), "2 governed": (hi, True, False)}
    res: dict = {}
    decode_tps(model, ids, 8)
    for _ in range(reps):
        for kind in KINDS:
            with corunner(kind, seconds=600):
                time.sleep(0.2)
                for name, (t, adaptive, static) in configs.items():
                    gov.max = hi
                    gov.n, gov.adaptive, gov._ups = t, adaptive, 0
                    if not adaptive:
                        gov.max = t
                    work[0] = STATIC if static else 0
                    res.setdefault((name, kind), []).append(decode_tps(model, ids, n))
                if binary:
                    for t in (hi, 1):
                        res.setdefault((f"llama-bench {t} thr", kind), []).append(llama_tg(binary, path, t, n))
    gov.max, gov.n, gov.adaptive = hi, hi, True
    work[0] = 0
    return {k: statistics.median(v) for k, v in res.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tasks(pid: int) -> dict:
    """tid -> (name, run s, wait s, switches) of every thread of process pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            run, wait, n = open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[:3]
            out[int(tid)] = (name, int(run) / 1e9, int(wait) / 1e9, int(n))
        except (OSError, ValueError):
            pass
    return out


def _serve(model_name: str, threads: int) -> tuple[subprocess.Popen, int]:
    """A lumen.serve process on a free port of 127.0.0.1, once its /health answers."""
    port = _free_port()
    srv = subprocess.Popen([sys.executable, "-m", "lumen.serve", "--model", model_name, "--port", str(port),
                            "-t", str(threads), "--log-level", "warning"], stdin=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return srv, port
        except OSError:
            if srv.poll() is not None:
                raise RuntimeError("the server exited")
            time.sleep(0.2)
    _stop(srv)
    raise RuntimeError("the server did not answer /health in 120 s")


def _stop(srv: subprocess.Popen) -> None:
    srv.terminate()
    try:
        srv.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.kill()
        srv.wait()


def part2(model, srv: subprocess.Popen, port: int, reps: int, n_prompts: int, out_len: int) -> dict:
    from lumen.bench.serve import Load, run_load
    prompt = model.tokenize(" ".join(["The quick brown fox jumps over the lazy dog."] * 12))[:100]
    load = Load(url=f"http://127.0.0.1:{port}", num_prompts=n_prompts, max_concurrency=1, input_len=100,
                output_len=out_len, ignore_eos=True)
    # warm: the client's and the server's paths
    run_load(Load(url=load.url, num_prompts=1, max_concurrency=1, input_len=16, output_len=4, ignore_eos=True))
    server, gen, cpu = [], [], []
    for _ in range(reps):
        before, ru0 = _tasks(srv.pid), resource.getrusage(resource.RUSAGE_SELF)
        res = run_load(load)
        after, ru1 = _tasks(srv.pid), resource.getrusage(resource.RUSAGE_SELF)
        server.append(res["tpot_ms"]["mean"])
        toks = res["total_output_tokens"]
        split = {"compute": [0.0, 0.0, 0], "event loop": [0.0, 0.0, 0], "other server threads": [0.0, 0.0, 0]}
        for tid, (name, r, w, s) in after.items():
            r0, w0, s0 = before.get(tid, (name, 0.0, 0.0, 0))[1:]
            key = ("compute" if name == "lumen-engine" else "event loop" if tid == srv.pid
                   else "other server threads")
            split[key][0] += r - r0
            split[key][1] += w - w0
            split[key][2] += s - s0
        client = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        cpu.append({k: (v[0] / toks * 1e3, v[1] / toks * 1e3, v[2] / toks) for k, v in split.items()}
                   | {"client (load generator)": (client / toks * 1e3, 0.0, 0.0)})
        ts = []
        for i, _ in enumerate(model.generate(prompt, max_tokens=out_len, temperature=0, ignore_eos=True)):
            ts.append(time.perf_counter())
        gen.append((ts[-1] - ts[0]) / (len(ts) - 1) * 1e3)
    keys = cpu[0].keys()
    per_token = {k: tuple(statistics.median(c[k][i] for c in cpu) for i in range(3)) for k in keys}
    return {"server_tpot_ms": statistics.median(server), "generate_tpot_ms": statistics.median(gen),
            "ratio": statistics.median(s / g for s, g in zip(server, gen)), "per_token": per_token}


def _stream(url: str, prompt: str, out_len: int) -> tuple[float, float]:
    """(TTFT s, TPOT s) of one streamed /v1/completions request (greedy, out_len tokens, EOS ignored), sent and
    timed by the load generator's own `send`."""
    import asyncio
    import httpx
    from lumen.bench.serve import send
    body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one():
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=30.0)) as client:
            return await send(client, "/v1/completions", body)
    o = asyncio.run(one())
    if not o.ok or o.tpot is None:
        raise RuntimeError(f"a request failed: {o.error or 'fewer than 2 tokens'}")
    return o.ttft, o.tpot


def part3(port: int, reps: int, n_requests: int, gap: float, out_len: int) -> dict:
    """kind -> (median TTFT ms of a new prompt, of a cached one, median TPOT ms) of requests sent one at a time,
    gap s apart, beside each neighbour; the neighbours alternate repetition by repetition. A new prompt is the
    first of the committed set (lumen/bench/data/prompts.json) behind a number of its own, so no prefix-cache hit;
    a cached one is that prompt as it is, in the prefix cache since the warm-up (as a chat's next turn: a short
    first step)."""
    from lumen.bench.offline import workload
    url = f"http://127.0.0.1:{port}"
    base = workload(1)[0][0]
    _stream(url, base, 4)                                # warm: the paths, and the cached prompt
    got = {k: ([], [], []) for k in KINDS}
    i = 0
    for _ in range(reps):
        for kind in KINDS:
            with corunner(kind, seconds=60 + 2 * n_requests * (gap + 5)):
                time.sleep(gap)                          # the neighbour is there before the first request
                for _ in range(n_requests):
                    for cached in (False, True):
                        i += 1
                        ttft, tpot = _stream(url, base if cached else f"Note {i}. {base}", out_len)
                        got[kind][int(cached)].append(ttft * 1e3)
                        got[kind][2].append(tpot * 1e3)
                        time.sleep(gap)
    return {k: tuple(statistics.median(x) for x in v) for k, v in got.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--reps", type=count, default=3)
    ap.add_argument("--gen", type=count, default=128, help="decode tokens per measurement (default 128)")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (default $LLAMA_BENCH; without it, "
                                          "Lumen alone)")
    ap.add_argument("--no-server", action="store_true", help="part 1 only")
    ap.add_argument("--gap", type=non_negative, default=1.5, help="part 3: seconds between requests (default 1.5)")
    ap.add_argument("--quick", action="store_true", help="1 repetition of 16 tokens, no llama-bench (for tests)")
    a = ap.parse_args(argv)
    a.llama_bench = given_tool(ap, "llama-bench", "--llama-bench", a.llama_bench, "LLAMA_BENCH")
    reps, n = (1, 16) if a.quick else (a.reps, a.gen)
    binary = None if a.quick else a.llama_bench
    hi = numba.config.NUMBA_NUM_THREADS
    with one_line_errors():
        model = lumen.load(a.model, ctx=1024, threads=hi)
    path = str(model.path)
    ids = np.random.default_rng(0).integers(0, model.config.n_vocab, 8).tolist()
    regions = regions_per_step(model, ids, 8)
    t = part1(model, path, reps, n, binary)
    print(f"\n1. decode beside neighbours: {a.model}, {n} tokens, median of {reps}, interleaved "
          f"[load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores]; {regions:.0f} parallel regions per step")
    names = sorted({k[0] for k in t}, key=lambda s: (s.startswith("llama"), s))
    print(f"{'':>24} " + " ".join(f"{k:>9}" for k in KINDS) + f" {'sleep/idle':>10} {'busy/idle':>9} {'lost/region':>12}")
    for name in names:
        v = [t[(name, k)] for k in KINDS]
        lost = (1 / v[2] - 1 / v[0]) / regions * 1e6 if not name.startswith("llama") else float("nan")
        print(f"{name:>24} " + " ".join(f"{x:>9.1f}" for x in v) + f" {v[1] / v[0]:>10.2f} {v[2] / v[0]:>9.2f}"
              f" {lost:>9.0f} us")
    srv = paused = None
    if not a.no_server:
        proc, port = _serve(a.model, hi)
        try:
            srv = part2(model, proc, port, reps, 2 if a.quick else 4, 32 if a.quick else 128)
            gap, n_req = (0.3, 2) if a.quick else (a.gap, 4)
            paused = part3(port, reps, n_req, gap, 8 if a.quick else 48)
        finally:
            _stop(proc)
        print(f"\n2. the server at concurrency 1, {hi} threads (governed), 100-token prompts: TPOT "
              f"{srv['server_tpot_ms']:.2f} ms, Model.generate {srv['generate_tpot_ms']:.2f} ms, ratio "
              f"{srv['ratio']:.2f} (median of per-repetition ratios)")
        print(f"{'per output token':>26} {'CPU ms':>8} {'waited ms':>10} {'switches':>9}")
        for k, (c, w, s) in srv["per_token"].items():
            print(f"{k:>26} {c:>8.3f} {w:>10.3f} {s:>9.1f}")
    if paused:
        print(f"\n3. the server, one request at a time {gap} s apart, beside each neighbour ({2 * n_req} requests x "
              f"{reps} repetitions, medians) [load {os.getloadavg()[0]:.1f}]")
        print(f"{'':>8} {'TTFT new':>9} {'TTFT cached':>12} {'TPOT ms':>8}   ratios to idle")
        idle = paused["none"]
        for k, v in paused.items():
            ratios = " ".join(f"{x / y:.2f}" for x, y in zip(v, idle))
            print(f"{k:>8} {v[0]:>9.1f} {v[1]:>12.1f} {v[2]:>8.2f}   {ratios}")
    base = t[("2 fixed, stealing", "none")]
    gov_busy = t[("2 governed", "busy")] / t[("2 governed", "none")]
    fixed_busy = t[("2 fixed, static split", "busy")] / t[("2 fixed, static split", "none")]
    one = t[("1 thread", "busy")] / base
    llama = (f"; llama-bench {t[(f'llama-bench {hi} thr', 'busy')] / t[(f'llama-bench {hi} thr', 'none')]:.2f}"
             if binary else "")
    verdict(f"beside a busy process, {hi} fixed threads keep {fixed_busy:.2f} of their idle decode "
            f"({(1 / t[('2 fixed, static split', 'busy')] - 1 / t[('2 fixed, static split', 'none')]) / regions * 1e6:.0f}"
            f" us lost per parallel region, {regions:.0f} regions a step): a barrier waits for a descheduled thread; "
            f"1 thread keeps {one:.2f} of {hi} threads' idle speed, the governed engine {gov_busy:.2f}{llama}; beside "
            f"a sleeping loop the governed engine keeps {t[('2 governed', 'sleep')] / t[('2 governed', 'none')]:.2f}"
            + (f"; the server's TPOT at concurrency 1 is {srv['ratio']:.2f}x Model.generate's" if srv else "")
            + (f"; one request at a time after pauses, beside a busy process: TTFT "
               f"{paused['busy'][0] / paused['none'][0]:.2f}x (new prompt) and {paused['busy'][1] / paused['none'][1]:.2f}x (cached), TPOT "
               f"{paused['busy'][2] / paused['none'][2]:.2f}x idle" if paused else ""))


if __name__ == "__main__":
    main()
