"""`python -m lumen.bench serve` as a reproducible benchmark: the prompt-length mixes (deterministic, the intended
distribution), the flag errors (one line, no traceback), a small sweep against a lumen.serve it starts itself,
every process it starts stopped (also on Ctrl-C), and --compare llama.cpp when llama-server is built."""
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lumen.bench import mix
from lumen.bench import serve as bench
from servers import ROOT

LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", "/tmp/lcpp/build/bin/llama-server"))


# ---------------------------------------------------------------------------------------------------------
# the mixes

def test_mix_is_deterministic():
    assert mix.lengths("chat", 50, seed=3) == mix.lengths("chat", 50, seed=3)
    assert mix.lengths("chat", 50, seed=3) != mix.lengths("chat", 50, seed=4)
    assert mix.lengths("chat", 20, seed=3) == mix.lengths("chat", 50, seed=3)[:20]      # a prefix of the same run
    # pinned: the same seed names the same workload on every platform and Python version
    assert mix.lengths("chat", 4, seed=0) == [(305, 136), (130, 69), (153, 85), (260, 74)]
    assert mix.windows(10_000, [100, 200], seed=0) == mix.windows(10_000, [100, 200], seed=0)


def test_mix_distributions():
    chat = mix.lengths("chat", 4000, seed=1)
    p = sorted(x for x, _ in chat)
    assert 140 <= statistics.median(p) <= 160                          # around 150 tokens
    assert 300 <= p[int(0.9 * len(p))] <= 450 and p[int(0.99 * len(p))] >= 650       # with a tail
    assert min(p) >= 8 and max(p) <= 2048
    o = [y for _, y in chat]
    assert 85 <= statistics.median(o) <= 105 and min(o) >= 16 and max(o) <= 256
    long = mix.lengths("long", 4000, seed=1)
    p = sorted(x for x, _ in long)
    assert 1300 <= statistics.median(p) <= 1500 and min(p) >= 1024 and max(p) <= 2048
    with pytest.raises(ValueError, match="unknown mix"):
        mix.lengths("code", 4)


def test_mix_windows_fit_the_corpus():
    plens = [p for p, _ in mix.lengths("long", 200, seed=2)]
    w = mix.windows(3000, plens, seed=2)
    assert [b - a for a, b in w] == plens and all(0 <= a and b <= 3000 for a, b in w)
    assert len({a for a, _ in w}) > 150                                # the prompts differ
    with pytest.raises(ValueError, match="does not fit"):
        mix.windows(1000, [1500], seed=0)
    assert len(mix.corpus()) > 100_000                                 # > 2048 tokens of committed text


def test_a_refused_prompt_preparation_is_one_line_with_the_servers_reason():
    """--input-len longer than the server's context: its /detokenize says why it refuses, and the error is that,
    in one line (it was httpx's two lines naming neither the reason nor what to change)."""
    import asyncio

    import httpx

    def server(request):
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [1, 2, 3]})
        return httpx.Response(400, json={"error": {"message": "600 tokens are more than\nmax_model_len (512)"}})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server), base_url="http://t") as client:
            return await bench._fit_prompt(client, "some text", 600)

    with pytest.raises(RuntimeError) as e:
        asyncio.run(run())
    assert str(e.value) == ("the server refused POST /detokenize (HTTP 400): 600 tokens are more than "
                            "max_model_len (512)")


def test_corpus_from_a_server_with_a_short_context():
    """A server that refuses the whole corpus as too long (a short max_model_len) gets it piece by piece: the same
    ids as whole where the tokenizer does not merge across the separator (here: one id per character)."""
    import asyncio

    import httpx

    def tokenize(request):
        text = json.loads(request.content)["content"]
        if len(text) > 5000:
            return httpx.Response(400, json={"error": {"message": "too long"}})
        return httpx.Response(200, json={"tokens": [ord(c) for c in text]})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(tokenize), base_url="http://t") as client:
            return await bench._tokenize_corpus(client, mix)

    assert asyncio.run(run()) == [ord(c) for c in mix.corpus()]


# ---------------------------------------------------------------------------------------------------------
# flag errors

