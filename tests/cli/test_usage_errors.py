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
    ("lumen.chat", "python -m lumen.chat", ["--temperature", "hot"], "argument --temperature/--temp: invalid "
                                                                      "float value: 'hot'"),
], ids=["generate-unknown", "generate-not-int", "generate-exclusive", "generate-choice", "chat-unknown",
        "chat-not-float"])
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
