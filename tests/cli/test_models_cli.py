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
