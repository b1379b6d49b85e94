"""Every command's exit status follows one rule (lumen/commands.py EXIT_STATUS, printed by `lumen --help`): 2 for a
wrong command line, said before any model loads; 1 for a run that failed (a model that cannot be found or loaded
included); 130 for Ctrl-C. A sample of each tool, in process, through commands.run as `python -m` runs them."""
import pytest

from lumen.commands import EXIT_STATUS, run


def status(module: str, argv: list[str]) -> int:
    import importlib
    return run(importlib.import_module(module).main, argv)


@pytest.mark.parametrize("module, argv, code", [
    # usage errors: a flag's value or combination
    ("lumen.generate", ["--prompt", "hi", "--temperature", "-1"], 2),
    ("lumen.generate", ["--prompt", "hi", "--threads", "0"], 2),
    ("lumen.generate", ["--prompt", "hi", "--ctx", "0"], 2),
    ("lumen.generate", ["--prompt", "hi", "--speculative", "draft"], 2),
    ("lumen.generate", ["--prompt", "hi", "--ngram-min", "2"], 2),
    ("lumen.generate", ["--prompt", "hi", "--speculative", "ngram", "--ngram-max", "0"], 2),
    ("lumen.generate", ["--prompt", "hi", "--speculative", "ngram", "--ngram-min", "3", "--ngram-max", "2"], 2),
    ("lumen.generate", ["--prompt", "hi", "--speculative", "ngram", "--draft-vocab", "0"], 2),
    ("lumen.generate", ["--prompt", "hi", "--draft-quant", "none"], 2),
    ("lumen.generate", ["--prompt", "hi", "--speculative", "ngram", "--draft-quant", "q8_0"], 2),
    ("lumen.serve.cli", ["--speculative", "draft", "--draft-model", "x", "--draft-quant", "q8"], 2),
    ("lumen.bench.cli", ["batch", "-npl", "0"], 2),
    ("lumen.bench.cli", ["batch", "--threads", "0"], 2),
    ("lumen.bench.cli", ["offline", "--max-num-seqs", "0"], 2),
    ("lumen.bench.cli", ["single", "-r", "0"], 2),
    ("lumen.profile.__main__", ["--threads", "0"], 2),
    ("lumen.profile.__main__", ["--phase", "nosuch"], 2),
    ("lumen.warmup", ["--threads", "0"], 2),
    ("lumen.models", ["--fetch", "nosuch"], 2),
    ("lumen.chat", ["--temperature", "-1"], 2),
    ("lumen.chat", ["--threads", "0"], 2),
    ("lumen.chat", ["--ctx", "0"], 2),
    ("lumen.chat", ["--ctx", "-5"], 2),
    ("lumen.perplexity", ["--file", "/etc/hostname", "--threads", "0"], 2),
    # failed runs: the model cannot be found
    ("lumen.generate", ["--prompt", "hi", "--model", "/nonexistent/m.gguf"], 1),
    ("lumen.bench.cli", ["single", "--model", "/nonexistent/m.gguf", "-r", "1"], 1),
    ("lumen.bench.cli", ["batch", "--model", "/nonexistent/m.gguf", "-r", "1"], 1),
    ("lumen.bench.cli", ["serve", "--serve-model", "/nonexistent/m.gguf"], 1),
    ("lumen.bench.cli", ["spec", "--model", "/nonexistent/m.gguf", "-r", "1"], 1),
    ("lumen.bench.cli", ["spec", "--draft-model", "/nonexistent/draft.gguf", "-r", "1"], 1),
    ("lumen.warmup", ["--model", "/nonexistent/m.gguf"], 1),
    ("lumen.perplexity", ["--file", "/nonexistent/text.txt"], 1),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_usage_errors_are_2_failed_runs_are_1(module, argv, code, capsys):
    assert status(module, argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: " in err.strip().splitlines()[-1], err


def test_interrupted_is_130(monkeypatch, capsys):
    from lumen import generate, models, warmup

    def interrupt(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(generate, "load_model", interrupt)
    assert status("lumen.generate", ["--prompt", "hi"]) == 130
    monkeypatch.setattr(warmup, "warm", interrupt)
    assert status("lumen.warmup", ["--model", "smollm2-135m"]) == 130
    monkeypatch.setattr(models, "fetch", interrupt)
    monkeypatch.setattr(models, "state", lambda name: "missing")
    assert status("lumen.models", ["--fetch", "smollm2-135m"]) == 130
    assert capsys.readouterr().err.count("interrupted") == 3


def test_the_rule_is_in_lumen_help(capsys):
    from lumen.cli import main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert EXIT_STATUS in out
    for code in ("  1 ", "  2 ", "  130 ", "  141 "):
        assert code in EXIT_STATUS


def test_interrupted_before_generating_ends_the_echoed_line(monkeypatch, capsys):
    """Ctrl-C while generate loads: "interrupted" on a line of its own after the terminal's ^C, no summary."""
    from lumen import generate

    def interrupt(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(generate, "load_model", interrupt)
    assert status("lumen.generate", ["--prompt", "hi"]) == 130
    assert capsys.readouterr().err == "\ninterrupted\n"
