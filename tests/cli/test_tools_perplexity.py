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
