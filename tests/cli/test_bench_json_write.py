"""A --json file that passed the check before the run but cannot be written after it (a read-only mount, a full
disk, /proc as root: the directory looks writable) ended the benchmark in a FileNotFoundError traceback after
the whole run; it is one error line and exit status 1, the figures already printed."""
from __future__ import annotations

import pytest

from lumen.commands import run


@pytest.mark.parametrize("module, argv", [
    ("single", ["-p", "4", "-n", "2", "--small", "0", "-r", "1"]),
    ("batch", ["-npp", "4", "-ntg", "1", "-npl", "1", "-r", "1"]),
    ("offline", ["--requests", "1", "--no-baseline"]),
    ("spec", ["-n", "4", "-r", "1", "--prompts-per-kind", "1", "--kinds", "completion"]),
])
def test_a_json_file_that_cannot_be_written_after_the_run_is_one_line(module, argv, smollm2_path, tmp_path,
                                                                      monkeypatch, capsys):
    import importlib
    mod = importlib.import_module(f"lumen.bench.{module}")
    monkeypatch.setattr(mod, "check_writable", lambda path, what: None)      # the check passed; the write fails
    out = tmp_path / "gone" / "b.json"
    assert run(mod.main, [*argv, "-m", str(smollm2_path), "-t", "1", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"error: cannot write the JSON to {out}: No such file or directory", err
