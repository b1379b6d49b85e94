"""The servers `lumen.bench serve --model M [--compare llama.cpp]` starts and stops itself.

Each runs as a child process on a free port of 127.0.0.1, in a session of its own (a Ctrl-C at the terminal
reaches the benchmark, which stops it) and told by the kernel to end if the benchmark dies (PR_SET_PDEATHSIG).
Up means its /health answers 200 (lumen.serve: once its kernels are compiled; llama-server: once the model is
loaded). `stop()` sends SIGTERM, waits, then SIGKILL; `Servers` stops every one it started, whatever happened.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .tools import ToolNotFound, find_tool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_llama_server(path: str | None) -> str:
    """The llama-server binary: path if given, else $LLAMA_SERVER, else `llama-server` on $PATH. Raises
    ToolNotFound when a given path is not an executable file (never falls back to another copy) or there is
    none."""
    found = find_tool("llama-server", "--llama-server", path, "LLAMA_SERVER")
    if found is None:
        raise ToolNotFound("llama-server not found: give --llama-server PATH or set $LLAMA_SERVER (how to build "
                           "it: python -m lumen.bench serve --help)")
    return found


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the benchmark's process ends, however it ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    except OSError:
        pass


class Server:
    """One server process: `name`, `url`, `log` (its output, kept in a temporary file)."""

    def __init__(self, name: str, args: list[str], *, port: int | None = None):
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        tag = re.sub(r"[^A-Za-z0-9_-]+", "-", name)
        fd, path = tempfile.mkstemp(prefix=f"lumen-bench-{tag}-", suffix=".log")
        os.close(fd)
        self.log = Path(path)
        self.p: subprocess.Popen | None = None

    def start(self, timeout: float = 600.0) -> "Server":
        import httpx
        with self.log.open("w") as out:
            self.p = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True,
                                      preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        t0 = time.monotonic()
        while True:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.p.returncode}) before it came up: {self.tail()}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{self.name} did not come up within {timeout:.0f} s: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)

    def tail(self, n: int = 3) -> str:
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        return (" | ".join(lines[-n:]) or "it printed nothing") + f" (log: {self.log})"

    def stop(self, timeout: float = 30.0) -> None:
        p = self.p
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


class Servers:
    """Started servers, stopped together on leaving the `with` block (an error or a Ctrl-C included). SIGTERM to
    the benchmark is turned into KeyboardInterrupt while it runs, so that stops them too."""

    def __init__(self):
        self.started: list[Server] = []

    def start(self, server: Server, timeout: float = 600.0) -> Server:
        self.started.append(server)
        return server.start(timeout)

    def __enter__(self) -> "Servers":
        def on_term(signum, frame):
            raise KeyboardInterrupt
        try:
            self._old = signal.signal(signal.SIGTERM, on_term)
        except ValueError:                            # not the main thread: no handler
            self._old = None
        return self

    def __exit__(self, *exc) -> None:
        try:
            for s in reversed(self.started):
                s.stop()
        finally:
            if self._old is not None:
                signal.signal(signal.SIGTERM, self._old)
        for s in self.started:
            if exc[0] is None:
                s.log.unlink(missing_ok=True)


def lumen_serve_args(model: str, threads: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "lumen.serve", "--model", model, "--threads", str(threads), "--no-ui",
            "--log-level", "warning", *extra]


def llama_server_args(binary: str, model: str, threads: int, slots: int, ctx: int, extra: list[str]) -> list[str]:
    """llama-server as the comparison runs it: one slot per concurrent request, ctx tokens shared among them,
    weight repacking on (its default)."""
    return [binary, "-m", model, "-t", str(threads), "-np", str(slots), "-c", str(ctx), *extra]
