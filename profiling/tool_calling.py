"""Does `auto` tool calling call when it should, and what does the tools' grammar cost a decode?

    python profiling/tool_calling.py [--model qwen2.5-coder-1.5b] [--llama-server PATH] [--reps 3]

The model is fetched on first use, as by `python -m lumen.models --fetch NAME`.

1. Call rate: ten prompts that each clearly need one of five tools, sent with tool_choice "auto", greedy, to
   `lumen.serve` and (with --llama-server) to llama-server --jinja on the same GGUF: the share of answers with a
   call, the share of those calls that parse and validate against their tool's schema (jsonschema), and the share
   that name the tool the prompt needs.
2. TPOT at each --concurrency (streamed, ignore_eos, 64 tokens; the median over --reps interleaved runs of the
   median over a run's requests): a prompt that needs no tool sent without tools, with the tools and "auto" (the
   grammar runs) and with the tools and "none" (the same longer prompt, no grammar), so that the grammar's own
   share is apart from the longer prompt's.
3. The grammar's mask alone: the median time to fill one token's mask while the "auto" grammar reads free text.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import numpy as np
from structured_output import free_port, start, stop
from verdict import checked_model, count, list_of, verdict

from lumen.bench.tools import given_tool
from lumen.engine.structured import GrammarCompiler
from lumen.format.gguf import GGUFFile
from lumen.format.tokenizer import Tokenizer
from lumen.model.store import resolve
from lumen.serve.tools import PARSERS, parse_tools, parser_for_template

def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = [
    _tool("get_weather", "The current weather in a city.",
          {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("add", "Add two integers and return their sum.", {"a": {"type": "integer"}, "b": {"type": "integer"}},
          ["a", "b"]),
    _tool("convert_currency", "Convert an amount of money from one currency to another at today's rate.",
          {"amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
          ["amount", "from_currency", "to_currency"]),
    _tool("send_email", "Send an email.", {"to": {"type": "string"}, "subject": {"type": "string"},
                                           "body": {"type": "string"}}, ["to", "subject", "body"]),
    _tool("get_time", "The current local time in a timezone or city.", {"timezone": {"type": "string"}},
          ["timezone"]),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    ("What's the weather like in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo at the moment? Give me the temperature in fahrenheit.", "get_weather"),
    ("What is 48213 plus 1978?", "add"),
    ("Add 7 and 35 for me.", "add"),
    ("How much is 250 US dollars in euros today?", "convert_currency"),
    ("Convert 1000 Japanese yen to British pounds.", "convert_currency"),
    ("Send an email to alice@example.com with the subject 'Lunch' saying I'll be 10 minutes late.", "send_email"),
    ("Email bob@example.com to tell him the meeting moved to 3pm.", "send_email"),
    ("What time is it in New York right now?", "get_time"),
    ("What's the current local time in Berlin?", "get_time"),
]
STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]


def call_rate(url: str) -> dict:
    """{"called", "valid", "right"}: shares over the prompts (valid and right: of the calls made)."""
    called = valid = right = 0
    with httpx.Client(base_url=url, timeout=600) as http:
        for prompt, want in PROMPTS:
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "tools": TOOLS, "tool_choice": "auto",
                "temperature": 0, "max_tokens": 160})
            r.raise_for_status()
            msg = r.json()["choices"][0]["message"]
            calls = msg.get("tool_calls") or []
            ok = bool(calls)
            for c in calls:
                try:
                    jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
                except (KeyError, ValueError, jsonschema.ValidationError):
                    ok = False
            called += bool(calls)
            valid += ok
            right += bool(calls) and calls[0]["function"]["name"] == want
            shown = [(c["function"]["name"], c["function"]["arguments"]) for c in calls] or (msg.get("content") or "")
            print(f"    {prompt[:50]:50s} -> {str(shown)[:100]}", flush=True)
    n = len(PROMPTS)
    return {"called": called / n, "valid": valid / max(called, 1), "right": right / max(called, 1)}


def tpot(url: str, tools: list | None, choice: str | None, tokens: int = 64) -> float:
    """Seconds per output token after the first, one streamed request; nan when the text did not stream (under
    "auto" the server holds back an answer that starts like a tool call, and then sends it in one piece)."""
    body = {"messages": STORY, "temperature": 0, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if tools:
        body |= {"tools": tools, "tool_choice": choice}
    first = last = None
    n = chunks = 0
    with httpx.Client(base_url=url, timeout=600) as http, http.stream("POST", "/v1/chat/completions",
                                                                     json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            if any(c["delta"].get("content") or c["delta"].get("tool_calls") for c in chunk.get("choices", [])):
                first = first or time.perf_counter()
                last = time.perf_counter()
                chunks += 1
    if n < 2 or first is None:
        raise RuntimeError(f"only {n} tokens streamed")
    return (last - first) / (n - 1) if chunks >= 2 else float("nan")


def median(v: list[float]) -> float:
    """The median of the measured values (not nan); nan when there is none."""
    v = [x for x in v if x == x]
    return statistics.median(v) if v else float("nan")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a == a and b == b else "not measured (an answer came in one piece: held back as a call)"


def tpot_at(url: str, tools: list | None, choice: str | None, concurrency: int) -> list[float]:
    """The TPOT of each of `concurrency` requests sent at once."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: tpot(url, tools, choice), range(concurrency)))


