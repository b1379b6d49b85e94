"""Tool calling without a model (lumen.serve.tools): the request's tools, tool_choice and tool messages checked (400
naming the field), the Hermes parser reading the same calls whether the text comes whole or in any chunking, the
tools' grammar accepting exactly well-formed calls (llguidance over SmolLM2's vocabulary), and the chat endpoint
alone over a byte tokenizer and a worker that answers with a call: message.tool_calls, finish_reason "tool_calls",
and a stream whose deltas (index, id, type and name first, then argument fragments) join to the whole answer."""
from __future__ import annotations

import functools
import json
import random

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_serve_handlers import ScriptedWorker

from lumen.engine.sequence import RequestMetrics, RequestOutput
from lumen.engine.structured.compiler import GrammarCompiler
from lumen.format.gguf import GGUFFile
from lumen.format.tokenizer import Tokenizer
from lumen.serve import protocol as P
from lumen.serve.app import add_error_handlers
from lumen.serve.openai import chat
from lumen.serve.openai.serving import Settings
from lumen.serve.prompts import Prompter
from lumen.serve.tools import (PARSERS, HermesParser, Llama3Parser, MistralParser, assemble, check_messages,
                               close_token, fallback_messages, marker_token, open_token, parse_tool_choice,
                               parse_tools, parser_for_template)
from lumen.serve.worker import Submission

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CITY = {"type": "function", "function": {"name": "weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TOOLS = parse_tools([ADD, CITY])
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": "}"} }}\n</tool_call>'
BARE = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


# --- the request ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools, words", [
    ("add", "must be a list"),
    ([{"type": "code_interpreter"}], "tools[0] must be"),
    ([{"type": "function", "function": {"name": "two words"}}], "tools[0].function.name"),
    ([ADD, ADD], "declared twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters must be a JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "must describe an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "null"}}}], "must describe an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"x-guidance": 3}}}], "x-guidance"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}], "uniqueItems"),
])
def test_bad_tools_are_400_naming_tools(tools, words):
    with pytest.raises(P.ApiError) as e:
        parse_tools(tools)
    assert (e.value.status, e.value.param) == (400, "tools") and words in e.value.message, e.value.message


def test_a_non_strict_tool_may_use_keywords_llguidance_cannot_enforce():
    t = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}])
    assert t[0].name == "f" and not t[0].strict
    assert parse_tools([{"type": "function", "function": {"name": "g"}}])[0].parameters["type"] == "object"
    assert parse_tools([{"type": "function", "function": {"name": "h", "parameters": {"x-guidance": None}}}])


def test_tool_choice():
    assert parse_tool_choice(None, TOOLS) == "auto" and parse_tool_choice(None, []) == "none"
    assert parse_tool_choice("required", TOOLS) == "required"
    assert parse_tool_choice({"type": "function", "function": {"name": "weather"}}, TOOLS) == "weather"
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"function": "add"}, 3):
        with pytest.raises(P.ApiError) as e:
            parse_tool_choice(bad, TOOLS)
        assert (e.value.status, e.value.param) == (400, "tool_choice")
    with pytest.raises(P.ApiError) as e:
        parse_tool_choice("required", [])
    assert e.value.param == "tool_choice"


def _assistant(cid="call_1", args='{"a": 1, "b": 2}'):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "add", "arguments": args}}]}


def test_tool_messages_must_answer_a_call():
    user = {"role": "user", "content": "1+2?"}
    check_messages([user, _assistant(), {"role": "tool", "tool_call_id": "call_1", "content": "3"}])
    check_messages([user, _assistant(args={"a": 1, "b": 2})])
    for msgs, words in [([user, {"role": "tool", "tool_call_id": "call_1", "content": "3"}], "no earlier"),
                        ([user, _assistant(), {"role": "tool", "tool_call_id": "call_2", "content": "3"}], "call_2"),
                        ([user, _assistant(), {"role": "tool", "content": "3"}], "needs a tool_call_id"),
                        ([user, _assistant(), {"role": "tool", "tool_call_id": 1, "content": "3"}], "got int 1"),
                        ([user, {"role": "assistant", "tool_calls": [{"id": 7, "type": "function", "function": {
                            "name": "add", "arguments": "{}"}}]}], "tool_calls[0].id must be a string, got int"),
                        ([user, _assistant(args="{not json")], "not valid JSON"),
                        ([user, {"role": "assistant", "tool_calls": [{"id": "x"}]}], "tool_calls[0]")]:
        with pytest.raises(P.ApiError) as e:
            check_messages(msgs)
        assert (e.value.status, e.value.param) == (400, "messages") and words in e.value.message


