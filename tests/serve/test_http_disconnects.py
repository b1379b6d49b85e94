"""`python -m lumen.serve` (SmolLM2, 2 sequences at a time) against clients that leave or crowd it: a client that
disconnects while queued behind --max-num-seqs, during a long (chunked) prefill, or mid-stream, and 12 streams
cancelled at once, each leave the running and waiting gauges at 0 and every KV block free; past --max-queue a
request gets 429 with Retry-After; past --max-connections a JSON 503; HEAD works on GET routes; SIGTERM with
streams in flight and an upload still arriving ends them (error event and [DONE], a 503) and exits 0 without a
traceback. Every wait is bounded; the test stops the server it starts."""
import asyncio
import json
import signal
import socket
import time

import httpx
import pytest

from servers import ServerProcess, aiter_sse_events, lumen_metrics, lumen_serve

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def proc(smollm2_path, tmp_path_factory):
    p = ServerProcess(lumen_serve(smollm2_path, "--max-model-len", "1024", "--kv-cache-mb", "64", "--max-num-seqs",
                                  "2", "--max-queue", "12", "--max-num-batched-tokens", "64",
                                  "--max-connections", "40", "--shutdown-timeout", "3", "--no-ui"),
                      tmp_path_factory.mktemp("serve") / "server.log")
    yield p
    p.stop(timeout=40)


def wait_for(url: str, ok, timeout: float = 30.0) -> dict:
    t0 = time.monotonic()
    while True:
        g = lumen_metrics(url)
        if ok(g):
            return g
        assert time.monotonic() - t0 < timeout, g
        time.sleep(0.05)


def idle_and_free(g: dict) -> bool:
    return (g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0
            and g["kv_cache_free_blocks"] == g["kv_cache_total_blocks"])


async def stream_events(client, body: dict, upto: int | None = None, started: asyncio.Event | None = None):
    """Events of a streamed completion; stops reading (the stream is closed) after `upto` of them."""
    events = []
    async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200, await r.aread()
        async for ev in aiter_sse_events(r):
            events.append(ev)
            if started is not None:
                started.set()
            if ev is None or (upto is not None and len(events) >= upto):
                break
    return events


def test_clients_leaving_at_each_phase_free_everything(proc):
    url = proc.url
    wait_for(url, idle_and_free)
    aborted0 = lumen_metrics(url).get("request_success_total:abort", 0)

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            running = [asyncio.Event(), asyncio.Event()]
            holders = [asyncio.create_task(stream_events(client, LONG, started=e)) for e in running]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running)), 60)
            # queued behind --max-num-seqs 2, then gone
            async with httpx.AsyncClient(base_url=url, timeout=0.5) as quick:
                with pytest.raises(httpx.ReadTimeout):
                    await quick.post("/v1/completions", json=dict(LONG, max_tokens=8))
            g = await asyncio.to_thread(wait_for, url, lambda g: g["num_requests_waiting"] == 0)
            assert g["num_requests_running"] == 2, g
            for t in holders:                         # mid-stream: both cut at once
                t.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            await asyncio.to_thread(wait_for, url, idle_and_free)
            # during a long prefill (~900 tokens in 64-token chunks), then gone
            async with httpx.AsyncClient(base_url=url, timeout=0.3) as quick:
                with pytest.raises(httpx.ReadTimeout):
                    await quick.post("/v1/completions", json={"prompt": "hello " * 900, "max_tokens": 4})
            await asyncio.to_thread(wait_for, url, idle_and_free)
            # 12 streams (2 running, 10 waiting), all cancelled at once
            started = [asyncio.Event() for _ in range(12)]
            many = [asyncio.create_task(stream_events(client, dict(LONG, prompt=f"Story {i}:"), started=e))
                    for i, e in enumerate(started)]
            t0 = time.monotonic()
            while sum(e.is_set() for e in started) < 2:          # whichever two arrived first run
                assert time.monotonic() - t0 < 60, "no two streams started"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            for t in many:
                t.cancel()
            await asyncio.gather(*many, return_exceptions=True)

    asyncio.run(asyncio.wait_for(go(), 180))
    g = wait_for(url, lambda g: idle_and_free(g) and g.get("request_success_total:abort", 0) >= aborted0 + 16)
    assert g["kv_cache_usage_perc"] == 0, g
    assert "Traceback" not in proc.log.read_text(errors="replace")


def test_past_the_queue_a_429_with_retry_after(proc):
    url = proc.url

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=dict(LONG, max_tokens=64)))
                     for _ in range(20)]                # 2 run, 12 wait, the rest are refused
            return await asyncio.gather(*tasks)

    rs = asyncio.run(asyncio.wait_for(go(), 180))
    refused = [r for r in rs if r.status_code == 429]
    assert refused and all(r.status_code in (200, 429) for r in rs), [r.status_code for r in rs]
    for r in refused:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
    wait_for(url, idle_and_free)


def test_head_and_the_connection_cap_through_the_command_line(proc):
    url = proc.url
    r = httpx.head(url + "/v1/models", timeout=10)
    assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) > 0
    idle = [socket.create_connection(("127.0.0.1", proc.port), timeout=5) for _ in range(40)]
    try:
        time.sleep(0.2)
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == 503
    finally:
        for s in idle:
            s.close()
    t0 = time.monotonic()
    while httpx.get(url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() - t0 < 10, "the closed connections still count"
        time.sleep(0.1)


def test_sigterm_ends_streams_and_uploads_in_flight_and_exits_0(proc):
    """Last in the module: it stops the server."""
    url = proc.url
    upload = socket.create_connection(("127.0.0.1", proc.port), timeout=30)
    upload.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(stream_events(client, dict(LONG, max_tokens=1000), started=e))
                     for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            proc.p.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    results = asyncio.run(asyncio.wait_for(go(), 120))
    for events in results:
        assert events[-1] is None, "no [DONE]"                     # the stream ended properly
        assert events[-2]["error"]["code"] == 503, events[-2]       # told why, after the 3 s drain
    upload.settimeout(10)
    answer = b""
    while chunk := upload.recv(65536):
        answer += chunk
    upload.close()
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 503
    assert proc.p.wait(30) == 0, proc.tail()
    assert "Traceback" not in proc.log.read_text(errors="replace"), proc.tail()
