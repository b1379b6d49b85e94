"""What does structured output cost a decode, and how does Lumen's compare with llama-server's?

    python profiling/structured_output.py [--quick] [--rounds 3] [--llama-server PATH]

On the committed schemas of profiling/structured_costs.py (a person record, a 3-way anyOf
tool call, a nested invoice), SmolLM2, 2 threads, temperature 0.8 with a seed per request:
1. TPOT of constrained requests / the same requests unconstrained (Engine in this process), at concurrency 1 and
   16 (at 1, each schema in turn). "The same unconstrained" is each request again without its constraint, with max_tokens = the tokens the
   constrained one made and ignore_eos, so both runs decode the same lengths at the same positions. Rounds are
   interleaved (constrained first, then unconstrained first); the ratio is of the medians over all requests.
2. TTFT of a request whose schema is new (a property name no earlier request used, so the compile cache misses)
   minus that of the same request again (cached), at concurrency 1, interleaved: the compile a new schema adds.
3. Output tok/s over HTTP, `lumen.serve` against llama-server (weight repacking on, its default), both sent the
   same /v1/completions bodies with llama-server's `json_schema` field (Lumen accepts it), at concurrency 1 and
   16, interleaved, medians; the share of outputs that parse as JSON is printed for both.
--quick: one round, part 1 at concurrency 1 and 4 only, no HTTP (for tests).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import lumen
from lumen import SamplingParams
from lumen.engine.engine import Engine
from lumen.engine.structured import Constraint
from structured_costs import SCHEMAS
from verdict import count, verdict
from lumen.bench.launch import _die_with_parent
from lumen.bench.tools import given_tool
from lumen.model.store import resolve

MODEL = "smollm2-135m"
PROMPT = "Here is the record as JSON:\n"
MAX_TOKENS = 96


def params(i: int, constraint=None, max_tokens: int = MAX_TOKENS, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, constraint=constraint,
                          ignore_eos=ignore_eos)


def tpot_round(engine: Engine, n: int, constrained_first: bool, first: int = 0) -> tuple[list[float], list[float]]:
    """(TPOTs constrained, TPOTs unconstrained) of n concurrent requests, one per committed schema in turn from
    schema number `first`."""
    names = list(SCHEMAS)
    cons = [Constraint.json_schema(SCHEMAS[names[(first + i) % len(names)]]) for i in range(n)]
    for c in cons:                                            # compiled before timing: TPOT, not TTFT
        engine.structured.compiler.compile(c)

    def constrained():
        return engine.generate([PROMPT] * n, [params(100 * first + i, c) for i, c in enumerate(cons)])

    def plain(lengths):
        return engine.generate([PROMPT] * n, [params(100 * first + i, None, max(k, 2), True)
                                              for i, k in enumerate(lengths)])
    if constrained_first:
        a = constrained()
        b = plain([len(o.token_ids) for o in a])
    else:                                                     # the lengths from a constrained run before the timing
        lengths = [len(o.token_ids) for o in constrained()]
        b = plain(lengths)
        a = constrained()
    tp = lambda outs: [o.metrics.tpot_s for o in outs if o.metrics.tpot_s is not None]   # noqa: E731
    return tp(a), tp(b)


def ttft_new_vs_cached(engine: Engine, rounds: int) -> tuple[float, float, float]:
    """(median TTFT new schema, median TTFT cached, median compile seconds) at concurrency 1."""
    new, cached, compile_s = [], [], []
    for r in range(rounds * 2):
        schema = json.loads(json.dumps(SCHEMAS["person"]))
        schema["properties"][f"field_{os.getpid()}_{time.monotonic_ns()}"] = {"type": "integer"}   # a cache miss
        c = Constraint.json_schema(schema)
        first = engine.generate(PROMPT, params(r, c, max_tokens=2))[0]
        again = engine.generate(PROMPT, params(r, c, max_tokens=2))[0]
        new.append(first.metrics.ttft_s)
        cached.append(again.metrics.ttft_s)
        compile_s.append(engine.structured.compiler.compile(c).compile_s)
    return statistics.median(new), statistics.median(cached), statistics.median(compile_s)


# ---- HTTP: lumen.serve and llama-server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, name: str) -> subprocess.Popen:
    import httpx
    # its own session (a Ctrl-C reaches this script, whose `finally` stops it), ended by the kernel if this
    # script dies unwinding nothing (SIGTERM, SIGKILL), and stopped here if it never comes up or we are interrupted
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_die_with_parent)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{name} did not come up in 300 s")
    except BaseException:
        stop(proc)
        raise


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def load(url: str, n: int, concurrency: int, round_: int) -> tuple[float, float, int]:
    """(output tok/s, share of the outputs that ended with "stop" (not max_tokens), tokens) of n requests,
    `concurrency` at a time; an output that ended with "stop" but does not parse as JSON is an error."""
    import httpx
    names = list(SCHEMAS)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(i):
            body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 1000 * round_ + i,
                    "json_schema": SCHEMAS[names[i % len(names)]]}
            async with sem:
                r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            j = r.json()
            ok = j["choices"][0]["finish_reason"] == "stop"
            if ok:
                json.loads(j["choices"][0]["text"])          # raises for an invalid output
            return j["usage"]["completion_tokens"], ok
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    toks = sum(t for t, _ in res)
    return toks / wall, sum(ok for _, ok in res) / n, toks


def http_compare(llama_server: str, rounds: int) -> dict:
    path = str(resolve(MODEL, quiet=True))
    lp, cp = free_port(), free_port()
    lumen_url, llama_url = f"http://127.0.0.1:{lp}", f"http://127.0.0.1:{cp}"
    servers = [start([sys.executable, "-m", "lumen.serve", "--model", MODEL, "--port", str(lp), "--threads", "2",
                      "--max-num-seqs", "16", "--max-model-len", "2048", "--log-level", "warning"], lumen_url,
                     "lumen.serve")]
    try:
        servers.append(start([llama_server, "-m", path, "-t", "2", "-np", "16", "-c", "8192", "--host",
                              "127.0.0.1", "--port", str(cp)], llama_url, "llama-server"))
        for url in (lumen_url, llama_url):                   # warm-up: kernels, grammars
            asyncio.run(load(url, 3, 3, 99))
        out: dict = {}
        for r in range(rounds):
            for conc, n in ((1, 3), (16, 16)):
                for name, url in (("lumen", lumen_url), ("llama-server", llama_url))[::1 if r % 2 == 0 else -1]:
                    tps, ok, toks = asyncio.run(load(url, n, conc, r))
                    out.setdefault((name, conc), []).append((tps, ok, toks))
                    print(f"  round {r} {name:12s} concurrency {conc:2d}: {tps:6.1f} tok/s, {toks} tokens, "
                          f"{ok:.0%} complete (the rest cut by max_tokens), all complete ones parse", flush=True)
        return out
    finally:
        for p in servers:
            stop(p)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=count, default=3)
    ap.add_argument("--quick", action="store_true", help="one round, concurrency 1 and 4, no HTTP (for tests)")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server for part 3 (default $LLAMA_SERVER; without it "
                                           "part 3 is skipped)")
    ap.add_argument("--no-http", action="store_true", help="skip part 3")
    args = ap.parse_args(argv)
    args.llama_server = given_tool(ap, "llama-server", "--llama-server", args.llama_server, "LLAMA_SERVER")
    rounds = 1 if args.quick else args.rounds
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    model = lumen.load(MODEL, threads=2)
    engine = Engine(model, threads=2, max_num_seqs=16, max_model_len=1024, kv_cache_mb=128)
    engine.generate(PROMPT, params(0, Constraint.json_schema(SCHEMAS["person"])))          # warm-up
    ratios = {}
    for n in ((1, 4) if args.quick else (1, 16)):
        cons, plain = [], []
        for r in range(rounds * (2 * len(SCHEMAS) if n == 1 else 1)):      # concurrency 1: every schema in turn
            a, b = tpot_round(engine, n, constrained_first=r % 2 == 0, first=r)
            cons += a
            plain += b
        mc, mp = statistics.median(cons), statistics.median(plain)
        ratios[n] = mc / mp
        print(f"TPOT at concurrency {n:2d}: constrained {mc * 1e3:.2f} ms, unconstrained {mp * 1e3:.2f} ms "
              f"(medians of {len(cons)} requests) -> {mc / mp:.3f}x")
    new, cached, comp = ttft_new_vs_cached(engine, rounds)
    print(f"TTFT concurrency 1: new schema {new * 1e3:.1f} ms, cached {cached * 1e3:.1f} ms -> +{(new - cached) * 1e3:.1f}"
          f" ms (compile alone {comp * 1e3:.1f} ms)")
    http = None
    if not (args.quick or args.no_http or args.llama_server is None):
        engine.structured.close()
        del engine, model
        http = http_compare(args.llama_server, rounds)
        for conc in (1, 16):
            lu = statistics.median(x[0] for x in http[("lumen", conc)])
            ll = statistics.median(x[0] for x in http[("llama-server", conc)])
            print(f"HTTP concurrency {conc:2d}: lumen {lu:.1f} tok/s, llama-server {ll:.1f} tok/s -> {lu / ll:.2f}x")
            http[conc] = lu / ll
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    n_hi = max(ratios)
    line = (f"a constrained request's TPOT is {ratios[1]:.2f}x an unconstrained one's at concurrency 1 and "
            f"{ratios[n_hi]:.2f}x at {n_hi}; a new schema adds {(new - cached) * 1e3:.0f} ms to TTFT")
    if http is not None:
        line += f"; Lumen serves {http[1]:.1f}x llama-server's output tok/s at concurrency 1, {http[16]:.1f}x at 16"
    verdict(line)


if __name__ == "__main__":
    main()
