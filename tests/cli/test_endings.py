"""How a command line ends when its user ends it early: its output piped to a reader that goes away (`| head`)
and Ctrl-C. Either way: no traceback, the shell's exit status (141 for SIGPIPE, 130 for SIGINT)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from lumen.commands import run


def run_to_closed_pipe(*args: str, unbuffered: bool) -> subprocess.CompletedProcess:
    """`python -m args` with stdout a pipe whose reader has already gone (as `| head` once it has its lines)."""
    r, w = os.pipe()
    os.close(r)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    try:
        return subprocess.run([sys.executable, "-m", *args], stdout=w, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=300)
    finally:
        os.close(w)


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("args", [("lumen", "--help"), ("lumen", "generate", "--help"), ("lumen.generate", "--help"),
                                  ("lumen.bench", "batch", "--help"), ("lumen.models",), ("lumen.gguf", "--help"),
                                  ("lumen.warmup", "--help"), ("lumen.serve", "--help"), ("lumen.profile", "--help")],
                         ids=["lumen", "lumen generate", "lumen.generate", "lumen.bench", "lumen.models", "lumen.gguf",
                              "lumen.warmup", "lumen.serve", "lumen.profile"])
def test_help_into_a_closed_pipe_ends_quietly(args, unbuffered):
    """Quiet; the status is 141, or argparse's 0 (it drops a help it cannot write); rich's 1 is made 141."""
    p = run_to_closed_pipe(*args, unbuffered=unbuffered)
    assert p.returncode in (0, 141), p.stderr
    assert p.stderr == "", p.stderr


@pytest.mark.parametrize("args", [("lumen.gguf", "{model}"), ("lumen.models",)], ids=["gguf", "models"])
def test_a_table_into_a_closed_pipe_is_141(args, smollm2_path):
    """`lumen gguf M | head -1` ended 1, the status of a failed run: rich ends a print whose reader has gone with
    SystemExit(1). EXIT_STATUS says 141, as for generate."""
    p = run_to_closed_pipe(*[a.format(model=smollm2_path) for a in args], unbuffered=False)
    assert p.returncode == 141 and p.stderr == "", (p.returncode, p.stderr)


def test_generation_into_a_closed_pipe_ends_quietly(smollm2_path):
    p = run_to_closed_pipe("lumen.generate", "-m", str(smollm2_path), "-p", "Once upon a time", "-n", "8",
                           "--ignore-eos", unbuffered=False)
    assert p.returncode == 141, p.stderr
    assert "Traceback" not in p.stderr and "error" not in p.stderr and "Broken pipe" not in p.stderr, p.stderr


def test_ctrl_c_in_perplexity_is_one_line(smollm2_path, tmp_path):
    """Ctrl-C while perplexity scores its chunks: "interrupted" and status 130, as generate ends."""
    text = tmp_path / "long.txt"
    text.write_text("\n".join(map(str, range(20000))))
    p = subprocess.Popen([sys.executable, "-m", "lumen.perplexity", "-m", str(smollm2_path), "-f", str(text)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in p.stderr:                            # the chunk count comes just before the first chunk runs
            seen.append(line)
            if "chunks of" in line:
                break
        assert "chunks of" in "".join(seen), "".join(seen)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and err.strip().endswith("interrupted"), err


def test_run_turns_endings_into_statuses():
    def interrupted(argv):
        raise KeyboardInterrupt

    def usage_error(argv):
        raise SystemExit(2)

    assert run(interrupted) == 130
    assert run(usage_error) == 2
    assert run(lambda argv: 0) == 0
    assert run(lambda argv: None) is None             # sys.exit(None): status 0


def test_a_closed_stdin_is_no_prompt(smollm2_path):
    """Started with stdin closed (`<&-`, some service managers), Python's sys.stdin is None: generate asks for a
    prompt and chat ends as at EOF, where both raised AttributeError."""
    def closed_stdin():
        os.close(0)

    r = subprocess.run([sys.executable, "-m", "lumen.generate", "-m", str(smollm2_path), "-n", "4"],
                       preexec_fn=closed_stdin, capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stderr) == (2, "error: give --prompt TEXT, --file FILE or pipe the prompt on stdin\n")
    r = subprocess.run([sys.executable, "-m", "lumen.chat", "-m", str(smollm2_path), "-n", "4"],
                       preexec_fn=closed_stdin, capture_output=True, text=True, timeout=300)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), r.stderr


def test_a_closed_stdout_is_written_nowhere(smollm2_path):
    """Started with stdout closed (`>&-`) generate raised "'NoneType' object has no attribute 'write'"; the text
    now goes nowhere, as to /dev/null, and the summary line still comes on stderr."""
    r = subprocess.run([sys.executable, "-m", "lumen.generate", "-m", str(smollm2_path), "-p", "Hi", "-n", "2"],
                       preexec_fn=lambda: os.close(1), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "generated" in r.stderr, r.stderr


def test_ctrl_c_in_generate_keeps_the_text_and_its_figures(smollm2_path):
    """Ctrl-C while generate decodes: the text so far ends its line, the summary line says how far it got, then
    "interrupted" and status 130; it was "interrupted" alone, the figures lost."""
    p = subprocess.Popen([sys.executable, "-m", "lumen.generate", "-m", str(smollm2_path), "-p", "Once upon a time",
                          "-n", "-1", "--ignore-eos"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        first = os.read(p.stdout.fileno(), 64)           # the first tokens are out: it is decoding
        assert first, p.stderr.read()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    out, err = (first + out).decode(), err.decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and err.strip().endswith("interrupted"), err
    assert out.strip() and out.endswith("\n"), out
    summary = [line for line in err.splitlines() if " generated (" in line]
    assert len(summary) == 1 and summary[0].startswith("prompt ") and "generated (interrupted) | load" in summary[0]
    assert int(summary[0].split(" generated (")[0].rsplit("| ", 1)[1]) >= 1, summary
