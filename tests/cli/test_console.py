"""The `lumen` console script: one command per tool, the same arguments as `python -m lumen.X`, errors in a line."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from lumen.commands import COMMANDS

SCRIPT = Path(sys.executable).parent / "lumen"     # installed by pyproject.toml's [project.scripts]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_the_script_is_installed():
    assert SCRIPT.is_file(), f"{SCRIPT} is missing: pip install -e . installs it (pyproject.toml [project.scripts])"


def test_help_lists_every_command():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for name in COMMANDS:
        assert f"  {name} " in r.stdout, r.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_a_main(name):
    assert callable(importlib.import_module(COMMANDS[name][0]).main)


def test_an_unknown_command_is_one_line():
    r = run("genrate", "--prompt", "x")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "unknown command 'genrate'" in r.stderr and "generate" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("name", ["gguf", "perplexity", "generate"])
def test_a_command_names_itself_as_invoked(name):
    r = run(name, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: lumen {name} "), r.stdout[:200]
    m = subprocess.run([sys.executable, "-m", f"lumen.{name}", "--help"], capture_output=True, text=True, timeout=120)
    assert m.stdout.startswith(f"usage: python -m lumen.{name} "), m.stdout[:200]


def test_a_wrong_flag_is_an_error_not_a_traceback(tmp_path):
    r = run("gguf", str(tmp_path / "missing.gguf"))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "missing.gguf" in r.stderr
    r = run("generate", "--no-such-flag")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--no-such-flag" in r.stderr


def test_python_m_lumen_is_the_script():
    """`python -m lumen COMMAND`, as a user who has not found the script may type it (like `python -m pip`)."""
    r = subprocess.run([sys.executable, "-m", "lumen", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and all(f"  {name} " in r.stdout for name in COMMANDS), r.stderr
    r = subprocess.run([sys.executable, "-m", "lumen", "genrate"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown command 'genrate'" in r.stderr, r.stderr


def test_gguf_takes_a_registry_name(smollm2_path):
    """`lumen gguf smollm2-135m`, as `lumen generate -m smollm2-135m`: the name was taken for a missing file."""
    r = run("gguf", "smollm2-135m")
    assert r.returncode == 0 and f"{smollm2_path.name}: GGUF v3" in " ".join(r.stdout.split()), r.stderr


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("lumen ")


def test_bench_help_names_the_script_as_invoked():
    """`lumen bench --help` told the user to type `python -m lumen.bench COMMAND --help`, and single's usage read
    "lumen bench [pp/tg options] [-h] ..."."""
    r = run("bench", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: lumen bench [single|batch|offline|serve|spec]"), r.stdout[:200]
    assert "`lumen bench COMMAND --help`" in r.stdout and "usage: lumen bench [single] [-h]" in r.stdout
    m = subprocess.run([sys.executable, "-m", "lumen.bench", "--help"], capture_output=True, text=True, timeout=120)
    assert m.stdout.startswith("usage: python -m lumen.bench [single|"), m.stdout[:200]


def test_help_command_shows_that_commands_help():
    """`lumen help generate` printed the list of commands again; it is `lumen generate --help`, as git and pip."""
    r = run("help", "generate")
    assert r.returncode == 0 and r.stdout.startswith("usage: lumen generate "), r.stdout[:200]
