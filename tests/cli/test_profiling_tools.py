"""The profiling scripts that run a llama.cpp tool when asked for: a wrong path to it is a one-line usage error
before any work, not minutes of measuring followed by a silent skip or a traceback."""
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
