"""Ctrl-C on `python -m lumen.serve` with a stream in flight, as a user at a terminal does it: the first SIGINT
says that it is draining, how many requests, for how long and how to stop now; a second one stops at once: the
stream ends with an error event and [DONE], the process exits 0, no traceback. Every wait is bounded and the
test stops the server it starts."""
import asyncio
import signal
import time

import httpx

from servers import ServerProcess, aiter_sse_events, lumen_serve

LONG = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}


def wait_for_line(proc: ServerProcess, text: str, timeout: float = 30.0) -> str:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        found = [line for line in proc.log.read_text(errors="replace").splitlines() if text in line]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no line with {text!r} in the server's log:\n{proc.tail()}")


def test_second_ctrl_c_stops_a_draining_server_now(smollm2_path, tmp_path):
    proc = ServerProcess(lumen_serve(smollm2_path, "--max-model-len", "2048", "--kv-cache-mb", "64", "--no-ui"),
                tmp_path / "server.log")
    try:
        async def go():
            chunks, error, done = 0, None, False
            async with httpx.AsyncClient(base_url=proc.url, timeout=120) as client:
                async with client.stream("POST", "/v1/completions", json=LONG) as r:
                    assert r.status_code == 200
                    async for ev in aiter_sse_events(r):
                        if ev is None:
                            done = True
                            break
                        if "error" in ev:
                            error = ev["error"]
                            continue
                        chunks += 1
                        if chunks == 3:                  # the stream is in flight: the first Ctrl-C
                            proc.p.send_signal(signal.SIGINT)
                            await asyncio.to_thread(wait_for_line, proc, "draining")
                            proc.p.send_signal(signal.SIGINT)   # the second: stop now
            return chunks, error, done

        chunks, error, done = asyncio.run(asyncio.wait_for(go(), 120))
        assert proc.p.wait(60) == 0, proc.tail()
    finally:
        proc.stop(signal.SIGKILL, timeout=10)
    log = proc.log.read_text(errors="replace")
    drains = [line for line in log.splitlines() if "draining" in line]
    assert len(drains) == 1, log
    assert drains[0].endswith("shutting down: draining 1 in-flight request (up to 30 s); press Ctrl-C again to "
                              "stop now"), drains[0]
    assert done and error is not None and error["code"] == 503, (chunks, error, done)
    assert chunks < LONG["max_tokens"], "the stream ran to its end: the second Ctrl-C did not stop it"
    assert "Traceback" not in log


def test_sighup_drains_like_sigterm(smollm2_path, tmp_path):
    """SIGHUP (the terminal that started the server closed) killed the process at once, by its default action, with
    the streams in flight cut and no exit code; now it drains as SIGTERM does: the stream finishes, exit 0."""
    proc = ServerProcess(lumen_serve(smollm2_path, "--max-model-len", "512", "--kv-cache-mb", "16", "--no-ui"),
                         tmp_path / "server.log",       # (as from a terminal, even when this run is under nohup)
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        async def go():
            chunks, done = 0, False
            async with httpx.AsyncClient(base_url=proc.url, timeout=120) as client:
                async with client.stream("POST", "/v1/completions", json=dict(LONG, max_tokens=40)) as r:
                    assert r.status_code == 200
                    async for ev in aiter_sse_events(r):
                        if ev is None:
                            done = True
                            break
                        assert "error" not in ev, ev
                        chunks += 1
                        if chunks == 2:
                            proc.p.send_signal(signal.SIGHUP)
            return chunks, done

        chunks, done = asyncio.run(asyncio.wait_for(go(), 120))
        assert proc.p.wait(60) == 0, proc.tail()
    finally:
        proc.stop(signal.SIGKILL, timeout=10)
    assert done and chunks >= 20, (chunks, done)
    assert "shutting down: draining 1 in-flight request" in proc.log.read_text(errors="replace")


def test_sighup_ignored_under_nohup_stays_ignored():
    from lumen.serve.cli import stop_signals
    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert signal.SIGHUP in stop_signals()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)          # nohup
        assert stop_signals() == (signal.SIGINT, signal.SIGTERM)
    finally:
        signal.signal(signal.SIGHUP, before)


def test_abort_all_ends_the_streams_without_waiting_for_the_step():
    """When the drain's timeout (or a second Ctrl-C, or a failing step) aborts everything, the streams waited for
    the engine's final outputs, which come only after the step that runs: a long prefill's (seconds under load), or
    never when the steps keep failing; past uvicorn's grace the clients were cut without their error event. Now
    every submission ends at once with its failure; the engine's final outputs still reach the metrics."""
    from types import SimpleNamespace

    from lumen.engine.sequence import RequestMetrics, RequestOutput
    from lumen.serve.worker import EngineWorker

    aborted, observed = [], []
    engine = SimpleNamespace(num_waiting=0, add_request=lambda prompt, sp: f"r{len(prompt)}",
                             abort=aborted.append)          # a step runs: the final outputs come after it
    worker = EngineWorker(engine, metrics=SimpleNamespace(observe=observed.append))

    async def go():
        sub = worker.submit_now([[1], [1, 2]], [None, None])
        worker.abort_all(503, "the server is shutting down")
        outs = [out async for out in worker.outputs(sub)]
        assert sorted(o.request_id for o in outs) == ["r1", "r2"] and all(o.finish_reason == "abort" for o in outs)
        assert sub.failure == (503, "the server is shutting down") and sorted(aborted) == ["r1", "r2"]
        assert worker.submissions() == []
        worker._deliver([RequestOutput("r1", [1], [], "", True, "abort", RequestMetrics())])   # the step ends
        assert [o.request_id for o in observed] == ["r1"] and sub.queue.empty()

    asyncio.run(asyncio.wait_for(go(), 5))


def test_the_drain_line_says_how_to_stop_now_with_the_signal_received(caplog):
    """A supervisor's SIGTERM was answered with "press Ctrl-C again": there is no terminal to press it in. The way
    to stop now is the same signal again."""
    from types import SimpleNamespace

    from lumen.serve.cli import _server_class

    Server = _server_class()
    server = Server.__new__(Server)                     # (no uvicorn config: drain() reads only these)
    drained = []
    server.worker = SimpleNamespace(submissions=lambda: ["a", "b"], drain=drained.append)
    server.shutdown_timeout = 30.0
    for sig, again in ((signal.SIGTERM, "send SIGTERM again"), (signal.SIGHUP, "send SIGHUP again"),
                       (signal.SIGINT, "press Ctrl-C again")):
        caplog.clear()
        with caplog.at_level("WARNING"):
            server.drain(sig)
        assert [r.getMessage() for r in caplog.records] == [
            f"shutting down: draining 2 in-flight requests (up to 30 s); {again} to stop now"]
    assert drained == [30.0] * 3
