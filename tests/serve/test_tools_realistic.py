"""Tool calling on tools the other tests never saw, through a live server (test_serve.live_server) on
Qwen2.5-Coder-0.5B-Instruct with the official `openai` client: nested objects, enums, arrays of objects, a tool
without parameters, bounded numbers and unicode enum values, six at once. Every call that comes back, whole or
joined from a stream's deltas as a client joins them, names a declared tool and its arguments validate against
its schema; no reply has content beside a call that is only leftover markup; a call, its result sent back as a
tool message, and the model's next turn go through. Skips when the model cannot be fetched (qwen05_path)."""
import json

import jsonschema
import pytest
from test_serve import MODEL_ID, live_server

import lumen

openai = pytest.importorskip("openai")


def _fn(name, desc, params=None):
    f = {"name": name, "description": desc}
    if params is not None:
        f["parameters"] = params
    return {"type": "function", "function": f}


def _obj(props, required=()):
    return {"type": "object", "properties": props, "required": list(required)}


TOOLS = [
    _fn("get_current_time", "Return the current UTC time."),
    _fn("convert_currency", "Convert money between currencies.", _obj({
        "amount": {"type": "number", "exclusiveMinimum": 0},
        "from_currency": {"enum": ["USD", "EUR", "JPY", "CHF"]}, "to_currency": {"enum": ["USD", "EUR", "JPY", "CHF"]}},
        ["amount", "from_currency", "to_currency"])),
    _fn("place_order", "Order products.", _obj({
        "items": {"type": "array", "minItems": 1, "items": _obj({"sku": {"type": "string"},
                                                                 "quantity": {"type": "integer", "minimum": 1}},
                                                                ["sku", "quantity"])},
        "shipping": {"enum": ["standard", "express"]}}, ["items", "shipping"])),
    _fn("update_user", "Update a user's profile.", _obj({
        "user_id": {"type": "integer"},
        "address": _obj({"city": {"type": "string"}, "country": {"type": "string"}}, ["city"])}, ["user_id"])),
    _fn("translate_text", "Translate a short text.", _obj({
        "text": {"type": "string"}, "target_language": {"enum": ["français", "日本語", "Deutsch"]}},
        ["text", "target_language"])),
    _fn("set_thermostat", "Set a room's temperature.", _obj({
        "room": {"enum": ["bedroom", "office"]}, "temperature": {"type": "number", "minimum": 10, "maximum": 30}},
        ["room", "temperature"])),
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {},
                                                                    "additionalProperties": False})
           for t in TOOLS}
ASKS = ["What time is it?", "How much is 250 euros in Japanese yen?",
        "Order 2 of SKU A-100 and 1 of SKU B-7 with express shipping.",
        "Translate 'Good morning' into Japanese.", "Set the bedroom to 21.5 degrees."]


@pytest.fixture(scope="module")
def client(qwen05_path):
    model = lumen.load(qwen05_path, ctx=1024, threads=2)
    with live_server(model, max_num_seqs=8) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _check(calls: list[tuple[str, str]]) -> None:
    for name, args in calls:
        assert name in SCHEMAS, name
        jsonschema.validate(json.loads(args), SCHEMAS[name])


def _joined(stream) -> tuple[str | None, list[tuple[str, str]], str]:
    content, calls, finish = None, {}, None
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                content = (content or "") + c.delta.content
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name, d
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index][1] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_calls_validate_whole_and_streamed(client, choice):
    for ask in ASKS:
        kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": ask}], tools=TOOLS, tool_choice=choice,
                  temperature=0, max_tokens=150)
        whole = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert calls or choice == "auto", whole
        _check(calls)
        if calls:
            assert whole.finish_reason == "tool_calls", whole
            # content beside a call is text the model wrote, never what is left of a call's markup
            assert whole.message.content is None or whole.message.content.strip(" \n`{}"), whole.message.content
        content, streamed, finish = _joined(client.chat.completions.create(stream=True, **kw))
        assert (content, streamed, finish) == (whole.message.content, calls, whole.finish_reason), ask


def test_a_tool_result_sent_back_gets_an_answer(client):
    messages = [{"role": "user", "content": "How much is 250 euros in Japanese yen?"}]
    r = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=100)
    msg = r.choices[0].message
    assert msg.tool_calls
    messages.append(msg.model_dump(exclude_none=True))
    for c in msg.tool_calls:
        messages.append({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"amount": 40250})})
    for stream in (False, True):
        kw = dict(model=MODEL_ID, messages=messages, tools=TOOLS, temperature=0, max_tokens=80)
        if stream:
            content, calls, finish = _joined(client.chat.completions.create(stream=True, **kw))
        else:
            ch = client.chat.completions.create(**kw).choices[0]
            content, finish = ch.message.content, ch.finish_reason
            calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        assert content or calls
        _check(calls[:-1] if finish == "length" else calls)     # (max_tokens may cut the last call)
        assert finish in ("stop", "tool_calls", "length")
