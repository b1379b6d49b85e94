"""Generate text: `python -m lumen.generate --prompt "..." [--chat] [--model NAME_OR_PATH] [sampling flags]`.

Streams the text to stdout as it is produced and prints one summary line to stderr: prompt tokens, TTFT,
prefill tok/s, decode tok/s, TPOT (rich-formatted when stderr is a terminal).

Structured output: --json-schema FILE, --regex R, --grammar FILE (Lark or GBNF) or --choice TEXT (repeated)
constrain the text (lumen.engine.structured); a file or value that is not valid is an error before the model
loads (exit code 2, as for other misuse).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

from .errors import LumenError, plural
from .format.tokenizer import check_unicode
from .model.store import DEFAULT_MODEL
from .commands import Parser, prog, run, threads_error, trained_context_only
from .engine.config import (DRAFT_QUANT_FLAGS, THREAD_FLAGS, EngineConfig, SpeculativeConfig, check_int,
                            draft_quant_flag)

ESCAPES = {ord(k): ord(v) for k, v in (("n", "\n"), ("r", "\r"), ("t", "\t"), ("'", "'"), ('"', '"'), ("\\", "\\"))}
HEX_DIGITS = b"0123456789abcdefABCDEF"
EPILOG = r"""escapes: in --prompt, --system and --stop, \n \r \t \' \" \\ and \xHH (a byte) are replaced as
llama.cpp does, so --stop "\n\n" stops at a blank line; any other backslash is kept as typed. --no-escape
takes the text literally. A prompt read from --file or stdin is taken as is, less one trailing newline (as
llama.cpp does for a prompt file), so `echo "def f(x):" | ...` continues the line echo wrote.

