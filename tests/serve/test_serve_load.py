"""`python -m lumen.serve` as a user starts it (a subprocess on a free port of 127.0.0.1):

- load with faults: 64 concurrent streaming clients with distinct prompts, greedy and seeded sampling, one in
  four disconnecting mid-stream, three rounds: every completed stream equals the same request run alone with
  Model.generate token for token (a cut one is a prefix of it), no KV block is held at the end of a round
  (/metrics), the cut requests were aborted, and RSS after round 3 <= RSS after round 1 + 50 MB;
- `python -m lumen.bench serve` against it (and against llama-server when it is built; skipped otherwise);
- shutdown under load: SIGTERM with requests in flight; the short ones finish, the long ones are told (an error
  event, then [DONE]) when --shutdown-timeout runs out, none hangs, and the exit code is 0;
- the command line: --api-key, --served-model-name, one log line per request with its id, SIGINT -> exit 0,
  a bad --model -> one error line and exit 1.
Every wait is bounded."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import lumen
from lumen import SamplingParams
from lumen.bench.offline import load_prompts
from lumen.serve.worker import Submission
from servers import ROOT, ServerProcess, aiter_sse_events, free_port, lumen_metrics, lumen_serve

LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", "/tmp/lcpp/build/bin/llama-server"))
N_CLIENTS = 64
SHUTDOWN_TIMEOUT = 4


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=2048, threads=2)


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    """The server the load, the benchmark and (last) the shutdown test share."""
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = ServerProcess(lumen_serve(smollm2_path, "--max-model-len", "1024", "--kv-cache-mb", "64", "--max-num-seqs", "16",
                            "--served-model-name", "smol", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)), log)
    yield proc
    proc.stop(timeout=SHUTDOWN_TIMEOUT + 30)


def wait_idle(url: str, aborted: float, timeout: float = 60.0) -> dict:
    """/metrics once nothing runs or waits and `aborted` requests have been counted as aborted."""
    t0 = time.monotonic()
    while True:
        m = lumen_metrics(url)
        if (m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
                and m.get("request_success_total:abort", 0) >= aborted):
            return m
        assert time.monotonic() - t0 < timeout, m
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------------
# load with faults

def requests_of_the_load() -> list[dict]:
    """64 distinct prompts from the committed dataset (cut to 160 characters), greedy (even) or seeded sampling
    (odd); every fourth client disconnects after three chunks of a long (ignore_eos) request."""
    items = load_prompts()
    by_kind: dict = {}
    for it in items:
        by_kind.setdefault(it["kind"], []).append(it["prompt"][:160])
    prompts = [p for group in zip(*by_kind.values()) for p in group][:N_CLIENTS]
    assert len(set(prompts)) == N_CLIENTS
    reqs = []
    for i, prompt in enumerate(prompts):
        body = {"model": "smol", "prompt": prompt, "max_tokens": 10 + 3 * (i % 4), "stream": True,
                "return_token_ids": True}
        body.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "top_k": 40,
                                                           "seed": 1000 + i})
        if i % 4 == 3:
            body.update(max_tokens=200, ignore_eos=True)
        reqs.append({"body": body, "cut": i % 4 == 3})
    return reqs


async def one_client(client: httpx.AsyncClient, req: dict) -> dict:
    """Stream one request; a `cut` client closes the connection after three token chunks."""
    ids, prompt_ids, done, finish = [], None, False, None
    async with client.stream("POST", "/v1/completions", json=req["body"]) as r:
        assert r.status_code == 200, await r.aread()
        chunks = 0
        async for ev in aiter_sse_events(r):
            if ev is None:
                done = True
                break
            assert "error" not in ev, ev
            for c in ev["choices"]:
                prompt_ids = c.get("prompt_token_ids", prompt_ids)
                ids += c["token_ids"]
                finish = c["finish_reason"] or finish
            chunks += 1
            if req["cut"] and chunks >= 3:
                break
    return {"ids": ids, "prompt_ids": prompt_ids, "done": done, "finish": finish}


async def one_round(url: str, reqs: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=N_CLIENTS + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.wait_for(asyncio.gather(*(one_client(client, r) for r in reqs)), 300)


@pytest.mark.slow
def test_load_with_faults(server, model):
    reqs = requests_of_the_load()
    end_ids = model.tokenizer.eot_ids
    refs: dict[int, list[int]] = {}
    rss = []
    aborted = lumen_metrics(server.url).get("request_success_total:abort", 0.0)
    for round_ in range(3):
        t0 = time.monotonic()
        results = asyncio.run(one_round(server.url, reqs))
        took = time.monotonic() - t0
        cut = sum(r["cut"] for r in reqs)
        m = wait_idle(server.url, aborted + cut)                           # every cut stream is aborted
        assert m["request_success_total:abort"] == aborted + cut, m
        assert m["kv_cache_usage_perc"] == 0 and m["kv_cache_free_blocks"] == m["kv_cache_total_blocks"], m
        aborted = m["request_success_total:abort"]
        rss.append(server.rss_mb())
        print(f"round {round_ + 1}: {len(reqs)} clients in {took:.1f} s, {cut} cut and aborted, RSS {rss[-1]:.0f} MB, "
              f"prefix-cache hit rate {m['prefix_cache_hit_rate']:.2f}")
        for i, (req, res) in enumerate(zip(reqs, results)):
            body = req["body"]
            params = SamplingParams(**{k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                                            "ignore_eos") if k in body})
            got = [t for t in res["ids"] if t not in end_ids]
            if req["cut"]:                                             # a prefix of what it would have made
                assert not res["done"] and 1 <= len(res["ids"]) < body["max_tokens"]
                want = [t.id for t in model.generate(res["prompt_ids"],
                                                     params=params.replace(max_tokens=len(res["ids"])))]
            else:
                assert res["done"] and res["finish"] in ("stop", "length"), res
                if i not in refs:
                    refs[i] = [t.id for t in model.generate(res["prompt_ids"], params=params)]
                want = refs[i]
            assert got == want, (round_, i, body)
    assert rss[2] <= rss[0] + 50, rss


# ---------------------------------------------------------------------------------------------------------
# the load generator

def bench(url: str, out: Path, *extra) -> dict:
    r = subprocess.run([sys.executable, "-m", "lumen.bench", "serve", "--url", url, "--num-prompts", "6",
                        "--max-concurrency", "3", "--input-len", "24", "--output-len", "6", "--ignore-eos",
                        "--probe-health", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--json", str(out),
                        *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Serving Benchmark Result" in r.stdout and "P99 TTFT (ms)" in r.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
def test_bench_serve(server, tmp_path):
    res = bench(server.url, tmp_path / "lumen.json")
    assert res["model"] == "smol" and res["completed"] == 6 and res["failed"] == 0
    assert res["total_output_tokens"] == 36 and res["total_input_tokens"] == 6 * 24
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = res[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
    assert res["goodput"] == pytest.approx(res["request_throughput"])
    assert res["health_probes"] > 0 and res["health_ms"]["p99"] > 0
    chat = bench(server.url, tmp_path / "chat.json", "--endpoint", "chat", "--request-rate", "20")
    assert chat["completed"] == 6 and chat["total_output_tokens"] == 36
    soak = bench(server.url, tmp_path / "soak.json", "--duration", "3", "--window", "1", "--request-rate", "4")
    assert len(soak["windows"]) == 3 and soak["completed"] == sum(w["completed"] for w in soak["windows"]) > 0
    assert all(w["rss_mb"] > 100 for w in soak["windows"]) and soak["drift"]["rss_growth_mb"] is not None


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason=f"llama-server is not built at {LLAMA_SERVER}")
def test_bench_serve_llama_server(smollm2_path, tmp_path):
    """The same load generator against llama.cpp's llama-server (-nr: its AMX repacking crashes on some CPUs)."""
    port = free_port()
    log = tmp_path / "llama.log"
    p = subprocess.Popen([str(LLAMA_SERVER), "-m", str(smollm2_path), "-t", "2", "-np", "3", "-c", "1024", "-nr",
                          "--host", "127.0.0.1", "--port", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert p.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() - t0 < 120, log.read_text()[-2000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        res = bench(url, tmp_path / "llama.json")
        assert res["completed"] == 6 and res["total_output_tokens"] == 36
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


# ---------------------------------------------------------------------------------------------------------
# shutdown under load (last: it stops the shared server)

async def stream_until_end(client, body: dict, started: asyncio.Event) -> dict:
    text_chunks, error, done = 0, None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for ev in aiter_sse_events(r):
            if ev is None:
                done = True
                break
            if "error" in ev:
                error = ev["error"]
                continue
            text_chunks += 1
            started.set()
    return {"chunks": text_chunks, "error": error, "done": done}


@pytest.mark.slow
def test_shutdown_under_load(server):
    short = {"prompt": "A short one:", "max_tokens": 8, "temperature": 0, "stream": True}
    long = {"prompt": "A long one:", "max_tokens": 1000, "ignore_eos": True, "stream": True}   # >= 7 s anywhere

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            events = [asyncio.Event() for _ in range(8)]
            tasks = [asyncio.create_task(stream_until_end(client, long if i % 2 else short, events[i]))
                     for i in range(8)]
            whole = asyncio.create_task(client.post("/v1/completions", json=long | {"stream": False}))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events[1::2])), 120)
            t_signal = time.monotonic()
            server.p.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient(timeout=5) as other:
                with pytest.raises(httpx.HTTPError):                 # the port is closed
                    await other.get(server.url + "/health")
            results = await asyncio.wait_for(asyncio.gather(*tasks, whole), SHUTDOWN_TIMEOUT + 60)
            return results, time.monotonic() - t_signal
    results, took = asyncio.run(go())
    whole = results.pop()                                            # a non-streamed one: a 503 in its place
    assert whole.status_code == 503 and "shutting down" in whole.json()["error"]["message"], whole.text
    for i, r in enumerate(results):
        assert r["done"], r                                          # every stream ended with [DONE]
        if i % 2 == 0:
            assert r["error"] is None and r["chunks"] >= 1, r        # the short ones finished
        else:
            assert r["error"]["code"] == 503 and "shutting down" in r["error"]["message"], r
    assert took < SHUTDOWN_TIMEOUT + 30
    assert server.p.wait(60) == 0, server.tail()
    log = server.log.read_text()
    assert "shutting down" in log and "Traceback" not in log