def test_fallback_prompt_carries_tools_calls_and_results():
    msgs = fallback_messages([{"role": "user", "content": "1+2?"}, _assistant(),
                              {"role": "tool", "tool_call_id": "call_1", "content": "3"}], TOOLS)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert '"name": "add"' in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert json.loads(msgs[2]["content"].split("\n")[1]) == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert msgs[3]["content"] == "<tool_response>\n3\n</tool_response>"
    dev = fallback_messages([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "1+2?"}], TOOLS)
    assert [m["role"] for m in dev] == ["developer", "user"]                  # one system message, rendered as such
    assert dev[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "add"' in dev[0]["content"]


# --- the parser -------------------------------------------------------------------------------------------------
def _parse(text: str, step: int, parser=HermesParser, cuts: list[int] | None = None) -> tuple[str, list[dict]]:
    """(content, calls) of text fed in pieces of `step` characters, or cut at `cuts`."""
    p, content, deltas = parser(), [], []
    bounds = [0, *(cuts if cuts is not None else range(step, len(text), step)), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        c, d = p.feed(text[a:b])
        content.append(c)
        deltas += d
    c, d = p.finish()
    calls = assemble(deltas + d)
    for call in calls:
        assert call["id"].startswith("call_")
        call["id"] = "X"
    return "".join(content) + c, calls


def _call(name, args):
    return {"id": "X", "type": "function", "function": {"name": name, "arguments": args}}


@pytest.mark.parametrize("text, content, calls", [
    ("Sure. " + CALL, "Sure.", [_call("add", '{"a": 1, "b": {"c": "}"} }')]),
    (CALL + "\n" + CALL.replace("add", "weather"), "", [_call("add", '{"a": 1, "b": {"c": "}"} }'),
                                                        _call("weather", '{"a": 1, "b": {"c": "}"} }')]),
    ('<tool_call>\n{"arguments": {"x": 1}, "name": "w"}\n</tool_call>', "", [_call("w", '{"x": 1}')]),
    ("no call here <tool", "no call here <tool", []),
    ("Sure. <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1", "Sure.", [_call("add", '{"a": 1')]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n}\n</tool_', "", [_call("add", '{"a": 1}')]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}', "", [_call("add", '{"a": 1}')]),
    # cut (max_tokens, a stop string) before the arguments: the call's name if complete, never its markup
    ('Sure. <tool_call>\n{"name": "add", "arguments":', "Sure.", [_call("add", "")]),
    ('<tool_call>\n{"name": "add"', "", [_call("add", "")]),
    ('<tool_call>\n{"name": "ad', "", []),
    ("<tool_call>", "", []),
    ('{"name": "add", "arguments": ', "", [_call("add", "")]),
    (BARE + '\n{"name": "add",', "", [_call("add", '{"a": 1, "b": 2}'), _call("add", "")]),
    (BARE + '\n{"na', "", [_call("add", '{"a": 1, "b": 2}')]),
    ('{"name": "Bob"', '{"name": "Bob"', []),                                         # maybe JSON text
    (BARE, "", [_call("add", '{"a": 1, "b": 2}')]),
    ("\n" + BARE + "\n" + BARE, "", [_call("add", '{"a": 1, "b": 2}')] * 2),
    (BARE + "\n" + BARE + "\n", "", [_call("add", '{"a": 1, "b": 2}')] * 2),
    (CALL + "\n", "", [_call("add", '{"a": 1, "b": {"c": "}"} }')]),
    ("```json\n" + BARE + "\n```", "", [_call("add", '{"a": 1, "b": 2}')]),
    ('{"answer": 1}', '{"answer": 1}', []),
    ('{"name": 1}', '{"name": 1}', []),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),                  # JSON text, not a call
    ('```json\n{"name": "Bob"}\n```', '```json\n{"name": "Bob"}\n```', []),
    ("```python\nx = 1\n```", "```python\nx = 1\n```", []),
    ("The sum is 3.", "The sum is 3.", []),
    (BARE + '\n{"result": 3}', '{"result": 3}', [_call("add", '{"a": 1, "b": 2}')]),   # text after the calls
])
def test_parser_same_calls_whole_or_in_chunks(text, content, calls):
    for step in (len(text) + 1, 1, 2, 3, 5, 8):
        assert _parse(text, step) == (content, calls), step


L3 = '{"name": "add", "parameters": {"a": 1, "b": {"c": "}"}}}'
MI = '{"name": "add", "arguments": {"a": 1, "b": "]"}}'


@pytest.mark.parametrize("parser, text, content, calls", [
    (Llama3Parser, L3, "", [_call("add", '{"a": 1, "b": {"c": "}"}}')]),
    (Llama3Parser, "<|python_tag|>" + L3, "", [_call("add", '{"a": 1, "b": {"c": "}"}}')]),
    (Llama3Parser, L3 + "; " + L3.replace("add", "weather"), "", [_call("add", '{"a": 1, "b": {"c": "}"}}'),
                                                                   _call("weather", '{"a": 1, "b": {"c": "}"}}')]),
    (Llama3Parser, "The sum is 3.", "The sum is 3.", []),
    (Llama3Parser, '{"answer": 1}', '{"answer": 1}', []),
    (Llama3Parser, "Sure: " + L3, "Sure: " + L3, []),                   # a call only as the whole message
    (MistralParser, "[TOOL_CALLS][" + MI + "]", "", [_call("add", '{"a": 1, "b": "]"}')]),
    (MistralParser, "[" + MI + ", " + MI.replace("add", "weather") + "]", "",
     [_call("add", '{"a": 1, "b": "]"}'), _call("weather", '{"a": 1, "b": "]"}')]),
    (MistralParser, " [TOOL_CALLS] [\n" + MI + "\n]", "", [_call("add", '{"a": 1, "b": "]"}')]),
    (MistralParser, "[1, 2, 3]", "[1, 2, 3]", []),
    (MistralParser, "[TOOL", "[TOOL", []),
    (MistralParser, "Hi there.", "Hi there.", []),
])
def test_other_formats_same_calls_whole_or_in_chunks(parser, text, content, calls):
    for step in (len(text) + 1, 1, 2, 3, 5, 8):
        assert _parse(text, step, parser) == (content, calls), step


@pytest.mark.parametrize("name, text, n_calls", [
    ("hermes", 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x}y"}}\n</tool_call>', 1),
    ("hermes", ' \n{"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"c": "\\"}"}}', 2),
    ("hermes", '```json\n{"name": "a", "arguments": {"x": [1, {"y": "]"}]}}\n```', 1),
    ("hermes", "Text with <tool and ``` code ```", 0),
    ("hermes", '<tool_call>\n{"name": "w", "arguments": {"s": "a\\\\\\"</tool_call>\\\\", "t": "\\u0041<"}}'
               '\n</tool_call>'
               '<tool_call>\n{"name": "v", "arguments": {}}\n</tool_call', 2),   # escapes; a cut close marker
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": [1, {"b": 2}]}}; {"name": "b", "parameters": {}}', 2),
    ("llama3", 'Just text {"name": 1}', 0),
    ("mistral", '[TOOL_CALLS] [ {"name": "add", "arguments": {"a": "]"}} ,{"name": "b", "arguments": {}} ]', 2),
    ("mistral", "[1, 2]", 0),
])
def test_parsers_same_calls_in_random_chunkings(name, text, n_calls):
    rng = random.Random(0)
    whole = _parse(text, len(text) + 1, PARSERS[name])
    assert len(whole[1]) == n_calls, whole
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        assert _parse(text, 0, PARSERS[name], cuts) == whole, cuts


@pytest.mark.parametrize("template, name", [
    ("{{ '<tool_call>' }}", "hermes"),
    ("{{ '[TOOL_CALLS]' + tool_calls|tojson }}", "mistral"),
    ("{{ '<|python_tag|>' }}", "llama3"),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}',
     "llama3"),
    ("{{ messages }}", "hermes"),
    (None, "hermes"),
])
def test_parser_for_template(template, name):
    assert parser_for_template(template) == name
    assert parser_for_template(template, "mistral") == "mistral" and parser_for_template(template, "none") is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parser_for_template(template, "nope")