sampling: plain generation is greedy by default. With --chat the defaults are those of llama.cpp's chat and
ollama: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.1 over the last 64 tokens; each
flag given overrides its default. --greedy makes it greedy (temperature 0, no repeat penalty);
--temperature 0 alone keeps the penalty."""


def argv_text(text):
    """A command-line argument as the user typed it: under a C locale without UTF-8 mode (PYTHONUTF8=0) Python
    decodes argv as ASCII and escapes each other byte (surrogateescape), so "café" came as "caf\\udcc3\\udca9" and
    was refused as not UTF-8; its bytes are decoded as UTF-8 again. Bytes that are not UTF-8 stay escaped (and
    are refused where the text is used). None and lists (repeated flags) are mapped through."""
    if isinstance(text, list):
        return [argv_text(t) for t in text]
    if not isinstance(text, str) or all(c < "\udc80" or c > "\udcff" for c in text):
        return text
    try:
        return os.fsencode(text).decode("utf-8")
    except (UnicodeError, ValueError):
        return text


def process_escapes(text: str) -> str:
    r"""llama.cpp's string_process_escapes (common/common.cpp): \n \r \t \' \" \\ become the character and \xHH
    the byte 0xHH; any other backslash (\a, \b and other unknown escapes, \x without two hex digits, a trailing
    backslash) is kept. Works on the UTF-8 bytes, so \xc3\xa9 is "é"; ValueError if the text or the bytes made are
    not valid UTF-8."""
    check_unicode(text)                                  # argv's undecodable bytes: not the escapes' fault
    src = text.encode("utf-8")
    out = bytearray()
    i = 0
    while i < len(src):
        if src[i] != ord("\\") or i + 1 == len(src):
            out.append(src[i])
            i += 1
        elif src[i + 1] in ESCAPES:
            out.append(ESCAPES[src[i + 1]])
            i += 2
        elif src[i + 1] == ord("x") and i + 3 < len(src) and all(c in HEX_DIGITS for c in src[i + 2:i + 4]):
            out.append(int(src[i + 2:i + 4], 16))
            i += 4
        else:
            out += src[i:i + 2]
            i += 2
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the escapes in {text!r} make bytes that are not UTF-8 ({e.reason}); "
                         "use --no-escape to take the text literally") from e


DEFAULT_MAX_TOKENS = 128
NO_LIMIT = -1               # --max-tokens -1: until an end token or the context's end (llama.cpp's -n -1)


def check_max_tokens(n: int | None) -> int | None:
    """--max-tokens as given: None (not given), NO_LIMIT or a positive count; ValueError for any other value."""
    if n is not None and n != NO_LIMIT:
        try:
            check_int("max_tokens", n)                   # 0 would generate nothing and print a line of zeros
        except ValueError as e:
            raise ValueError(f"{e}; {NO_LIMIT} generates until an end token or the context's end") from None
    return n

def flag_words(message: str, ap: argparse.ArgumentParser) -> str:
    """A flag's value error from the sampler or the engine, as the command line's user reads it: the keyword that
    starts it (top_p, seed) as its flag (--top-p, --seed), and no Python None (a flag left out is its default;
    --seed -1 is a fresh seed)."""
    name, _, rest = message.partition(" ")
    flag = next((o for a in ap._actions if a.dest == name for o in a.option_strings if o.startswith("--")), None)
    if flag is None:
        return message
    if name == "stop":                                   # (the list it was given is the API's word)
        return "--stop must not be empty"
    none = "must be -1 (a fresh seed) or " if name == "seed" else "must be "
    return f"{flag} {rest.replace('must be None or ', none)}"


def check_ctx(ctx: int | None) -> None:
    """--ctx as given: None (not given) or 1 .. the most positions Lumen holds; ValueError otherwise (a usage error,
    said before the model loads)."""
    if ctx is not None:
        from .llm import MAX_CTX
        check_int("ctx", ctx, hi=MAX_CTX)


# Sampling defaults: plain completion is greedy; a chat gets what llama.cpp's and ollama's users get (llama.cpp's
# temperature, top-k, top-p and min-p; ollama's repeat penalty over the last 64 tokens), since greedy decoding
# of a small chat model loops on one phrase until the token limit.
PLAIN_SAMPLING = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, presence_penalty=0.0,
                      frequency_penalty=0.0, repeat_last_n=64)
CHAT_SAMPLING = dict(PLAIN_SAMPLING, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1)


def add_sampling_args(ap: argparse.ArgumentParser, chat_only: bool = False) -> None:
    """The sampling flags, their defaults left None so sampling_from_args can pick plain or chat defaults.
    chat_only: the help states the chat defaults alone (lumen.chat)."""
    def default(name: str, off: str = "") -> str:
        c, p = CHAT_SAMPLING[name], PLAIN_SAMPLING[name]
        if chat_only or c == p:
            return f"default {c}{off}"
        return f"default {p}{off}; {c} with --chat"
    ap.add_argument("--temperature", "--temp", type=float, default=None, help=f"0 = greedy ({default('temperature')})")
    ap.add_argument("--top-k", type=int, default=None, help=default("top_k", ", 0 = off"))
    ap.add_argument("--top-p", type=float, default=None, help=default("top_p", ", 1 = off"))
    ap.add_argument("--min-p", type=float, default=None, help=default("min_p", ", 0 = off"))
    ap.add_argument("--repeat-penalty", type=float, default=None, help=default("repeat_penalty", ", 1 = off"))
    ap.add_argument("--presence-penalty", type=float, default=None, help=default("presence_penalty"))
    ap.add_argument("--frequency-penalty", type=float, default=None, help=default("frequency_penalty"))
    ap.add_argument("--repeat-last-n", type=int, default=None,
                    help=default("repeat_last_n") + ": tokens the penalties look back over (-1 = all)")
    ap.add_argument("--greedy", action="store_true",
                    help="always the most likely token: temperature 0, and no repeat penalty unless one is given")
    ap.add_argument("--seed", type=int, default=None,
                    help="seed of the sampler (default, or -1 as llama.cpp: fresh entropy)")


def sampling_from_args(args, chat: bool) -> dict:
    """Model.generate's sampling keywords: each flag given, else the chat or plain default (--greedy: the plain
    ones, which are greedy); ValueError for --greedy with a temperature above 0."""
    if args.greedy and args.temperature:                  # (0 agrees; another temperature would sample)
        raise ValueError(f"--greedy is temperature 0: drop it or --temperature {args.temperature:g}")
    base = PLAIN_SAMPLING if args.greedy or not chat else CHAT_SAMPLING
    out = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    return dict(out, seed=None if args.seed == -1 else args.seed)      # (-1: llama.cpp's "random")


def read_stdin_prompt(stream) -> str:
    """A prompt piped on stdin, as is but for one trailing newline (as llama.cpp reads a prompt file, -f): echo
    and a file's last line end in one the user did not mean as part of the prompt. Read as UTF-8 bytes where the
    stream has them, whatever the locale's encoding (an ASCII one refused "café"; a Latin-1 one made it "cafÃ©"),
    as --file reads."""
    buffer = getattr(stream, "buffer", None)
    try:
        text = stream.read() if buffer is None else buffer.read().decode("utf-8")
    except UnicodeDecodeError as e:                      # (a strict UTF-8 stdin; a C locale's escapes the bytes)
        at = f" at byte {e.start}" if buffer is not None else ""
        raise ValueError(f"the prompt on stdin is not valid UTF-8 ({e.reason}{at})") from None
    return without_last_newline(text)


def read_prompt_file(path: str) -> str:
    """The prompt of --file: the file's text as is (its bytes, no newline translation) but for one trailing
    newline, as llama.cpp's -f; UsageError when it cannot be read, ValueError when it is not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"--file {path}: cannot read it ({e.strerror or e})") from None
    try:
        return without_last_newline(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"the prompt file {path} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def without_last_newline(text: str) -> str:
    if text.endswith("\n"):
        text = text[:-2] if text.endswith("\r\n") else text[:-1]
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog=prog("generate"), description="Generate text with a GGUF model.",
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default=DEFAULT_MODEL,
                    help=f"registry name (see python -m lumen.models) or path to a .gguf file "
                         f"(default {DEFAULT_MODEL})")
    given = ap.add_mutually_exclusive_group()
    given.add_argument("--prompt", "-p", help="the prompt (escapes processed); when neither it nor --file is given, "
                                              "read from stdin as is but for one trailing newline")
    given.add_argument("--file", "-f", metavar="FILE", help="read the prompt from FILE, as is but for one trailing "
                                                            "newline (llama.cpp's -f)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (and sample "
                    "as llama.cpp and ollama do, below; --greedy for greedy)")
    ap.add_argument("--system", help="system message in chat mode (escapes processed)")
    ap.add_argument("--max-tokens", "-n", type=int, default=None,
                    help=f"the most tokens to generate (default {DEFAULT_MAX_TOKENS}, or fewer where the context ends; "
                         f"{NO_LIMIT}: until an end token or the context's end, as llama.cpp)")
    add_sampling_args(ap)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable; escapes processed)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="keep generating past end-of-generation tokens (for fixed-length benchmarks)")
    ap.add_argument("--no-escape", action="store_true",
                    help="take --prompt, --system and --stop literally (no escape processing)")
    ap.add_argument("--ctx", "--ctx-size", "-c", type=int, default=None,
                    help="context length to allocate (default 2048, or the model's trained context if smaller; "
                         "--ctx-size and -c as llama.cpp)")
    ap.add_argument("--force-ctx", action="store_true",
                    help="allow --ctx beyond the model's trained context (output past it is unreliable)")
    EngineConfig.add_cli_args(ap, only=THREAD_FLAGS)
    ap.add_argument("--special", action="store_true",
                    help="parse special-token text in the prompt (fill-in-the-middle markers, say); with --chat in "
                         "the messages too, where it is otherwise text")
    sp = ap.add_argument_group("speculative decoding (greedy output is identical; sampled output has the same "
                               "distribution)")
    sp.add_argument("--speculative", choices=["ngram", "draft"],
                    help="draft tokens by prompt lookup (ngram) or with --draft-model, verified in one pass")
    sp.add_argument("--draft-model", help="a model sharing the target's vocabulary (registry name or .gguf path)")
    sp.add_argument("--num-speculative-tokens", type=int, default=None,
                    help="the most tokens drafted per step (default 5; the engine adapts k to the acceptance)")
    sp.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram the lookup matches (default 1)")
    sp.add_argument("--ngram-max", type=int, default=4, help="longest n-gram the lookup matches (default 4)")
    sp.add_argument("--draft-vocab", type=int, default=32768, metavar="N",
                    help="the draft model proposes only the first N token ids (default 32768; N past the "
                         "vocabulary: all of it)")
    sp.add_argument("--draft-quant", choices=DRAFT_QUANT_FLAGS, default="q4_0",
                    help="the draft model's matrices stored in more bits per weight are requantized to Q4_0 as it "
                         "loads (default; none: as stored)")
    so = ap.add_argument_group("structured output (the text must match; ends when the grammar is complete)")
    one = so.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE",
                     help="a JSON schema file: the text is JSON that validates (whitespace bounded: at most one "
                          "space, or newlines and 20 spaces of indent, between tokens)")
    one.add_argument("--json-object", action="store_true", help="the text is any JSON object")
    one.add_argument("--regex", metavar="R", help="the whole text matches the regex R (Rust syntax, as llguidance)")
    one.add_argument("--grammar", metavar="FILE",
                     help="a grammar file: Lark (llguidance's dialect, a `start:` rule) or GBNF (`root ::= ...`)")
    one.add_argument("--choice", action="append", metavar="TEXT", help="the text is one of the --choice values "
                     "(repeat it)")
    tc = ap.add_argument_group("tool calling (implies --chat; calls are printed as JSON lines after the text)")
    tc.add_argument("--tools", metavar="FILE", help="a JSON file: a list of OpenAI function tools "
                                                    "([{\"type\": \"function\", \"function\": {\"name\", "
                                                    "\"parameters\"}}])")
    tc.add_argument("--tool-choice", default="auto", metavar="CHOICE",
                    help="auto (default), required, none, or the name of the one function to call; beside "
                         "--json-schema or --json-object, auto gives calls or JSON text that follows it, required "
                         "and a name give calls, none the JSON (as the server takes response_format)")
    return ap


