"""`python -m lumen.profile` as a subprocess on SmolLM2 with a fake machine cache. lumen.machine itself:
tests/test_machine.py."""
import json
import math
import os
import subprocess
import sys

import pytest

FAKE = {"cpu": None, "cores": os.cpu_count(), "threads": os.cpu_count(), "version": None, "bw_1t_gbps": 10.0,
        "bw_gbps": 20.0, "fma_1t_gflops": 50.0, "fma_gflops": 100.0, "int8_dot_1t_gops": 150.0,
        "int8_dot_gops": 300.0, "int8_dot_isa": "fake isa", "measured_at": "fake"}


@pytest.fixture(scope="module")
def home(tmp_path_factory, new_home):
    """A LUMEN_HOME with the real models and their packs linked in, and a fake machine.json."""
    from lumen.machine import VERSION, cpu_model
    d = new_home(tmp_path_factory.mktemp("lumen_home"))
    (d / "machine.json").write_text(json.dumps(dict(FAKE, cpu=cpu_model(), version=VERSION)))
    return d


def run(home, *args, timeout=300):
    env = dict(os.environ, LUMEN_HOME=str(home), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "lumen.profile", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def full(home, smollm2_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("out")
    r = run(home, "--model", smollm2_path, "--prompt-tokens", 16, "--gen-tokens", 4, "--threads", 2,
            "--json", d / "p.json", "--plot", d / "p.png")
    return r, d


def _rows(out: str, title: str) -> list[list[str]]:
    """The body rows of the rich table whose title starts with `title`."""
    lines = out.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(title))
    rows = []
    for ln in lines[i + 4:]:
        if not ln.startswith("│"):
            break
        rows.append([c.strip() for c in ln.strip("│").split("│")])
    return rows


def test_report_tables(full):
    r, _ = full
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # 4 generated tokens: the first is sampled from the prefill step, then 3 decode steps
    for title in ("prefill: 16 tokens", "decode: 3 tokens", "ms per layer", "Python/dispatch overhead"):
        assert title in out, out
    assert "coverage decode: min" in out and "coverage prefill: min" in out
    for phase in ("prefill", "decode"):
        rows = _rows(out, phase + ":")
        ops = {row[0] for row in rows}
        assert {"q", "down", "attention", "output", "embed"} <= ops
        for row in rows:
            for cell in row[1:8]:
                assert math.isfinite(float(cell.rstrip("%")))
    layers = _rows(out, "ms per layer")
    assert [int(row[0]) for row in layers] == list(range(30))
    over = {row[0]: float(row[1]) for row in _rows(out, "Python/dispatch overhead")}
    assert {"schedule", "prepare", "dispatch", "return", "sample", "detokenize", "unattributed", "total"} <= set(over)


def test_json_and_plots(full):
    r, d = full
    assert r.returncode == 0, r.stderr
    data = json.loads((d / "p.json").read_text())
    assert data["records"] and data["steps"][0]["phase"] == "prefill"
    s = data["summary"]
    assert s["run"]["prompt_tokens"] == 16 and s["run"]["gen_tokens"] == 4
    assert data["machine"]["bw_gbps"] == 20.0
    dec = {row["op"]: row for row in s["ops"]["decode"]}
    q = dec["q"]
    assert q["calls"] == 30 * 3 and q["gflops"] > 0 and q["intensity"] > 0
    # the matmul bound uses the int8 dot peak, the rest the FMA peak, both against the bandwidth
    assert q["bound_gflops"] == pytest.approx(min(300.0, q["intensity"] * 20.0))
    assert q["roofline_share"] == pytest.approx(q["gflops"] / q["bound_gflops"])
    att = dec["attention"]
    assert att["bound_gflops"] == pytest.approx(min(100.0, att["intensity"] * 20.0))
    assert 0.9 <= s["phases"]["decode"]["coverage_min"] <= 1.0
    for name in ("p.png", "p-ops.png"):
        blob = (d / name).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000


def test_filters(home, smollm2_path):
    r = run(home, "--model", smollm2_path, "--prompt-tokens", 8, "--gen-tokens", 3, "--phase", "decode",
            "--op", "down", "--layer", 2)
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout, "decode:")
    assert [row[0] for row in rows] == ["down"] and rows[0][1] == "2"
    assert "prefill:" not in r.stdout
    assert [row[0] for row in _rows(r.stdout, "ms per layer")] == ["2"]


@pytest.mark.parametrize("args, code, msg", [
    (["--phase", "training"], 2, "unknown phase 'training'"),
    (["--op", "flash"], 1, "unknown op 'flash'"),
    (["--layer", "99"], 1, "unknown layer 99"),
    (["--prompt-tokens", "0"], 2, "--prompt-tokens must be at least 1"),
    (["--gen-tokens", "-3"], 2, "--gen-tokens must be at least 1"),
    (["--prompt-tokens", "x"], 2, "invalid int value"),
    (["--json", "/no/such/dir/p.json"], 2, "does not exist"),
    (["--plot", "/no/such/dir/p.png"], 2, "does not exist"),
])
def test_bad_input(home, smollm2_path, args, code, msg):
    r = run(home, "--model", smollm2_path, "--prompt-tokens", 4, "--gen-tokens", 2, *args)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert msg in r.stderr and "Traceback" not in r.stderr


def test_unwritable_path_fails_before_the_run(home, smollm2_path, tmp_path):
    r = run(home, "--model", smollm2_path, "--json", tmp_path)  # a directory; default 512+128 would take long
    assert r.returncode == 2 and "is a directory" in r.stderr and "Traceback" not in r.stderr


def test_machine_prints_cached_limits(home):
    r = run(home, "--machine")
    assert r.returncode == 0, r.stderr
    assert "memory read GB/s" in r.stdout and "20.0" in r.stdout and "int8 dot GOP/s" in r.stdout
