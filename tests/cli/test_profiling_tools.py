"""A profiling script run the wrong way says so before any work, in a line that names the problem, never with a
traceback: an unknown model or a file that is not one is that line alone (status 1); a count, number or list it
cannot use, or an unknown flag, is argparse's usage and error (status 2); a wrong path to the llama.cpp tool a
comparison runs is one line too (status 2), not minutes of measuring followed by a silent skip or a traceback."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, flag, env", [("structured_output", "--llama-server", "LLAMA_SERVER"),
                                               ("tool_calling", "--llama-server", "LLAMA_SERVER"),
                                               ("shared_machine", "--llama-bench", "LLAMA_BENCH")])
@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_wrong_tool_path_is_a_usage_error(script, flag, env, how, tmp_path):
    missing = str(tmp_path / "no-such-tool")
    environ = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SERVER", "LLAMA_BENCH")}
    args = [flag, missing] if how == "flag" else []
    if how == "env":
        environ[env] = missing
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / f"{script}.py"), *args], cwd=ROOT, env=environ,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-1000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0] and missing in lines[0], r.stderr
    assert (flag if how == "flag" else f"${env}") in lines[0]
    assert r.stdout == ""                       # nothing measured, nothing printed


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """profiling/<script>.py with args, no llama.cpp tool in the environment; its stdout must stay empty (nothing
    measured) and nothing may trace back."""
    environ = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SERVER", "LLAMA_BENCH")}
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / f"{script}.py"), *args], cwd=ROOT, env=environ,
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-2000:]
    assert r.stdout == "", r.stdout[-1000:]
    return r


# every script that takes a model, and how: none of these loads one (the name is refused first)
MODEL_ARGS = {s: ["-m", "nosuch"] for s in (
    "attention_share", "bandwidth", "batch_decode_scaling", "batch_step_ops", "budget_sweep", "chunked_prefill_itl",
    "cost_model_accuracy", "decode_stream", "decode_vs_context", "dispatch_cold_cache", "kernel_n_vs_1",
    "ngram_replay", "pack_pages", "per_n_roofline", "prefix_cache", "serving_schedulers", "shared_machine",
    "small_n_threads", "spec_verify_cost", "startup", "thread_scaling", "unpack_rows", "vnni_ports",
    "where_p99_itl_comes_from")}
MODEL_ARGS |= {"compile_profile": ["--models", "smollm2-135m", "nosuch"],   # the last one too, before the first runs
               "structured_costs": ["--models", "nosuch"], "tool_calling": ["--model", "nosuch"],
               "pd_serving": ["simulate", "--model", "nosuch"]}


@pytest.mark.parametrize("script", sorted(MODEL_ARGS))
def test_an_unknown_model_is_one_line(script):
    r = run_script(script, *MODEL_ARGS[script])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "unknown model 'nosuch'" in lines[0] and "smollm2-135m" in lines[0]      # (the known names follow)
    # its own name first; startup.py's model is refused by the lumen.generate it times, and it says so
    assert lines[0].startswith(f"{script}.py: " if script != "startup" else "python -m lumen.generate failed"), lines


# each way a script opens its model: lumen.load, Engine, GGUFFile, checked_model (for a server), lumen.generate
@pytest.mark.parametrize("script", ["attention_share", "batch_step_ops", "kernel_n_vs_1", "per_n_roofline",
                                    "pd_serving", "startup", "unpack_rows"])
@pytest.mark.parametrize("what", ["missing", "not a GGUF"])
def test_a_path_that_is_not_a_model_is_one_line(script, what, tmp_path):
    path = tmp_path / "model.gguf"
    if what == "not a GGUF":
        path.write_text("not a model\n" * 8)
    r = run_script(script, *(["itl"] if script == "pd_serving" else []), "--model", str(path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert str(path) in lines[0], lines
    assert ("no such model file" if what == "missing" else "not a GGUF file") in lines[0], lines


def test_startup_takes_a_relative_path_from_where_it_runs(tmp_path):
    """startup.py's children run in a directory of their own: a relative model path is the caller's."""
    (tmp_path / "model.gguf").write_text("not a model\n" * 8)
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / "startup.py"), "--model", "model.gguf"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "not a GGUF file" in r.stderr and str(tmp_path / "model.gguf") in r.stderr, r.stderr


USAGE = [("attention_rows", ["--ns", "1,x"], "argument --ns: expected a whole number, got 'x' in '1,x'"),
         ("attention_rows", ["--heads", "9", "--kv-heads", "4"], "--heads must be a multiple of --kv-heads"),
         ("attention_share", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
         ("bandwidth", ["--threads", "0"], "argument --threads: must be at least 1, got 0"),
         ("batch_decode_scaling", ["--steps", "x"], "argument --steps: expected a whole number, got 'x'"),
         ("batch_step_ops", ["--batch", "-1"], "argument --batch: must be at least 1, got -1"),
         ("budget_sweep", ["--rates", "1,x"], "argument --rates: expected a number, got 'x' in '1,x'"),
         ("chunked_prefill_itl", ["--decodes", "0"], "argument --decodes: must be at least 1, got 0"),
         ("compile_profile", ["--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
         ("cost_model_accuracy", ["--requests", "0"], "argument --requests: must be at least 1, got 0"),
         ("decode_stream", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
         ("decode_vs_context", ["--threads", "999"], "argument --threads: must be between 1 and"),
         ("dispatch_cold_cache", ["--calls", "0"], "argument --calls: must be at least 1, got 0"),
         ("false_sharing", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
         ("gate_reference", ["--pause", "-1"], "argument --pause: must be at least 0, got -1"),
         ("gate_reference", ["--bogus"], "unrecognized arguments: --bogus"),
         ("kernel_n_vs_1", ["--n", "0"], "argument --n: must be at least 1, got 0"),
         ("ngram_replay", ["--sizes", "1-4,4-2"], "argument --sizes: expected lo-hi with 1 <= lo <= hi <= 16, got "
                                                  "'4-2' in '1-4,4-2'"),
         ("pack_pages", ["--rows", "0"], "argument --rows: must be at least 1, got 0"),
         ("pd_serving", ["goodput", "--rates", "0.3,x"], "argument --rates: expected a number, got 'x' in '0.3,x'"),
         ("pd_serving", ["goodput", "--configs", "pd,nope"], "argument --configs: expected colocated, pd or both"),
         ("per_n_roofline", ["--ns", "1,,4"], "argument --ns: expected a whole number, got '' in '1,,4'"),
         ("prefix_cache", ["--prefix", "0"], "argument --prefix: must be at least 1, got 0"),
         ("ray_serve", ["prefix", "--request-rate", "0"], "argument --request-rate: must be above 0, got 0"),
         ("serving_schedulers", ["-r", "0"], "argument -r/--repetitions: must be at least 1, got 0"),
         ("shared_machine", ["--gap", "-1"], "argument --gap: must be at least 0, got -1"),
         ("small_n_threads", ["--ns", "0,8"], "argument --ns: must be at least 1, got 0 in '0,8'"),
         ("spec_verify_cost", ["--rows", "1"], "argument --rows: must be at least 2"),
         ("startup", ["--runs", "0"], "argument --runs: must be at least 1, got 0"),
         ("structured_costs", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
         ("structured_output", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),
         ("thread_scaling", ["--gen", "0"], "argument --gen: must be at least 1, got 0"),
         ("tool_calling", ["--concurrency", "1,x"], "argument --concurrency: expected a whole number, got 'x'"),
         ("ui_overhead", ["--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0"),
         ("ui_overhead", ["--bogus"], "unrecognized arguments: --bogus"),
         ("unpack_rows", ["--ns", "8,x"], "argument --ns: expected a whole number, got 'x' in '8,x'"),
         ("unpack_rows", ["--threads", "999"], "argument --threads: must be between 1 and"),
         ("vnni_ports", ["--reuse", "0,1"], "argument --reuse: must be at least 1, got 0 in '0,1'"),
         ("where_p99_itl_comes_from", ["--rate", "0"], "argument --rate: must be above 0, got 0")]


@pytest.mark.parametrize("script, args, said", USAGE, ids=[f"{s} {' '.join(a)}" for s, a, _ in USAGE])
def test_a_value_it_cannot_use_is_a_usage_error(script, args, said):
    r = run_script(script, *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines[0].startswith("usage: "), r.stderr          # argparse's usage, kept
    assert f"{script}.py: error: {said}" in lines[-1], lines                       # the line that says what


def test_given_tool_is_none_unless_asked_for(monkeypatch, tmp_path):
    import argparse

    from lumen.bench.tools import given_tool
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    ap = argparse.ArgumentParser(prog="x")
    assert given_tool(ap, "llama-server", "--llama-server", None, "LLAMA_SERVER") is None
    tool = tmp_path / "llama-server"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER", str(tool))
    assert given_tool(ap, "llama-server", "--llama-server", None, "LLAMA_SERVER") == str(tool)
    with pytest.raises(SystemExit) as e:
        given_tool(ap, "llama-server", "--llama-server", str(tmp_path / "nope"), "LLAMA_SERVER")
    assert e.value.code == 2


def test_profiling_prompts_stay_within_the_tokenizers_ids(qwen05_file, monkeypatch):
    """The profiling scripts' random prompts use only ids the engine admits: Qwen2.5's embedding has rows past its
    tokenizer's ids, and prompts drawn up to config.n_vocab were refused (batch_step_ops on the 1.5B stopped with
    'token id 151860 is outside the vocabulary')."""
    from types import SimpleNamespace

    import numpy as np

    from lumen.engine.admission import prompt_ids
    from lumen.format.gguf import GGUFFile
    from lumen.format.tokenizer import Tokenizer
    from lumen.model.config import config_from_metadata
    monkeypatch.syspath_prepend(str(ROOT / "profiling"))
    from token_ids import random_ids
    meta = GGUFFile(qwen05_file).metadata
    owner = SimpleNamespace(config=config_from_metadata(meta), tokenizer=Tokenizer.from_metadata(meta))
    assert owner.config.n_vocab > owner.tokenizer.vocab_end            # the padded case this is about
    ids = random_ids(np.random.default_rng(0), 20000, owner)
    assert ids.max() >= owner.tokenizer.vocab_end - 50                 # the whole range, up to its end
    assert prompt_ids(ids.tolist(), owner.tokenizer, owner.config.n_vocab, False) == ids.tolist()
