"""Every command's --help lists all of its modes: each flag the README uses with a command (and each bench
subcommand) appears in that command's `--help`, and the README's invocations parse. No model is loaded."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
COMMANDS = ("lumen.generate", "lumen.serve", "lumen.bench", "lumen.profile", "lumen.models", "lumen.perplexity",
            "lumen.gguf")
BENCH = ("single", "batch", "offline", "serve", "spec")
# Modes each --help must name even where the README shows none of them on a command line.
MODES = {
    ("lumen.profile", None): {"--machine", "--overhead", "--engine", "--serving"},
    ("lumen.bench", None): set(BENCH),
    ("lumen.serve", None): {"--replicas", "--speculative", "--scheduler", "--profile"},
    ("lumen.generate", None): {"--chat", "--speculative"},
    ("lumen.models", None): {"--fetch"},
}


def readme_invocations() -> list[tuple[str, str | None, list[str]]]:
    """(command, bench subcommand or None, its arguments) for every command line `python -m lumen.X ...` (at
    the start of a line, or after a pipe) in the README's code blocks (continuations joined, comments dropped)."""
    out, block, lines = [], False, README.read_text().splitlines()
    joined: list[str] = []
    for line in lines:
        if line.startswith("```"):
            block = not block
            continue
        if not block:
            continue
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line.strip()
        else:
            joined.append(line)
    for line in joined:
        for m in re.finditer(r"(?:^|\|\s*)python -m (lumen\.[a-z]+)([^|&#]*)", line.strip()):
            args = shlex.split(m.group(2))
            sub = args.pop(0) if m.group(1) == "lumen.bench" and args and args[0] in BENCH else None
            out.append((m.group(1), sub, args))
    return out


INVOCATIONS = readme_invocations()


def flags(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if re.fullmatch(r"--?[a-zA-Z][\w-]*(=.*)?", a)}


@cache
def help_text(command: str, sub: str | None) -> str:
    argv = [sys.executable, "-m", command, *([sub] if sub else []), "--help"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (argv, r.stderr)
    return r.stdout


def test_the_readme_documents_every_command():
    assert {c for c, _, _ in INVOCATIONS} == set(COMMANDS)


DOCUMENTED: dict[tuple[str, str | None], set[str]] = {}
for _cmd, _sub, _args in INVOCATIONS:
    DOCUMENTED.setdefault((_cmd, _sub), set()).update(flags(_args))
for _key, _modes in MODES.items():
    DOCUMENTED.setdefault(_key, set()).update(_modes)


@pytest.mark.parametrize("command, sub", sorted(DOCUMENTED, key=lambda k: (k[0], k[1] or "")),
                         ids=[f"{c} {s or ''}".strip() for c, s in sorted(DOCUMENTED, key=lambda k: (k[0], k[1] or ""))])
def test_help_lists_what_the_readme_documents(command, sub):
    text = help_text(command, sub)
    missing = [f for f in sorted(DOCUMENTED[(command, sub)])
               if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not missing, f"`python -m {command} {sub or ''} --help` does not list {missing}:\n{text}"


@pytest.mark.parametrize("sub", BENCH)
def test_bench_subcommand_help_is_its_own(sub):
    """`lumen.bench SUB --help` is SUB's help alone; the list of subcommands heads only `lumen.bench --help`."""
    assert "the default command" not in help_text("lumen.bench", sub)
    assert "the default command, single" in help_text("lumen.bench", None)


def test_profile_modes_parse_as_the_readme_writes_them():
    """Every README invocation of lumen.profile parses (the parser alone: nothing runs)."""
    from lumen.profile.__main__ import parse
    modes = set()
    for command, _, args in INVOCATIONS:
        if command == "lumen.profile":
            modes.add(parse(args)[2])
    assert {"run", "machine", "engine", "serving"} <= modes


@pytest.mark.parametrize("args, error", [
    (["--engine", "--prompt-tokens", "5"], "--prompt-tokens does not go with --engine"),
    (["--tiny"], "--tiny does not go with a profiled run"),
    (["--serving", "f.json", "--engine"], "not allowed with argument"),
    (["--machine", "--model", "gemma3-270m"], "--model does not go with --machine"),
])
def test_profile_refuses_options_of_another_mode(args, error, capsys):
    from lumen.profile.__main__ import parse
    with pytest.raises(SystemExit) as e:
        parse(args)
    assert e.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.parametrize("text", ["not json at all", '{"steps": []}', "[1, 2]"], ids=["text", "json", "list"])
def test_profile_serving_names_a_file_that_is_not_a_profile(tmp_path, text, capsys):
    from lumen.profile.__main__ import main
    f = tmp_path / "some.txt"
    f.write_text(text)
    assert main(["--serving", str(f)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {f}: not a serving profile") and len(err.strip().splitlines()) == 1