# ---------------------------------------------------------------------------------------------------------
# the command line

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}: {{ m.content }}\n{% endfor %}<|im_start|>assistant: "


@pytest.mark.slow
def test_cli_flags_log_line_and_sigint(smollm2_path, model, tmp_path):
    log = tmp_path / "cli.log"
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    proc = ServerProcess(lumen_serve(smollm2_path, "--max-model-len", "512", "--kv-cache-mb", "16", "--api-key", "k3y",
                            "--served-model-name", "my-model", "--chat-template", str(tmp_path / "chat.jinja")), log)
    try:
        url = proc.url
        assert httpx.get(url + "/v1/models").status_code == 401
        key = {"Authorization": "Bearer k3y"}
        card = httpx.get(url + "/v1/models", headers=key).json()["data"][0]
        assert card["id"] == "my-model" and card["max_model_len"] == 512
        r = httpx.post(url + "/v1/completions", headers=key | {"X-Request-Id": "cli-req-1"}, timeout=60,
                       json={"model": "my-model", "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == "my-model"
        messages = [{"role": "user", "content": "Hi there"}]
        r = httpx.post(url + "/tokenize", headers=key, json={"messages": messages}).json()
        assert r["tokens"] == model.tokenize("<|im_start|>user: Hi there\n<|im_start|>assistant: ", special=True)
        r = httpx.post(url + "/v1/chat/completions", headers=key, timeout=60,
                       json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(model.tokenize(
            "<|im_start|>user: Hi there\n<|im_start|>assistant: ", special=True))
    finally:
        code = proc.stop(signal.SIGINT)
    assert code == 0, proc.tail()
    lines = [ln for ln in log.read_text().splitlines() if "id=cli-req-1" in ln]
    assert len(lines) == 1 and '"POST /v1/completions" 200' in lines[0] and "completion=3" in lines[0], lines
    assert "127.0.0.1:" in log.read_text() and "Traceback" not in log.read_text()


@pytest.mark.parametrize("args, says", [
    (["--model", "/nonexistent/nope.gguf"], "nope.gguf"),
    (["--max-model-len", "9000"], "trained on"),
    (["--max-model-len", "100000"], "--max-model-len 100000 is beyond the 8192 tokens"),   # (before the pool)
    (["--max-model-len", "2048", "--kv-cache-mb", "8"], "--kv-cache-mb"),
    (["--chat-template", "/nonexistent/t.jinja"], "--chat-template /nonexistent/t.jinja: cannot read it"),
    (["--chat-template", "{bad}"], "--chat-template {bad}: not UTF-8 (invalid start byte at byte 14)"),
    (["--chat-template", "/dev/null"], "--chat-template /dev/null is empty"),     # (it served empty prompts)
    (["--chat-template", "{syntax}"], "--chat-template {syntax}: chat template syntax error at line 1"),
], ids=["no such model", "beyond the trained context", "far beyond it", "KV cache too small", "no such template",
        "not UTF-8", "empty template", "not Jinja"])
def test_cli_startup_errors_are_one_line(smollm2_path, args, says, tmp_path):
    """A --chat-template that cannot be one is a usage error (status 2, said before the model loads), as a
    --tools or --grammar file is; the rest are failed runs (1)."""
    bad, syntax = tmp_path / "bad.jinja", tmp_path / "syntax.jinja"
    bad.write_bytes(b"{{ messages }}\xff")
    syntax.write_text("{% for m in messages %}{{ m.content }}")
    args = [a.replace("{bad}", str(bad)).replace("{syntax}", str(syntax)) for a in args]
    says = says.replace("{bad}", str(bad)).replace("{syntax}", str(syntax))
    cmd = lumen_serve(smollm2_path, *args) if args[0] != "--model" else [sys.executable, "-m", "lumen.serve", *args]
    r = subprocess.run([*cmd, "--port", str(free_port())], capture_output=True, text=True, timeout=180, cwd=ROOT)
    err = r.stderr.strip().splitlines()
    usage = args[0] == "--chat-template"
    assert r.returncode == (2 if usage else 1) and says in err[-1], r.stderr
    assert err[-1].startswith("python -m lumen.serve: error:" if usage else "error:"), r.stderr
    assert "Traceback" not in r.stderr and (not usage or len(err) == 1), r.stderr


def test_cli_port_in_use_or_out_of_range_fails_before_loading(smollm2_path):
    """--port 70000 served on port 4464 (getaddrinfo wraps it) while the log said 70000; a port in use or a host
    that does not resolve failed only after the model had loaded, in uvicorn's words."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, code, says in ((["--port", "70000"], 2, "--port must be between 1 and 65535, got 70000"),
                                 (["--port", str(port)], 1, f"error: cannot listen on 127.0.0.1:{port}: "),
                                 (["--host", "nosuchhost.invalid"], 1, "error: cannot listen on nosuchhost.invalid")):
            r = subprocess.run([*lumen_serve(smollm2_path), *args], capture_output=True, text=True, timeout=60,
                               cwd=ROOT)
            err = r.stderr.strip().splitlines()
            assert r.returncode == code and says in err[-1], r.stderr
            assert "Traceback" not in r.stderr and "serving" not in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------------------
# a client that does not read

def test_outputs_a_client_has_not_taken_are_merged():
    """A stream whose client never reads held one output per step, each with all the token ids so far: memory
    quadratic in max_tokens (4 MB for 1,000 tokens, GBs near a 32k context). Now the outputs it has not taken are
    merged into one per request, which says the same (deltas joined, totals the newest)."""
    from lumen.engine.sequence import RequestMetrics, RequestOutput
    from lumen.serve.worker import EngineWorker

    async def go():
        worker = EngineWorker(engine=None)
        sub = Submission(["a", "b"])
        worker._subs = {"a": sub, "b": sub}
        ids, outs = [], []
        for t in range(500):
            ids.append(t)
            done = t == 499
            for rid in ("a", "b"):
                outs.append(RequestOutput(rid, [1], list(ids), "x" * len(ids), done, "length" if done else None,
                                          RequestMetrics(), delta_token_ids=[t], delta_text="x", delta_pieces=["x"]))
            if t in (199, 299):
                worker._deliver(outs)
                outs = []
                if t == 199:                     # the client reads once, then never again
                    got = [await sub.queue.get(), await sub.queue.get()]
                    assert [len(o.delta_token_ids) for o in got] == [200, 200]
        worker._deliver(outs)
        assert sub.queue.qsize() == 2, sub.queue.qsize()
        rest = [sub.queue.get_nowait(), sub.queue.get_nowait()]
        assert sorted(o.request_id for o in rest) == ["a", "b"]
        for o in rest:
            assert o.delta_token_ids == list(range(200, 500)) and o.delta_text == "x" * 300
            assert o.delta_pieces == ["x"] * 300 and o.finished and o.finish_reason == "length"
            assert o.token_ids == list(range(500))
        assert sub.queue.empty() and worker._subs == {}

    asyncio.run(go())