@pytest.mark.parametrize("text, content, calls", [
    (BARE, "", [_call("add", '{"a": 1, "b": 2}')]),
    (BARE.replace("add", "sub"), BARE.replace("add", "sub"), []),           # JSON text naming no declared tool
    ('{"arguments": {"a": 1}, "name": "sub"}', '{"arguments": {"a": 1}, "name": "sub"}', []),
    ("```json\n" + BARE.replace("add", "sub") + "\n```", "```json\n" + BARE.replace("add", "sub") + "\n```", []),
    (CALL, "", [_call("add", '{"a": 1, "b": {"c": "}"} }')]),                 # tagged: the grammar names it
    ('{"name": "add"', "", [_call("add", "")]),                                # cut: a declared tool's name
    ('{"name": "sub", "arguments": ', '{"name": "sub", "arguments": ', []),
])
def test_a_parser_that_knows_the_tools_reads_only_their_bare_calls(text, content, calls):
    """With a JSON response_format beside tools the answer may be any object, {"name": ..., "arguments": ...}
    too: a bare call is one of a declared tool, else it is the text it is."""
    parser = functools.partial(HermesParser, names=["add", "weather"])
    for step in (1, 3, len(text)):
        assert _parse(text, step, parser) == (content, calls)


@pytest.mark.parametrize("bare", [False, True])
def test_a_long_call_is_read_once_not_again_per_token(monkeypatch, bare):
    """The end of a call (a close marker outside any string, or a bare call's closing brace) was looked for in the
    whole call's text at every token: a 37,000-character argument cost 8-11 s of the server's time. Each scan goes on
    from where the last one stopped: the characters scanned stay within twice the text's, fed 3 at a time."""
    import lumen.serve.tools as tools
    scanned = [0]
    real_scan, real_in = tools._object_scan, tools._IN_STRING

    def object_scan(text, start, *state):
        scanned[0] += len(text) - start
        return real_scan(text, start, *state)

    class InString:
        def search(self, text, pos):
            m = real_in.search(text, pos)
            scanned[0] += (m.start() if m else len(text)) - pos
            return m
    monkeypatch.setattr(tools, "_object_scan", object_scan)
    monkeypatch.setattr(tools, "_IN_STRING", InString())
    args = json.dumps({"path": "a.py", "content": 'print("x")\n' * 400})
    text = f'{{"name": "write", "arguments": {args}}}' if bare else \
        f'<tool_call>\n{{"name": "write", "arguments": {args}}}\n</tool_call>'
    content, calls = _parse(text, 3, functools.partial(HermesParser, names=["write"]))
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == json.loads(args)
    assert len(text) / 2 < scanned[0] < 2 * len(text), (scanned[0], len(text))


def test_parser_streams_name_first_then_argument_fragments():
    p = HermesParser()
    deltas = []
    for ch in CALL:
        deltas += p.feed(ch)[1]
    deltas += p.finish()[1]
    assert deltas[0].id and deltas[0].name == "add"
    assert len(deltas) > 3 and all(d.id is None and d.name is None for d in deltas[1:])


# --- the grammar ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler(smollm2_path):
    tok = Tokenizer.from_metadata(GGUFFile(str(smollm2_path)).metadata)
    with GrammarCompiler(tok) as c:
        yield tok, c


def _accepts(compiler, constraint, text: str, first: tuple[int, ...] = ()) -> bool:
    tok, c = compiler
    m = c.compile(constraint).matcher()
    row = np.zeros(m.vocab.mask_words, np.int32)
    try:
        for t in [*first, *tok.encode(text, add_bos=False, special=False), tok.eos_id]:
            m.fill_mask(row)
            m.advance(t)
    except Exception:                        # noqa: BLE001 - StructuredOutputError: the token is not allowed
        return False
    return True


W = '{"name": "weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("choice, parallel, text, ok", [
    ("auto", True, "Hello, no call needed.", True),
    ("auto", True, "", True),
    ("auto", True, "Let me add. " + CALL.replace('{"c": "}"} ', "2"), True),
    ("auto", True, "<tool_call>\n" + W + "\n</tool_call>\n<tool_call>\n" + W + "\n</tool_call>", True),
    ("auto", False, "<tool_call>\n" + W + "\n</tool_call>\n<tool_call>\n" + W + "\n</tool_call>", False),
    ("auto", True, "<tool_call>\n" + W + "\n</tool_call> and more text", False),
    ("auto", True, "<tool_call>\n" + W.replace('"Paris"', "3") + "\n</tool_call>", False),       # invalid args
    ("auto", True, "<tool_call>\n" + W.replace("weather", "wether") + "\n</tool_call>", False),  # unknown name
    ("auto", True, '<tool_call>\n{"name": "weather", "arguments": {"city": "P", "x": 1}}\n</tool_call>', False),
    ("auto", True, BARE, True),
    ("auto", True, BARE.replace("2", '"two"'), False),
    ("auto", True, "```json\n" + W + "\n```", True),
    ("auto", True, '{"answer": 42}', True),
    ("auto", True, '{"name": "Bob", "age": 3}', True),                 # JSON text that names no tool
    ("auto", True, 'Here:\n```json\n{"name": "Bob"}\n```', True),
    ("auto", True, '```json\n{"name": "Bob"}\n```', True),
    ("auto", True, '{"name": "wether", "arguments": {"city": "P"}}', True),    # a call of no tool: text
    ("auto", True, '{"name": "weather", "age": 3}', False),            # a tool's name starts a call
    ("auto", True, '{{"name": "weather", "arguments": {"city": "P"}}}', False),   # Qwen2.5-Coder's doubled braces
    ("auto", True, '```json\n{{"name": "weather", "arguments": {"city": "P"}}}\n```', False),
    ("auto", True, "Write {{ name }} in the template.", True),
    ("auto", True, BARE + "\n", True),                                 # the model's token "}}\n", then its end
    ("auto", True, BARE + "\n" + BARE + "\n", True),
    ("auto", True, "<tool_call>\n" + W + "\n</tool_call>\n", True),
    ("required", True, "<tool_call>\n" + W + "\n</tool_call>\n", True),
    ("weather", True, "<tool_call>\n" + W + "\n</tool_call>\n", True),
    ("auto", True, BARE + "\n" * 5, False),                            # whitespace stays bounded
    # after bare calls, text that starts no call (the result the model expects): not forced into another call
    ("auto", True, BARE + '\n{"result": 3}', True),
    ("auto", True, BARE + '\n{"name": "wether", "arguments": {}}', False),
    ("auto", True, BARE + "\n```json\n" + W + "\n```", False),
    ("auto", True, BARE + "\nthen <tool_call>\n" + W + "\n</tool_call>", False),
    ("auto", False, BARE + '\n{"result": 3}', False),
    ("required", True, "<tool_call>\n" + W + "\n</tool_call>", True),
    ("required", True, "Sure. <tool_call>\n" + W + "\n</tool_call>", False),
    ("required", True, "No.", False),
    ("weather", True, "<tool_call>\n" + W + "\n</tool_call>", True),
    ("weather", True, "<tool_call>\n" + W + "\n</tool_call>\n<tool_call>\n" + W + "\n</tool_call>", False),
    ("add", True, "<tool_call>\n" + W + "\n</tool_call>", False),
])
def test_grammar_accepts_exactly_valid_calls(compiler, choice, parallel, text, ok):
    assert _accepts(compiler, HermesParser().grammar(TOOLS, choice, parallel), text) is ok


