"""The shapes a Qwen2.5 model writes a call in besides a clean `<tool_call>{...}</tool_call>`, read by the Hermes
parser the same whether the text comes whole or a few characters at a time: arguments as a JSON string (OpenAI
clients parse a call's arguments as an object: the string's text is sent, as llama.cpp reads it), a call without
arguments, and a malformed call, which comes back as the text it is, never as a call whose arguments do not parse."""
from __future__ import annotations

import json

import pytest

from lumen.serve.tools import HermesParser, assemble

NAMES = ["add", "get_current_time"]


def _parse(text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    p, content, deltas = HermesParser(names=NAMES), [], []
    for a in range(0, len(text), step):
        c, d = p.feed(text[a:a + step])
        content.append(c)
        deltas += d
    c, d = p.finish()
    return "".join(content) + c, [(x["function"]["name"], x["function"]["arguments"]) for x in assemble(deltas + d)]


ARGS = '{"a": 1, "b": "x}"}'
STRING = json.dumps(ARGS)                   # "{\"a\": 1, \"b\": \"x}\"}"


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "add", "arguments": ' + STRING + '}\n</tool_call>', "", [("add", ARGS)]),
    ('{"name": "add", "arguments": ' + STRING + '}', "", [("add", ARGS)]),
    ('```json\n{"name": "add", "arguments": ' + STRING + '}\n```', "", [("add", ARGS)]),
    ('<tool_call>\n{"arguments": ' + STRING + ', "name": "add"}\n</tool_call>', "", [("add", ARGS)]),
    ('<tool_call>\n{"name": "get_current_time", "arguments": ""}\n</tool_call>', "", [("get_current_time", "{}")]),
    ('<tool_call>\n{"name": "get_current_time"}\n</tool_call>', "", [("get_current_time", "{}")]),
])
def test_arguments_as_a_json_string_or_none_are_the_objects_text(text, content, calls):
    for step in (len(text), 1, 2, 3, 7):
        got = _parse(text, step)
        assert got == (content, calls), step
        for _, args in got[1]:
            assert isinstance(json.loads(args), dict)


CODE = {"code": 'print("</tool_call>")', "note": "a \\\" quote, then </tool_call> again"}


@pytest.mark.parametrize("args", [json.dumps(CODE), json.dumps(json.dumps(CODE))])
def test_a_close_marker_inside_an_argument_string_is_the_strings_text(args):
    """The close marker's text inside a JSON string (code that prints it) is part of the argument, not the call's
    end: the grammar lets a string hold it as ordinary tokens. It cut the call there: a whole answer came back as
    content and no call, a stream as a call with truncated arguments and the rest as content."""
    text = '<tool_call>\n{"name": "add", "arguments": ' + args + '}\n</tool_call>\n<tool_call>\n' \
           '{"name": "get_current_time", "arguments": {}}\n</tool_call>'
    for step in (len(text), 1, 2, 3, 7):
        content, calls = _parse(text, step)
        assert content == "" and [name for name, _ in calls] == ["add", "get_current_time"], step
        assert json.loads(calls[0][1]) == CODE and calls[1][1] == "{}", step


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": }\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}, }\n</tool_call>',
    '<tool_call>\n{"name": add, "arguments": {"a": 1}}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": "not json"}\n</tool_call>',
    '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',
    '{"name": "add", "arguments": {"a": 1, "b": }}',
])
def test_a_malformed_whole_call_is_its_text(text):
    """The whole answer (how the server reads a non-streamed reply) of a call that does not parse is content."""
    assert _parse("Let me add.\n" + text, len(text) + 20) == ("Let me add.\n" + text, [])


def test_extra_keys_in_a_call_stay_out_of_its_arguments():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}, "id": "x"}\n</tool_call>'
    assert _parse(text, len(text)) == ("", [("add", '{"a": 1}')])


# --- the grammar: a call in a ```json fence ends with the fence ---------------------------------------------------
@pytest.fixture(scope="module")
def compiler(smollm2_path):
    from lumen.engine.structured.compiler import GrammarCompiler
    from lumen.format.gguf import GGUFFile
    from lumen.format.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(GGUFFile(str(smollm2_path)).metadata)
    with GrammarCompiler(tok) as c:
        yield tok, c


def _accepts(compiler, constraint, text: str) -> bool:
    import numpy as np
    tok, c = compiler
    m = c.compile(constraint).matcher()
    row = np.zeros(m.vocab.mask_words, np.int32)
    try:
        for t in [*tok.encode(text, add_bos=False, special=False), tok.eos_id]:
            m.fill_mask(row)
            m.advance(t)
    except Exception:                        # noqa: BLE001 - StructuredOutputError: the token is not allowed
        return False
    return True


T = '{"name": "get_current_time", "arguments": {}}'
A = '{"name": "add", "arguments": {"a": 1}}'


@pytest.mark.parametrize("parallel, text, ok", [
    (True, "```json\n" + T + "\n```", True),
    (True, "```json\n" + T + "\n" + A + "\n```", True),
    (True, "```json\n" + T + "\n```\n", True),
    (True, "```json\n" + T + "\n```\nThe time is coming.", True),
    (True, "```\n" + T + "\n```", True),
    (False, "```json\n" + T + "\n```", True),
    # Qwen2.5-Coder-0.5B wrote one brace too many after a fenced call, and it came back as content "}\n```"
    (True, "```json\n" + T + "\n}\n```", False),
    (True, "```json\n" + T, False),                       # the fence must close
    (False, "```json\n" + T, False),
    (True, T, True),                                      # a bare call without a fence needs no end
    (True, T + '\n{"result": 3}', True),
])
def test_a_fenced_call_ends_with_its_fence(compiler, parallel, text, ok):
    from lumen.serve.tools import parse_tools
    tools = parse_tools([{"type": "function", "function": {"name": "get_current_time"}},
                         {"type": "function", "function": {"name": "add", "parameters": {
                             "type": "object", "properties": {"a": {"type": "integer"}}}}}])
    assert _accepts(compiler, HermesParser().grammar(tools, "auto", parallel), text) is ok
