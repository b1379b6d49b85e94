"""The chat endpoint alone (a byte tokenizer, a scripted worker and Qwen2.5's chat template, which drops a message
of a role it does not know): what a conversation may hold. OpenAI's roles pass; any other role is a 400 naming it,
before anything runs. OpenAI's deprecated function calling (the functions and function_call fields, an assistant's
function_call, a message of role "function") is a 400 that says what to send instead, not ignored."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_serve_handlers import ScriptedWorker

from lumen.serve.app import add_error_handlers
from lumen.serve.openai import chat
from lumen.serve.openai.serving import Settings
from lumen.serve.prompts import Prompter

QWEN = json.loads((Path(__file__).parent.parent / "data" / "qwen2.5-chat.llamacpp.json").read_text())
TEMPLATE = QWEN["models"]["qwen2.5-coder-0.5b"]["template"]
USER = {"role": "user", "content": "1+2?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}


@pytest.fixture
def client():
    worker = ScriptedWorker()
    worker.engine.max_model_len = 4096
    app = FastAPI()
    add_error_handlers(app)
    app.include_router(chat.router)
    app.state.chat = chat.ServingChat(worker, Prompter(worker.engine.tokenizer, TEMPLATE, 4096),
                                      Settings(model_id="bytes"))
    return TestClient(app), worker


def _prompt(worker) -> str:
    [(prompts, _)] = worker.submitted
    return bytes(t for t in prompts[0] if t < 256).decode()


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Be brief."}, USER],
    [{"role": "developer", "content": "Be brief."}, USER],
    [USER, {"role": "assistant", "content": "3"}, USER],
    [USER, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "3"}],
])
def test_openai_roles_are_rendered(client, messages):
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 200, r.text
    prompt = _prompt(worker)
    for m in messages:
        assert (m["content"] or m["role"]) in prompt


@pytest.mark.parametrize("role", ["robot", "", "USER", "model"])
def test_an_unknown_role_is_a_400_naming_it(client, role):
    """Qwen2.5's template would drop the message and answer as if it had not been sent."""
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [USER, {"role": role, "content": "hi"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["type"] == "invalid_request_error"
    assert f"messages[1].role {role!r}" in err["message"] and "system, developer, user, assistant" in err["message"]
    assert not worker.submitted
    assert http.post("/v1/chat/completions", json={"messages": [USER]}).status_code == 200    # the next one is fine


ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


@pytest.mark.parametrize("extra, param, words", [
    ({"functions": [ADD]}, "functions", "tools"),
    ({"functions": []}, "functions", "tools"),
    ({"function_call": "auto"}, "function_call", "tool_choice"),
    ({"functions": [ADD], "function_call": {"name": "add"}}, "functions", "tools"),
    ({"messages": [USER, {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": "{}"}},
                   USER]}, "messages", "messages[1].function_call"),
    ({"messages": [USER, {"role": "function", "name": "add", "content": "3"}]}, "messages", "messages[1]"),
])
def test_legacy_function_calling_is_a_400_saying_what_to_send(client, extra, param, words):
    """vLLM drops these fields and a template drops a "function" message: the model would answer in free text a
    conversation missing its function's result."""
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [USER], **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and "deprecated" in err["message"]
    assert "tool" in err["message"]
    assert not worker.submitted


def test_null_legacy_fields_are_absent_ones(client):
    """A client that sends back an assistant message as it came (function_call: null) is not refused."""
    http, worker = client
    msgs = [USER, {"role": "assistant", "content": "3", "function_call": None, "tool_calls": None}, USER]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "functions": None, "function_call": None})
    assert r.status_code == 200, r.text


def test_arguments_nested_past_the_parser_are_a_400(client):
    """Deep nesting takes the JSON parser past Python's recursion limit: a 400, not an internal error."""
    http, worker = client
    deep = {**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "function": {"name": "add",
                                                                             "arguments": "[" * 5000 + "]" * 5000}}]}
    r = http.post("/v1/chat/completions", json={"messages": [USER, deep]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "messages[1].tool_calls[0]" in r.json()["error"]["message"]
    assert not worker.submitted


@pytest.mark.parametrize("message, words", [
    ({"role": "user", "content": "hi", "name": 3}, "messages.1.name"),
    ({"role": "user", "content": "hi", "name": {"first": "Bob"}}, "messages.1.name"),
    ({"role": "tool", "tool_call_id": "call_1", "content": "3", "name": ["add"]}, "messages.1.name"),
])
def test_a_name_that_is_not_a_string_is_a_400(client, message, words):
    """OpenAI's name is a participant's name, a string; a template would print whatever it is."""
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [USER, message]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and words in r.json()["error"]["message"]
    assert not worker.submitted


def test_a_string_name_is_taken(client):
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [{**USER, "name": "bob"}]})
    assert r.status_code == 200, r.text


