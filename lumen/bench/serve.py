"""A load generator for any OpenAI-compatible server, in the manner of `vllm bench serve`.

    python -m lumen.bench serve --url http://127.0.0.1:8000 [--endpoint completions|chat] [--num-prompts 64]
        [--request-rate R (Poisson) | --max-concurrency C] [--input-len N] [--output-len N] [--ignore-eos]
        [--slo-ttft-ms MS] [--slo-tpot-ms MS] [--probe-health] [--json FILE]

Requests are streamed (SSE) over plain OpenAI HTTP (httpx), so the same run measures Lumen
(`python -m lumen.serve`) and llama.cpp's llama-server. Prompts are lumen/bench/data/prompts.json taken as
`lumen.bench offline` takes them (round-robin over its kinds, max_tokens 16..256 by request); --input-len cuts
or repeats each to N tokens (through the server's /tokenize and /detokenize, which both servers have) and
--output-len sets every max_tokens (with --ignore-eos every request makes exactly that many).

Per request: TTFT (send -> first non-empty text chunk), ITL (gaps between text chunks; one token each on both
servers), TPOT ((E2E - TTFT) / (output tokens - 1)), E2E. Output tokens are the server's usage
(stream_options.include_usage) when it reports it, else the number of text chunks. Reported: request, output
and total token throughput; TTFT, TPOT, ITL, E2E mean/p50/p90/p99; goodput (requests/s meeting every SLO
given); with --probe-health, the latency of GET /health sampled every --probe-interval-ms during the load.

Soak: --duration S keeps sending for S seconds (--request-rate R for a steady Poisson rate, or
--max-concurrency C clients back to back) and reports each --window of seconds: requests finished, output
tok/s, TTFT and ITL p99, and the server's RSS (process_resident_memory_bytes from its /metrics, which
lumen.serve exports); then the drift from the first window to the last. A ten-minute soak:
`--duration 600 --request-rate R --window 60`.

A benchmark anyone can rerun: --mix chat|long (seeded prompt and output lengths cut from committed text:
lumen.bench.mix), --concurrency 1,4,16 (a sweep; --num-prompts per level, default 2x the level), and
--serve-model MODEL, which starts `lumen.serve` itself on a free port of 127.0.0.1; --compare llama.cpp
[--llama-server PATH] starts llama-server too on the same GGUF (-np <largest level> -c <enough> -t --threads,
weight repacking on) and runs the same requests against both, interleaved per level and repetition, then prints
output tok/s, TTFT p50/p99 and ITL p50/p99 side by side with their ratios. Every server started is stopped at
the end, on an error and on Ctrl-C (lumen.bench.launch). --corunner sleep,busy runs every level and repetition
again beside each co-runner (lumen.bench.corunner, its own process on the same cores as the servers and this
client), with fresh prompts, and prints each server's figures beside it over its idle ones of the same repetition.

    python -m lumen.bench serve --serve-model qwen2.5-coder-1.5b --compare llama.cpp --llama-server PATH \
        --mix chat --concurrency 1,4,16 --ignore-eos -r 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from ..commands import Parser, check_writable, prog
from .mix import MIXES as MIX_NAMES
from .tools import BUILD_LLAMA, comma_list

LLAMA_SERVER = """llama.cpp's llama-server for comparison: build it from the llama.cpp source inside the
llama-cpp-python 0.3.36 sdist (needs cmake and a C++ compiler; with the vector extensions this CPU reports and
never AMX):
""" + BUILD_LLAMA + """
then either
  build/bin/llama-server -m MODEL.gguf -t 2 -np 16 -c 8192 --host 127.0.0.1 --port 8080
  python -m lumen.bench serve --url http://127.0.0.1:8080 --max-concurrency 16 --input-len 100 --output-len 128 \\
      --ignore-eos
or let the benchmark start both servers and stop them:
  python -m lumen.bench serve --serve-model MODEL --llama-server build/bin/llama-server --mix chat \\
      --concurrency 1,4,16 --ignore-eos