class UsageError(Exception):
    """A command-line value that cannot be used (exit code 2)."""


def constraint_from_args(args):
    """The Constraint the structured-output flags ask for (None: no flag); UsageError saying which flag and why."""
    if not (args.json_schema or args.grammar or args.regex is not None or args.choice or args.json_object):
        return None                                      # (llguidance and its kernels load only when asked)
    from .engine.structured import Constraint, StructuredOutputError
    flag, make, value = None, None, None
    if args.json_schema is not None:
        flag, make, value = f"--json-schema {args.json_schema}", Constraint.json_schema, _read(args.json_schema,
                                                                                               "--json-schema")
    elif args.grammar is not None:
        flag, make, value = f"--grammar {args.grammar}", Constraint.lark_or_gbnf, _read(args.grammar, "--grammar")
    elif args.regex is not None:
        flag, make, value = "--regex", Constraint.regex, args.regex
    elif args.choice:
        if "" in args.choice:                            # (the only reply it allows is an empty one)
            raise UsageError("--choice: a choice cannot be empty")
        flag, make, value = "--choice", Constraint.choice, args.choice
    elif args.json_object:
        return Constraint.json_object()
    if flag is None:
        return None
    try:
        return make(value)
    except StructuredOutputError as e:
        raise UsageError(f"{flag}: {e}") from None


