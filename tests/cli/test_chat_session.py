"""`python -m lumen.chat` driven through a pipe, as a script or a user would drive it: on SmolLM2, greedy (so each
reply must be exactly what Model.generate gives for the conversation so far, rendered by the chat template; the
engine's logits are the same with or without a prefix-cache hit). Two turns where the second sees the first,
/clear, /exit, EOF; and SIGINT during a reply, which stops that reply and keeps the session. Every wait is
bounded and the tests stop what they start."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import lumen
from lumen.format.chat import chat_template_from_metadata
from lumen.generate import render_messages

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300
N = 48
STATS = re.compile(r"^prompt (\d+) tok \| TTFT \d+ ms \| .* \| (\d+) generated \((\w+)\)( \| (\d+) cached)?$")


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=2048, threads=2)


def greedy(model, messages: list[dict], max_tokens: int = N) -> tuple[str, int]:
    """The greedy reply to the conversation and its prompt's length in tokens."""
    text = render_messages(model, chat_template_from_metadata(model.metadata), messages)
    toks = list(model.generate(text, max_tokens=max_tokens, temperature=0, special=True))
    return "".join(t.text for t in toks), len(model.tokenize(text, special=True))


def chat(model_path, *args) -> list[str]:
    return [sys.executable, "-m", "lumen.chat", "--model", str(model_path), "--greedy", "-n", str(N), *args]


def stats_lines(stderr: str) -> list[re.Match]:
    return [m for m in map(STATS.match, stderr.splitlines()) if m]


