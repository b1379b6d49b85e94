"""`lumen perplexity` as a user runs it: its flags checked before the model loads, its exit status."""
from __future__ import annotations

import pytest

from lumen.commands import run


@pytest.fixture
def no_load(monkeypatch):
    """A model load fails the test: a usage error is said before any model loads."""
    from lumen import generate

    def load(*a, **kw):
        raise AssertionError("the model loaded")
    monkeypatch.setattr(generate, "load_model", load)


@pytest.mark.parametrize("ctx", ["16777217", "1000000000", "99999999999999999999"])
def test_a_ctx_beyond_the_largest_is_a_usage_error(ctx, tmp_path, no_load, capsys):
    """--ctx past MAX_CTX (with --force-ctx, so the trained context does not stop it first) exited 1 with
    "ctx must be an integer in [1, 16777216]" after the load started; it is a flag's value out of its range: 2."""
    from lumen import perplexity
    text = tmp_path / "t.txt"
    text.write_text("Some text to score. " * 20)
    assert run(perplexity.main, ["--file", str(text), "--ctx", ctx, "--force-ctx"]) == 2
    err = capsys.readouterr().err
    assert "--ctx must be at most 16777216" in err and "Traceback" not in err, err


def test_a_text_too_short_to_score_is_said_before_the_model_loads(smollm2_path, tmp_path, no_load, capsys):
    """An empty file loaded the weights and compiled the kernels (30 s on a first run) before it said that 0
    tokens score nothing; the tokenizer alone says it now."""
    from lumen import perplexity
    text = tmp_path / "empty.txt"
    text.write_text("")
    assert run(perplexity.main, ["--model", str(smollm2_path), "--file", str(text)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == ("error: the text has 0 tokens; at least 3 are needed to score one "
                                            "(use a longer file)"), err


def test_a_ctx_beyond_the_text_and_the_trained_one_runs_at_the_texts_length(smollm2_path, tmp_path, monkeypatch,
                                                                            capsys):
    """A text shorter than --ctx is one chunk of its own length, so --ctx 100000 on a short text needs no
    --force-ctx (SmolLM2 is trained on 8192): it was refused ("ctx=100000 is beyond the 8192 tokens ...; pass
    --force-ctx"), and with --force-ctx it allocated a KV cache of 100000 tokens for a few hundred."""
    from lumen import generate, perplexity
    seen = {}
    real = generate.load_model

    def load(name, ctx, *a, **kw):
        seen["ctx"] = ctx
        return real(name, ctx, *a, **kw)
    monkeypatch.setattr(generate, "load_model", load)
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert run(perplexity.main, ["--model", str(smollm2_path), "--file", str(text), "--ctx", "100000",
                                 "-t", "1"]) == 0
    out, err = capsys.readouterr()
    n = int(err.split("note: the text has ")[1].split()[0])
    assert seen["ctx"] == n < 8192 and "Final estimate: PPL = " in out, err
    assert f"{n} tokens, 1 chunks of {n}" in err, err


def test_a_text_longer_than_the_trained_context_is_refused_before_the_weights_load(smollm2_path, tmp_path, no_load,
                                                                                   capsys):
    from lumen import perplexity
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 1000)      # about 10000 tokens
    assert run(perplexity.main, ["--model", str(smollm2_path), "--file", str(text), "--ctx", "9000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("error: ctx=9000 is beyond the 8192 tokens this model was trained on (output past that is "
                   "unreliable); pass --force-ctx to use it anyway"), err