def tools_from_args(args):
    """(tools, tool_choice) from --tools FILE and --tool-choice (None: no --tools); UsageError naming the flag."""
    if not args.tools:
        if args.tool_choice != "auto":
            raise UsageError("--tool-choice needs --tools FILE")
        return None
    from .serve.protocol import ApiError
    from .serve.tools import parse_tool_choice, parse_tools
    try:
        spec = json.loads(_read(args.tools, "--tools"))
    except json.JSONDecodeError as e:
        raise UsageError(f"--tools {args.tools}: not JSON ({e})") from None
    if isinstance(spec, dict) and "tools" in spec:             # a request body's {"tools": [...]} too
        spec = spec["tools"]
    if spec == []:                                   # (else "--tool-choice: tool_choice 'auto' needs tools")
        raise UsageError(f"--tools {args.tools}: the list holds no tools")
    choice = args.tool_choice
    if choice not in ("auto", "required", "none"):
        choice = {"type": "function", "function": {"name": choice}}
    try:
        tools = parse_tools(spec)
        return tools, parse_tool_choice(choice, tools)
    except ApiError as e:
        flag = "--tool-choice" if e.param == "tool_choice" else f"--tools {args.tools}"
        raise UsageError(f"{flag}: {e.message}") from None


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {path} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def chat_prompt(model, user: str, system: str | None, tools=None, special: bool = False) -> tuple[str | None, str]:
    """The rendered chat prompt, or None with the reason when the model has no chat template. special: the
    messages' special-token text parses as tokens too."""
    from .format.chat import chat_template_from_metadata
    template = chat_template_from_metadata(model.metadata)
    if template is None:
        return None, "this model has no chat template (tokenizer.chat_template); running plain completion"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return render_messages(model, template, messages, tools, special=special), ""


