"""`python -m lumen.serve` with a KV pool far smaller than its load, as a user would stress it: two dozen
concurrent requests (streamed and whole, greedy and seeded, n > 1, stop strings, logprobs, echo, min_tokens,
penalties and logit_bias) whose blocks do not fit at once, so running requests are preempted and recomputed.
Every answer under that load equals the same request sent alone to the same server (text, finish reason,
logprobs, token ids), the server counts the preemptions, and once the load is over no request runs or waits and
every KV block is free; streams cut while they preempt one another free everything. SmolLM2 through
/v1/completions, Qwen2.5-Coder-0.5B through /v1/chat/completions. Every wait is bounded; the tests stop the servers
they start."""
import asyncio
import json
import time

import httpx
import pytest

from servers import ServerProcess, lumen_metrics, lumen_serve

COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was a",
                      "List three colors:", "import numpy as np\n", "The quick brown fox", "Q: What is 2+2?\nA:",
                      "In 1492, Columbus", "Write a haiku about rain.", "SELECT * FROM", "My favourite food is",
                      "The meaning of life is"]
CHAT_QUESTIONS = ["Write a Python function that reverses a string.", "What is a closure?",
                  "Explain recursion in one sentence.", "Name three sorting algorithms.", "def add(a, b):",
                  "What does HTTP stand for?", "Write SQL to count rows.", "What is 17 * 3?"]


