"""Prefill and decode apart (lumen.serve.ray.pd) against colocated serving: what the hand-off costs, what it buys
the streams' inter-token latency, and which P:D ratio a larger machine wants.

    python profiling/pd_serving.py handoff [--model qwen2.5-coder-1.5b] [--prompt-tokens 2000]
        P1 D1 (1 thread each): a warm-up, then one prompt of N tokens; its KV hand-off (the pull through Ray, and
        the write into the decode replica's blocks) against its prefill on the prefill replica, from /metrics
    python profiling/pd_serving.py threshold [--model smollm2-135m]
        P1 D1: TTFT through the prefill pool and on the decode replica for prompts of 32 .. 1024 tokens: the
        hand-off's fixed cost, and the prompt length whose local prefill takes as long (--pd-threshold's default)
    python profiling/pd_serving.py leaks [--model smollm2-135m]
        P1 D1: 200 requests (48-600 tokens, 4 at a time), the prefill replica killed (SIGKILL) twice: blocks held
        or leaked on any replica afterwards, and the requests that failed
    python profiling/pd_serving.py goodput [--configs colocated,pd] [--rates 0.3,0.6,0.9,1.2] [--json FILE]
            [--model M] [--prompt-tokens 2000 --out-tokens 64 | --mix chat|long] [--slo-ttft-ms --slo-tpot-ms]
        Poisson arrivals of 2000-token prompts, 64 tokens out (smollm2-135m), or of a lumen.bench.mix workload:
        the share of requests within a TTFT of 3 s and a TPOT of 20 ms at each rate; goodput (DistServe): the
        highest rate at which 90% are; the verdict once FILE holds both configs for the model and workload (one
        config per invocation keeps each exclusive hold short)
    python profiling/pd_serving.py itl [--model smollm2-135m] [--streams 3] [--long 3] [--prompt-tokens 1000]
        ITL p99 of streams decoding while long prompts arrive: PD (P1 D1, 1 thread each) vs colocated (one
        process, 2 threads, the default paced scheduler), back to back, the same requests
    python profiling/pd_serving.py simulate [--model qwen2.5-coder-1.5b] [--cores 16]
        the step-cost model (lumen.engine.costs, fitted at 1 thread on this machine): the highest request rate
        each split of the cores into one-thread replicas sustains within the SLOs, colocated vs P:D, for a
        long-prompt, a chat-like and a short workload (steady state, no queueing)

Servers are `python -m lumen.serve` on a free port of 127.0.0.1, stopped with SIGINT. Each ends with a VERDICT
line. Run the measuring modes under `flock -x /tmp/lumen-cpu.lock` on a shared machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from ray_serve import Server, metrics_sum  # noqa: E402
import ray_serve  # noqa: E402
from verdict import checked_model, count, list_of, non_negative, positive, verdict  # noqa: E402


def text_ids(model: str, n: int, seed: int = 0) -> list[int]:
    """n token ids of real text (the committed prompt set), from an offset chosen by seed."""
    from lumen.bench.offline import load_prompts
    from lumen.model.parts import build_tokenizer, open_gguf
    from lumen.model.store import resolve
    tok = build_tokenizer(open_gguf(resolve(model))[0].metadata)
    corpus = tok.encode(" ".join(it["prompt"] for it in load_prompts()) * 4, add_bos=False, special=False)
    at = (seed * 7919) % (len(corpus) - n)
    return corpus[at:at + n]


def pd_args(threshold: int = 64) -> list[str]:
    return ["--prefill-replicas", "1", "--decode-replicas", "1", "--threads", "1", "--pd-threshold", str(threshold)]


# ---- the hand-off against the prefill
def handoff(model: str, n: int, log: Path) -> dict:
    ray_serve.MODEL = model
    os.environ["RAY_ADDRESS"] = "local"
    with Server([*pd_args(), "--max-model-len", str(n + 64), "--max-num-batched-tokens", "512",
                 "--kv-cache-mb", "256"], log) as s:
        with httpx.Client(base_url=s.url, timeout=None) as http:
            r = http.post("/v1/completions", json={"prompt": text_ids(model, 200, 1), "max_tokens": 2})
            assert r.status_code == 200, r.text
            time.sleep(2.5)
            before = {k: metrics_sum(s.url, k) for k in ("pd_prefill_seconds_sum", "kv_handoff_seconds_sum",
                                                           "kv_import_seconds_total", "kv_transfer_bytes_total")}
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json={"prompt": text_ids(model, n, 2), "max_tokens": 2})
            ttft_e2e = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            time.sleep(2.5)                               # the replicas' next report
            got = {k: metrics_sum(s.url, k) - v for k, v in before.items()}
    row = {"mode": "handoff", "model": model, "prompt_tokens": n, "prefill_s": got["pd_prefill_seconds_sum"],
           "pull_s": got["kv_handoff_seconds_sum"], "write_s": got["kv_import_seconds_total"],
           "bytes": got["kv_transfer_bytes_total"], "request_s": ttft_e2e, "load": os.getloadavg()[0]}
    row["ratio"] = (row["pull_s"] + row["write_s"]) / row["prefill_s"]
    print(json.dumps(row), flush=True)
    verdict(f"{model}, {n}-token prompt: KV hand-off {1e3 * (row['pull_s'] + row['write_s']):.0f} ms "
            f"(pull {1e3 * row['pull_s']:.0f} + write {1e3 * row['write_s']:.0f}, {row['bytes'] / 2 ** 20:.0f} MiB) "
            f"= {100 * row['ratio']:.1f}% of its prefill ({row['prefill_s']:.1f} s); target <= 10%")
    return row


# ---- where PD starts to pay: its fixed cost in TTFT against a local prefill's time
def threshold(model: str, sizes: list[int], repeats: int, log: Path) -> dict:
    """TTFT through the prefill pool (--pd-threshold 0) and on the decode replica (a threshold past every prompt),
    same server, alternating, distinct prompts (no cache hits): the hand-off's fixed cost is their difference;
    the threshold is the prompt length whose local prefill takes as long (a shorter prompt costs the decode
    replica's streams less than PD costs the request)."""
    ray_serve.MODEL = model
    os.environ["RAY_ADDRESS"] = "local"
    top = max(sizes)
    rows = {}
    for mode, thr in (("pd", 0), ("local", 10 ** 6)):
        with Server([*pd_args(thr), "--max-model-len", str(top + 64), "--kv-cache-mb", "128"], log) as s:
            with httpx.Client(base_url=s.url, timeout=None) as http:
                http.post("/v1/completions", json={"prompt": text_ids(model, 100, 3), "max_tokens": 2})
                for n in sizes:
                    ts = []
                    for r in range(repeats):
                        t0 = time.perf_counter()
                        res = http.post("/v1/completions", json={"prompt": text_ids(model, n, 50 + 10 * r + n),
                                                                 "max_tokens": 1})
                        assert res.status_code == 200, res.text
                        ts.append(time.perf_counter() - t0)
                    rows[(mode, n)] = sorted(ts)[len(ts) // 2]
    over = [rows[("pd", n)] - rows[("local", n)] for n in sizes]
    cost = sorted(over)[len(over) // 2]
    base = rows[("local", min(sizes))]
    for n in sizes:
        print(json.dumps({"mode": "threshold", "model": model, "prompt_tokens": n, "ttft_pd_s": rows[("pd", n)],
                          "ttft_local_s": rows[("local", n)], "local_prefill_s": rows[("local", n)] - base}),
              flush=True)
    per_token = (rows[("local", top)] - base) / (top - min(sizes))
    at = cost / per_token
    verdict(f"{model}: PD adds {1e3 * cost:.0f} ms to a request's TTFT (median over {len(sizes)} sizes); a local "
            f"prefill takes that long at {at:.0f} tokens ({1e3 * per_token:.2f} ms/token): the --pd-threshold")
    return {"cost_s": cost, "threshold": at}


# ---- no block leaked when a prefill replica dies
def pool_state(url: str) -> dict:
    """Per replica: its pid, free/total/held KV blocks and whether it is a decode replica (it counts transfers)."""
    out: dict = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line.startswith("lumen:") or 'replica="' not in line:
            continue
        key, value = line.rsplit(" ", 1)
        rep = key.split('replica="')[1].split('"')[0]
        d = out.setdefault(rep, {"decode": False})
        name = key.split("{")[0][6:]
        if name == "replica_info":
            d["pid"] = int(key.split('pid="')[1].split('"')[0])
        elif name in ("kv_cache_free_blocks", "kv_cache_total_blocks", "kv_held_blocks"):
            d[name] = float(value)
        elif name == "kv_transfers_total":
            d["decode"] = True
            d[key.split('result="')[1].split('"')[0]] = float(value)
    return out


def prefill_pid(url: str, not_pid: int | None = None, timeout: float = 120.0) -> int:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        pids = [d["pid"] for d in pool_state(url).values() if not d["decode"] and "pid" in d]
        pids = [p for p in pids if p != not_pid and os.path.exists(f"/proc/{p}")]
        if pids:
            return pids[0]
        time.sleep(0.5)
    raise RuntimeError("no prefill replica reported")


def leaks(model: str, n_requests: int, kills: list[int], hold_s: float, log: Path) -> dict:
    ray_serve.MODEL = model
    os.environ["RAY_ADDRESS"] = "local"
    rng = random.Random(0)
    reqs = [text_ids(model, rng.randrange(48, 600), rng.randrange(8)) for _ in range(n_requests)]
    with Server([*pd_args(), "--max-model-len", "700", "--kv-cache-mb", "64", "--kv-hold-timeout", str(hold_s),
                 "--max-num-seqs", "8"], log) as s:
        killed: list[int] = []
        failed, done = [], 0

        async def run():
            from lumen.bench.serve import send
            gate = asyncio.Semaphore(4)
            async with httpx.AsyncClient(base_url=s.url, timeout=httpx.Timeout(None, connect=30.0)) as client:
                async def one(i, ids):
                    nonlocal done
                    async with gate:
                        if i in kills:                    # the prefill replica dies with requests in flight
                            pid = await asyncio.to_thread(prefill_pid, s.url, killed[-1] if killed else None)
                            os.kill(pid, 9)
                            killed.append(pid)
                        o = await send(client, "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                                   "stream": True})
                        done += 1
                        if not o.ok:
                            failed.append(o.error)
                await asyncio.gather(*(one(i, ids) for i, ids in enumerate(reqs)))
        t0 = time.perf_counter()
        asyncio.run(run())
        took = time.perf_counter() - t0
        time.sleep(hold_s + 3)                            # holds nobody pulled expire; the next reports
        state = pool_state(s.url)
    leaked = sum(d["kv_cache_total_blocks"] - d["kv_cache_free_blocks"] for d in state.values()
                 if "kv_cache_total_blocks" in d)
    held = sum(d.get("kv_held_blocks", 0) for d in state.values())
    row = {"mode": "leaks", "model": model, "requests": n_requests, "killed": len(killed), "failed": len(failed),
           "errors": sorted(set(failed))[:3], "leaked_blocks": leaked, "held_blocks": held, "took_s": took,
           "replicas": state, "load": os.getloadavg()[0]}
    print(json.dumps(row), flush=True)
    verdict(f"{model}: {n_requests} requests, the prefill replica killed {len(killed)} times: {leaked:.0f} blocks "
            f"leaked, {held:.0f} held, {len(failed)} requests failed (--kv-failure recompute); target 0 leaked")
    return row


# ---- goodput, as DistServe defines it
def goodput(model: str, configs: list[str], rates: list[float], n: int, n_in: int, n_out: int, slo_ttft_ms: float,
            slo_tpot_ms: float, log: Path, json_path: Path, mix: str | None = None) -> None:
    """Poisson arrivals of n requests (n_in prompt tokens, n_out out; or mix's lengths), each prompt a window of the
    mix's committed text at its own offset (lumen.bench.mix: no prompt finds another's prefix cached), at each rate; the share meeting both SLOs; goodput = the highest rate at which 90% do. Rows go to json_path; the
    verdict compares the configs found there for this model and workload (run them in separate invocations to
    keep each exclusive hold short)."""
    ray_serve.MODEL = model
    os.environ["RAY_ADDRESS"] = "local"
    if mix is not None:
        from lumen.bench.mix import MIXES
        m = MIXES[mix]
        n_in, n_out = m.prompt_range[1], m.output_range[1]          # the longest request, for --max-model-len
    workload = mix or f"{n_in}/{n_out}"
    common = ["--max-model-len", str(n_in + n_out + 64), "--kv-cache-mb", "512", "--max-num-seqs", "16"]
    args = {"colocated": ["--threads", "2", *common], "pd": [*pd_args(), *common]}
    for config in configs:
        with Server(args[config], log) as s:
            warm = ray_serve.bench(s.url, num_prompts=2, max_concurrency=1, input_len=min(n_in, 512), output_len=4,
                                   ignore_eos=True)
            assert warm["failed"] == 0, warm["errors"]
            for i, rate in enumerate(rates):
                lens = {} if mix else {"input_len": n_in, "output_len": n_out}     # windows of the chat mix's
                res = ray_serve.bench(s.url, num_prompts=n, request_rate=rate, **lens,  # text: no prefix cached
                                      ignore_eos=True, seed=i + 1, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                                      mix=mix or "chat")
                row = {"mode": "goodput", "config": config, "model": model, "workload": workload,
                       "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "rate": rate, "n": n,
                       "met": res["goodput"] * res["duration_s"] / n, "failed": res["failed"],
                       "ttft_ms_p50": res["ttft_ms"]["p50"], "ttft_ms_p99": res["ttft_ms"]["p99"],
                       "tpot_ms_p50": res["tpot_ms"]["p50"], "tpot_ms_p99": res["tpot_ms"]["p99"],
                       "itl_ms_p99": res["itl_ms"]["p99"], "load": os.getloadavg()[0]}
                print(json.dumps(row), flush=True)
                with json_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    rows = [json.loads(line) for line in json_path.read_text().splitlines() if line.strip()]
    best = {}
    for r in rows:
        if (r["model"], _workload(r)) == (model, workload) and r["met"] >= 0.9:
            best[r["config"]] = max(best.get(r["config"], 0.0), r["rate"])
    seen = {r["config"] for r in rows if (r["model"], _workload(r)) == (model, workload)}
    if seen >= {"pd", "colocated"}:
        pd, colo = best.get("pd", 0.0), best.get("colocated", 0.0)
        name = f"{mix} mix" if mix else f"{n_in} in / {n_out} out"
        verdict(f"{model}, {name}, SLO TTFT {slo_ttft_ms:.0f} ms and TPOT {slo_tpot_ms:.0f} ms "
                f"for 90%: goodput PD (P1 D1 x 1 thread) {pd:g} req/s vs colocated (2 threads) {colo:g} req/s "
                f"(rates {', '.join(f'{r:g}' for r in rates)}); target PD >= 1.2x")


def _workload(row: dict) -> str:
    """A goodput row's workload: its mix, or "in/out" (rows written before mixes had input_len/output_len)."""
    return row.get("workload") or f"{row['input_len']}/{row['output_len']}"


# ---- ITL of running streams while long prompts arrive
async def itl_load(url: str, model: str, streams: int, n_long: int, n: int, gap_s: float, out_tokens: int) -> dict:
    from lumen.bench.serve import send
    stream_ids = [text_ids(model, 48, 10 + i) for i in range(streams)]
    long_ids = [text_ids(model, n, 100 + i) for i in range(n_long)]
    done = asyncio.Event()
    gaps: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=30.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        body = {"max_tokens": out_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

        async def stream(ids):
            while not done.is_set():                      # a closed loop: always decoding until the long ones end
                o = await send(client, "/v1/completions", {**body, "prompt": ids})
                assert o.ok, o.error
                gaps.extend(o.itl)
        tasks = [asyncio.create_task(stream(ids)) for ids in stream_ids]
        await asyncio.sleep(3.0)
        longs = []
        for ids in long_ids:
            longs.append(asyncio.create_task(send(client, "/v1/completions", {**body, "prompt": ids,
                                                                              "max_tokens": 8})))
            await asyncio.sleep(gap_s)
        res = await asyncio.gather(*longs)
        done.set()
        await asyncio.gather(*tasks)
    gaps.sort()
    ttft = sorted(o.ttft for o in res if o.ok)
    return {"itl_p50_ms": 1e3 * gaps[len(gaps) // 2], "itl_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))],
            "itl_max_ms": 1e3 * gaps[-1], "gaps": len(gaps), "long_ttft_mean_s": sum(ttft) / max(1, len(ttft)),
            "long_failed": sum(not o.ok for o in res)}


def itl(model: str, streams: int, n_long: int, n: int, gap_s: float, out_tokens: int, log: Path) -> list[dict]:
    ray_serve.MODEL = model
    os.environ["RAY_ADDRESS"] = "local"
    common = ["--max-model-len", str(n + 64), "--kv-cache-mb", "256", "--max-num-seqs", "16"]
    configs = {"colocated, 1 process x 2 threads": ["--threads", "2", *common],
               "PD, P1 D1 x 1 thread": [*pd_args(), *common]}
    rows = []
    for name, args in configs.items():
        with Server(args, log) as s:
            warm = asyncio.run(itl_load(s.url, model, 1, 1, 64, 0.1, 8))   # compile, both pools
            assert warm["long_failed"] == 0
            row = {"mode": "itl", "config": name, "model": model, "streams": streams, "long": n_long,
                   "prompt_tokens": n, **asyncio.run(itl_load(s.url, model, streams, n_long, n, gap_s, out_tokens)),
                   "load": os.getloadavg()[0]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    colo, pd = rows
    verdict(f"{model}, {streams} streams while {n_long} prompts of {n} tokens arrive: ITL p99 PD "
            f"{pd['itl_p99_ms']:.0f} ms vs colocated {colo['itl_p99_ms']:.0f} ms = "
            f"{pd['itl_p99_ms'] / colo['itl_p99_ms']:.2f}x (target <= 0.3x); the long prompts' TTFT "
            f"{pd['long_ttft_mean_s']:.1f} s vs {colo['long_ttft_mean_s']:.1f} s")
    return rows


# ---- the cost model, 16 cores
WORKLOADS = {"long-prompt (2000 in, 64 out)": (2000, 64), "chat-like (600 in, 200 out)": (600, 200),
             "short (100 in, 100 out)": (100, 100)}


def prefill_s(cm, n: int, chunk: int = 512) -> float:
    """A prompt alone, in chunks of `chunk` tokens."""
    t, done = 0.0, 0
    while done < n:
        c = min(chunk, n - done)
        t += cm.predict(c, 1, c * done + c * (c + 1) // 2)
        done += c
    return t


def decode_step(cm, b: int, ctx: int) -> float:
    return cm.predict(b, b, b * ctx)


def simulate(model: str, cores: int, max_seqs: int = 64) -> list[dict]:
    """Steady-state goodput (requests/s within the SLOs) of `cores` one-thread replicas. SLOs per workload: TPOT
    <= 2x a lone decode step at that context, TTFT <= 3x the prompt's prefill alone. Colocated, the better of:
    mixed, each step carries B decodes and c prompt tokens in the ratio the workload brings them (c = B * in /
    out) within the TPOT SLO (TTFT: the steps a prompt waits for its chunks); phased, k prompts prefilled alone,
    then decoded together (TTFT k prefills). PD: prefill replicas run prompts alone (capacity 1 / prefill time),
    decode replicas the largest batch within the TPOT SLO; the hand-off is left out (under 2% of a prefill,
    measured). No queueing: Poisson arrivals add waiting to every TTFT, more to the colocated phases."""
    import lumen
    from lumen.engine.costs.steps import calibrate
    eng = lumen.Engine(lumen.load(model, ctx=4096, threads=1), threads=1, max_num_batched_tokens=512,
                       max_num_seqs=max_seqs, kv_cache_mb=64, scheduler="fcfs")
    cm = calibrate(eng.runner, eng.cost_key)
    print(cm.fit.describe(), flush=True)
    rows = []
    for wname, (n_in, n_out) in WORKLOADS.items():
        ctx = n_in + n_out // 2
        tpot_slo, ttft_slo = 2 * decode_step(cm, 1, ctx), 3 * prefill_s(cm, n_in)
        mixed = phased = 0.0
        for b in range(1, max_seqs + 1):                     # colocated, per replica: chunks beside decodes
            c = b * n_in / n_out
            step = cm.predict(b + c, b + 1, b * ctx + c * n_in / 2)
            if step <= tpot_slo and (n_in / c) * step <= ttft_slo:
                mixed = max(mixed, b / (n_out * step))
        pre = prefill_s(cm, n_in)
        for k in range(1, max_seqs + 1):                     # ... or phases: k prompts alone, then k decode together
            if k * pre <= ttft_slo and decode_step(cm, k, ctx) <= tpot_slo:
                phased = max(phased, k / (k * pre + n_out * decode_step(cm, k, ctx)))
        best_colo = max(mixed, phased)
        bmax = max([b for b in range(1, max_seqs + 1) if decode_step(cm, b, ctx) <= tpot_slo] or [0])
        dec = bmax / (n_out * decode_step(cm, bmax, ctx)) if bmax else 0.0
        row = {"workload": wname, "tpot_slo_ms": 1e3 * tpot_slo, "ttft_slo_s": ttft_slo,
               "colocated": cores * best_colo, "colocated_mode": "mixed" if mixed >= phased else "phased", "pd": {}}
        for p in range(1, cores):
            row["pd"][f"{p}:{cores - p}"] = min(p / pre, (cores - p) * dec) if pre <= ttft_slo else 0.0
        row["best_pd"] = max(row["pd"], key=row["pd"].get)
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "pd"}),
              flush=True)
    ratios = [r for r in rows[0]["pd"] if int(r.split(":")[0]) in (2, 4, 6, 8, 10, 12)]
    print(f"\n{cores} one-thread replicas, {model}: requests/s within the SLOs (steady state)")
    print("| workload | SLO TPOT / TTFT | colocated (mode) | " + " | ".join(f"PD {r}" for r in ratios) + " | best P:D |")
    print("|---|---|---|" + "---|" * len(ratios) + "---|")
    for r in rows:
        print(f"| {r['workload']} | {r['tpot_slo_ms']:.0f} ms / {r['ttft_slo_s']:.1f} s | {r['colocated']:.2f} "
              f"({r['colocated_mode']}) | "
              + " | ".join(f"{r['pd'][k]:.2f}" for k in ratios)
              + f" | {r['best_pd']} ({r['pd'][r['best_pd']]:.2f}) |")
    long = rows[0]
    verdict(f"simulated {cores} cores, {model}: long-prompt goodput PD {long['best_pd']} "
            f"{long['pd'][long['best_pd']]:.2f} req/s vs colocated {long['colocated']:.2f} = "
            f"{long['pd'][long['best_pd']] / max(long['colocated'], 1e-9):.2f}x; chat-like best "
            f"{rows[1]['best_pd']}, short: PD/colocated {rows[2]['pd'][rows[2]['best_pd']] / max(rows[2]['colocated'], 1e-9):.2f}x")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["handoff", "threshold", "leaks", "goodput", "itl", "simulate"])
    ap.add_argument("--configs", default="colocated,pd", help="goodput: which servers, in this invocation")
    ap.add_argument("--rates", type=list_of(positive), default="0.3,0.6,0.9,1.2",
                    help="goodput: requests per second")
    ap.add_argument("--requests", type=count, default=12, help="goodput: requests per rate")
    ap.add_argument("--slo-ttft-ms", type=positive, default=3000.0)
    ap.add_argument("--slo-tpot-ms", type=positive, default=20.0)
    ap.add_argument("--json", default="/tmp/pd_serving.jsonl", help="goodput: rows appended here")
    ap.add_argument("--model")
    ap.add_argument("--prompt-tokens", type=count)
    ap.add_argument("--streams", type=count, default=3)
    ap.add_argument("--long", type=count, default=3)
    ap.add_argument("--gap", type=non_negative, default=2.0, help="seconds between the long prompts (itl)")
    ap.add_argument("--out-tokens", type=count, default=64, help="tokens out per request (itl, goodput)")
    ap.add_argument("--mix", choices=["chat", "long"], help="goodput: lumen.bench.mix's lengths and text instead")
    ap.add_argument("--cores", type=count, default=16)
    ap.add_argument("--log", default="/tmp/pd_serving.log")
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    if bad := [c for c in configs if c not in ("colocated", "pd")]:
        ap.error(f"argument --configs: expected colocated, pd or both, got {bad[0]!r} in {args.configs!r}")
    if args.cores < 2:
        ap.error(f"argument --cores: must be at least 2 (a prefill and a decode replica), got {args.cores}")
    model = args.model or ("qwen2.5-coder-1.5b" if args.mode in ("handoff", "simulate") else "smollm2-135m")
    checked_model(model)                                # before any server starts, not in its log
    random.seed(0)
    if args.mode == "handoff":
        handoff(model, args.prompt_tokens or 2000, Path(args.log))
    elif args.mode == "threshold":
        threshold(model, [32, 128, 512, 1024], 3, Path(args.log))
    elif args.mode == "leaks":
        leaks(model, 200, [60, 130], 5.0, Path(args.log))
    elif args.mode == "goodput":
        goodput(model, configs, args.rates, args.requests, args.prompt_tokens or 2000, args.out_tokens,
                args.slo_ttft_ms, args.slo_tpot_ms, Path(args.log), Path(args.json), args.mix)
    elif args.mode == "itl":
        itl(model, args.streams, args.long, args.prompt_tokens or 1000, args.gap, args.out_tokens, Path(args.log))
    else:
        simulate(model, args.cores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