def render_messages(model, template: str, messages: list[dict], tools=None, special: bool = False) -> str:
    """The conversation as the model's chat template writes it, ending with the assistant's turn opened (text to
    tokenize with special tokens parsed). tools: lumen.serve.tools Tools, rendered by the template if it takes
    them, else by the fallback system prompt (as the server does). The messages' control-token texts stay text
    (Tokenizer.shield), so a user's "<|im_start|>" cannot open a turn, unless special."""
    from .format.chat import render_chat
    tok = model.tokenizer
    if not special:
        messages = tok.shield_messages(messages)
    kw = {}
    if tools:
        from .serve.tools import tool_messages
        messages, kw = tool_messages(template, messages, tools)    # (as the server shows them)
    return render_chat(template, messages, bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                       eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
                       add_generation_prompt=True, **kw)


def summary_line(stats, reason: str | None = None) -> str:
    """One request's figures from its RequestMetrics: prompt tokens, TTFT, prefill and decode tok/s, TPOT, tokens
    generated and why it ended (reason, else its stop_reason)."""
    decode = ("" if stats.tpot_s is None else       # (one token: no decode step to time; as the chat page says it)
              f"decode {stats.decode_tps:.1f} tok/s | TPOT {stats.tpot_s * 1e3:.1f} ms | ")
    return (f"prompt {stats.prompt_tokens} tok | TTFT {stats.prefill_s * 1e3:.0f} ms | prefill "
            f"{stats.prefill_tps:.1f} tok/s | {decode}{stats.gen_tokens} generated ({reason or stats.stop_reason})")


def print_summary(console, line: str) -> None:
    """The summary line on stderr: dim on a terminal, plain (no markup parsed) elsewhere."""
    if console.is_terminal:
        from rich.markup import escape
        console.print(f"[dim]{escape(line)}[/]", soft_wrap=True)       # one line, however wide
    else:
        print(line, file=sys.stderr, flush=True)


COMPILING = "compiling the kernels for this CPU (first run only, up to a minute; cached afterwards)"