-np 16 gives 16 slots of -c / 16 tokens each (8192 / 16 = 512 here). Weight repacking (llama.cpp's default and its
fastest path) stays on: -nr (--no-repack) handicaps llama.cpp; say so beside any figure that used it."""


@dataclass
class Load:
    """What one run sends, and where (the command line's flags, by name)."""
    url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 64
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    probe_health: bool = False
    probe_interval_ms: float = 50.0
    duration: float | None = None
    window: float = 60.0
    label: str | None = None
    mix: str | None = None


@dataclass
class Outcome:
    """One request: times in seconds from its send."""
    ok: bool
    error: str = ""
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft: float | None = None
    itl: list = field(default_factory=list)
    e2e: float = 0.0
    finished_at: float = 0.0       # seconds from the start of the load

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog=prog("bench serve"), description=__doc__.splitlines()[0],
                                 epilog=LLAMA_SERVER, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="the server's base URL (default http://127.0.0.1:8000)")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                    help="/v1/completions (default) or /v1/chat/completions")
    ap.add_argument("--model", help="model id to send (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests to send (default 64; with --concurrency, per level: 2x the level, at least 8)")
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second, Poisson arrivals (default inf: all at once)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ap.add_argument("--input-len", type=int, default=None, help="cut or repeat every prompt to N tokens")
    ap.add_argument("--output-len", type=int, default=None, help="max_tokens of every request")
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (every request makes max_tokens)")
    ap.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals (default 0)")
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    ap.add_argument("--probe-health", action="store_true", help="sample GET /health latency during the load")
    ap.add_argument("--probe-interval-ms", type=float, default=None,
                    help="with --probe-health: between health probes (default 50)")
    ap.add_argument("--duration", type=float, default=None,
                    help="soak: send requests for this many seconds (cycling through the prompts) instead of "
                         "--num-prompts; needs --request-rate or --max-concurrency")
    ap.add_argument("--window", type=float, default=None,
                    help="with --duration: report latency, throughput and the server's RSS per window of this many "
                         "seconds (default 60)")
    ap.add_argument("--label", default=None, help="a name for this run in the JSON")
    ap.add_argument("--json", metavar="FILE", help="write the results here")
    wl = ap.add_argument_group("a reproducible sweep (lumen.bench.mix; the servers started here)")
    wl.add_argument("--mix", choices=sorted(MIX_NAMES),
                    help="prompt and output lengths: chat (prompts log-normal around 150 tokens, with a tail), long "
                         "(1024..2048 tokens); seeded by --seed, cut from committed text")
    wl.add_argument("--concurrency", metavar="LEVELS",
                    help="a sweep of --max-concurrency levels, comma-separated (e.g. 1,4,16), each with its own "
                         "--num-prompts requests")
    wl.add_argument("-r", "--repetitions", type=int, default=1,
                    help="runs per level and server, interleaved (default 1; medians)")
    wl.add_argument("--serve-model", metavar="MODEL",
                    help="start `lumen.serve --model MODEL` on a free port of 127.0.0.1 and measure it (instead of "
                         "--url); stopped at the end")
    wl.add_argument("--threads", "-t", type=int, default=2, help="threads of the servers started here (default 2)")
    wl.add_argument("--serve-args", default="", help="extra lumen.serve flags, e.g. \"--max-num-batched-tokens 64\"")
    wl.add_argument("--compare", choices=["llama.cpp"],
                    help="also start llama-server on the same GGUF (-np <largest level> -c <enough> -t THREADS) "
                         "and run the same requests against it, interleaved per level; needs --serve-model")
    wl.add_argument("--llama-server", metavar="PATH",
                    help="the llama-server binary (implies --compare; default $LLAMA_SERVER, else on $PATH)")
    wl.add_argument("--llama-args", default="", help="extra llama-server flags (e.g. \"-nr\", said beside figures)")
    wl.add_argument("--corunner", metavar="KINDS", default=None,
                    help="also run every level and repetition beside each co-runner, comma-separated: sleep (a "
                         "process sleeping 1 ms in a loop), busy (one spinning a core); each server's figures "
                         "beside it are divided by its idle ones of the same repetition (lumen.bench.corunner)")
    return ap


# ---- the requests
_CORPUS: dict[str, list[int]] = {}        # the mix's corpus as token ids, by server URL (tokenized once)

def _answer(r) -> dict:
    """r's JSON body; when the server refused the request, a RuntimeError of one line with what was asked and the
    server's own reason (its OpenAI-style error message, else the start of its body)."""
    if r.status_code == 200:
        return r.json()
    try:
        why = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        why = r.text[:200]
    why = " ".join(str(why).split()) or "no reason given"
    raise RuntimeError(f"the server refused {r.request.method} {r.request.url.path} (HTTP {r.status_code}): {why}")


async def _model_id(client) -> str:
    return _answer(await client.get("/v1/models"))["data"][0]["id"]


async def _tokenize_corpus(client, mix) -> list[int]:
    """The mix's corpus as the server tokenizes it: whole, or, from a server that refuses a text that long (one
    with a short max_model_len), each committed prompt apart, joined by the separator's ids."""
    r = await client.post("/tokenize", json={"content": mix.corpus()})
    if r.status_code != 400:
        return _answer(r)["tokens"]
    out: list[int] = []
    sep = None
    for piece in mix.corpus_pieces():
        if out:
            if sep is None:
                sep = _answer(await client.post("/tokenize", json={"content": mix.SEPARATOR}))["tokens"]
            out += sep
        out += _answer(await client.post("/tokenize", json={"content": piece}))["tokens"]
    return out


