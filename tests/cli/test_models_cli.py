"""`lumen models` as a user reads it: in a terminal or through a pipe (`lumen models | grep qwen`)."""
from __future__ import annotations

import os
import subprocess
import sys

from lumen.model.store import MODELS


def test_a_pipe_gets_whole_names_and_paths(tmp_path):
    """Off a terminal rich lays a table out for 80 columns, which cut the names and paths to "qwen2.5-coder-0…";
    through a pipe each model is one line with its whole name and path."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    r = subprocess.run([sys.executable, "-m", "lumen.models"], capture_output=True, text=True, timeout=120,
                       env={**env, "LUMEN_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    for name, spec in MODELS.items():
        rows = [line for line in r.stdout.splitlines() if f" {name} " in line]
        assert len(rows) == 1, r.stdout
        assert str(home / "models" / name / spec.filename) in rows[0], r.stdout
    assert "…" not in r.stdout, r.stdout


def test_fetch_of_a_verified_model_does_not_download_it_again(smollm2_path, monkeypatch, capsys):
    """`lumen models --fetch NAME` on a model already fetched and verified says so; it downloaded it again
    (1.1 GB for qwen2.5-coder-1.5b). --verify is the way to check the file again."""
    from lumen import models
    from lumen.model import store

    def download(name, console):
        raise AssertionError(f"{name} downloaded again")

    monkeypatch.setattr(store, "_fetch", download)
    assert store.state("smollm2-135m") == "verified"
    assert models.main(["--fetch", "smollm2-135m"]) == 0
    assert "smollm2-135m is already fetched and verified" in capsys.readouterr().err


def test_help_names_the_models_fetch_takes(capsys):
    """--fetch's help ended mid-sentence ("unless it is already") and its metavar hid the names it takes."""
    import pytest
    from lumen.models import main
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "unless it is fetched already: " in out
    assert all(name in out for name in MODELS), out


def test_verify_says_what_it_verified(monkeypatch, tmp_path, capsys):
    """`lumen models --verify NAME` printed the table and nothing saying the check was done, or passed."""
    from lumen import models
    from lumen.errors import FetchError
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    monkeypatch.setattr(models, "verify", lambda name: tmp_path / f"{name}.gguf")
    assert models.main(["--verify", "smollm2-135m"]) == 0
    assert capsys.readouterr().err == f"smollm2-135m: sha256 matches, verified: {tmp_path / 'smollm2-135m.gguf'}\n"

    def mismatch(name):
        raise FetchError(f"sha256 mismatch for {name}")
    monkeypatch.setattr(models, "verify", mismatch)
    assert models.main(["--verify", "smollm2-135m"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "error: sha256 mismatch for smollm2-135m\n"