@contextmanager
def status_while_compiling(console, text: str = COMPILING, done: str = "compiled and loaded in"):
    """Say `text` from the first Numba compile inside the block to its end, and nothing if nothing compiles:
    kernels loaded from Numba's cache fire no "numba:compile" event. (A timer cannot tell the two apart: loading
    the cached forward pass took 0.7-1.0 s on 2 busy cores.) On a terminal it is a spinner (console.status); off
    one (a pipe, a log, a service) it is a plain line at once and "<done> N s" at the end (the whole block's time, so
    a block that also loads says so in `done`), so a minute of
    compiling never looks like a hang. On an empty compile cache (a first run) it says so on entering the block,
    without waiting for the imports and the load that come before the first compile. The one helper every command
    that waits on a first compile uses."""
    from .paths import compile_cache_is_empty
    terminal = getattr(console, "is_terminal", False)
    status = console.status(text, spinner="dots") if terminal else None
    out = getattr(console, "file", None) or sys.stderr
    started = []

    def begin():
        if not started:
            started.append(time.perf_counter())
            if status is not None:
                status.start()
            else:
                print(f"{text}...", file=out, flush=True)

    if compile_cache_is_empty():                        # before Numba is imported: that takes a while too
        begin()
    from numba.core import event

    class ShowOnCompile(event.Listener):
        def on_start(self, ev):
            begin()

        def on_end(self, ev):
            pass

    ok = False
    try:
        with event.install_listener("numba:compile", ShowOnCompile()):
            yield
        ok = True
    finally:
        if started:
            if status is not None:
                status.stop()
            elif ok:                                     # (a load that failed is said by its error, not "loaded")
                print(f"{done} {time.perf_counter() - started[0]:.0f} s", file=out, flush=True)


def tokens_to_generate(model, prompt, special: bool, max_tokens: int | None) -> int:
    """The max_tokens of the run: --max-tokens as given, the default 128 or the rest of the context (NO_LIMIT),
    cut where the context ends; LumenError in the flags' words when the prompt and --max-tokens do not fit (the
    API's ContextError names its keywords, which a command-line user never typed)."""
    from .engine.admission import prompt_ids
    n_prompt = len(prompt_ids(prompt, model.tokenizer, model.config.n_vocab, special))
    room = model.n_ctx - n_prompt
    if room < 1:
        raise LumenError(f"the prompt ({plural(n_prompt, 'token')}) leaves no room to generate in the context of "
                         f"{plural(model.n_ctx, 'token')}: give a larger --ctx or a shorter prompt")
    if max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if max_tokens == NO_LIMIT:
        return room
    if max_tokens > room:
        need, trained = n_prompt + max_tokens, model.config.ctx_train
        larger = (f"give --ctx {need} or more" if need <= trained else      # (not a --ctx the model refuses)
                  f"give a smaller --max-tokens (the model was trained on {plural(trained, 'token')})")
        raise LumenError(f"the prompt ({plural(n_prompt, 'token')}) and --max-tokens {max_tokens} exceed the context "
                         f"of {plural(model.n_ctx, 'token')}: {larger}, or -n {NO_LIMIT} to generate to the context's "
                         "end")
    return max_tokens


