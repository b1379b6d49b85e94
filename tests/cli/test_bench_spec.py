"""python -m lumen.bench spec: one real interleaved run on SmolLM2 (plain, ngram and a draft model side by side:
rows, JSON, identical greedy text), flag errors, the workloads' prompts, and the parsing of llama-lookup's
report."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lumen.bench import spec


@pytest.mark.slow
def test_one_run_per_kind(smollm2_path, tmp_path):
    out = tmp_path / "spec.json"
    r = subprocess.run([sys.executable, "-m", "lumen.bench", "spec", "-m", str(smollm2_path), "--draft-model",
                        str(smollm2_path), "-n", "24", "-r", "1", "--prompts-per-kind", "1", "--kinds", "edit,chat",
                        "-t", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "| edit |" in r.stdout and "| chat |" in r.stdout
    assert "ngram t/s" in r.stdout and "draft t/s" in r.stdout
    data = json.loads(out.read_text())
    assert [s["kind"] for s in data["summary"]] == ["edit", "chat"]
    for row in data["runs"]:
        assert row["same_text"] and row["tokens"] == 24
        for m in ("plain", "ngram", "draft"):
            assert row[f"{m}_tps"] > 0
        for m in ("ngram", "draft"):
            assert 0 <= row[f"{m}_accepted_pct"] <= 100 and row[f"{m}_tok_per_step"] >= 1.0
    # the edit prompt asks for the function back: prompt lookup finds something to draft there, and so does the
    # model drafting for itself
    assert data["runs"][0]["ngram_accepted_pct"] > 0 and data["runs"][0]["draft_accepted_pct"] > 0


@pytest.mark.parametrize("argv, msg", [(["--kinds", "poetry"], "unknown kind"), (["-r", "0"], "-r must be at least 1, got 0"),
                                       (["--prompts-per-kind", "0"], "--prompts-per-kind must be at least 1, got 0"),
                                       (["--kinds", ","], "names no workload"),
                                       (["--llama-lookup", "/nonexistent"], "--llama-lookup /nonexistent: does not exist"),
                                       (["-t", "0"], "--threads must be between 1")])
def test_bad_flags(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        spec.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_prompts_are_the_committed_sets_in_kind_order():
    items = spec.prompts(["chat", "code", "completion", "edit"], 2)
    assert [x["kind"] for x in items] == ["chat", "chat", "code", "code", "completion", "completion", "edit", "edit"]
    assert all(x["prompt"] for x in items)
    assert [x["chat"] for x in items] == [True, True] + [False] * 6      # free chat goes through the template


def test_workloads_are_what_they_say():
    """completion: the head of a function in an open fence; edit: a whole function and a rename whose answer
    repeats the prompt's code."""
    for it in spec.prompts(["completion"], 12):
        assert it["prompt"].startswith("```python\n") and it["prompt"].count("```") == 1
    for it in spec.prompts(["edit"], 12):
        body = it["prompt"].split("```python\n")[1].split("```")[0]
        old = it["prompt"].split("renaming `")[1].split("`")[0]
        assert body.count(old) >= 3 and it["prompt"].endswith("```python\n")


def test_llama_lookup_report_parsed(tmp_path):
    fake = tmp_path / "llama-lookup"
    fake.write_text("#!/bin/sh\ncat >&2 <<'EOF'\n"
                    "1.03.864.632 I decoded   25 tokens in   0.200 seconds, speed:  125.000 t/s\n"
                    "1.03.864.633 I n_draft      = 3\n1.03.864.634 I n_predict    = 25\n"
                    "1.03.864.634 I n_drafted    = 20\n1.03.864.637 I n_accept     = 15\nEOF\n")
    fake.chmod(0o755)
    row = spec.run_llama(str(fake), "m.gguf", "p", 25, 2, None, [])
    assert row == {"tps": 125.0, "tokens": 25, "drafted": 20, "accepted_pct": 75.0}


def test_a_run_that_fails_is_one_error_line(tmp_path, capsys):
    """A file that is not a GGUF (or any lumen.generate that fails) ended the benchmark in a RuntimeError
    traceback; it is lumen.generate's own error, in a line."""
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"root:x:0:0" * 10)
    assert spec.main(["-m", str(bad), "-r", "1", "--prompts-per-kind", "1", "--kinds", "edit", "-n", "4"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: lumen.generate failed (1): {bad}: not a GGUF file") and err.count("\n") == 1, err


def test_a_failed_generate_run_is_said_by_its_error_line():
    """The error was the last 500 characters of lumen.generate's stderr: its compile notes came first, the error
    on a third line ("lumen.generate failed (1): compiling the kernels ... compiled and loaded in 34 s / error:
    ...")."""
    err = ("compiling the kernels for this CPU (first run only, up to a minute; cached afterwards)...\n"
           "compiled and loaded in 34 s\nerror: the draft model's vocabulary has 262144 tokens, the target's 49152\n")
    assert spec.failure(err) == "the draft model's vocabulary has 262144 tokens, the target's 49152"
    assert spec.failure("Segmentation fault\n") == "Segmentation fault"
    assert spec.failure("") == "it printed nothing"


def test_a_gen_length_beyond_the_context_is_said_in_this_tools_flags(smollm2_path, capsys):
    """-n 5000 failed with lumen.generate's own advice, "give --ctx 5053 or more, or -n -1", flags that
    `bench spec` does not take; it names -n and the most that fits."""
    assert spec.main(["-m", str(smollm2_path), "-r", "1", "--prompts-per-kind", "1", "--kinds", "completion",
                      "-n", "5000", "-t", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: lumen.generate failed (1): -n 5000 does not fit: the prompt takes "), err
    assert "--ctx" not in err and "--max-tokens" not in err and err.endswith(" or less"), err
    n_prompt = int(err.split("the prompt takes ")[1].split()[0])
    assert err.endswith(f"use -n {2048 - n_prompt} or less"), err


def test_a_draft_model_of_another_vocabulary_fails_before_any_run(smollm2_path, gemma3_path, capsys, monkeypatch):
    """--draft-model gemma3-270m for smollm2-135m ran the first plain and ngram runs (seconds to minutes) before
    lumen.generate refused the draft; the vocabularies are compared from the files' metadata first."""
    def no_run(*a, **kw):
        raise AssertionError("a run started")
    monkeypatch.setattr(spec, "run_lumen", no_run)
    assert spec.main(["-m", str(smollm2_path), "--draft-model", str(gemma3_path), "-r", "1", "-n", "4",
                      "--prompts-per-kind", "1", "--kinds", "completion", "-t", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "error: the draft model's vocabulary has 262144 tokens, the target's 49152: they must share one"