@pytest.mark.parametrize("argv, msg", [
    (["--concurrency", "1,x"], "--concurrency takes comma-separated integers"),
    (["--concurrency", "0,4"], "--concurrency levels must be at least 1"),
    (["--concurrency", "4", "--max-concurrency", "4"], "not both"),
    (["--concurrency", "4", "--duration", "10", "--request-rate", "4"], "does not take --duration"),
    (["--compare", "llama.cpp"], "give it with --serve-model"),
    (["--serve-model", "smollm2-135m", "--url", "http://127.0.0.1:1"], "not both"),
    (["--serve-args", "--pace 2"], "goes with --serve-model"),
    (["--serve-model", "smollm2-135m", "--llama-server", "/no/such/llama-server"],
     "--llama-server /no/such/llama-server: does not exist"),
    (["--mix", "code"], "invalid choice"),
    (["-r", "0"], "--repetitions must be at least 1"),
    (["-r", "2"], "-r repeats the runs of a sweep"),
    (["--serve-model", "smollm2-135m", "--threads", "0"], "--threads must be at least 1"),
    (["--duration", "nan"], "--duration must be positive, got nan"),
    (["--duration", "10", "--window", "0"], "--window must be positive, got 0.0"),
    (["--probe-health", "--probe-interval-ms", "0"], "--probe-interval-ms must be positive, got 0.0"),
    (["--url", "http://127.0.0.1:1", "--window", "5"], "--window goes with --duration"),     # (given, then unused)
    (["--url", "http://127.0.0.1:1", "--probe-interval-ms", "5"], "--probe-interval-ms goes with --probe-health"),
    (["--slo-ttft-ms", "-1"], "--slo-ttft-ms must be positive, got -1.0"),
    (["--slo-tpot-ms", "nan"], "--slo-tpot-ms must be positive, got nan"),
    (["--temperature", "-0.5"], "--temperature must be at least 0, got -0.5"),
    (["--temperature", "nan"], "--temperature must be at least 0, got nan"),
    (["--concurrency", "2", "--corunner", "busy,idle"], "--corunner takes sleep, busy"),
    (["--corunner", "busy"], "--corunner runs a sweep beside co-runners"),
    (["--serve-model", "smollm2-135m", "--serve-args", '"--pace'], "--serve-args '\"--pace': no closing quotation"),
    (["--serve-model", "smollm2-135m", "--llama-args", "'-nr"], "--llama-args \"'-nr\": no closing quotation"),
])
def test_bad_flags(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1


def test_missing_llama_server_on_path(monkeypatch, capsys):
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SystemExit):
        bench.main(["--serve-model", "smollm2-135m", "--compare", "llama.cpp"])
    assert "llama-server not found: give --llama-server PATH" in capsys.readouterr().err


