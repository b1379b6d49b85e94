"""python -m lumen.bench spec: one real interleaved run on SmolLM2 (rows, JSON, identical greedy text), flag errors,
and the parsing of llama-lookup's report."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lumen.bench import spec


@pytest.mark.slow
def test_one_run_per_kind(smollm2_path, tmp_path):
    out = tmp_path / "spec.json"
    r = subprocess.run([sys.executable, "-m", "lumen.bench", "spec", "-m", str(smollm2_path), "-n", "24", "-r", "1",
                        "--prompts-per-kind", "1", "--kinds", "code,chat", "-t", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "| code |" in r.stdout and "| chat |" in r.stdout
    data = json.loads(out.read_text())
    assert [s["kind"] for s in data["summary"]] == ["code", "chat"]
    for row in data["runs"]:
        assert row["same_text"] and row["tokens"] == 24
        assert row["plain_tps"] > 0 and row["spec_tps"] > 0
        assert 0 <= row["accepted_pct"] <= 100 and row["tok_per_step"] >= 1.0
    # the code prompt asks for the file back: prompt lookup finds something to draft there
    assert data["runs"][0]["accepted_pct"] > 0


@pytest.mark.parametrize("argv, msg", [(["--kinds", "poetry"], "unknown kind"), (["-r", "0"], "at least 1"),
                                       (["--llama-lookup", "/nonexistent"], "not an executable")])
def test_bad_flags(argv, msg, capsys):
    with pytest.raises(SystemExit):
        spec.main(argv)
    assert msg in capsys.readouterr().err


def test_prompts_are_the_committed_set_in_kind_order():
    items = spec.prompts(["chat", "code"], 2)
    assert [x["kind"] for x in items] == ["chat", "chat", "code", "code"]
    assert all(x["prompt"] for x in items)


def test_llama_lookup_report_parsed(tmp_path):
    fake = tmp_path / "llama-lookup"
    fake.write_text("#!/bin/sh\ncat >&2 <<'EOF'\n"
                    "1.03.864.632 I decoded   25 tokens in   0.200 seconds, speed:  125.000 t/s\n"
                    "1.03.864.633 I n_draft      = 3\n1.03.864.634 I n_predict    = 25\n"
                    "1.03.864.634 I n_drafted    = 20\n1.03.864.637 I n_accept     = 15\nEOF\n")
    fake.chmod(0o755)
    row = spec.run_llama(str(fake), "m.gguf", "p", 25, 2, None, [])
    assert row == {"tps": 125.0, "tokens": 25, "drafted": 20, "accepted_pct": 75.0}