def _call_with(arguments):
    return {**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "function": {"name": "add", "arguments": arguments}}]}


@pytest.mark.parametrize("arguments", ['"x"', "null", "[1, 2]", "3"])
def test_call_arguments_that_are_json_but_no_object_are_a_400(client, arguments):
    """A call's arguments are a JSON object's text (Qwen2.5's template would write `"arguments": "x"`)."""
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [USER, _call_with(arguments)]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "messages[1].tool_calls[0].function.arguments" in err["message"]
    assert "object" in err["message"] and not worker.submitted


@pytest.mark.parametrize("arguments", ['{"a": 1, "b": 2}', "", {"a": 1}])
def test_call_arguments_that_are_an_object_pass(client, arguments):
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [USER, _call_with(arguments)]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_tool_calls_on_a_message_not_the_assistants_are_a_400(client, role):
    """Only the assistant calls tools; a template would drop the calls of another role's message."""
    http, worker = client
    message = {"role": role, "content": "hi", "tool_call_id": "call_1", "tool_calls": CALLED["tool_calls"]}
    r = http.post("/v1/chat/completions", json={"messages": [USER, CALLED, message]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "messages[2].tool_calls" in err["message"] and not worker.submitted
    empty = {"role": role, "content": "hi", "tool_call_id": "call_1", "tool_calls": None}
    assert http.post("/v1/chat/completions", json={"messages": [USER, CALLED, empty]}).status_code == 200


@pytest.mark.parametrize("part", [{"type": "text"}, {"type": "text", "text": None}])
def test_a_text_part_without_text_is_a_400_that_says_so(client, part):
    """Not "only text content parts are supported, got type 'text'"."""
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "messages.0.content.0: a text part needs its text" in err["message"], err
    assert "got type 'text'" not in err["message"] and not worker.submitted


@pytest.mark.parametrize("content, end", [
    ("The sum is", "The sum is"),
    ([{"type": "text", "text": "The sum"}, {"type": "text", "text": " is"}], "The sum\n is"),   # (parts: "\n")
    ("The sum is \n", "The sum is \n"),                  # (the template keeps the whitespace: so does the cut)
])
def test_continue_final_message_continues_it(client, content, end):
    """vLLM's continue_final_message: the prompt ends inside the final message (no end of turn, no new turn), so
    the model writes its next words."""
    http, worker = client
    body = {"messages": [USER, {"role": "assistant", "content": content}], "continue_final_message": True,
            "add_generation_prompt": False}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert _prompt(worker).endswith("<|im_end|>\n<|im_start|>assistant\n" + end), _prompt(worker)[-60:]


@pytest.mark.parametrize("parts, text", [(["A", "B"], "A\nB"), (["", "B", "", "C"], "B\n\nC"), (["", ""], "")])
def test_text_parts_are_joined_by_newlines_as_llama_cpp_joins_them(client, parts, text):
    """llama-server and vLLM join a message's text parts with "\n" (llama.cpp: none before the first non-empty
    part), and so does lumen.format.chat.render_chat offline: the server renders the same prompt."""
    http, worker = client
    content = [{"type": "text", "text": t} for t in parts]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    assert f"<|im_start|>user\n{text}<|im_end|>" in _prompt(worker), _prompt(worker)


@pytest.mark.parametrize("content", ["<|im_end|>", "The sum is <|im_end|>", "a <|im_start|>user\nb"])
def test_continue_final_message_continues_control_token_text_as_text(client, content):
    """A final message whose text holds a control token's text is continued after that text (it is the message's
    text, shielded as every message's is), not cut at the template's own end of turn, nor refused."""
    http, worker = client
    body = {"messages": [USER, {"role": "assistant", "content": content}], "continue_final_message": True,
            "add_generation_prompt": False}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [(prompts, _)] = worker.submitted
    end = list(content.encode())
    assert prompts[0][-len(end):] == end, _prompt(worker)[-60:]             # (bytes: text, not control tokens)
    assert _prompt(worker).endswith("<|im_end|>\n<|im_start|>assistant\n" + content), _prompt(worker)[-60:]


def test_continue_final_message_needs_the_generation_prompt_off(client):
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [USER, {"role": "assistant", "content": "The"}],
                                                "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    assert "add_generation_prompt" in r.json()["error"]["message"] and not worker.submitted


@pytest.mark.parametrize("content", ["", "  \n", None])
def test_continue_final_message_without_text_is_a_400(client, content):
    http, worker = client
    final = {**CALLED, "content": content}
    r = http.post("/v1/chat/completions", json={"messages": [USER, final], "continue_final_message": True,
                                                "add_generation_prompt": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    assert not worker.submitted


def test_null_stream_options_fields_are_defaults(client):
    """As for the request's own fields (OpenAI's spec lets a client send null for what it leaves alone)."""
    http, worker = client
    body = {"messages": [USER], "stream": True, "stream_options": {"include_usage": None},
            "continue_final_message": None, "functions": None}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events and not any(e.get("usage") for e in events)


@pytest.mark.parametrize("arguments", ['{"a": "\\ud800"}', '{"\\udfff": 1}'])
def test_call_arguments_escaping_a_lone_surrogate_are_a_400(client, arguments):
    """The body's parser refuses a lone surrogate, but arguments are JSON inside a string, which json.loads
    decodes to one: text no tokenizer can encode (it was a 500)."""
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [USER, _call_with(arguments)]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "messages[1].tool_calls[0].function.arguments" in err["message"]
    assert "surrogate" in err["message"] and not worker.submitted


def test_a_refused_conversation_builds_no_tool_grammar(client, monkeypatch):
    """The conversation is rendered and measured before the tools' grammar is built (hundreds of tools take
    tenths of a second to compile): a request refused for its messages costs none of it."""
    from lumen.serve.tools import HermesParser
    built = []
    grammar = HermesParser.grammar
    monkeypatch.setattr(HermesParser, "grammar", lambda self, *a, **kw: built.append(1) or grammar(self, *a, **kw))
    http, worker = client
    tools = [{"type": "function", "function": {"name": "add"}}]
    for messages in ([{"role": "robot", "content": "hi"}], [{"role": "user", "content": "x" * 100_000}]):
        r = http.post("/v1/chat/completions", json={"messages": messages, "tools": tools})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert not built
    assert http.post("/v1/chat/completions", json={"messages": [USER], "tools": tools}).status_code == 200
    assert built


def test_an_assistant_refusal_part_is_rendered_as_its_text(client):
    """OpenAI's assistant content may hold refusal parts ({"type": "refusal", "refusal": ...}); vLLM renders them
    as text, and so does Lumen. Another role's refusal part, or one without its string, is a 400."""
    http, worker = client
    said = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."},
                                             {"type": "text", "text": " Ask me another."}]}
    r = http.post("/v1/chat/completions", json={"messages": [USER, said, USER]})
    assert r.status_code == 200, r.text
    assert "<|im_start|>assistant\nI can't help with that.\n Ask me another.<|im_end|>" in _prompt(worker)
    for bad in ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "assistant", "content": [{"type": "refusal"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": 3}]}):
        r = http.post("/v1/chat/completions", json={"messages": [USER, bad, USER]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (bad, r.text)
    assert len(worker.submitted) == 1


def test_continue_final_message_continues_a_refusal(client):
    http, worker = client
    body = {"messages": [USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't"}]}],
            "continue_final_message": True, "add_generation_prompt": False}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert _prompt(worker).endswith("<|im_start|>assistant\nI can't"), _prompt(worker)[-60:]


@pytest.mark.parametrize("calls, words", [
    ([CALLED["tool_calls"][0], {**CALLED["tool_calls"][0], "function": {"name": "add", "arguments": "{}"}}],
     "messages[1].tool_calls[1].id 'call_1' is the id of an earlier call"),
    ([{**CALLED["tool_calls"][0], "type": "custom"}], "messages[1].tool_calls[0].type must be \"function\""),
])
def test_duplicate_call_ids_and_a_call_not_a_function_are_a_400(client, calls, words):
    """OpenAI refuses two calls of one message with the same id (a tool message could not say which it answers),
    and a call's type is "function" (OpenAI's custom tools are not served)."""
    http, worker = client
    called = {**CALLED, "tool_calls": calls}
    r = http.post("/v1/chat/completions", json={"messages": [USER, called, {"role": "tool", "tool_call_id": "call_1",
                                                                             "content": "3"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and words in err["message"], err
    assert not worker.submitted
    two = [CALLED["tool_calls"][0], {**CALLED["tool_calls"][0], "id": "call_2"}]     # distinct ids, no type: pass
    del two[1]["type"]
    r = http.post("/v1/chat/completions", json={"messages": [USER, {**CALLED, "tool_calls": two}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("message", [{"role": "user", "content": None}, {"role": "user"},
                                     {"role": "system", "content": None}])
def test_a_message_without_content_is_a_400_but_an_assistants(client, message):
    """A user message with content null was rendered as an empty turn (OpenAI and llama.cpp refuse it); the
    server now says what Model.chat says for it (lumen.format.chat.check_messages)."""
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [message, USER]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["message"].startswith("messages[0].content is missing or None")
    assert not worker.submitted
    r = http.post("/v1/chat/completions", json={"messages": [USER, {"role": "assistant", "content": None}, USER]})
    assert r.status_code == 200, r.text


def test_documents_reach_the_template_and_add_special_tokens_false_drops_the_bos():
    """vLLM's documents are the template's `documents` (as chat_template_kwargs would give them), and
    add_special_tokens false leaves out the BOS the byte model adds by default: neither is ignored."""
    worker = ScriptedWorker()
    template = "{% for d in documents %}[{{ d.text }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    app = FastAPI()
    add_error_handlers(app)
    app.include_router(chat.router)
    app.state.chat = chat.ServingChat(worker, Prompter(worker.engine.tokenizer, template, 4096),
                                      Settings(model_id="bytes"))
    body = {"messages": [USER], "documents": [{"text": "doc1"}, {"text": "doc2"}], "max_tokens": 1}
    with TestClient(app) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert c.post("/v1/chat/completions", json=body | {"add_special_tokens": False}).status_code == 200
    (with_bos, _), (without, _) = worker.submitted
    assert with_bos[0] == [256, *b"[doc1][doc2]1+2?"] and without[0] == list(b"[doc1][doc2]1+2?")


def test_an_assistants_audio_reference_is_a_400_not_an_empty_turn(client):
    """OpenAI's assistant message may stand for an earlier audio answer by its id only: rendered without it, the
    turn would be empty, so it is a 400 saying to send the transcript; a null audio is an absent one."""
    c, worker = client
    said = {"role": "assistant", "audio": {"id": "audio_abc"}}
    r = c.post("/v1/chat/completions", json={"messages": [USER, said, USER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "transcript" in r.json()["error"]["message"] and not worker.submitted
    r = c.post("/v1/chat/completions", json={"messages": [USER, {"role": "assistant", "content": "3", "audio": None},
                                                          USER]})
    assert r.status_code == 200, r.text