def completion_bodies() -> list[dict]:
    """24 requests of 5 to ~120 tokens each: about 1500 tokens of KV wanted at once, for a pool of 544."""
    bodies = []
    for i, p in enumerate(COMPLETION_PROMPTS * 2):
        b = {"prompt": p + " " * (i // len(COMPLETION_PROMPTS)), "max_tokens": 20 + (i * 7) % 60, "temperature": 0,
             "ignore_eos": i % 2 == 1, "return_token_ids": True, "stream": i % 2 == 0}
        if i % 3 == 0:
            b["stop"] = ["\n\n", "."]
        if i % 4 == 1:
            b["logprobs"] = 3
        if i % 5 == 2:
            b.update(n=3, temperature=0.9, seed=42 + i)
        if i % 6 == 5:
            b.update(temperature=0.7, seed=7 + i)
        if i % 7 == 3:
            b.update(echo=True, logprobs=2)
        if i % 11 == 4:
            b.update(min_tokens=5, presence_penalty=0.5, logit_bias={"13": 2.0})
        bodies.append(b)
    return bodies


def chat_bodies() -> list[dict]:
    bodies = []
    for i, q in enumerate(CHAT_QUESTIONS * 2):
        b = {"messages": [{"role": "user", "content": q + " " * (i // len(CHAT_QUESTIONS))}],
             "max_tokens": 24 + (i * 11) % 50, "temperature": 0, "stream": i % 2 == 0}
        if i % 3 == 0:
            b["stop"] = ["\n\n", "()"]
        if i % 4 == 1:
            b.update(logprobs=True, top_logprobs=2)
        if i % 4 == 2:
            b.update(n=2, temperature=0.8, seed=i)
        if i % 4 == 3:
            b.update(stream=True, stream_options={"include_usage": True})
        bodies.append(b)
    return bodies


async def answer(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """What a request answered, per choice: text, finish reason, logprobs and token ids (and the usage)."""
    n, chat = body.get("n", 1), path.endswith("chat/completions")
    text, finish, lps, ids, usage = {}, {}, {}, {}, None

    def take(c: dict) -> None:
        i = c["index"]
        text[i] = text.get(i, "") + ((c.get("delta") or c.get("message") or {}).get("content") or ""
                                     if chat else c["text"])
        finish[i] = c.get("finish_reason") or finish.get(i)
        ids.setdefault(i, []).extend(c.get("token_ids") or [])
        if c.get("logprobs"):
            lp = c["logprobs"]
            lps.setdefault(i, []).extend([(x["token"], x["logprob"], x["top_logprobs"]) for x in lp["content"]]
                                         if chat else list(zip(lp["tokens"], lp["token_logprobs"],
                                                               lp["top_logprobs"])))
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith("data: "):
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    usage = ev.get("usage") or usage
                    for c in ev["choices"]:
                        take(c)
            assert done, "the stream ended without [DONE]"
    else:
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        for c in r.json()["choices"]:
            take(c)
    assert sorted(text) == list(range(n)), text
    return {"text": [text[i] for i in range(n)], "finish": [finish[i] for i in range(n)],
            "logprobs": [lps.get(i) for i in range(n)], "ids": [ids.get(i) for i in range(n)],
            "completion_tokens": usage and usage["completion_tokens"]}


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    t0 = time.monotonic()
    while True:
        m = lumen_metrics(url)
        if m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 \
                and m["kv_cache_free_blocks"] == m["kv_cache_total_blocks"]:
            return m
        assert time.monotonic() - t0 < timeout, m
        time.sleep(0.1)


def alone_then_together(url: str, path: str, bodies: list[dict], rounds: int = 2) -> int:
    """Send each body alone, then all at once `rounds` times; every answer under load must equal the one alone.
    Returns the preemptions the load caused."""
    async def go():
        limits = httpx.Limits(max_connections=len(bodies) + 4)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            alone = [await answer(client, path, b) for b in bodies]
            before = (await asyncio.to_thread(lumen_metrics, url))["num_preemptions_total"]
            for round_ in range(rounds):
                together = await asyncio.gather(*(answer(client, path, b) for b in bodies))
                for i, (b, a, t) in enumerate(zip(bodies, alone, together)):
                    assert t == a, (round_, i, b, a, t)
            return (await asyncio.to_thread(lumen_metrics, url))["num_preemptions_total"] - before
    return asyncio.run(asyncio.wait_for(go(), 600))


@pytest.fixture(scope="module")
def smol(smollm2_path, tmp_path_factory):
    """SmolLM2 with 34 KV blocks of 16 tokens (544 tokens) for up to 16 sequences of up to 256."""
    proc = ServerProcess(lumen_serve(smollm2_path, "--max-model-len", "256", "--kv-cache-mb", "12",
                                     "--max-num-seqs", "16", "--no-ui"),
                         tmp_path_factory.mktemp("serve") / "server.log")
    yield proc
    assert proc.stop(timeout=60) == 0, proc.tail()
    assert "Traceback" not in proc.log.read_text(errors="replace")


@pytest.mark.slow
def test_completions_under_preemption_equal_each_request_alone(smol):
    m = lumen_metrics(smol.url)
    assert m["kv_cache_total_blocks"] * 16 < 600, m              # the load below wants ~1500 tokens of KV
    preempted = alone_then_together(smol.url, "/v1/completions", completion_bodies())
    assert preempted > 0, "the load never ran out of KV blocks: it tests nothing"
    m = wait_idle(smol.url)
    assert m["kv_cache_usage_perc"] == 0, m


@pytest.mark.slow
def test_streams_cut_while_preempting_each_other_free_everything(smol):
    """16 long streams (200 tokens each, 3200 tokens of KV wanted in a pool of 544) preempt one another; once
    they have, every client leaves at once. All 16 are aborted, every block is free, and a greedy request
    afterwards answers as it did before the load (the freed and prefix-cached blocks hold no stale KV)."""
    probe = {"prompt": "Story 3: once", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True}

    async def go():
        async with httpx.AsyncClient(base_url=smol.url, timeout=300, limits=httpx.Limits(max_connections=24)) as c:
            before = await answer(c, "/v1/completions", probe)
            m0 = await asyncio.to_thread(lumen_metrics, smol.url)
            started = [asyncio.Event() for _ in range(16)]

            async def stream(i: int) -> None:
                body = {"prompt": f"Story {i}: once", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
                        "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_lines():
                        started[i].set()
            tasks = [asyncio.create_task(stream(i)) for i in range(16)]
            t0 = time.monotonic()
            while (await asyncio.to_thread(lumen_metrics, smol.url))["num_preemptions_total"] \
                    <= m0["num_preemptions_total"]:
                assert time.monotonic() - t0 < 120, "no preemption"
                assert not any(t.done() for t in tasks), [t for t in tasks if t.done()]
                await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            aborted0 = m0.get("request_success_total:abort", 0)
            t0 = time.monotonic()
            while True:
                m = await asyncio.to_thread(lumen_metrics, smol.url)
                if m.get("request_success_total:abort", 0) >= aborted0 + 16:
                    break
                assert time.monotonic() - t0 < 30, m
                await asyncio.sleep(0.1)
            assert m["request_success_total:abort"] == aborted0 + 16, m
            await asyncio.to_thread(wait_idle, smol.url)
            after = await answer(c, "/v1/completions", probe)
            return before, after
    before, after = asyncio.run(asyncio.wait_for(go(), 300))
    assert after == before
    assert len(before["ids"][0]) == 40


@pytest.mark.slow
def test_chat_under_preemption_equal_each_request_alone_qwen(qwen05_path, tmp_path):
    proc = ServerProcess(lumen_serve(qwen05_path, "--max-model-len", "256", "--kv-cache-mb", "4",
                                     "--max-num-seqs", "16", "--no-ui"), tmp_path / "server.log")
    try:
        preempted = alone_then_together(proc.url, "/v1/chat/completions", chat_bodies(), rounds=1)
        assert preempted > 0, "the load never ran out of KV blocks: it tests nothing"
        m = wait_idle(proc.url)
        assert m["kv_cache_usage_perc"] == 0, m
    finally:
        code = proc.stop(timeout=60)
    assert code == 0, proc.tail()
    assert "Traceback" not in proc.log.read_text(errors="replace")