def test_two_turns_clear_and_exit(smollm2_path, model):
    u1, u2 = "My name is Ada. Remember it.", "What is my name?"
    script = f"{u1}\n{u2}\n/clear\n{u2}\n/exit\nnot read: the session has ended\n"
    r = subprocess.run(chat(smollm2_path), input=script, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    a1, p1 = greedy(model, [{"role": "user", "content": u1}])
    a2, p2 = greedy(model, [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
                            {"role": "user", "content": u2}])
    a3, p3 = greedy(model, [{"role": "user", "content": u2}])
    assert a2 != a3, "the model answers the same with and without the history: the test shows nothing"
    assert r.stdout == f"{a1}\n{a2}\n{a3}\n"           # the second turn saw the first; after /clear it did not
    stats = stats_lines(r.stderr)
    assert [int(m[1]) for m in stats] == [p1, p2, p3], r.stderr
    assert int(stats[1][5] or 0) >= 16, "the second turn reused none of the first one's KV blocks"
    assert "(the conversation is cleared)" in r.stderr


def test_a_seed_seeds_the_session_not_each_turn(smollm2_path):
    """--seed seeds the session, as llama.cpp's does: the same question asked again after /clear is sampled anew
    (each turn took the seed afresh, so it got the same reply), the first reply is generate --chat --seed's, and
    the same seed replays the whole session."""
    cmd = [sys.executable, "-m", "lumen.chat", "--model", str(smollm2_path), "-n", "12", "--seed", "7",
           "--temperature", "1.0"]
    script = "Tell me about the sea.\n/clear\nTell me about the sea.\n/exit\n"
    runs = [subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
            for _ in range(2)]
    assert all(r.returncode == 0 and "Traceback" not in r.stderr for r in runs), runs[0].stderr
    first, second = runs[0].stdout.split("\n")[:2]
    assert first != second, runs[0].stdout
    assert runs[1].stdout == runs[0].stdout
    gen = subprocess.run([sys.executable, "-m", "lumen.generate", "--model", str(smollm2_path), "--chat", "-n", "12",
                          "--seed", "7", "--temperature", "1.0", "-p", "Tell me about the sea."],
                         capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert gen.returncode == 0 and gen.stdout == first + "\n", (gen.stdout, first)


def test_eof_ends_the_session(smollm2_path):
    r = subprocess.run(chat(smollm2_path), input="", capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert (r.returncode, r.stdout) == (0, "") and "Traceback" not in r.stderr, r.stderr


def test_commands_and_a_model_without_a_template(smollm2_path, tmp_path):
    r = subprocess.run(chat(smollm2_path), input="/help\n/nope\n", capture_output=True, text=True, timeout=TIMEOUT,
                       cwd=ROOT)
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert "/clear" in r.stderr and "unknown command /nope; /help lists them" in r.stderr
    from synth import write_model
    write_model(tmp_path / "tiny.gguf", "llama")
    r = subprocess.run([sys.executable, "-m", "lumen.chat", "--model", str(tmp_path / "tiny.gguf")], input="hi\n",
                       capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].endswith(
        "has no chat template (tokenizer.chat_template); use python -m lumen.generate for plain completion")


def test_max_tokens_past_the_context_is_refused_at_start(smollm2_path):
    """Every message would be refused, one error line per line typed, and the session would end with 0."""
    r = subprocess.run([*chat(smollm2_path), "-n", "4096", "--ctx", "1024"], input="hi\nhello\n", capture_output=True,
                       text=True, timeout=TIMEOUT, cwd=ROOT)
    assert (r.returncode, r.stdout) == (1, ""), r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("error: --max-tokens 4096 leaves no room for a message in the "
                                                 "context of 1024 tokens (--ctx)")


def test_a_context_past_training_is_refused_and_forced_as_generate_does(smollm2_path):
    """The refusal said "pass --force-ctx", which chat did not take ("unrecognized arguments")."""
    r = subprocess.run(chat(smollm2_path, "--ctx", "9000"), input="", capture_output=True, text=True, timeout=TIMEOUT,
                       cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].endswith("pass --force-ctx to use it anyway")
    r = subprocess.run(chat(smollm2_path, "--ctx", "9000", "--force-ctx"), input="", capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=ROOT)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), r.stderr


def test_max_tokens_minus_one_is_the_default_as_in_generate(smollm2_path):
    r = subprocess.run([*chat(smollm2_path), "-n", "-1"], input="hi\n", capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_a_reply_cut_by_the_context_says_so(smollm2_path):
    """The reply stopped mid-sentence at the context's end with only "(length)" in the figures, as if -n had cut
    it, though no -n was given."""
    cmd = [sys.executable, "-m", "lumen.chat", "--model", str(smollm2_path), "--greedy", "--ctx", "64"]
    r = subprocess.run(cmd, input="Count from 1 to 100.\n", capture_output=True, text=True, timeout=TIMEOUT,
                       cwd=ROOT)
    assert r.returncode == 0 and stats_lines(r.stderr)[-1].group(0).endswith("(length)"), r.stderr
    assert "note: the reply was cut where the context of 64 tokens ends (--ctx)" in r.stderr.splitlines(), r.stderr
    r = subprocess.run(cmd + ["-n", "4"], input="Count from 1 to 100.\n", capture_output=True, text=True,
                       timeout=TIMEOUT, cwd=ROOT)
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr


@pytest.mark.parametrize("io", ["utf-8:surrogateescape", "utf-8:strict"])
def test_a_line_that_is_not_utf8_is_refused_and_the_session_goes_on(smollm2_path, io):
    """With a strict UTF-8 stdin (a UTF-8 locale's) the line raised UnicodeDecodeError out of the session: a
    traceback, and the lines after it never read. The lines after it are answered, and piped input with a line
    that failed ends with status 1 (it ended with 0, where generate says 1 for the same text)."""
    env = {**os.environ, "PYTHONIOENCODING": io}
    r = subprocess.run(chat(smollm2_path), input=b"caf\xe9\nhi\n", capture_output=True, timeout=TIMEOUT, cwd=ROOT,
                       env=env)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert err.splitlines()[0] == "error: the text is not valid UTF-8: it holds byte 0xe9"
    assert len(stats_lines(err)) == 1 and r.stdout.strip(), err
    r = subprocess.run(chat(smollm2_path), input=b"/help\r\n", capture_output=True, timeout=TIMEOUT, cwd=ROOT, env=env)
    assert r.stderr.decode().startswith("/clear "), r.stderr                 # a CRLF line is the line


@pytest.mark.parametrize("n", ["0", "-3"])
def test_max_tokens_below_one_is_said_as_generate_says_it(smollm2_path, n):
    r = subprocess.run([sys.executable, "-m", "lumen.chat", "--model", str(smollm2_path), "-n", n], input="",
                       capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)
    assert (r.returncode, r.stderr) == (2, f"error: --max-tokens must be at least 1, got {n}; -1 generates "
                                           "until an end token or the context's end\n")      # usage


def test_a_stop_during_the_prompt_ends_the_reply_before_its_first_token(smollm2_path):
    """Ctrl-C was seen only when a token came out, so a long message's prefill ran to its end first (10 s for
    1084 tokens of the 1.5B on a busy machine). Now it is seen after each prefill chunk."""
    from lumen.chat import Conversation
    from lumen.engine.sampling.params import SamplingParams
    model = lumen.load(smollm2_path, max_model_len=512, max_num_batched_tokens=16)
    chat = Conversation(model, chat_template_from_metadata(model.metadata), system=None,
                        params=SamplingParams(max_tokens=8, temperature=0))
    asked, written = [], []
    stats = chat.reply("the cat sat on the mat " * 20, written.append, lambda: asked.append(1) or len(asked) > 1)
    assert (stats.stop_reason, stats.gen_tokens, written) == ("abort", 0, [])
    assert chat.messages[-1] == {"role": "assistant", "content": ""}
    stats = chat.reply("hi", written.append, lambda: False)                      # the session goes on
    assert stats.stop_reason in ("eos", "length") and stats.gen_tokens > 0 and written


class Session:
    """lumen.chat in a subprocess with both pipes read by threads, so the test can wait for what it printed."""

    def __init__(self, argv):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, bufsize=1, cwd=ROOT)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=self._read, args=(f, buf), daemon=True)
                        for f, buf in ((self.p.stdout, self.out), (self.p.stderr, self.err))]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(f, buf):
        while True:
            c = f.read(1)
            if not c:
                return
            buf.append(c)

    def send(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def wait_for(self, cond, what: str, timeout: float = TIMEOUT) -> None:
        t0 = time.monotonic()
        while not cond():
            assert self.p.poll() is None or cond(), f"the chat exited ({self.p.returncode}) before {what}:\n" \
                                                     f"{''.join(self.err)}"
            assert time.monotonic() - t0 < timeout, f"no {what} within {timeout} s:\n{''.join(self.err)}"
            time.sleep(0.05)

    def stats(self) -> list[re.Match]:
        return stats_lines("".join(self.err))

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)
        for t in self.readers:
            t.join(10)