def test_no_server_at_the_url_says_where_and_what_to_do(capsys):
    """With no --url, a new user's first run meets no server at the default URL: the error names it."""
    with socket.socket() as s:                   # a port with nothing listening on it
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert bench.main(["--url", url, "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot connect to {url} (") and "--serve-model MODEL" in err, err
    assert err.count("\n") == 1


# ---------------------------------------------------------------------------------------------------------
# against servers it starts

def children(pid: int) -> set[int]:
    """Every descendant of pid (the servers run in sessions of their own, but stay its children)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out |= {int(k) for k in kids}
        todo += [int(k) for k in kids]
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def run_bench(*argv, timeout=300) -> tuple[subprocess.CompletedProcess, set[int]]:
    """Run it, noting every process it starts while it runs."""
    p = subprocess.Popen([sys.executable, "-m", "lumen.bench", "serve", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    seen: set[int] = set()
    t0 = time.monotonic()
    while p.poll() is None and time.monotonic() - t0 < timeout:
        seen |= children(p.pid)
        time.sleep(0.2)
    if p.poll() is None:
        p.kill()
    out, err = p.communicate(timeout=30)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), seen


@pytest.mark.slow
def test_sweep_against_a_server_it_starts(smollm2_path, tmp_path):
    out = tmp_path / "sweep.json"
    r, seen = run_bench("--serve-model", str(smollm2_path), "--mix", "chat", "--concurrency", "1,3",
                        "--num-prompts", "3", "--output-len", "4", "--ignore-eos", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and seen
    assert not [p for p in seen if alive(p)]                           # every server it started is gone
    res = json.loads(out.read_text())
    assert res["levels"] == [1, 3] and "--threads 2" in res["info"]["lumen_cmd"]
    for c in ("1", "3"):
        (run,) = res["runs"][c]["Lumen"]
        assert run["completed"] == 3 and run["failed"] == 0 and run["total_output_tokens"] == 12
        assert run["max_concurrency"] == int(c) and run["mix"] == "chat"
        assert 30 <= run["total_input_tokens"] <= 3 * 2048
        m = res["medians"][c]["Lumen"]
        assert m["output tok/s"] > 0 and 0 < m["TTFT p50"] <= m["TTFT p99"] and 0 < m["ITL p50"] <= m["ITL p99"]
    assert "output tok/s" in r.stdout and "TTFT p99" in r.stdout


@pytest.mark.slow
def test_ctrl_c_stops_the_servers(smollm2_path, tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "lumen.bench", "serve", "--serve-model", str(smollm2_path),
                          "--concurrency", "2", "--num-prompts", "4", "--output-len", "200", "--ignore-eos"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "TMPDIR": str(tmp_path)})     # (the interrupted server's log, kept)
    try:
        t0 = time.monotonic()
        while not children(p.pid) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        kids = children(p.pid)
        assert kids, "no server was started"
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
        t0 = time.monotonic()
        while [k for k in kids if alive(k)] and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert not [k for k in kids if alive(k)]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason=f"llama-server is not built at {LLAMA_SERVER}")
def test_compare_llama_server(smollm2_path, tmp_path):
    out = tmp_path / "compare.json"
    r, seen = run_bench("--serve-model", str(smollm2_path), "--llama-server", str(LLAMA_SERVER), "--mix", "chat",
                        "--concurrency", "2", "--num-prompts", "2", "--output-len", "4", "--ignore-eos", "--json",
                        str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(seen) >= 2 and not [p for p in seen if alive(p)]
    res = json.loads(out.read_text())
    assert "-np 2" in res["info"]["llama_cmd"] and "-t 2" in res["info"]["llama_cmd"]
    lumen, llama = res["runs"]["2"]["Lumen"][0], res["runs"]["2"]["llama.cpp"][0]
    assert lumen["completed"] == llama["completed"] == 2 and llama["total_output_tokens"] == 8
    assert abs(lumen["total_input_tokens"] - llama["total_input_tokens"]) <= 4      # the same prompts
    assert "ratio" in r.stdout


def _run(tps, ttft, itl99):
    return {"output_throughput": tps, "ttft_ms": {"p50": ttft, "p99": ttft}, "itl_ms": {"p50": itl99, "p99": itl99}}


def test_beside_ratios_pair_each_repetition_with_its_own_idle_run():
    raw = {"none": {4: {"Lumen": [_run(100, 50, 10), _run(50, 100, 20)]}},
           "busy": {4: {"Lumen": [_run(80, 100, 15), _run(20, 300, 20)]}}}
    (row,) = bench.beside_ratios(raw)
    assert row["corunner"] == "busy" and row["level"] == 4 and row["server"] == "Lumen"
    # per repetition 0.8 and 0.4 -> 0.6 (the ratio of medians would be 50/75)
    assert row["output tok/s"] == pytest.approx(0.6) and row["TTFT p50"] == pytest.approx(2.5)
    assert row["ITL p99"] == pytest.approx(1.25)
    assert "busy" in bench.render_beside([row]) and "0.60x" in bench.render_beside([row])


@pytest.mark.slow
def test_sweep_beside_a_busy_loop(smollm2_path, tmp_path):
    out = tmp_path / "beside.json"
    r, seen = run_bench("--serve-model", str(smollm2_path), "--mix", "chat", "--concurrency", "2",
                        "--num-prompts", "2", "--output-len", "4", "--ignore-eos", "--corunner", "busy",
                        "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [p for p in seen if alive(p)]                 # the server and the co-runner are gone
    res = json.loads(out.read_text())
    (idle,) = res["runs"]["2"]["Lumen"]
    (busy,) = res["corunners"]["busy"]["runs"]["2"]["Lumen"]
    assert idle["completed"] == busy["completed"] == 2 and busy["total_output_tokens"] == 8
    (row,) = res["beside_ratios"]
    assert row["corunner"] == "busy" and row["output tok/s"] > 0
    assert "beside a busy loop" in r.stdout and "beside co-runners" in r.stdout
