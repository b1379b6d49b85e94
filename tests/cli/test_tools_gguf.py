"""`lumen gguf FILE` as a user reads it: in a terminal or through a pipe (`lumen gguf M | grep rope`)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.synth import write_model


def _gguf(path, columns: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns:
        env["COLUMNS"] = columns
    return subprocess.run([sys.executable, "-m", "lumen.gguf", str(path)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_a_pipe_gets_whole_keys_and_values(tmp_path):
    """Off a terminal rich lays the tables out for 80 columns, which cut a key to
    "llama.attention.layer_norm_rms_epsi…"; through a pipe each key is one line, whole."""
    write_model(tmp_path / "m.gguf", meta={"general.a_rather_long_metadata_key_name_for_the_test": 7})
    r = _gguf(tmp_path / "m.gguf")
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout, r.stdout
    for key in ("llama.attention.layer_norm_rms_epsilon", "general.a_rather_long_metadata_key_name_for_the_test"):
        rows = [line for line in r.stdout.splitlines() if key in line]
        assert len(rows) == 1, r.stdout
    assert [line for line in r.stdout.splitlines() if "blk.0.attn_output.weight" in line], r.stdout


def test_a_narrow_terminal_folds_keys_instead_of_cutting_them(tmp_path):
    """With COLUMNS set narrow, a long key wraps onto the next line; no part of it is dropped."""
    write_model(tmp_path / "m.gguf")
    r = _gguf(tmp_path / "m.gguf", columns="50")
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout, r.stdout


def test_a_file_without_tensors_says_so(tmp_path):
    """A vocabulary-only GGUF (llama.cpp's ggml-vocab-*.gguf) printed an empty table titled "0 tensors, data at
    offset N" with N past the file's end, and "total tensor bytes: 0"; it says what the file is instead."""
    from gguf import GGUFWriter
    path = tmp_path / "vocab.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = _gguf(path)
    assert r.returncode == 0, r.stderr
    assert "tokenizer.ggml.tokens" in r.stdout and "data at offset" not in r.stdout, r.stdout
    assert f"no tensors: a metadata-only file (a vocabulary, as llama.cpp's ggml-vocab-*.gguf), not a model to " \
           f"run; {path.stat().st_size:,} file bytes" in " ".join(r.stdout.split()), r.stdout


def test_a_wrong_name_is_said_as_every_tool_says_it(tmp_path, capsys):
    """Anything but a registry name was opened as a file: a mistyped name said "cannot open nosuch: No such file
    or directory", "" said "cannot open .: Is a directory"."""
    from lumen.gguf import main
    from lumen.model.store import MODELS
    for arg, says in (("nosuch", f"unknown model 'nosuch': not a known name ({', '.join(MODELS)})"),
                      ("", "unknown model ''"), (str(tmp_path), f"{tmp_path} is a directory")):
        assert main([arg]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {says}") and len(err.splitlines()) == 1, err