def test_ctrl_c_stops_the_reply_and_keeps_the_session(smollm2_path, model):
    u1, u2 = "Tell me a long story about a dragon.", "What is the capital of France?"
    full, _ = greedy(model, [{"role": "user", "content": u1}], max_tokens=400)
    assert len(model.tokenize(full)) >= 300, "the first reply must be long, to be stopped in its course"
    s = Session(chat(smollm2_path, "-n", "400"))
    try:
        s.send(u1)
        s.wait_for(lambda: len("".join(s.out)) >= 20, "the first reply")
        s.p.send_signal(signal.SIGINT)                   # during the reply: it stops, the session stays
        s.wait_for(lambda: len(s.stats()) == 1, "the first reply's figures")
        s.send(u2)
        s.wait_for(lambda: len(s.stats()) == 2, "the second reply's figures")
        s.p.send_signal(signal.SIGINT)                   # at the prompt: the session ends
        assert s.p.wait(60) == 0, "".join(s.err)
    finally:
        s.close()
    out, err = "".join(s.out), "".join(s.err)
    assert "Traceback" not in err
    first, second = s.stats()
    assert first[3] == "abort" and int(first[2]) < 400, err
    assert second[3] in ("eos", "length"), err
    # stdout: the stopped reply (a prefix of the whole one), a newline, the second reply, a newline; the second
    # turn's prompt holds the stopped reply as the assistant's turn
    m = next(i for i, (a, b) in enumerate(zip(out, full + "\0")) if a != b)
    found = []
    for k in (m, m - 1):
        if out[k] == "\n" and out[k + 1:].strip():
            text = render_messages(model, chat_template_from_metadata(model.metadata), [
                {"role": "user", "content": u1}, {"role": "assistant", "content": out[:k]},
                {"role": "user", "content": u2}])
            found.append(len(model.tokenize(text, special=True)) == int(second[1]))
    assert any(found), (out, err)
    assert m < len(full) - 1, "the first reply was not stopped"


def test_ctrl_c_just_after_a_reply_ends_the_session(smollm2_path, monkeypatch):
    """A SIGINT landing after a reply's figures but before the next read (a busy machine delays the handler)
    raised KeyboardInterrupt out of the session: "interrupted" and status 130 instead of the prompt's end, 0."""
    import io
    from lumen import chat as chat_cli

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(chat_cli, "print_summary", interrupted)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhello\n"))
    try:
        assert chat_cli.main(["--model", str(smollm2_path), "--greedy", "-n", "2"]) == 0
    except KeyboardInterrupt:                         # (not out of the test: it would end pytest's session)
        pytest.fail("KeyboardInterrupt left the session")