@pytest.mark.parametrize("parser, choice, parallel, text, ok", [
    (Llama3Parser, "auto", True, "Hello, no call needed.", True),
    (Llama3Parser, "auto", True, W.replace("arguments", "parameters"), True),
    (Llama3Parser, "auto", True, "<|python_tag|>" + W.replace("arguments", "parameters"), True),
    (Llama3Parser, "auto", True, W.replace("arguments", "parameters") + "; " + BARE.replace("arguments", "parameters"),
     True),
    (Llama3Parser, "auto", False, W.replace("arguments", "parameters") + "; " + W.replace("arguments", "parameters"),
     False),
    (Llama3Parser, "auto", True, W, False),                                          # Hermes' key
    (Llama3Parser, "auto", True, '{"name": "Bob", "age": 3}', True),
    (Llama3Parser, "auto", True, '{"name": "Bob", "parameters": {}}', True),            # names no tool: text
    (Llama3Parser, "auto", True, W.replace("arguments", "parameters").replace('"Paris"', "3"), False),
    (Llama3Parser, "required", True, "No.", False),
    (Llama3Parser, "weather", True, W.replace("arguments", "parameters"), True),
    (Llama3Parser, "weather", True, W.replace("arguments", "parameters") + "; " + W.replace("arguments", "parameters"),
     False),
    (MistralParser, "auto", True, "Hello.", True),
    (MistralParser, "auto", True, "[" + W + "]", True),
    (MistralParser, "auto", True, "[TOOL_CALLS][" + W + ", " + BARE + "]", True),
    (MistralParser, "auto", True, "[" + W, False),                                   # the list must end
    (MistralParser, "auto", True, "[" + W.replace("weather", "wether") + "]", True),     # (text)
    (MistralParser, "auto", True, "[1, 2]", True),
    (MistralParser, "required", True, "[" + BARE + "]", True),
    (MistralParser, "add", True, "[" + W + "]", False),
    (MistralParser, "required", True, "[" + W + "]\n", True),
    (Llama3Parser, "required", True, W.replace("arguments", "parameters") + " \n", True),
    (Llama3Parser, "required", True, W.replace("arguments", "parameters") + '\n{"result": 3}', True),
    (Llama3Parser, "required", True, W.replace("arguments", "parameters") + ' ; {"name": "x"}', False),
    (MistralParser, "required", True, "[" + W + ']\n{"result": 3}', False),
    (MistralParser, "weather", True, "[" + W + ", " + W + "]", False),
])
def test_other_formats_grammar_accepts_their_own_calls(compiler, parser, choice, parallel, text, ok):
    assert _accepts(compiler, parser().grammar(TOOLS, choice, parallel), text) is ok


@pytest.mark.parametrize("name, text", [
    ("hermes", '{"name": "schedule_meeting", "arguments": {"title": "Standup", "start": "9:00"}}'),
    ("hermes", '```json\n{\n  "name": "Joke",\n  "arguments": {"text": "Why?"}\n}\n```'),
    ("llama3", '{"name": "schedule_meeting", "parameters": {"title": "Standup"}}'),
    ("mistral", '[{"name": "schedule_meeting", "arguments": {"title": "Standup"}}]'),
])
def test_auto_lets_a_call_of_no_tool_through_as_its_text(compiler, name, text):
    """Under auto a model that has begun a bare call of a function it was not given ({"name": "schedule_meeting",
    its name already written) may go on with the arguments' key as it means to, and the answer is that text (as
    vLLM and llama-server answer it): refused there, it spelled the key wrong ("arguments': ...") and the content was
    not even JSON. No call of an undeclared tool is ever read."""
    parser = functools.partial(PARSERS[name], names=[t.name for t in TOOLS])
    assert _accepts(compiler, parser().grammar(TOOLS, "auto", True), text)
    for step in (1, 4, len(text)):
        assert _parse(text, step, parser) == (text, [])


def test_a_tools_arguments_get_the_schema_rewrites_of_a_response_format(compiler):
    """A tool's parameters go through the same checks and rewrites as a response_format schema (checked_schema):
    llguidance's regex for `{"exclusiveMinimum": 0, "maximum": 0.5}` takes 0 itself, which the rewrite keeps out;
    the tool grammar used to skip it and let a call send {"p": 0}."""
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}},
        "required": ["p"]}}}])
    grammar = HermesParser().grammar(tools, "required")
    call = '<tool_call>\n{"name": "f", "arguments": {"p": %s}}\n</tool_call>'
    assert _accepts(compiler, grammar, call % "0.25")
    assert not _accepts(compiler, grammar, call % "0")


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_parser_reads_what_its_grammar_allows(compiler, name):
    """A call the grammar accepts (written by a required choice's forced path, here by hand) parses back."""
    parser = PARSERS[name]
    one = {"hermes": "<tool_call>\n" + W + "\n</tool_call>", "llama3": W.replace("arguments", "parameters"),
           "mistral": "[" + W + "]"}[name]
    assert _accepts(compiler, parser().grammar(TOOLS, "required"), one)
    assert _parse(one, 3, parser) == ("", [_call("weather", '{"city": "Paris"}')])