def load_model(name: str, ctx: int | None, threads: int | None, force_ctx: bool, **kw):
    """lumen.load, refusing a ctx beyond the model's trained context (the API only warns) unless force_ctx."""
    from . import load
    with trained_context_only("pass --force-ctx to use it anyway", allow=force_ctx):
        return load(name, ctx=ctx, threads=threads, **kw)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("prompt", "system", "stop", "choice", "regex"):
        setattr(args, name, argv_text(getattr(args, name)))
    from .engine.sampling.params import SamplingParams   # refused before the model loads (or is fetched: a 1 GB
                                                         # download to learn --top-p 2 is wrong)
    try:
        check_max_tokens(args.max_tokens)
        SamplingParams(**sampling_from_args(args, args.chat or args.tools is not None), stop=args.stop,
                       speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens)
        if why := threads_error(args.threads):
            raise ValueError(why)
        if args.speculative:                             # --ngram-min/-max, --draft-vocab: in range
            SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens or 5, ngram_min=args.ngram_min,
                              ngram_max=args.ngram_max, draft_vocab=args.draft_vocab)
        args.draft_quant = draft_quant_flag(args.draft_quant)
        check_ctx(args.ctx)
    except ValueError as e:                              # a flag's value: a usage error
        print(f"error: {flag_words(str(e), ap)}", file=sys.stderr)
        return 2
    from rich.console import Console
    err = Console(stderr=True, highlight=False)
    literal_prompt = args.prompt is None                 # read from a file or stdin: no escapes
    if literal_prompt and args.file is None and (sys.stdin is None or sys.stdin.isatty()):   # (None: stdin closed)
        print("error: give --prompt TEXT, --file FILE or pipe the prompt on stdin", file=sys.stderr)
        return 2
    if literal_prompt:
        try:
            args.prompt = read_stdin_prompt(sys.stdin) if args.file is None else read_prompt_file(args.file)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    try:
        constraint = constraint_from_args(args)          # before the model loads: a bad file fails fast
        tooling = tools_from_args(args)
        answer = None                                    # auto beside --json-schema/--json-object: calls or JSON
        if tooling is not None and tooling[1] != "none":
            from .serve.tools import tool_answer
            try:
                answer = tool_answer(constraint, tooling[1])
            except ValueError as e:
                flag = "--regex" if args.regex is not None else "--grammar" if args.grammar else "--choice"
                raise UsageError(f"{flag} {e}".replace("tool_choice \"none\"", "--tool-choice none")) from None
        if args.system is not None and not (args.chat or tooling is not None):   # (it would be dropped unsaid)
            raise UsageError("--system is the system message of a chat: give --chat too")
        if args.speculative == "draft" and not args.draft_model:
            raise UsageError("--speculative draft needs --draft-model")
        if args.draft_model and args.speculative != "draft":
            raise UsageError("--draft-model is used with --speculative draft")
        for flag, v, default, mode in (("--num-speculative-tokens", args.num_speculative_tokens, None, None),
                                       ("--ngram-min", args.ngram_min, 1, None),
                                       ("--ngram-max", args.ngram_max, 4, None),
                                       ("--draft-vocab", args.draft_vocab, 32768, "draft"),
                                       ("--draft-quant", args.draft_quant, "q4_0", "draft")):
            if v != default and (args.speculative != mode if mode else not args.speculative):   # mode None: either
                raise UsageError(f"{flag} is used with --speculative {mode or '(ngram or draft)'}")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gen = None                                           # the generation, once it runs (Ctrl-C reports it)
    try:
        if not args.no_escape:
            args.stop = [process_escapes(s) for s in args.stop]
            args.system = args.system and process_escapes(args.system)
            if not literal_prompt:
                args.prompt = process_escapes(args.prompt)
        with status_while_compiling(err):    # a first load compiles its weight types' kernels and packs; a first
                                             # warm-up waits for the forward pass
            t0 = time.perf_counter()
            model = load_model(args.model, args.ctx, args.threads, args.force_ctx,
                               adaptive_threads=args.adaptive_threads)
            t_load = time.perf_counter() - t0
            if args.speculative:                 # (the draft by name: loaded, and requantized, by speculation())
                model.speculation(draft_model=args.draft_model, num_speculative_tokens=args.num_speculative_tokens
                                  or 5, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                                  draft_vocab=args.draft_vocab, draft_quant=args.draft_quant)
            # a throwaway token compiles the forward pass (or waits for it) under the status line; a warm start
            # only loads it (~15 ms), before the prompt's clock starts, instead of a decode step (60-100 ms, 1.5B)
            from .model import precompile
            if precompile.ready():
                t0, t_compile = time.perf_counter(), 0.0
                model.engine.runner.load()
                t_load += time.perf_counter() - t0
            else:
                t_compile = model.warmup()
        prompt, special, chat = args.prompt, args.special, False
        parser, shown = None, None
        if tooling is not None:
            from .format.chat import chat_template_from_metadata
            from .serve.tools import PARSERS, call_grammar, parser_for_template, shown_tools
            shown = shown_tools(*tooling)
            if tooling[1] != "none":
                kind = PARSERS[parser_for_template(chat_template_from_metadata(model.metadata))]
                parser = kind(names=[t.name for t in tooling[0]],     # (JSON naming no tool: text)
                              calls_only=tooling[1] != "auto")
                constraint = call_grammar(kind, model.tokenizer, *tooling, True, answer)    # (the server's)
        if args.chat or tooling is not None:
            rendered, why = chat_prompt(model, args.prompt, args.system, shown, args.special)
            if rendered is None and tooling is not None:
                raise LumenError("--tools needs a model with a chat template")
            if rendered is None:
                print(f"note: {why}" + ("; --system is not used" if args.system else ""),  # (and plain
                      file=sys.stderr)                                          # completion's sampling)
            else:
                prompt, chat = model.tokenize(rendered, special=True, shielded=not args.special), True  # (one BOS)
        from .engine.sequence import RequestMetrics
        stats = RequestMetrics()
        max_tokens = tokens_to_generate(model, prompt, special, args.max_tokens)
        gen = model.generate(prompt, max_tokens=max_tokens, **sampling_from_args(args, chat),
                             stop=args.stop, special=special,
                             stats=stats, speculative=args.speculative,
                             num_speculative_tokens=args.num_speculative_tokens, ignore_eos=args.ignore_eos,
                             constraint=constraint)
        out = sys.stdout
        deltas, wrote = [], False
        for tok in gen:
            text = tok.text
            if parser is not None:
                text, calls = parser.feed(text)
                deltas += calls
            out.write(text)
            out.flush()
            wrote = wrote or bool(text)
        if parser is not None:
            text, calls = parser.finish()
            out.write(text)
            wrote = wrote or bool(text)
            from .serve.tools import assemble
            cut = stats.stop_reason == "length"          # (a call the grammar completed ends the reply)
            for call in assemble(deltas + calls):        # one JSON line per call
                f = call["function"]
                try:
                    arguments = json.loads(f["arguments"] or ("" if cut else "{}"))
                except json.JSONDecodeError:               # cut by --max-tokens: as written
                    arguments = f["arguments"]
                out.write("\n" * wrote + json.dumps({"name": f["name"], "arguments": arguments}, ensure_ascii=False))
                wrote = True
        out.write("\n")
        out.flush()
        if parser is not None and stats.stop_reason == "length":
            print(f"note: the reply was cut at {plural(stats.gen_tokens, 'token')} (--max-tokens, --ctx): a tool call "
                  "in it is incomplete or missing", file=sys.stderr, flush=True)
    except (LumenError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)  # plain: one line, no markup parsing of paths
        return 1
    except BrokenPipeError:                              # stdout's reader is gone (`| head`): commands.run ends it
        raise
    except OSError as e:  # the store and the pack cache say what to do; anything else at least names the file
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:                            # Ctrl-C: the text so far ends its line, and its figures
        if gen is not None:
            gen.close()                                  # (aborts the request)
            sys.stdout.write("\n")
            sys.stdout.flush()
            print_summary(err, run_summary(stats, t_load, t_compile, args.speculative, "interrupted"))
        print("interrupted" if gen is not None else "\ninterrupted", file=sys.stderr)   # (after the ^C echoed)
        return 130
    print_summary(err, run_summary(stats, t_load, t_compile, args.speculative))
    return 0


def run_summary(stats, t_load: float, t_compile: float, speculative: str | None, reason: str | None = None) -> str:
    """The summary line of a run (summary_line, the load and warm-up times, the speculative counts); reason: why
    it ended, when not the request's stop reason."""
    return (summary_line(stats, reason) + f" | load {t_load:.2f} s"
            + (f" | warm-up {t_compile:.1f} s" if t_compile > 1.0 else "")
            + (f" | {speculative}: {100 * stats.acceptance_rate:.0f}% of {stats.spec_proposed} drafted accepted, "
               f"{stats.mean_accepted_length:.2f} tok/verify step over {stats.spec_steps} steps"
               if stats.spec_steps else ""))


if __name__ == "__main__":
    sys.exit(run(main))
