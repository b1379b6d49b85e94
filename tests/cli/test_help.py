"""The documentation's commands work as written: every command line in the README and the reference pages
(`python -m lumen.X ...`, `lumen X ...`, `python profiling/X.py ...`) names a command that exists, and each flag it
uses appears in that command's `--help`; each command's `--help` lists all of its modes; the README shows every
command of the `lumen` console script. The pages' relative links resolve, their Python blocks compile, and they
keep to what a user reads (no paths outside the repository, no internal issue numbers). No model is loaded."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from lumen.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The README and every reference page: the package's READMEs, the profiling pages, the tests' page.
DOCS = [README, *sorted((ROOT / "lumen").rglob("README.md")), ROOT / "profiling" / "README.md",
        ROOT / "profiling" / "RESULTS.md", *sorted((ROOT / "tests").rglob("README.md"))]
BENCH = ("single", "batch", "offline", "serve", "spec")
# Modes each --help must name even where no page shows them on a command line.
MODES = {
    ("profile", None): {"--machine", "--overhead", "--engine", "--serving"},
    ("bench", None): set(BENCH),
    ("serve", None): {"--replicas", "--speculative", "--scheduler", "--profile"},
    ("generate", None): {"--chat", "--speculative"},
    ("models", None): {"--fetch"},
}
# A command line, at the start of a line or after a pipe: `python -m lumen.X`, `lumen X` or `python profiling/X.py`,
# its arguments up to a pipe, `&&`, `;` or a comment.
COMMAND_LINE = re.compile(r"(?:^|\|\s*)(python -m lumen\.([a-z_]+)|lumen ([a-z_]+)|python (profiling/\w+\.py))"
                          r"([^|&#;]*)")


def rel(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def code_blocks(doc: Path) -> list[tuple[str, list[str]]]:
    """(language, lines) of each fenced code block."""
    out, lang, lines = [], None, []
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                out.append((lang, lines))
                lang = None
        elif lang is not None:
            lines.append(line)
    return out


def invocations(doc: Path) -> list[tuple[str, str, str | None, list[str]]]:
    """(form, command, bench subcommand or None, its arguments) of every command line in the page's shell blocks
    (continuations joined). form is "module" (`python -m lumen.X`), "script" (`lumen X`) or "profiling";
    command is the tool's name (`generate`) or the script's path (`profiling/x.py`)."""
    out = []
    for lang, lines in code_blocks(doc):
        if lang == "python":
            continue
        joined: list[str] = []
        for line in lines:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1] + " " + line.strip()
            else:
                joined.append(line)
        for line in joined:
            for m in COMMAND_LINE.finditer(line.strip()):
                form = "module" if m.group(2) else "script" if m.group(3) else "profiling"
                command = m.group(2) or m.group(3) or m.group(4)
                args = shlex.split(m.group(5))
                sub = args.pop(0) if command == "bench" and args and args[0] in BENCH else None
                out.append((form, command, sub, args))
    return out


INVOCATIONS = {rel(d): invocations(d) for d in DOCS}
ALL = [(doc, *inv) for doc, invs in INVOCATIONS.items() for inv in invs]


def flags(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if re.fullmatch(r"--?[a-zA-Z][\w-]*(=.*)?", a)}


@cache
def help_text(command: str, sub: str | None) -> str:
    """A tool's help through the console script's dispatch (`lumen X --help`), or a profiling script's."""
    if command.startswith("profiling/"):
        argv = [sys.executable, str(ROOT / command), "--help"]
    else:
        argv = [sys.executable, "-m", "lumen.cli", command, *([sub] if sub else []), "--help"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, (argv, r.stderr)
    return r.stdout


def test_every_page_is_read():
    """Every page is found, and each page of the package shows command lines this test can check."""
    assert len(DOCS) >= 12 and all(d.is_file() for d in DOCS), DOCS
    empty = [rel(d) for d in DOCS if d.is_relative_to(ROOT / "lumen") and not INVOCATIONS[rel(d)]]
    assert not empty, f"no command line found in {empty}"


def test_the_readme_shows_every_command():
    """Each command of the `lumen` console script appears in the README, in either form."""
    shown = {command for form, command, _, _ in INVOCATIONS["README.md"] if form != "profiling"}
    assert shown >= set(COMMANDS), f"the README shows no command line of {sorted(set(COMMANDS) - shown)}"


def test_every_command_named_exists():
    for doc, form, command, _, _ in ALL:
        if form == "profiling":
            assert (ROOT / command).is_file(), f"{doc}: {command} does not exist"
        else:
            assert command in COMMANDS, f"{doc}: `lumen {command}` is no command of {sorted(COMMANDS)}"


@pytest.mark.parametrize("module", sorted({c for _, form, c, _, _ in ALL if form == "module"}))
def test_the_module_form_runs(module):
    """`python -m lumen.X --help` works for every X a page runs that way."""
    r = subprocess.run([sys.executable, "-m", f"lumen.{module}", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr


DOCUMENTED: dict[tuple[str, str | None], dict[str, set[str]]] = {}
for _doc, _form, _cmd, _sub, _args in ALL:
    if _form == "profiling" or _cmd in COMMANDS:
        for _f in flags(_args):
            DOCUMENTED.setdefault((_cmd, _sub), {}).setdefault(_f, set()).add(_doc)
for _key, _modes in MODES.items():
    for _f in _modes:
        DOCUMENTED.setdefault(_key, {}).setdefault(_f, set()).add("MODES")
KEYS = sorted(DOCUMENTED, key=lambda k: (k[0], k[1] or ""))


@pytest.mark.parametrize("command, sub", KEYS, ids=[f"{c} {s or ''}".strip() for c, s in KEYS])
def test_help_lists_what_the_pages_use(command, sub):
    text = help_text(command, sub)
    missing = {f: sorted(docs) for f, docs in sorted(DOCUMENTED[(command, sub)].items())
               if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)}
    assert not missing, f"`{command} {sub or ''} --help` does not list {missing} (flag: pages using it):\n{text}"


@pytest.mark.parametrize("sub", BENCH)
def test_bench_subcommand_help_is_its_own(sub):
    """`lumen.bench SUB --help` is SUB's help alone; the list of subcommands heads only `lumen.bench --help`."""
    assert "the default command" not in help_text("bench", sub)
    assert "the default command, single" in help_text("bench", None)


def test_profile_modes_parse_as_the_pages_write_them():
    """Every page's invocation of lumen.profile parses (the parser alone: nothing runs)."""
    from lumen.profile.__main__ import parse
    modes = set()
    for _, _, command, _, args in ALL:
        if command == "profile":
            modes.add(parse(args)[2])
    assert {"run", "machine", "engine", "serving", "overhead"} <= modes


@pytest.mark.parametrize("doc", [rel(d) for d in DOCS])
def test_python_blocks_compile(doc):
    for i, (lang, lines) in enumerate(code_blocks(ROOT / doc)):
        if lang == "python":
            compile("\n".join(lines), f"{doc} python block {i}", "exec")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


@pytest.mark.parametrize("doc", [rel(d) for d in DOCS])
def test_relative_links_resolve(doc):
    """Every link to a file of the repository points to one that exists, and to a heading it has."""
    path = ROOT / doc
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, frag = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
            broken.append(target)
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(target)
    assert not broken, f"{doc}: broken links {broken}"


# What a user's page never says: paths outside the repository, internal issue numbers, how the work is organised.
NOT_FOR_USERS = [r"\.\./shared", r"/work/", r"/tmp/lcpp", r"lumen-cpu\.lock", r"\bflock\b", r"\bissue \d+",
                 r"other developers", r"/root/", r"other helpers", r"other sessions", r"the issue's"]


@pytest.mark.parametrize("doc", [rel(d) for d in DOCS])
def test_pages_are_for_users(doc):
    text = (ROOT / doc).read_text()
    found = [p for p in NOT_FOR_USERS if re.search(p, text, re.IGNORECASE)]
    assert not found, f"{doc} says {found}"


def test_the_readme_is_short():
    """A user's page: what Lumen is, how to run it, one line per feature; the journal lives in profiling/."""
    assert len(README.read_text().splitlines()) <= 250


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
    assert "Error" not in err and "indices" not in err        # (no Python words: "TypeError: list indices ...")


def test_profile_serving_of_no_requests_says_so(tmp_path, capsys):
    """A server stopped before any request finished writes an empty profile: one line saying so, not an empty
    table."""
    from lumen.profile import Profiler
    from lumen.profile import serving
    from lumen.profile.__main__ import main
    f = tmp_path / "p.json"
    serving.save(f, Profiler(), [])
    assert main(["--serving", str(f)]) == 1
    out = capsys.readouterr().out
    assert "no request finished" in out and len(out.strip().splitlines()) == 1


# The tools whose options are checked below: module, the arguments before --help.
OPTION_TOOLS = {"generate": ("lumen.generate", []), "chat": ("lumen.chat", []), "perplexity": ("lumen.perplexity", []),
                "models": ("lumen.models", []), **{f"bench {b}": (f"lumen.bench.{b}", []) for b in BENCH}}


@pytest.mark.parametrize("tool", sorted(OPTION_TOOLS))
def test_every_option_says_what_it_does(tool, monkeypatch):
    """Each option of a tool's --help has a line of help, and states its default once: `-n` had none, and bench
    spec's --threads said both "default: all cores" and "default 2"."""
    import argparse
    import importlib
    parsers = []

    def grab(self, file=None):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "print_help", grab)
    module, before = OPTION_TOOLS[tool]
    with pytest.raises(SystemExit):
        importlib.import_module(module).main([*before, "--help"])
    bad = [(a.option_strings, a.help) for a in parsers[-1]._actions if not isinstance(a, argparse._HelpAction)
           and (not (a.help or "").strip() or len(re.findall(r"\bdefault\b", a.help)) > 1)]
    assert not bad, bad


@pytest.mark.parametrize("module", ["generate", "chat", "perplexity"])
def test_ctx_takes_llama_cpp_names(module):
    """llama.cpp's -c / --ctx-size work wherever --ctx does."""
    import importlib
    ap = importlib.import_module(f"lumen.{module}").build_parser()
    need = ["--file", "f.txt"] if module == "perplexity" else []
    assert {ap.parse_args([*need, flag, "1024"]).ctx for flag in ("--ctx", "--ctx-size", "-c")} == {1024}


@pytest.mark.parametrize("module", ["lumen.generate", "lumen.serve.cli"])
def test_draft_vocab_says_what_a_value_past_the_vocabulary_does(module):
    """`--draft-vocab 100000000` is taken, and the draft proposes from the whole vocabulary (as the default 32768
    does for a model of 32000 tokens): the help says so rather than leave it to a guess."""
    import importlib
    text = " ".join(importlib.import_module(module).build_parser().format_help().split())
    assert "--draft-vocab N the draft model proposes only the first N token ids" in text, text
    assert "N past the vocabulary: all of it)" in text, text