async def _fit_prompt(client, text: str, n: int) -> str:
    """The text cut or repeated to n tokens, through the server's /tokenize and /detokenize (llama-server's
    shape, which lumen.serve also takes)."""
    ids = _answer(await client.post("/tokenize", json={"content": text}))["tokens"]
    if not ids:
        raise ValueError("the server tokenized a prompt to no tokens")
    ids = (ids * (n // len(ids) + 1))[:n]
    return _answer(await client.post("/detokenize", json={"tokens": ids}))["content"]


async def prepare(load: Load, client, variant: int = 0) -> list[tuple[str, int]]:
    """The run's (prompt, max_tokens) list: the committed workload (cut or repeated to --input-len), or with
    --mix, windows of the committed corpus of the mix's lengths (lumen.bench.mix), through the server's
    /tokenize and /detokenize; --input-len and --output-len override the lengths. Each variant (a sweep's level
    and repetition) cuts the same lengths from other places, so no run finds another's prompts cached."""
    from .offline import workload
    if load.mix is None:
        reqs = workload(load.num_prompts)
        if load.input_len is not None:
            reqs = [(await _fit_prompt(client, p, load.input_len), n) for p, n in reqs]
    else:
        from . import mix
        lens = mix.lengths(load.mix, load.num_prompts, load.seed)
        if load.input_len is not None:
            lens = [(load.input_len, o) for _, o in lens]
        ids = _CORPUS.get(load.url)
        if ids is None:
            ids = _CORPUS[load.url] = await _tokenize_corpus(client, mix)
        reqs = []
        for (a, b), (_, o) in zip(mix.windows(len(ids), [p for p, _ in lens], load.seed * 1_000_003 + variant),
                                  lens):
            reqs.append((_answer(await client.post("/detokenize", json={"tokens": ids[a:b]}))["content"], o))
    if load.output_len is not None:
        reqs = [(p, load.output_len) for p, _ in reqs]
    return reqs


def _payload(load: Load, model: str, prompt: str, max_tokens: int) -> dict:
    p = {"model": model, "max_tokens": max_tokens, "temperature": load.temperature, "stream": True,
         "stream_options": {"include_usage": True}}
    if load.ignore_eos:
        p["ignore_eos"] = True
    if load.endpoint == "chat":
        p["messages"] = [{"role": "user", "content": prompt}]
    else:
        p["prompt"] = prompt
    return p


async def send(client, path: str, payload: dict) -> Outcome:
    """One streamed request, timed chunk by chunk."""
    t0 = time.perf_counter()
    res = Outcome(ok=False)
    last = t0
    chunks = 0
    try:
        async with client.stream("POST", path, json=payload) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {body[:200]}"
                return res
            buf = b""
            done = False
            async for raw in r.aiter_raw():       # events split here: httpx's line iterators cost ~0.5 ms a token
                buf += raw
                *events, buf = buf.split(b"\n")
                for line in events:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        res.ok = done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = str(obj["error"])[:200]
                        done = True
                        break
                    usage = obj.get("usage")
                    if usage:
                        res.output_tokens = usage.get("completion_tokens", 0)
                        res.prompt_tokens = usage.get("prompt_tokens")
                    for c in obj.get("choices") or []:
                        text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                        if text:
                            now = time.perf_counter()
                            if res.ttft is None:
                                res.ttft = now - t0
                            else:
                                res.itl.append(now - last)
                            last = now
                            chunks += 1
                if done:
                    break
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
    if res.ok and not res.output_tokens:
        res.output_tokens = chunks
    return res


async def probe_health(client, interval: float, stop: asyncio.Event, out: list) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        try:
            r = await client.get("/health")
            if r.status_code == 200:
                out.append(time.perf_counter() - t)
        except Exception:  # noqa: BLE001 - a missed probe is just missing
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def server_rss_mb(client) -> float | None:
    """The server's resident memory from its /metrics (process_resident_memory_bytes, which lumen.serve
    exports), or None when it has no such metric."""
    try:
        r = await client.get("/metrics")
        for line in r.text.splitlines():
            if line.startswith("process_resident_memory_bytes "):
                return float(line.split()[1]) / 2 ** 20
    except Exception:  # noqa: BLE001 - no metrics, no RSS
        pass
    return None


async def sample_rss(client, interval: float, stop: asyncio.Event, t0: float, out: list) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
        out.append((time.perf_counter() - t0, await server_rss_mb(client)))


def _arun(coro):
    """`coro` on uvloop where it is installed (uvicorn[standard] brings it): the client shares the cores with the
    server it measures, and asyncio's own loop costs it more CPU per token."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_load(load: Load, reqs: list[tuple[str, int]] | None = None) -> dict:
    return _arun(run(load, reqs))


def prepare_load(load: Load, variant: int = 0) -> list[tuple[str, int]]:
    """`prepare` against load.url, on its own: the prompts a comparison sends to every server."""
    import httpx

    async def go():
        async with httpx.AsyncClient(base_url=load.url, timeout=httpx.Timeout(None, connect=30.0)) as client:
            return await prepare(load, client, variant)
    return _arun(go())


async def run(load: Load, reqs: list[tuple[str, int]] | None = None) -> dict:
    """One load against load.url: reqs (prompt, max_tokens), or those `prepare` makes."""
    import httpx
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=load.url, headers=headers, timeout=timeout, limits=limits) as client, \
            httpx.AsyncClient(base_url=load.url, headers=headers, timeout=timeout) as prober:
        model = load.model or await _model_id(client)
        if reqs is None:
            reqs = await prepare(load, client)
        path = "/v1/chat/completions" if load.endpoint == "chat" else "/v1/completions"
        warm = await send(client, path, _payload(load, model, reqs[0][0], 4))
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")

        rng = random.Random(load.seed)
        rate = load.request_rate
        gate = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

        async def one(prompt, n):
            if gate is None:
                res = await send(client, path, _payload(load, model, prompt, n))
            else:
                async with gate:
                    res = await send(client, path, _payload(load, model, prompt, n))
            res.finished_at = time.perf_counter() - t0
            return res

        stop, health, rss = asyncio.Event(), [], [(0.0, await server_rss_mb(prober))]
        t0 = time.perf_counter()
        side = [asyncio.create_task(probe_health(prober, load.probe_interval_ms / 1e3, stop, health))] \
            if load.probe_health else []
        if load.duration:
            side.append(asyncio.create_task(sample_rss(prober, load.window, stop, t0, rss)))
        tasks = []
        if load.duration and rate == float("inf"):            # closed loop: max_concurrency clients, back to back
            async def client_loop(k):
                out, i = [], k
                while time.perf_counter() - t0 < load.duration:
                    out.append(await one(*reqs[i % len(reqs)]))
                    i += load.max_concurrency
                return out
            loops = [asyncio.create_task(client_loop(k)) for k in range(load.max_concurrency)]
            outcomes = [o for batch in await asyncio.gather(*loops) for o in batch]
        else:
            i = 0
            while (i < len(reqs)) if not load.duration else (time.perf_counter() - t0 < load.duration):
                tasks.append(asyncio.create_task(one(*reqs[i % len(reqs)])))
                i += 1
                if rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(rate))
            outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*side)
        if load.duration:
            rss.append((duration, await server_rss_mb(prober)))
    res = summarize(outcomes, duration, health if load.probe_health else None, load, model)
    if load.duration:
        res["windows"] = windows(outcomes, rss, load.window, load.duration, duration)
        res["drift"] = drift(res["windows"])
    return res


# ---- the numbers
def _stats(values_s: list[float]) -> dict:
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = np.asarray(values_s) * 1e3
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99))}


def summarize(outcomes: list[Outcome], duration: float, health: list | None, load: Load, model: str) -> dict:
    ok = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    prompt_known = all(o.prompt_tokens is not None for o in ok)
    in_tokens = sum(o.prompt_tokens for o in ok) if ok and prompt_known else None
    res = {"label": load.label, "url": load.url, "endpoint": load.endpoint, "model": model,
           "num_prompts": len(outcomes), "request_rate": None if load.request_rate == float("inf")
           else load.request_rate, "max_concurrency": load.max_concurrency, "input_len": load.input_len,
           "output_len": load.output_len, "ignore_eos": load.ignore_eos, "mix": load.mix, "seed": load.seed,
           "completed": len(ok), "failed": len(outcomes) - len(ok),
           "errors": sorted({o.error for o in outcomes if not o.ok})[:5], "duration_s": duration,
           "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
           "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
           "total_token_throughput": None if in_tokens is None else (in_tokens + out_tokens) / duration,
           "ttft_ms": _stats([o.ttft for o in ok if o.ttft is not None]),
           "tpot_ms": _stats([o.tpot for o in ok if o.tpot is not None]),
           "itl_ms": _stats([g for o in ok for g in o.itl]),
           "e2e_ms": _stats([o.e2e for o in ok])}
    if load.slo_ttft_ms is not None or load.slo_tpot_ms is not None:
        def good(o: Outcome) -> bool:
            if load.slo_ttft_ms is not None and (o.ttft is None or o.ttft * 1e3 > load.slo_ttft_ms):
                return False
            return load.slo_tpot_ms is None or o.tpot is None or o.tpot * 1e3 <= load.slo_tpot_ms
        res["slo_ttft_ms"], res["slo_tpot_ms"] = load.slo_ttft_ms, load.slo_tpot_ms
        res["goodput"] = sum(good(o) for o in ok) / duration
    if health is not None:
        res["health_probes"] = len(health)
        res["health_ms"] = _stats(health) | {"max": max(health) * 1e3 if health else None}
    return res


def windows(outcomes: list[Outcome], rss: list, window: float, planned: float, duration: float) -> list[dict]:
    """The soak run cut into windows by finish time: per window, requests, output tok/s, TTFT and ITL p50/p99,
    and the server's RSS at the window's end."""
    out = []
    n = max(1, int(round(planned / window)))             # the requests still running at the end: in the last one
    for k in range(n):
        a, b = k * window, (k + 1) * window if k < n - 1 else max(duration, planned)
        done = [o for o in outcomes if o.ok and a <= o.finished_at and (o.finished_at < b or k == n - 1)]
        at_end = [mb for t, mb in rss if t <= b + 1e-6 and mb is not None]
        out.append({"start_s": a, "end_s": b, "completed": len(done),
                    "output_throughput": sum(o.output_tokens for o in done) / max(b - a, 1e-9),
                    "ttft_ms": _stats([o.ttft for o in done if o.ttft is not None]),
                    "itl_ms": _stats([g for o in done for g in o.itl]),
                    "rss_mb": at_end[-1] if at_end else None})
    return out


def drift(wins: list[dict]) -> dict:
    """First window against last: RSS growth and latency change."""
    first, last = wins[0], wins[-1]
    rss = [w["rss_mb"] for w in wins if w["rss_mb"] is not None]

    def ratio(key, stat):
        x, y = first[key][stat], last[key][stat]
        return y / x if x and y is not None else None
    return {"rss_first_mb": rss[0] if rss else None, "rss_last_mb": rss[-1] if rss else None,
            "rss_growth_mb": rss[-1] - rss[0] if len(rss) > 1 else None,
            "ttft_p99_ratio": ratio("ttft_ms", "p99"), "itl_p99_ratio": ratio("itl_ms", "p99"),
            "throughput_ratio": last["output_throughput"] / first["output_throughput"]
            if first["output_throughput"] else None}


def report(res: dict) -> str:
    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)
    lines = ["============ Serving Benchmark Result ============",
             f"{'Successful requests:':<40}{res['completed']}",
             f"{'Failed requests:':<40}{res['failed']}",
             f"{'Benchmark duration (s):':<40}{f(res['duration_s'])}",
             f"{'Total input tokens:':<40}{f(res['total_input_tokens'], 'd')}",
             f"{'Total generated tokens:':<40}{res['total_output_tokens']}",
             f"{'Request throughput (req/s):':<40}{f(res['request_throughput'])}",
             f"{'Output token throughput (tok/s):':<40}{f(res['output_throughput'])}",
             f"{'Total token throughput (tok/s):':<40}{f(res['total_token_throughput'])}"]
    if "goodput" in res:
        lines.append(f"{'Request goodput (req/s):':<40}{f(res['goodput'])}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        lines.append(f"{title:-^50}")
        short = key.split("_")[0].upper()
        for stat, name in (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99")):
            label = f"{name} {short} (ms):"
            lines.append(f"{label:<40}{f(res[key][stat])}")
    if "health_ms" in res:
        h = res["health_ms"]
        lines.append(f"{'GET /health during the load':-^50}")
        lines.append(f"{'Probes:':<40}{res['health_probes']}")
        for stat in ("p50", "p99", "max"):
            label = f"{stat.upper()} (ms):"
            lines.append(f"{label:<40}{f(h[stat])}")
    if "windows" in res:
        lines.append(f"{'Soak: per window':-^50}")
        lines.append(f"{'window s':>10}{'done':>6}{'tok/s':>8}{'TTFT p99':>10}{'ITL p99':>9}{'RSS MB':>8}")
        for w in res["windows"]:
            lines.append(f"{w['start_s']:>4.0f}-{w['end_s']:<5.0f}{w['completed']:>6}{w['output_throughput']:>8.1f}"
                         f"{f(w['ttft_ms']['p99'], '.0f'):>10}{f(w['itl_ms']['p99'], '.0f'):>9}"
                         f"{f(w['rss_mb'], '.0f'):>8}")
        d = res["drift"]
        lines.append(f"{'RSS growth first -> last (MB):':<40}{f(d['rss_growth_mb'], '+.1f')}")
        lines.append(f"{'TTFT p99 last / first:':<40}{f(d['ttft_p99_ratio'])}")
        lines.append(f"{'ITL p99 last / first:':<40}{f(d['itl_p99_ratio'])}")
        lines.append(f"{'Output tok/s last / first:':<40}{f(d['throughput_ratio'])}")
    if res["errors"]:
        lines.append(f"{'Errors':-^50}")
        lines += res["errors"]
    lines.append("=" * 50)
    return "\n".join(lines)


# ---- a sweep, against the servers started here
FIGURES = (("output tok/s", "output_throughput", None), ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
           ("ITL p50", "itl_ms", "p50"), ("ITL p99", "itl_ms", "p99"))


def figure(res: dict, key: str, stat: str | None) -> float | None:
    return res[key] if stat is None else res[key][stat]


def medians(runs: list[dict]) -> dict:
    """The median of each side-by-side figure over repetitions, and the failures summed."""
    out = {}
    for name, key, stat in FIGURES:
        vals = [v for v in (figure(r, key, stat) for r in runs) if v is not None]
        out[name] = float(np.median(vals)) if vals else None
    out["failed"] = sum(r["failed"] for r in runs)
    return out


def side_by_side(table: dict, reps: int, title: str) -> str:
    """table: {level: {server: medians}} -> one row per server and level, and each other server's ratio to the
    first (Lumen) when there are two."""
    servers = list(next(iter(table.values())))
    head = f"{'conc':>5} {'server':<12}" + "".join(f"{n:>13}" for n, _, _ in FIGURES) + f"{'failed':>8}"
    lines = [title, f"(medians of {reps}; TTFT and ITL in ms; ratio = {servers[0]} / {servers[-1]})"
             if len(servers) > 1 else f"(medians of {reps}; TTFT and ITL in ms)", head]
    for c, row in table.items():
        for srv, m in row.items():
            lines.append(f"{c if c else 'all':>5} {srv:<12}" + "".join(
                f"{'-' if m[n] is None else format(m[n], '.1f'):>13}" for n, _, _ in FIGURES) + f"{m['failed']:>8}")
        if len(servers) > 1:
            a, b = row[servers[0]], row[servers[-1]]
            lines.append(f"{'':>5} {'ratio':<12}" + "".join(
                f"{'-' if not a[n] or not b[n] else format(a[n] / b[n], '.2f') + 'x':>13}" for n, _, _ in FIGURES))
    return "\n".join(lines)


def per_level(load: Load, levels: list[int | None], num_prompts: int | None) -> dict:
    """Each level's Load: its max_concurrency and number of requests (default 2x the level, at least 8)."""
    from dataclasses import replace
    return {c: replace(load, max_concurrency=c, num_prompts=num_prompts or (64 if c is None else max(8, 2 * c)))
            for c in levels}


def all_prompts(loads: dict, reps: int, url: str, kinds: tuple = ("none",)) -> dict:
    """{(level, repetition, co-runner kind): requests}, made through url's tokenizer; each its own variant of the
    prompts (a run never finds its prompts in the server's prefix cache from an earlier one)."""
    from dataclasses import replace
    return {(c, r, kind): prepare_load(replace(lv, url=url), variant=1 + (k * reps + r) * len(kinds) + j)
            for k, (c, lv) in enumerate(loads.items()) for r in range(reps) for j, kind in enumerate(kinds)}


def sweep(loads: dict, prompts: dict, reps: int, servers: dict[str, str],
          kinds: tuple = ("none",)) -> tuple[dict, dict]:
    """Every level's load against every server, the servers interleaved per repetition, each repetition with
    prompts of its own (`all_prompts`), the same for every server; within a repetition, idle ("none") and then
    beside each other co-runner kind (lumen.bench.corunner: its own process on the same cores).
    Returns ({kind: {level: {server: medians}}}, {kind: {level: {server: [results]}}})."""
    from dataclasses import replace

    from .corunner import corunner
    raw = {kind: {c: {name: [] for name in servers} for c in loads} for kind in kinds}
    for c, lv in loads.items():
        for r in range(reps):
            for kind in kinds:
                with corunner(kind, seconds=3600):
                    for name, url in servers.items():
                        res = run_load(replace(lv, url=url, label=name), prompts[c, r, kind])
                        raw[kind][c][name].append(res)
                        beside = "" if kind == "none" else f" beside a {kind} loop"
                        print(f"concurrency {c or 'all'}: {name}{beside} {res['output_throughput']:.1f} output "
                              f"tok/s, {res['failed']} failed", file=sys.stderr, flush=True)
    table = {kind: {c: {name: medians(runs) for name, runs in per.items()} for c, per in levels.items()}
             for kind, levels in raw.items()}
    return table, raw


def beside_ratios(raw: dict) -> list[dict]:
    """Per co-runner kind, level, server and figure: the median over repetitions of (the figure beside the
    co-runner / the same server's idle figure in the same repetition). Throughput: below 1 is a loss; TTFT and
    ITL: above 1 is a loss."""
    import statistics
    rows = []
    for kind, levels in raw.items():
        if kind == "none":
            continue
        for c, per in levels.items():
            for name, runs in per.items():
                idle = raw["none"][c][name]
                row = {"corunner": kind, "level": c, "server": name}
                for fig, key, stat in FIGURES:
                    pairs = [(figure(b, key, stat), figure(i, key, stat)) for b, i in zip(runs, idle)]
                    pairs = [b / i for b, i in pairs if b is not None and i]
                    row[fig] = statistics.median(pairs) if pairs else None
                rows.append(row)
    return rows


def render_beside(rows: list[dict]) -> str:
    lines = ["beside co-runners: each figure / the same server's idle figure in the same repetition (medians; "
             "sleep = a process sleeping 1 ms in a loop, busy = one spinning a core)",
             f"{'conc':>5} {'server':<12} {'beside':<7}" + "".join(f"{n:>13}" for n, _, _ in FIGURES)]
    for r in rows:
        lines.append(f"{r['level'] if r['level'] else 'all':>5} {r['server']:<12} {r['corunner']:<7}" + "".join(
            f"{'-' if r[n] is None else format(r[n], '.2f') + 'x':>13}" for n, _, _ in FIGURES))
    return "\n".join(lines)


def _token_lengths(url: str, texts: list[str]) -> list[int]:
    import httpx
    with httpx.Client(base_url=url, timeout=120) as client:
        out = []
        for t in texts:
            out.append(len(_answer(client.post("/tokenize", json={"content": t}))["tokens"]))
    return out


def run_started(loads: dict, args, binary: str | None) -> tuple[dict, dict, dict]:
    """Start lumen.serve (and llama-server), sweep, stop them (also on an error or a Ctrl-C). The prompts are
    made through lumen.serve's tokenizer and sent to both. args.serve_argv, args.llama_argv: the split flags."""
    from . import launch
    from ..model.store import resolve
    path = str(resolve(args.serve_model))
    top = max((c for c in loads if c), default=16)
    info = {"model": path, "threads": args.threads}
    with launch.Servers() as started:
        extra = args.serve_argv + ["--shutdown-timeout", "5"]
        if top > 16 and "--max-num-seqs" not in extra:
            extra += ["--max-num-seqs", str(top)]
        lumen = started.start(launch.Server("Lumen", launch.lumen_serve_args(path, args.threads, extra)))
        servers = {"Lumen": lumen.url}
        info["lumen_cmd"] = " ".join(lumen.args)
        prompts = all_prompts(loads, args.repetitions, lumen.url, args.kinds)
        if binary is not None:
            # one slot per concurrent request, each holding the longest prompt and output of the run with room
            longest = max(_token_lengths(lumen.url, sorted({p for reqs in prompts.values() for p, _ in reqs})))
            per_slot = longest + max(n for reqs in prompts.values() for _, n in reqs) + 64
            ctx = top * (-(-per_slot // 256) * 256)
            llama = started.start(launch.Server("llama.cpp", launch.llama_server_args(
                binary, path, args.threads, top, ctx, args.llama_argv)))
            servers["llama.cpp"] = llama.url
            info["llama_cmd"] = " ".join(llama.args)
        table, raw = sweep(loads, prompts, args.repetitions, servers, args.kinds)
    return table, raw, info


def _levels(text: str) -> list[int]:
    items = comma_list("--concurrency", text)
    try:
        levels = [int(x) for x in items]
    except ValueError:
        raise ValueError(f"--concurrency takes comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency levels must be at least 1, got {text!r}")
    return sorted(set(levels))


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.num_prompts is not None and args.num_prompts < 1:
        ap.error(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        ap.error(f"--request-rate must be positive, got {args.request_rate}")
    for flag, v in (("--duration", args.duration), ("--window", args.window),
                    ("--probe-interval-ms", args.probe_interval_ms), ("--slo-ttft-ms", args.slo_ttft_ms),
                    ("--slo-tpot-ms", args.slo_tpot_ms)):
        if v is not None and not v > 0:                  # (not v > 0: a NaN too)
            ap.error(f"{flag} must be positive, got {v}")
    for flag, v, needs, default in (("--window", "window", "duration", 60.0),
                                    ("--probe-interval-ms", "probe_interval_ms", "probe_health", 50.0)):
        if getattr(args, v) is not None and not getattr(args, needs):    # (else given, then silently unused)
            ap.error(f"{flag} goes with --{needs.replace('_', '-')}")
        if getattr(args, v) is None:
            setattr(args, v, default)
    if not args.temperature >= 0:                        # a server would refuse every request, the warm-up first
        ap.error(f"--temperature must be at least 0, got {args.temperature}")
    if args.duration and args.request_rate == float("inf") and not args.max_concurrency:
        ap.error("--duration needs --request-rate or --max-concurrency (else it would send without bound)")
    for name in ("max_concurrency", "input_len", "output_len", "repetitions", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    levels = [args.max_concurrency]
    if args.concurrency is not None:
        try:
            levels = _levels(args.concurrency)
        except ValueError as e:
            ap.error(str(e))
        if args.max_concurrency is not None:
            ap.error("give --concurrency (a sweep) or --max-concurrency, not both")
        if args.duration is not None:
            ap.error("--concurrency sweeps a fixed number of requests per level; it does not take --duration")
    compare = args.compare or args.llama_server
    if args.serve_model is None:
        if compare:
            ap.error("--compare starts both servers on one GGUF: give it with --serve-model MODEL")
        for flag in ("serve_args", "llama_args"):
            if getattr(args, flag):
                ap.error(f"--{flag.replace('_', '-')} goes with --serve-model (the servers started here)")
    elif args.url is not None:
        ap.error("give --url (a running server) or --serve-model (start one here), not both")
    elif args.duration is not None:
        ap.error("--serve-model runs a fixed number of requests; a soak (--duration) takes a running server (--url)")
    if args.repetitions > 1 and args.serve_model is None and args.concurrency is None:
        ap.error("-r repeats the runs of a sweep: give --concurrency or --serve-model")
    from .corunner import parse_kinds
    try:
        args.kinds = ("none", *parse_kinds(args.corunner))
    except ValueError as e:
        ap.error(str(e))
    from .tools import split_args                          # (an unclosed quote: a usage error before any start)
    args.serve_argv = split_args(ap, "--serve-args", args.serve_args)
    args.llama_argv = split_args(ap, "--llama-args", args.llama_args)
    if args.corunner is not None and args.serve_model is None and args.concurrency is None:
        ap.error("--corunner runs a sweep beside co-runners: give --serve-model or --concurrency")
    if args.json and (why := check_writable(args.json, "the JSON")):      # before the run, not after it
        ap.error(why)
    if args.url is not None:
        from urllib.parse import urlsplit
        parts = urlsplit(args.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            ap.error(f"--url {args.url}: give the server's base URL, e.g. http://127.0.0.1:8000")
    binary = None
    if compare:
        from .launch import find_llama_server
        from .tools import ToolNotFound, refuse
        try:
            binary = find_llama_server(args.llama_server)
        except ToolNotFound as e:
            refuse(ap, str(e))
    if args.serve_model is not None:                     # a name or path that is not a model: before anything starts
        from ..errors import LumenError
        from ..model.store import resolve
        try:
            resolve(args.serve_model)
        except (LumenError, OSError, TypeError) as e:   # the run failed (status 1), as every tool's model lookup
            print(f"error: {e}", file=sys.stderr)
            return 1
    skip = {"json", "concurrency", "repetitions", "serve_model", "threads", "serve_args", "compare", "llama_server",
            "llama_args", "corunner", "kinds", "serve_argv", "llama_argv"}
    load = Load(**{k: v for k, v in vars(args).items() if k not in skip})
    load.url = args.url or "http://127.0.0.1:8000"
    sweeping = args.serve_model is not None or args.concurrency is not None
    if not sweeping:
        load.num_prompts = args.num_prompts or 64
    try:
        if not sweeping:
            res = run_load(load)
        elif args.serve_model is None:
            loads = per_level(load, levels, args.num_prompts)
            prompts = all_prompts(loads, args.repetitions, load.url, args.kinds)
            table, raw = sweep(loads, prompts, args.repetitions, {"server": load.url}, args.kinds)
            info = {"url": load.url}
        else:
            table, raw, info = run_started(per_level(load, levels, args.num_prompts), args, binary)
    except KeyboardInterrupt:
        print("interrupted: every server started here is stopped", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - unreachable server, bad URL, HTTP errors, a server that fails: one line
        import httpx
        if isinstance(e, httpx.ConnectError) and args.serve_model is None:    # say where, and what to do
            print(f"error: cannot connect to {load.url} ({e}): start a server there (python -m lumen.serve), "
                  "or give --url URL, or --serve-model MODEL to start one here", file=sys.stderr)
        elif isinstance(e, (RuntimeError, OSError, ValueError)):    # ours, or a file's: the message says it all
            print(f"error: {e}", file=sys.stderr)
        else:                                                       # an HTTP client's: its name says what failed
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if not sweeping:
        print(report(res))
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return 0 if res["completed"] else 1
    mixname = f"mix {load.mix}" if load.mix else "the committed workload"
    lens = f", input {load.input_len}" if load.input_len else ""
    lens += f", output {load.output_len}" if load.output_len else ""
    title = (f"== {info.get('model', load.url)}: {mixname}{lens}, "
             f"{'ignore_eos' if load.ignore_eos else 'stopping at EOS'}")
    print(side_by_side(table["none"], args.repetitions, title + " =="))
    for kind in args.kinds[1:]:
        print("\n" + side_by_side(table[kind], args.repetitions, f"{title}, beside a {kind} loop =="))
    ratios = beside_ratios(raw)
    if ratios:
        print("\n" + render_beside(ratios))
    if args.json:
        out = {"info": info, "levels": list(table["none"]),
               "medians": {str(c): v for c, v in table["none"].items()},
               "runs": {str(c): v for c, v in raw["none"].items()}}
        if ratios:
            out["corunners"] = {kind: {"medians": {str(c): v for c, v in table[kind].items()},
                                       "runs": {str(c): v for c, v in raw[kind].items()}} for kind in args.kinds[1:]}
            out["beside_ratios"] = ratios
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(m["failed"] == 0 for levels in table.values() for row in levels.values()
                    for m in row.values()) else 1