def mask_cost(model: str) -> float:
    """Median seconds to fill one mask of the "auto" grammar along free text (the model's own parser)."""
    meta = GGUFFile(str(resolve(model, quiet=True))).metadata
    tok = Tokenizer.from_metadata(meta)
    parser = PARSERS[parser_for_template(meta.get("tokenizer.chat_template"))]
    with GrammarCompiler(tok) as c:
        m = c.compile(parser().grammar(parse_tools(TOOLS), "auto")).matcher()
        row = np.zeros(m.vocab.mask_words, np.int32)
        text = "The keeper climbed the stairs as the storm broke over the rocks, and the lamp turned on. " * 3
        times = []
        for t in tok.encode(text, add_bos=False, special=False):
            t0 = time.perf_counter()
            m.fill_mask(row)
            times.append(time.perf_counter() - t0)
            m.advance(t)
    return statistics.median(times[3:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--llama-server",
                    help="llama.cpp's llama-server, run with --jinja, for its call rate (default $LLAMA_SERVER; "
                         "without it that part is skipped)")
    ap.add_argument("--reps", type=count, default=3, help="TPOT runs per condition (default 3)")
    ap.add_argument("--concurrency", type=list_of(count), default="1",
                    help="comma-separated concurrencies for TPOT (default 1)")
    args = ap.parse_args(argv)
    args.llama_server = given_tool(ap, "llama-server", "--llama-server", args.llama_server, "LLAMA_SERVER")
    checked_model(args.model)                                    # before any server starts, not in its log

    mask = mask_cost(args.model)
    print(f"mask fill of the auto grammar along free text: median {mask * 1e6:.0f} us per token", flush=True)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    concs = args.concurrency
    server = start([sys.executable, "-m", "lumen.serve", "--model", args.model, "--port", str(port), "--threads", "2",
                    "--max-model-len", "4096", "--max-num-seqs", str(max(16, *concs)), "--no-ui", "--log-level",
                    "warning"], url, "lumen.serve")
    try:
        print("lumen.serve, auto:", flush=True)
        lumen = call_rate(url)
        tpot(url, None, None, 8)                                  # warm-up
        conds = {"no tools": (None, None), "tools, auto": (TOOLS, "auto"), "tools, none": (TOOLS, "none")}
        tp: dict = {}
        for conc in concs:
            runs: dict = {k: [] for k in conds}
            for r in range(args.reps):
                for name in list(conds)[::1 if r % 2 == 0 else -1]:
                    runs[name].append(median(tpot_at(url, *conds[name], conc)))
            for k, v in runs.items():
                tp[k, conc] = median(v)
                print(f"TPOT concurrency {conc:2d}, {k:12s}: {tp[k, conc] * 1e3:.1f} ms (runs' medians "
                      f"{', '.join(f'{x * 1e3:.1f}' for x in v)})", flush=True)
    finally:
        stop(server)

    llama = None
    if args.llama_server:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start([args.llama_server, "--jinja", "-m", str(resolve(args.model, quiet=True)), "-t", "2", "-c",
                        "4096", "--host", "127.0.0.1", "--port", str(port)], url, "llama-server")
        try:
            print("llama-server --jinja, auto:", flush=True)
            llama = call_rate(url)
        finally:
            stop(server)

    line = (f"auto on {len(PROMPTS)} prompts needing a tool, {args.model} greedy: Lumen calls {lumen['called']:.0%} "
            f"({lumen['valid']:.0%} of calls parse and validate, {lumen['right']:.0%} name the needed tool)")
    if llama is not None:
        line += (f", llama-server {llama['called']:.0%} ({llama['valid']:.0%} valid, {llama['right']:.0%} the "
                 "needed tool)")
    for conc in concs:
        auto, plain, none = (tp[k, conc] for k in ("tools, auto", "no tools", "tools, none"))
        line += (f"; TPOT at concurrency {conc} with tools / without {ratio(auto, plain)} (the grammar alone: "
                 f"auto / none {ratio(auto, none)})")
    line += f"; mask {mask * 1e6:.0f} us a token"
    verdict(line)


if __name__ == "__main__":
    main()
