"""What the web UI costs (lumen.serve.ui): first paint of / and /dashboard, and the server's output tok/s at
concurrency 16 with the dashboard closed, polled by a bare client, and open in headless Chromium.

    python profiling/ui_overhead.py [--reps 3] [--num-prompts 64] [--fixed-threads]

One server (python -m lumen.serve, SmolLM2, 2 threads, max_num_seqs 16) for every run; the conditions run
interleaved after a warm-up run, and each run is `python -m lumen.bench serve` (all prompts at once, at most 16
in flight, --ignore-eos so every request makes --output-len tokens), in an order rotated each repetition, each
after 6 s idle. The browser runs on this machine too, so
the "browser" condition also pays its rendering.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from verdict import count

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FCP_JS = """() => new Promise((ok) => new PerformanceObserver((l) => {
    for (const e of l.getEntries()) if (e.name === 'first-contentful-paint') ok(e.startTime); })
  .observe({type: 'paint', buffered: true}))"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(url: str, args, label: str) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "lumen.bench", "serve", "--url", url, "--num-prompts",
                        str(args.num_prompts), "--max-concurrency", "16", "--input-len", str(args.input_len),
                        "--output-len", str(args.output_len), "--ignore-eos", "--label", label, "--json", f.name],
                       check=True, capture_output=True, cwd=ROOT)
        res = json.loads(Path(f.name).read_text())
    res = res[0] if isinstance(res, list) else res
    for key in ("output_throughput", "output_tok_s", "output_tps"):
        if key in res:
            return float(res[key])
    raise KeyError(f"no output throughput in {sorted(res)}")


def poller(url: str, stop: threading.Event, path: str = "/dashboard/data") -> None:
    while not stop.wait(1.0):
        httpx.get(url + path, timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=count, default=3)
    ap.add_argument("--num-prompts", type=count, default=64)
    ap.add_argument("--input-len", type=count, default=128)
    ap.add_argument("--output-len", type=count, default=128)
    ap.add_argument("--fcp-loads", type=count, default=7)
    ap.add_argument("--fixed-threads", action="store_true", help="the server's --fixed-threads: no governor")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tempfile.mktemp(suffix=".log"), "w")
    srv = subprocess.Popen([sys.executable, "-m", "lumen.serve", "--threads", "2", "--max-num-seqs", "16",
                            "--max-model-len", "1024", "--kv-cache-mb", "128", "--port", str(port),
                            "--log-level", "warning", *(["--fixed-threads"] if args.fixed_threads else [])],
                           stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    pw = sync_playwright().start()
    browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert srv.poll() is None and time.monotonic() - t0 < 300, "the server did not come up"
            time.sleep(0.2)
        fcp = {"/": [], "/dashboard": []}
        for _ in range(args.fcp_loads):
            for path in fcp:
                ctx = browser.new_context()
                page = ctx.new_page()
                page.goto(url + path)
                fcp[path].append(page.evaluate(FCP_JS))
                ctx.close()
        for path, v in fcp.items():
            print(f"first contentful paint {path}: median {statistics.median(v):.0f} ms, "
                  f"min {min(v):.0f}, max {max(v):.0f} ({len(v)} loads)", flush=True)
        bench(url, args, "warm-up")
        tps: dict[str, list[float]] = {"closed": [], "poller": [], "browser": [], "metrics": []}
        conds = list(tps)
        for rep in range(args.reps):
            for cond in conds[rep % len(conds):] + conds[:rep % len(conds)]:      # each condition first, second and third in turn
                time.sleep(6)                      # idle past the tap's hold (5 s) since the last poll, every time
                stop = threading.Event()
                helper, ctx = None, None
                if cond in ("poller", "metrics"):          # metrics: GET /metrics instead (no step recording)
                    path = "/metrics" if cond == "metrics" else "/dashboard/data"
                    helper = threading.Thread(target=poller, args=(url, stop, path), daemon=True)
                    helper.start()
                elif cond == "browser":
                    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
                    page = ctx.new_page()
                    page.goto(url + "/dashboard")
                    page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 1")
                v = bench(url, args, cond)
                stop.set()
                if helper is not None:
                    helper.join(15)
                if ctx is not None:
                    ctx.close()
                tps[cond].append(v)
                print(f"rep {rep} {cond}: {v:.1f} tok/s", flush=True)
        base = statistics.mean(tps["closed"])
        for cond, v in tps.items():
            pairs = [x / c for x, c in zip(v, tps["closed"])]          # each run over the closed run beside it
            print(f"{cond}: {statistics.mean(v):.1f} ± {statistics.stdev(v) if len(v) > 1 else 0:.1f} tok/s, "
                  f"ratio of means {statistics.mean(v) / base:.3f}, median of paired ratios "
                  f"{statistics.median(pairs):.3f}", flush=True)
        print(f"load average: {os.getloadavg()}")
    finally:
        browser.close()
        pw.stop()
        srv.send_signal(signal.SIGTERM)
        srv.wait(60)


if __name__ == "__main__":
    main()