def test_a_marker_that_is_a_special_token_may_start_the_calls(compiler):
    """Mistral's [TOOL_CALLS] is a control token in its GGUF: the text cannot spell it, so the grammar names its id
    (here SmolLM2's <|im_start|> stands in for it)."""
    tok, _ = compiler

    class Marked(MistralParser):
        marker = "<|im_start|>"

    mark = marker_token(tok, Marked)
    assert mark == tok.encode("<|im_start|>", add_bos=False, special=True)[0]
    assert marker_token(tok, Llama3Parser) is None and marker_token(tok, HermesParser) is None   # not one token
    auto, required = Marked().grammar(TOOLS, "auto", True, mark), Marked().grammar(TOOLS, "required", True, mark)
    assert _accepts(compiler, auto, "[" + W + "]", (mark,)) and _accepts(compiler, auto, "[" + W + "]")
    assert _accepts(compiler, required, "[" + W + "]", (mark,))
    assert not _accepts(compiler, auto, "Hello.", (mark,))                       # the marker starts calls only
    assert not _accepts(compiler, Marked().grammar(TOOLS, "auto", True), "[" + W + "]", (mark,))


REFS = parse_tools([{"type": "function", "function": {"name": "tree", "parameters": {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {
        "label": {"$ref": "#/$defs/label"}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
        "kind": {"$ref": "#/definitions/kind"}, "note": {"const": {"$ref": "#/not/a/ref"}}},
    "required": ["label", "kids"], "additionalProperties": False,
    "$defs": {"label": {"type": "string", "maxLength": 8}}, "definitions": {"kind": {"enum": ["a", "b"]}}}}},
    ADD])


@pytest.mark.parametrize("choice", ["auto", "required", "tree"])
def test_a_tool_schema_may_refer_to_itself(compiler, choice):
    """$ref into the parameters' own $defs / definitions, or to their root, holds once they sit inside a call."""
    call = '{"name": "tree", "arguments": {"label": "x", "kids": [{"label": "y", "kids": []}], "kind": "a"}}'
    grammar = HermesParser().grammar(REFS, choice)
    assert _accepts(compiler, grammar, "<tool_call>\n" + call + "\n</tool_call>")
    assert not _accepts(compiler, grammar, "<tool_call>\n" + call.replace('"y"', "3") + "\n</tool_call>")
    assert not _accepts(compiler, grammar, "<tool_call>\n" + call.replace('"a"', '"c"') + "\n</tool_call>")
    if choice == "auto":
        assert _accepts(compiler, grammar, call)


def test_a_strict_tool_may_use_formats_llguidance_does_not_know(compiler):
    """An unknown string format is an annotation (JSON Schema): accepted for a strict tool, and not enforced."""
    login = parse_tools([{"type": "function", "function": {"name": "login", "strict": True, "parameters": {
        "type": "object", "properties": {"user": {"type": "string", "format": "email"},
                                         "password": {"type": "string", "format": "password"}},
        "required": ["user", "password"], "additionalProperties": False}}}])
    call = '<tool_call>\n{"name": "login", "arguments": {"user": "a@b.co", "password": "x1"}}\n</tool_call>'
    assert _accepts(compiler, HermesParser().grammar(login, "required"), call)
    assert not _accepts(compiler, HermesParser().grammar(login, "required"), call.replace("a@b.co", "ab"))


