"""--llama-args with an unclosed quote (`--llama-args '"-nr'`) ended bench single, batch and spec in a
`ValueError: No closing quotation` traceback after the model had loaded (exit 1); it is a usage error, said
before any work (exit 2)."""
from __future__ import annotations

import pytest

from lumen.commands import run


@pytest.mark.parametrize("argv", [["single", "-r", "1"], ["batch", "-r", "1"], ["spec", "-r", "1"]])
def test_an_unclosed_quote_in_llama_args_is_a_usage_error(argv, monkeypatch, capsys):
    import lumen
    import lumen.model.store as store

    def no_work(*a, **kw):
        raise AssertionError("the benchmark started")
    monkeypatch.setattr(lumen, "load", no_work)
    monkeypatch.setattr(store, "resolve", no_work)
    from lumen.bench.cli import main
    assert run(main, [*argv, "--llama-args", '"-nr']) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].endswith("error: --llama-args '\"-nr': no closing quotation"), err
