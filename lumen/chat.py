"""Chat with a model in the terminal: `python -m lumen.chat [--model M] [--system TEXT] [sampling flags]`.

A conversation, as llama.cpp's llama-cli and `ollama run` hold one: each line typed is a user message, the whole
history goes through the model's chat template, the reply streams to stdout and one line of figures per reply
goes to stderr. /clear forgets the history, /exit (or EOF) ends the session, /help lists the commands. Ctrl-C
during a reply stops that reply (what was written stays in the history) and returns to the prompt; Ctrl-C at the
prompt ends the session. A line ending in a backslash continues on the next one.

The engine runs with prefix caching, so each turn recomputes only what the last one did not leave in the KV
cache (the new message and the reply's last partial block). The history is dropped oldest turn first when it
would no longer leave room for a reply in the context. Input works the same on a terminal (line editing when
Python has readline) and through a pipe (no prompt is printed there).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import signal
import sys
import time

from .commands import Parser, prog, run, threads_error
from .engine.config import THREAD_FLAGS, EngineConfig

from .errors import LumenError, plural
from .generate import (NO_LIMIT, add_sampling_args, argv_text, check_ctx, check_max_tokens, flag_words, load_model,
                       print_summary, process_escapes, render_messages, sampling_from_args, status_while_compiling,
                       summary_line)
from .model.store import DEFAULT_MODEL

HELP = """/clear   forget the conversation (the system prompt stays)
/exit    end the session (also /quit, /bye, or EOF: Ctrl-D)
/help    this list
Ctrl-C stops a reply; at the prompt it ends the session. End a line with \\ to continue it on the next."""
REPLY_ROOM = 256            # tokens a reply is sure to have when --max-tokens is not given (older turns dropped)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog=prog("chat"), description="Chat with a GGUF model in the terminal "
                                 "(multi-turn, through the model's chat template).", epilog=HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default=DEFAULT_MODEL, help="registry name (see python -m lumen.models) or "
                    f"path to a .gguf file (default {DEFAULT_MODEL})")
    ap.add_argument("--system", "-s", help="system prompt (escapes processed as in lumen.generate)")
    ap.add_argument("--max-tokens", "-n", type=int, default=None,
                    help="the most tokens of one reply (default, or -1 as llama.cpp: until the model ends its turn, or the "
                         "context's end)")
    add_sampling_args(ap, chat_only=True)
    ap.add_argument("--ctx", "--ctx-size", "-c", type=int, default=None,
                    help="context length, the whole conversation included (default 2048, or the model's trained "
                         "context if smaller; --ctx-size and -c as llama.cpp)")
    ap.add_argument("--force-ctx", action="store_true",
                    help="allow --ctx beyond the model's trained context (output past it is unreliable)")
    EngineConfig.add_cli_args(ap, only=THREAD_FLAGS)
    ap.add_argument("--no-escape", action="store_true", help="take --system literally")
    return ap


class Conversation:
    """The history and the engine that answers it. reply() streams one answer to `write` and keeps it."""

    def __init__(self, model, template: str, *, system: str | None, params):
        from .engine.engine import Engine
        from .kernels.attention import BLOCK
        self.model, self.template, self.system, self.params = model, template, system, params
        self.messages: list[dict] = []
        self.engine = Engine(model.parts, threads=model.threads, max_model_len=model.n_ctx, max_num_seqs=1,
                             max_num_batched_tokens=model.n_batch, num_kv_blocks=-(-model.n_ctx // BLOCK),
                             enable_prefix_caching=True, adaptive_threads=model.adaptive_threads)
        self.dropped = 0                            # turns dropped to fit the context, in all
        self.turns = 0                              # replies asked for (turn_params)

    def clear(self) -> None:
        self.messages = []

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        text = render_messages(self.model, self.template, head + messages)
        return self.model.tokenize(text, special=True, shielded=True)

    def fit(self, messages: list[dict]) -> list[int]:
        """The prompt of `messages`, the oldest turns dropped until a reply has room; LumenError when the last
        message alone leaves none."""
        room = self.params.max_tokens or min(REPLY_ROOM, self.model.n_ctx // 4)
        while True:
            ids = self.prompt_ids(messages)
            if len(ids) + room <= self.model.n_ctx:
                return ids
            if len(messages) <= 1:
                raise LumenError(f"the message takes {plural(len(ids), 'token')}: with {room} for the reply that "
                                 f"exceeds the context of {plural(self.model.n_ctx, 'token')} (--ctx)")
            messages[:] = messages[2:] if messages[1]["role"] == "assistant" else messages[1:]
            self.dropped += 1

    def turn_params(self):
        """The next reply's SamplingParams. A given seed seeds the session, as llama.cpp seeds its sampler once: the
        first reply takes it as it is (as `generate --chat --seed` does), each later one a seed drawn from it and
        the turn's number, so the same seed replays the session and no two turns sample with the same numbers."""
        p, turn = self.params, self.turns
        self.turns += 1
        if p.seed is None or turn == 0:
            return p
        import numpy as np
        seed = int(np.random.SeedSequence([p.seed, turn]).generate_state(1, np.uint64)[0] >> np.uint64(1))
        return dataclasses.replace(p, seed=seed)

    def reply(self, text: str, write, stop_requested) -> object:
        """Answer the user's `text`: the reply's text goes to write() as it comes; stop_requested() true after
        an engine step (a token, or a chunk of the prompt) aborts the request. Returns the RequestMetrics of the
        reply (stop_reason "abort" if stopped)."""
        from .engine.sequence import RequestMetrics
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.fit(messages)
        stats = RequestMetrics()
        answer = []
        stream = self.engine.stream(ids, self.turn_params(), metrics=stats,
                                    stop=stop_requested)    # (asked every step: a prompt's chunks too)
        try:
            for out in stream:
                if out.error:
                    raise LumenError(out.error)
                if out.delta_text:
                    answer.append(out.delta_text)
                    write(out.delta_text)
        finally:
            stream.close()                          # aborts the request if it has not finished
        self.messages = messages + [{"role": "assistant", "content": "".join(answer)}]
        return stats


