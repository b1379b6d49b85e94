"""A wrong command line is one line on stderr, `prog: error: message`, status 2, and no traceback; argparse's
whole usage came first (20 lines for generate), the error last."""
from __future__ import annotations

import pytest

from lumen.commands import run


@pytest.mark.parametrize("module, prog, argv, message", [
    ("lumen.generate", "python -m lumen.generate", ["--bogus"], "unrecognized arguments: --bogus"),
    ("lumen.generate", "python -m lumen.generate", ["-p", "hi", "-n", "many"],
     "argument --max-tokens/-n: invalid int value: 'many'"),
    ("lumen.generate", "python -m lumen.generate", ["-p", "a", "-f", "b"],
     "argument --file/-f: not allowed with argument --prompt/-p"),
    ("lumen.generate", "python -m lumen.generate", ["-p", "a", "--speculative", "maybe"],
     "argument --speculative: invalid choice: 'maybe' (choose from ngram, draft)"),
    ("lumen.chat", "python -m lumen.chat", ["--bogus"], "unrecognized arguments: --bogus"),
    ("lumen.perplexity", "python -m lumen.perplexity", ["--bogus"], "unrecognized arguments: --bogus"),
    ("lumen.perplexity", "python -m lumen.perplexity", [], "the following arguments are required: --file/-f"),
    ("lumen.chat", "python -m lumen.chat", ["--temperature", "hot"], "argument --temperature/--temp: invalid "
                                                                      "float value: 'hot'"),
], ids=["generate-unknown", "generate-not-int", "generate-exclusive", "generate-choice", "chat-unknown",
        "perplexity-unknown", "perplexity-no-file", "chat-not-float"])
def test_a_wrong_command_line_is_one_line(module, prog, argv, message, capsys):
    import importlib
    assert run(importlib.import_module(module).main, argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.replace("'ngram', 'draft'", "ngram, draft") == f"{prog}: error: {message}\n"


@pytest.mark.parametrize("module, argv", [
    ("lumen.serve.cli", ["--bogus"]), ("lumen.bench.cli", ["batch", "--bogus"]), ("lumen.bench.cli", ["--bogus"]),
    ("lumen.bench.cli", ["spec", "--bogus"]), ("lumen.bench.cli", ["offline", "--bogus"]),
    ("lumen.bench.cli", ["serve", "--bogus"]), ("lumen.profile.__main__", ["--bogus"]), ("lumen.models", ["--bogus"]),
    ("lumen.perplexity", ["--bogus"]), ("lumen.gguf", []), ("lumen.warmup", ["--bogus"])],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_every_tool_says_a_wrong_command_line_in_one_line(module, argv, capsys):
    import importlib
    assert run(importlib.import_module(module).main, argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and ": error: " in err, err


def test_help_of_an_unknown_command_is_a_usage_error(capsys):
    """`lumen help nosuch` printed the general help, status 0, as if the command existed."""
    from lumen.cli import main
    assert main(["help", "nosuch"]) == 2
    assert "unknown command 'nosuch'" in capsys.readouterr().err
    assert main(["help", "models"]) == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("module, argv, code, message", [
    ("lumen.generate", ["-p", "hi", "--json-schema", "{missing}"], 2,
     "error: --json-schema {missing}: cannot read it (No such file or directory)"),
    ("lumen.generate", ["-p", "hi", "--grammar", "{latin1}"], 2,
     "error: --grammar {latin1} is not valid UTF-8 (invalid continuation byte at byte 3)"),
    ("lumen.generate", ["-p", "hi", "--tools", "{missing}"], 2,
     "error: --tools {missing}: cannot read it (No such file or directory)"),
    ("lumen.perplexity", ["--file", "{missing}"], 1, "error: --file {missing}: cannot read it (No such file or "
                                                      "directory)"),
    ("lumen.perplexity", ["--file", "{latin1}"], 1,
     "error: --file {latin1} is not valid UTF-8 (invalid continuation byte at byte 3)"),
    ("lumen.perplexity", ["--file", "{latin1}", "--ctx", "1"], 2,
     "python -m lumen.perplexity: error: --ctx must be at least 4 (2 with --score all), got 1"),
], ids=["schema-missing", "grammar-latin1", "tools-missing", "perplexity-missing", "perplexity-latin1",
        "perplexity-ctx"])
def test_an_unreadable_file_is_said_once(module, argv, code, message, tmp_path, capsys):
    """The reason once, as --file says it: these said Python's "[Errno 2] No such file or directory: 'x'" after
    the file's name."""
    import importlib
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    names = {"missing": str(tmp_path / "missing.txt"), "latin1": str(tmp_path / "latin1.txt")}
    argv = [a.format(**names) for a in argv]
    assert run(importlib.import_module(module).main, argv) == code
    out, err = capsys.readouterr()
    assert err == message.format(**names) + "\n", err


def test_a_tools_file_with_no_tools_names_the_file(tmp_path, capsys):
    """An empty list said "--tool-choice: tool_choice 'auto' needs tools", naming a flag not given."""
    from lumen.generate import main
    f = tmp_path / "tools.json"
    f.write_text("[]")
    assert run(main, ["-p", "hi", "--tools", str(f)]) == 2
    assert capsys.readouterr().err == f"error: --tools {f}: the list holds no tools\n"


@pytest.mark.parametrize("argv, prog", [(["-m", "lumen", "generate"], "python -m lumen generate"),
                                        (["-m", "lumen.generate"], "python -m lumen.generate"),
                                        (["-m", "lumen", "bench", "batch"], "python -m lumen bench batch")])
def test_usage_names_the_command_as_typed(argv, prog):
    """`python -m lumen generate --bogus` said "python -m lumen.generate: error: ...", a command not typed."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, *argv, "--bogus"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == f"{prog}: error: unrecognized arguments: --bogus\n", r.stderr


@pytest.mark.parametrize("value, expected", [("-1e300", -1e300), ("-2.5E-3", -2.5e-3), ("-.5", -0.5), ("-3", -3.0),
                                             ("-inf", float("-inf")), ("-Infinity", float("-inf"))])
def test_a_negative_number_in_any_float_spelling_is_a_value(value, expected):
    """argparse's pattern for a negative number has no exponent and no inf: `--frequency-penalty -1e300` was
    "expected one argument". Now it is the value (and then checked like any other: -inf is refused by the sampler's
    check with its own message)."""
    from lumen.generate import build_parser
    args = build_parser().parse_args(["-p", "x", "--frequency-penalty", value])
    assert args.frequency_penalty == expected


def test_a_negative_number_that_is_not_a_number_stays_a_flag(capsys):
    from lumen.generate import main
    assert run(main, ["-p", "x", "--frequency-penalty", "-nope"]) == 2
    assert "expected one argument" in capsys.readouterr().err
