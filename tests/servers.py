"""What the server tests share: a free port, a server process on 127.0.0.1 (up once /health answers, stopped by
the test that started it), and the events of an SSE stream."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lumen_serve(model_path, *extra) -> list[str]:
    """The command that serves model_path with 2 threads (the port is added by ServerProcess)."""
    return [sys.executable, "-m", "lumen.serve", "--model", str(model_path), "--threads", "2", *extra]


class ServerProcess:
    """A server subprocess on a free port of 127.0.0.1: its URL, pid and log; waits until /health answers (a
    server that exits or does not come up within health_timeout fails the test and is stopped). popen: more of
    subprocess.Popen's arguments (env, start_new_session)."""

    def __init__(self, args: list[str], log: Path, health_timeout: float = 180.0, **popen):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.p = subprocess.Popen([*args, "--port", str(self.port)], stdout=log.open("w"), stderr=subprocess.STDOUT,
                                  cwd=ROOT, **popen)
        t0 = time.monotonic()
        try:
            while True:
                assert self.p.poll() is None, f"the server exited ({self.p.returncode}):\n{self.tail()}"
                assert time.monotonic() - t0 < health_timeout, f"the server did not come up:\n{self.tail()}"
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        except BaseException:
            self.kill()
            raise

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.p.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send sig and wait; a server that does not stop within timeout is killed and fails the test."""
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"the server did not stop within {timeout} s:\n{self.tail()}")
        return self.p.returncode

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


@contextmanager
def uvicorn_thread(config):
    """Run uvicorn.Server(config) (a uvicorn.Config with its port) in a thread of this process until the block
    ends; then stop it and check the thread is gone."""
    import threading

    import uvicorn
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    t0 = time.monotonic()
    while not srv.started:
        assert t.is_alive() and time.monotonic() - t0 < 10, "the server did not start"
        time.sleep(0.02)
    try:
        yield srv
    finally:
        srv.should_exit = True
        t.join(10)
        assert not t.is_alive(), "the server did not stop"


def lumen_metrics(url: str) -> dict:
    """The server's lumen:* samples from /metrics, summed over labels but finished_reason (kept as
    "request_success_total:<reason>")."""
    out: dict = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("lumen:"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0][len("lumen:"):]
            if 'finished_reason="' in name:
                key += ":" + name.split('finished_reason="')[1].split('"')[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def sse_events(r: httpx.Response) -> list:
    """The JSON events of a streamed response, checking it ends with [DONE]."""
    lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


async def aiter_sse_events(r):
    """The JSON events of an SSE response as they arrive, then None for its `data: [DONE]` (the proper end)."""
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            yield None
            return
        yield json.loads(line[6:])