class Input:
    """Lines from stdin: with a prompt and line editing on a terminal, plain reads through a pipe. A line ending
    in a backslash continues on the next. None at EOF."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdin or io.StringIO()   # (None: started with stdin closed, read as EOF)
        self.tty = self.stream.isatty()
        if self.tty:
            try:                                     # input() edits lines and keeps a history when it is there
                importlib.import_module("readline")
            except ImportError:
                pass

    def _readline(self) -> str:
        """One line through a pipe. Read as bytes where the stream has them: a strict UTF-8 stdin (a UTF-8 locale's)
        raised UnicodeDecodeError on a line that is not UTF-8 and lost the rest of its chunk; its bad bytes are
        kept as surrogates instead, so the message is refused as in any other locale and the session goes on."""
        buffer = getattr(self.stream, "buffer", None)
        if buffer is None:
            return self.stream.readline()
        line = buffer.readline().decode("utf-8", "surrogateescape")
        return line[:-2] + "\n" if line.endswith("\r\n") else line      # (as a text stream reads it)

    def line(self) -> str | None:
        parts = []
        while True:
            if self.tty:
                try:
                    got = input("> " if not parts else ". ")
                except EOFError:
                    return None if not parts else "\n".join(parts)
            else:
                got = self._readline()
                if not got:
                    return None if not parts else "\n".join(parts)
                got = got[:-1] if got.endswith("\n") else got
            if got.endswith("\\"):
                parts.append(got[:-1])
                continue
            parts.append(got)
            return "\n".join(parts)


class StopFlag:
    """SIGINT while a reply runs sets the flag (the reply stops between two tokens, the engine left in a sound
    state) instead of raising KeyboardInterrupt somewhere in the engine's step."""

    def __init__(self):
        self.set = False

    def __enter__(self):
        self.set = False
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, sig, frame):
        self.set = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)
        return False


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.system = argv_text(args.system)
    from rich.console import Console
    err = Console(stderr=True, highlight=False)
    from .engine.sampling.params import SamplingParams
    try:                                                 # the flags' values: usage errors, before the model loads
        if check_max_tokens(args.max_tokens) == NO_LIMIT:     # as generate says it (SamplingParams adds "or None")
            args.max_tokens = None                       # (this one's default)
        params = SamplingParams(max_tokens=args.max_tokens, **sampling_from_args(args, chat=True))
        if why := threads_error(args.threads):
            raise ValueError(why)
        check_ctx(args.ctx)
    except ValueError as e:
        print(f"error: {flag_words(str(e), ap)}", file=sys.stderr)
        return 2
    try:
        from .format.chat import chat_template_from_metadata
        system = args.system if args.no_escape or args.system is None else process_escapes(args.system)
        with status_while_compiling(err):
            t0 = time.perf_counter()
            model = load_model(args.model, args.ctx, args.threads, args.force_ctx,
                               adaptive_threads=args.adaptive_threads)
            if args.max_tokens is not None and args.max_tokens >= model.n_ctx:       # no message would ever fit
                raise LumenError(f"--max-tokens {args.max_tokens} leaves no room for a message in the context of "
                                 f"{model.n_ctx} tokens (--ctx)")
            template = chat_template_from_metadata(model.metadata)
            if template is None:
                raise LumenError(f"{args.model} has no chat template (tokenizer.chat_template); use "
                                 "python -m lumen.generate for plain completion")
            chat = Conversation(model, template, system=system, params=params)
            chat.engine.generate([[0]], SamplingParams(max_tokens=1, temperature=0))   # compile (or load) now
        t_load = time.perf_counter() - t0
    except (LumenError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    reader = Input()
    if reader.tty:
        err.print(f"[dim]{args.model} ready in {t_load:.1f} s; /help for the commands[/]", soft_wrap=True)
    out = sys.stdout

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    failed = False                                   # a line that failed: status 1 at the end of piped input
    try:                                             # Ctrl-C outside a reply (StopFlag's) is at the prompt,
        while True:                                  # even just after a reply's figures: the session ends
            try:
                text = reader.line()
            except UnicodeDecodeError as e:              # a terminal's strict UTF-8 input(): the line is refused
                print(f"error: the line is not valid UTF-8 ({e.reason})", file=sys.stderr, flush=True)
                failed = True
                continue
            if text is None:                             # EOF
                if reader.tty:
                    print(file=sys.stderr)
                return int(failed and not reader.tty)
            command = text.strip()
            if not command:
                continue
            if command in ("/exit", "/quit", "/bye"):
                return int(failed and not reader.tty)
            if command == "/clear":
                chat.clear()
                print("(the conversation is cleared)", file=sys.stderr, flush=True)
                continue
            if command in ("/help", "/?"):
                print(HELP, file=sys.stderr, flush=True)
                continue
            if command.startswith("/") and " " not in command:
                print(f"unknown command {command}; /help lists them", file=sys.stderr, flush=True)
                continue
            dropped = chat.dropped
            try:
                with StopFlag() as stop:
                    stats = chat.reply(text, write, lambda: stop.set)
            except (LumenError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                failed = True
                continue
            write("\n")
            if args.max_tokens is None and stats.stop_reason == "length":   # (with -n, fit() left the room for it)
                print(f"note: the reply was cut where the context of {model.n_ctx} tokens ends (--ctx)",
                      file=sys.stderr, flush=True)
            if chat.dropped > dropped:
                print(f"note: the {chat.dropped - dropped} oldest turn(s) dropped to fit the context of "
                      f"{model.n_ctx} tokens", file=sys.stderr, flush=True)
            cached = f" | {stats.cached_tokens} cached" if stats.cached_tokens else ""
            print_summary(err, summary_line(stats) + cached)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(run(main))
