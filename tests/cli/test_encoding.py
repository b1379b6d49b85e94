"""A terminal or pipe whose encoding cannot write all text (PYTHONIOENCODING=ascii, a Latin-1 locale): the text
the model generates is printed with backslash escapes for what it cannot encode, status 0, never a
UnicodeEncodeError halfway through the reply."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from lumen.commands import run


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])     # (surrogateescape: an uncoerced C locale's)
@pytest.mark.parametrize("encoding, want", [("ascii", b"caf\\xe9 \\u65e5\n"), ("latin-1", b"caf\xe9 \\u65e5\n"),
                                            ("utf-8", "café 日\n".encode())])
def test_run_escapes_what_stdout_cannot_encode(monkeypatch, encoding, want, errors):
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding=encoding, errors=errors)
    monkeypatch.setattr(sys, "stdout", out)
    assert run(lambda argv: print("café 日") or 0) == 0
    assert raw.getvalue() == want


@pytest.mark.parametrize("env", [{"PYTHONIOENCODING": "ascii"}, {"PYTHONIOENCODING": "latin-1"},
                                 {"LANG": "C", "LC_ALL": "C"},
                                 {"LANG": "C", "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}],
                         ids=["ascii", "latin-1", "C-locale", "C-locale-uncoerced"])
def test_generate_prints_what_the_terminal_cannot_encode_escaped(smollm2_path, env):
    """`--choice` makes the reply non-ASCII whatever the model would say."""
    r = subprocess.run([sys.executable, "-m", "lumen.generate", "-m", str(smollm2_path), "-p", "Say café:",
                        "--choice", "café 日本", "-n", "20"], capture_output=True, stdin=subprocess.DEVNULL,
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **env}, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert r.stdout in (b"caf\\xe9 \\u65e5\\u672c\n", b"caf\xe9 \\u65e5\\u672c\n", "café 日本\n".encode()), r.stdout
    assert b"Traceback" not in r.stderr and b"generated" in r.stderr


def test_a_prompt_on_stdin_is_utf8_whatever_the_locale(smollm2_path):
    """Under PYTHONIOENCODING=ascii `printf 'café' | lumen generate` said "the prompt on stdin is not valid
    UTF-8", and under latin-1 the prompt was "cafÃ©"; stdin is read as UTF-8 bytes, as --file is."""
    from lumen.generate import read_stdin_prompt
    for encoding in ("ascii", "latin-1", "utf-8"):
        stream = io.TextIOWrapper(io.BytesIO("Say café 日本\n".encode()), encoding=encoding)
        assert read_stdin_prompt(stream) == "Say café 日本"
    with pytest.raises(ValueError, match=r"^the prompt on stdin is not valid UTF-8 \(invalid start byte at byte 2\)$"):
        read_stdin_prompt(io.TextIOWrapper(io.BytesIO(b"ab\xff"), encoding="ascii"))
    assert read_stdin_prompt(io.StringIO("text\n")) == "text"                    # a stream without bytes
    r = subprocess.run([sys.executable, "-m", "lumen.generate", "-m", str(smollm2_path), "-n", "1"],
                       input="Say café".encode(), capture_output=True, timeout=300,
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONIOENCODING": "ascii"})
    import lumen
    n = len(lumen.load(smollm2_path, ctx=64, threads=1).tokenize("Say café"))
    assert r.returncode == 0 and f"prompt {n} tok |".encode() in r.stderr, r.stderr


def test_argv_text_is_utf8_under_a_c_locale_without_utf8_mode(smollm2_path):
    """LC_ALL=C with PYTHONUTF8=0: Python decoded argv as ASCII, so -p "café" was refused ("the text is not valid
    UTF-8: it holds byte 0xc3") though its bytes are UTF-8; they are decoded as UTF-8 again. Bytes that are not
    UTF-8 are still refused."""
    from lumen.generate import argv_text
    assert argv_text("caf\udcc3\udca9") == "café" and argv_text(["a", "\udcc3\udca9"]) == ["a", "é"]
    assert argv_text("ab\udcff") == "ab\udcff" and argv_text(None) is None and argv_text("日本") == "日本"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0",
           "PYTHONCOERCECLOCALE": "0"}
    r = subprocess.run([sys.executable, "-m", "lumen.generate", "-m", str(smollm2_path), "-p", "Say café:",
                        "--choice", "café", "--stop", "é", "-n", "8"], capture_output=True, timeout=300,
                       stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"caf\n", r.stdout                       # the stop string "é" ends it
    r = subprocess.run([sys.executable, "-m", "lumen.generate", "-m", str(smollm2_path), "-p", b"ab\xff", "-n", "1"],
                       capture_output=True, timeout=300, stdin=subprocess.DEVNULL, env=env)
    assert (r.returncode, r.stderr) == (1, b"error: the text is not valid UTF-8: it holds byte 0xff\n")