def test_a_tool_call_takes_only_valid_dates_and_times(compiler):
    """A tool's date-time argument is RFC 3339's (lumen.engine.structured.constraint.exact_formats), as a
    response_format's: llguidance's own regex took a leap second at any time and February 29 of every year."""
    meet = parse_tools([{"type": "function", "function": {"name": "meet", "parameters": {
        "type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}, "required": ["at"]}}}])
    call = '<tool_call>\n{"name": "meet", "arguments": {"at": "%s"}}\n</tool_call>'
    grammar = HermesParser().grammar(meet, "required")
    assert _accepts(compiler, grammar, call % "2024-02-29T10:00:00Z")
    assert not _accepts(compiler, grammar, call % "2024-03-01T10:00:60Z")
    assert not _accepts(compiler, grammar, call % "2023-02-29T10:00:00Z")


def test_a_tool_without_parameters_takes_no_arguments(compiler):
    """OpenAI: omitting parameters defines an empty parameter list, so the call's arguments are {}."""
    now = parse_tools([{"type": "function", "function": {"name": "now", "description": "The time."}}])
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    for choice in ("auto", "required", "now"):
        grammar = HermesParser().grammar(now, choice)
        assert _accepts(compiler, grammar, call)
        assert not _accepts(compiler, grammar, call.replace("{}", '{"tz": "UTC"}'))


def test_a_call_takes_no_arguments_its_tool_does_not_list(compiler):
    """Arguments a function would not take (a key the schema does not list, at any depth) are refused, as
    llama.cpp and vLLM's default grammar refuse them."""
    order = parse_tools([{"type": "function", "function": {"name": "order", "parameters": {
        "type": "object", "properties": {"items": {"type": "array", "items": {
            "type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}}}}}}])
    call = '<tool_call>\n{"name": "order", "arguments": %s}\n</tool_call>'
    for choice in ("auto", "required", "order"):
        grammar = HermesParser().grammar(order, choice)
        assert _accepts(compiler, grammar, call % '{"items": [{"sku": "a"}]}')
        assert not _accepts(compiler, grammar, call % '{"items": [{"sku": "a"}], "minItems": 1}')
        assert not _accepts(compiler, grammar, call % '{"items": [{"sku": "a", "qty": 2}]}')


def test_arguments_are_an_object_whatever_the_schema_leaves_open(compiler):
    """A schema without a type ({}, or only properties) still makes the arguments a JSON object."""
    for params in ({}, {"properties": {"q": {"type": "string"}}}, {"type": ["object", "null"]}):
        tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])
        for choice in ("auto", "required"):
            grammar = HermesParser().grammar(tools, choice)
            assert _accepts(compiler, grammar, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
            for args in ('"text"', "null", "[1]", "3"):
                text = '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>' % args
                assert not _accepts(compiler, grammar, text), (params, args)


ANSWER = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
          "required": ["city", "temp"]}


@pytest.mark.parametrize("parser, text, ok", [
    (HermesParser, '{"city": "Paris", "temp": 21}', True),
    (HermesParser, '{"city": "Paris", "temp": "warm"}', False),                  # the answer follows its schema
    (HermesParser, '{"city": "Paris"}', False),
    (HermesParser, "It is warm.", False),                                        # no free text beside it
    (HermesParser, "<tool_call>\n" + W + "\n</tool_call>", True),
    (HermesParser, "<tool_call>\n" + W + "\n</tool_call>\n<tool_call>\n" + BARE + "\n</tool_call>", True),
    (HermesParser, W, True),                                                     # a bare call
    (HermesParser, W.replace('"Paris"', "3"), False),
    (HermesParser, '{"name": "wether", "arguments": {"city": "P"}}', False),
    (Llama3Parser, '{"city": "Paris", "temp": 21}', True),
    (Llama3Parser, W.replace("arguments", "parameters"), True),
    (MistralParser, '{"city": "Paris", "temp": 21}', True),
    (MistralParser, "[" + W + ", " + BARE + "]", True),
    (MistralParser, "[" + W.replace("weather", "wether") + "]", False),
])
def test_auto_with_a_response_format_is_calls_or_the_answer(compiler, parser, text, ok):
    """tool_choice auto with a JSON response_format: the output is calls, or JSON text that follows the answer's
    schema (OpenAI's reading: the format is the text answer's), and the parser reads each back as such."""
    assert _accepts(compiler, parser().grammar(TOOLS, "auto", True, None, ANSWER), text) is ok
    if ok and text.startswith('{"city"'):
        assert _parse(text, 3, parser) == (text, [])


def test_required_ignores_the_answer():
    assert HermesParser().grammar(TOOLS, "required", True, None, ANSWER) == HermesParser().grammar(TOOLS, "required")
    odd = {**ANSWER, "x-guidance": 5}                   # options that are no object: ignored, not a 500
    assert HermesParser().grammar(TOOLS[1:], "auto", True, None, odd).kind == "grammar_lark"     # strict tool


def test_a_non_strict_tool_ignores_a_pattern_llguidance_cannot_enforce(compiler):
    params = {"type": "object", "properties": {"pw": {"type": "string", "pattern": "^(?=.*\\d).{8,}$"}},
              "required": ["pw"]}
    login = parse_tools([{"type": "function", "function": {"name": "login", "parameters": params}}])
    call = '<tool_call>\n{"name": "login", "arguments": {"pw": "abc"}}\n</tool_call>'
    assert _accepts(compiler, HermesParser().grammar(login, "required"), call)
    with pytest.raises(P.ApiError, match="look-around"):
        parse_tools([{"type": "function", "function": {"name": "login", "parameters": params, "strict": True}}])


def test_beside_an_answer_a_tagged_call_starts_only_with_its_token(qwen05_file):
    """Qwen2.5's <tool_call> is one token: beside a JSON answer it is the only way into a tagged call, so a model
    that starts to write "<" (echoing <tool_response> after a result) is not forced into a call."""
    tok = Tokenizer.from_metadata(GGUFFile(str(qwen05_file)).metadata)
    oid = open_token(tok, HermesParser)
    assert oid is not None and tok.token_bytes(oid) == b"<tool_call>"
    lt = tok.encode("<", add_bos=False, special=False)
    assert len(lt) == 1
    with GrammarCompiler(tok) as c:
        def allowed_first(grammar) -> set[int]:
            m = c.compile(grammar).matcher()
            row = np.zeros(m.vocab.mask_words, np.int32)
            m.fill_mask(row)
            return {t for t in (oid, lt[0]) if (row[t // 32] >> (t % 32)) & 1}

        assert allowed_first(HermesParser().grammar(TOOLS, "auto", True, None, ANSWER, oid)) == {oid}
        assert allowed_first(HermesParser().grammar(TOOLS, "auto", True, None, ANSWER)) == {oid, lt[0]}
        grammar = HermesParser().grammar(TOOLS, "auto", True, None, ANSWER, oid)
        assert _accepts((tok, c), grammar, "\n" + W + "\n</tool_call>", (oid,))
        assert _accepts((tok, c), grammar, '{"city": "Paris", "temp": 21}')


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_tagged_call_closes_and_the_next_opens_with_their_tokens(qwen05_file, choice):
    """Qwen2.5's </tool_call> and <tool_call> are one token each: the grammar closes a call with its token (not
    forced as pieces the model never saw) and opens the next with its token only, so a model that starts to write
    "<" after a call (the <tool_response> it expects) is not forced into one more call."""
    tok = Tokenizer.from_metadata(GGUFFile(str(qwen05_file)).metadata)
    oid, cid = open_token(tok, HermesParser), close_token(tok, HermesParser)
    assert cid is not None and tok.token_bytes(cid) == b"</tool_call>"
    lt, nl = tok.encode("<", add_bos=False, special=False), tok.encode("\n", add_bos=False, special=False)
    call = [oid, *tok.encode("\n" + W + "\n", add_bos=False, special=False)]
    with GrammarCompiler(tok) as c:
        m = c.compile(HermesParser().grammar(TOOLS, choice, True, None, None, oid, cid)).matcher()
        row = np.zeros(m.vocab.mask_words, np.int32)

        def allowed(t: int) -> bool:
            m.fill_mask(row)
            return bool((row[t // 32] >> (t % 32)) & 1)

        for t in call:
            assert allowed(t)
            m.advance(t)
        assert allowed(cid) and not allowed(lt[0])
        m.advance(cid)
        for t in nl:
            m.advance(t)
        assert allowed(oid) and not allowed(lt[0]) and allowed(tok.eos_id)
        for t in [*call, cid, tok.eos_id]:
            m.fill_mask(row)
            m.advance(t)


def test_no_grammar_for_none():
    assert HermesParser().grammar(TOOLS, "none") is None and HermesParser().grammar([], "auto") is None


# --- the endpoint alone -----------------------------------------------------------------------------------------
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


class CallingWorker(ScriptedWorker):
    """Answers with content and a call, ending with "stop" (the model's end of turn)."""
    REPLY = ("Let me see. " + CALL).encode()

    async def submit(self, prompts, params):
        sub = await super().submit(prompts, params)
        items = []
        while not sub.queue.empty():
            items.append(sub.queue.get_nowait())
        for out in items:
            if out.finished:
                out.finish_reason = "stop"
            sub.queue.put_nowait(out)
        return sub


@pytest.fixture
def client():
    worker = CallingWorker()
    app = FastAPI()
    add_error_handlers(app)
    app.include_router(chat.router)
    app.state.chat = chat.ServingChat(worker, Prompter(worker.engine.tokenizer, TEMPLATE, 4096),
                                      Settings(model_id="bytes"))
    app.state.worker = worker
    return TestClient(app), worker


BODY = {"messages": [{"role": "user", "content": "add 1 and 2"}], "tools": [ADD, CITY]}


def test_endpoint_answers_tool_calls_whole_and_streamed(client):
    http, worker = client
    r = http.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me see."
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": {"c": "}"} }'}
    prompt = bytes(worker.submitted[0][0][0][1:]).decode()
    assert '"name": "add"' in prompt and "<tool_call>" in prompt          # the fallback system prompt
    assert worker.submitted[0][1][0].constraint.kind == "grammar_lark"

    with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as s:
        events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert content == "Let me see."
    assert calls[0]["id"] and calls[0]["type"] == "function" and calls[0]["function"]["name"] == "add"
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:]) and len(calls) > 2
    assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _joined(events: list[dict]) -> dict:
    """The message a client makes of a stream's deltas (the openai client's rule: a null is replaced, text is
    appended), and the finish_reason."""
    msg: dict = {}
    for e in events:
        for c in e["choices"]:
            for k, v in c["delta"].items():
                if k == "tool_calls":
                    for tc in v:
                        call = msg.setdefault("tool_calls", {}).setdefault(tc["index"], {"arguments": ""})
                        call["name"] = call.get("name") or tc["function"].get("name")
                        call["arguments"] += tc["function"]["arguments"]
                elif v is None:
                    msg.setdefault(k, None)
                elif msg.get(k) is None:
                    msg[k] = v
                else:
                    msg[k] += v
            msg["finish_reason"] = c["finish_reason"] or msg.get("finish_reason")
    return msg


@pytest.mark.parametrize("reply", [CALL, "Let me see.", "", CALL[:-25]])
def test_endpoint_stream_joins_to_the_whole_message(reply):
    """content too: null with only calls, "" with nothing at all, as the whole answer has it; a call whose
    arguments a stop string cut finishes with "stop", not "tool_calls"."""
    class Worker(CallingWorker):
        REPLY = reply.encode()

        async def submit(self, prompts, params):
            if self.REPLY:
                return await super().submit(prompts, params)
            sub = await ScriptedWorker.submit(self, prompts, params)      # no output for an empty reply: one
            sub.queue.put_nowait(RequestOutput("r0", prompts[0], [], "", True, "stop", RequestMetrics()))
            return sub

    http = _chat_client(Worker())
    whole = http.post("/v1/chat/completions", json=BODY).json()["choices"][0]
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as s:
        events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    joined = _joined(events)
    assert joined["content"] == whole["message"]["content"] == ({CALL: None, "": ""}.get(reply, reply)
                                                                if reply != CALL[:-25] else None)
    assert joined["finish_reason"] == whole["finish_reason"] == ("tool_calls" if reply == CALL else "stop")
    calls = [{"name": c["name"], "arguments": c["arguments"]} for c in joined.get("tool_calls", {}).values()]
    assert calls == [c["function"] for c in whole["message"].get("tool_calls", [])]



def _chat_client(worker) -> TestClient:
    """A client of the chat endpoint alone over worker (a scripted one), with the server's error handlers."""
    app = FastAPI()
    add_error_handlers(app)
    app.include_router(chat.router)
    app.state.chat = chat.ServingChat(worker, Prompter(worker.engine.tokenizer, TEMPLATE, 4096),
                                      Settings(model_id="bytes"))
    return TestClient(app)

TWO_CALLS = CALL + "\n" + CALL.replace('"a": 1', '"a": 7')


@pytest.mark.parametrize("size", [1, 5, len(TWO_CALLS)])
def test_endpoint_streams_one_call_entry_per_chunk_name_first(size):
    """As OpenAI streams a call: each chunk's tool_calls holds one entry; a call's first has its id, type and name
    and arguments "", the later ones only argument text. A client that starts a call on its id and appends the
    arguments of the entries without one, reading only tool_calls[0], gets the whole answer's calls, however
    many characters an engine output brings."""
    class Worker(CallingWorker):
        REPLY = TWO_CALLS.encode()

        async def submit(self, prompts, params):
            self.submitted.append((prompts, params))
            sub, ids, lo = Submission(["r0"]), list(self.REPLY), 0
            for hi in [*range(size, len(ids), size), len(ids)]:            # size characters an output
                done = hi == len(ids)
                sub.queue.put_nowait(RequestOutput("r0", prompts[0], ids[:hi], self.REPLY[:hi].decode(), done,
                                                   "stop" if done else None, RequestMetrics(),
                                                   delta_token_ids=ids[lo:hi], delta_text=self.REPLY[lo:hi].decode()))
                lo = hi
            return sub

    http = _chat_client(Worker())
    whole = http.post("/v1/chat/completions", json={**BODY, "max_tokens": 500}).json()["choices"][0]
    assert [json.loads(c["function"]["arguments"])["a"] for c in whole["message"]["tool_calls"]] == [1, 7]
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "max_tokens": 500, "stream": True}) as s:
        events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    calls: dict[int, dict] = {}
    for e in events:
        tcs = e["choices"][0]["delta"].get("tool_calls")
        if not tcs:
            continue
        assert len(tcs) == 1
        tc = tcs[0]
        if "id" in tc:                          # a call's first entry: its name, no argument text yet
            assert tc["type"] == "function" and tc["function"] == {"name": "add", "arguments": ""}
            calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls.values()] == [
        c["function"] for c in whole["message"]["tool_calls"]]
    finishes = [e["choices"][0]["finish_reason"] for e in events]
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])


MISTRAL_TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                    "{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "{# an assistant's tool_calls come back as [TOOL_CALLS] #}")


@pytest.mark.parametrize("template, flag, reply, key", [
    (MISTRAL_TEMPLATE, None, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', '"arguments"'),
    (TEMPLATE, "llama3", '{"name": "add", "parameters": {"a": 1, "b": 2}}', '"parameters"'),
])
def test_endpoint_reads_the_format_of_the_template_or_the_flag(template, flag, reply, key):
    class Worker(CallingWorker):
        REPLY = reply.encode()

    worker = Worker()
    app = FastAPI()
    add_error_handlers(app)
    app.include_router(chat.router)
    app.state.chat = chat.ServingChat(worker, Prompter(worker.engine.tokenizer, template, 4096),
                                      Settings(model_id="bytes", tool_call_parser=flag))
    r = TestClient(app).post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = [c["function"] for c in choice["message"]["tool_calls"]]
    assert calls == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    prompt = bytes(worker.submitted[0][0][0][1:]).decode()
    assert ("[AVAILABLE_TOOLS]" in prompt) is (template == MISTRAL_TEMPLATE)     # the template renders the tools
    grammar = worker.submitted[0][1][0].constraint.value
    assert "BARE_FIRST" in grammar and "<tool_call>" not in grammar and key in grammar


def test_endpoint_none_sends_no_grammar_and_no_parsing(client):
    http, worker = client
    r = http.post("/v1/chat/completions", json={**BODY, "tool_choice": "none"})
    msg = r.json()["choices"][0]["message"]
    assert msg["content"] == "Let me see. " + CALL and "tool_calls" not in msg
    assert worker.submitted[0][1][0].constraint is None
    prompt = bytes(worker.submitted[0][0][0][1:]).decode()
    assert "<tools>" not in prompt and '"add"' not in prompt           # not shown tools it may not call
    http.post("/v1/chat/completions", json=BODY)
    assert '"add"' in bytes(worker.submitted[1][0][0][1:]).decode()


@pytest.mark.parametrize("choice, answered", [("auto", True), ("required", False), ("none", True)])
def test_endpoint_takes_a_response_format_beside_tools(client, choice, answered):
    """OpenAI's Agents SDK sends its output type as response_format on every turn, tools or not: with auto the
    grammar allows the calls or the JSON answer, with required only calls, with none only the answer."""
    http, worker = client
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": ANSWER}}
    r = http.post("/v1/chat/completions", json={**BODY, "tool_choice": choice, "response_format": rf})
    assert r.status_code == 200, r.text
    c = worker.submitted[0][1][0].constraint
    assert (c.kind == "json_schema") is (choice == "none")
    assert ('"temp"' in c.value) is answered


def test_endpoint_answer_naming_no_tool_stays_content(client):
    """An answer (response_format json_object) shaped like a call of a tool that is not declared is content, whole
    and streamed."""
    http, worker = client
    answer = '{"name": "sub", "arguments": {"a": 1}}'
    worker.REPLY = answer.encode()
    body = {**BODY, "response_format": {"type": "json_object"}}
    msg = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg["content"] == answer and "tool_calls" not in msg
    events = [json.loads(line[6:]) for line in http.post("/v1/chat/completions", json={**body, "stream": True})
              .text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == answer
    assert not any("tool_calls" in e["choices"][0]["delta"] for e in events if e["choices"])


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": "add"}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": "1"}]},
     "messages"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),        # not JSON: no answer beside calls
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_endpoint_bad_requests_are_400_naming_the_field(client, extra, param):
    http, worker = client
    r = http.post("/v1/chat/completions", json={**BODY, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not worker.submitted


def test_a_template_with_tools_renders_them_itself():
    """Qwen2.5's template (from the llama-server goldens) takes the tools and the call history; no fallback."""
    from pathlib import Path
    data = json.loads((Path(__file__).parent.parent / "data" / "qwen2.5-chat.llamacpp.json").read_text())
    template = data["models"]["qwen2.5-coder-0.5b"]["template"]
    worker = ScriptedWorker()
    p = Prompter(worker.engine.tokenizer, template, 4096)
    msgs = [P.ChatMessage(**m) for m in ({"role": "user", "content": "1+2?"}, _assistant(),
                                        {"role": "tool", "tool_call_id": "call_1", "content": "3"})]
    text = p.render(msgs, True, TOOLS)
    assert "# Tools" in text and '"name": "add"' in text and "You are Qwen" in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    assert "<|im_start|>system\n# Tools" not in p.render(msgs[:1], True, TOOLS)   # the template's, not ours


# --- lumen.generate --tools -------------------------------------------------------------------------------------
def test_generate_tools_flags(tmp_path):
    from lumen.generate import UsageError, build_parser, tools_from_args
    f = tmp_path / "tools.json"
    f.write_text(json.dumps([ADD, CITY]))
    args = build_parser().parse_args(["--tools", str(f), "--tool-choice", "weather", "-p", "x"])
    tools, choice = tools_from_args(args)
    assert [t.name for t in tools] == ["add", "weather"] and choice == "weather"
    f.write_text(json.dumps({"tools": [ADD]}))                       # a request body's tools field too
    assert tools_from_args(build_parser().parse_args(["--tools", str(f), "-p", "x"]))[1] == "auto"
    assert tools_from_args(build_parser().parse_args(["-p", "x"])) is None
    for argv, words in [(["--tool-choice", "required"], "--tool-choice needs --tools"),
                        (["--tools", str(f), "--tool-choice", "nope"], "--tool-choice: tool_choice names"),
                        (["--tools", str(tmp_path / "missing.json")], "cannot read it")]:
        with pytest.raises(UsageError, match=words):
            tools_from_args(build_parser().parse_args([*argv, "-p", "x"]))
    f.write_text("[{")
    with pytest.raises(UsageError, match="not JSON"):
        tools_from_args(build_parser().parse_args(["--tools", str(f), "-p", "x"]))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}, "auto"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_marker_cut_by_max_tokens_is_content_only_where_content_may_be(choice, stream):
    """A model whose call marker is several tokens (SmolLM2: "<tool_" after 3 of them) cut by max_tokens answered
    tool_choice "required" with content "<tool_": the grammar allows no content there (nor for a named function),
    so nothing is; with "auto" the text stays the content it may be."""
    class Worker(CallingWorker):
        REPLY = b"<tool_"

        async def submit(self, prompts, params):
            self.submitted.append((prompts, params))
            sub, ids = Submission(["r0"]), list(self.REPLY)
            sub.queue.put_nowait(RequestOutput("r0", prompts[0], ids, self.REPLY.decode(), True, "length",
                                               RequestMetrics(), delta_token_ids=ids, delta_text=self.REPLY.decode()))
            return sub

    http = _chat_client(Worker())
    body = {**BODY, "tool_choice": choice, "max_tokens": 3, "stream": stream}
    if stream:
        with http.stream("POST", "/v1/chat/completions", json=body) as s:
            events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert not any(e["choices"][0]["delta"].get("tool_calls") for e in events if e["choices"])
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        msg, finish = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
        content = msg["content"] or ""
        assert "tool_calls" not in msg
    assert finish == "length" and content == ("<tool_" if choice == "auto" else "")
