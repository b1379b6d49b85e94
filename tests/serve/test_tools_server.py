"""Tool calling through a live server (test_serve.live_server) on Qwen2.5-Coder-0.5B-Instruct, with the official
`openai` client: `required` and named calls name a declared tool and their arguments validate (jsonschema); a
streamed answer's tool_calls deltas joined by the client equal the whole answer; bad tools, tool_choice,
dangling tool messages, unknown roles, deprecated function calling and call arguments nested past the JSON
parser or escaping a lone surrogate are 400s naming the field while concurrent good requests finish; and an
agent loop (the model calls a real Python function, gets its result as a tool message, and answers with it) works
end to end; and
--tool-call-parser llama3 / mistral hold the same model to those formats and read them back; and a tool from
openai.pydantic_function_tool ($defs and $ref) parses back through the client's parse() and stream(); and a
JSON response_format beside tools gives calls or JSON that follows it.
Skips when the model cannot be fetched (the qwen05_path fixture)."""
import asyncio
import json

import httpx
import jsonschema
import pytest
from test_serve import MODEL_ID, assert_error, live_server

import lumen

openai = pytest.importorskip("openai")

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers and return their sum.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}, "strict": True}}
TOOLS = [ADD, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_ADD = [{"role": "user", "content": "What is 1234 plus 4321? Use the add tool."}]
ASK_WEATHER = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def model(qwen05_path):
    return lumen.load(qwen05_path, ctx=1024, threads=2)


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, max_num_seqs=8) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _validate(call) -> dict:
    assert call.type == "function" and call.id
    assert call.function.name in SCHEMAS
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_validate(client, choice):
    for messages in (ASK_ADD, ASK_WEATHER):
        r = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_tokens=120)
        ch = r.choices[0]
        # OpenAI and vLLM: "tool_calls" when the model chose to call ("auto", "required"), "stop" when named
        assert ch.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls"), ch
        assert ch.message.tool_calls
        for call in ch.message.tool_calls:
            _validate(call)
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
        assert r.usage.completion_tokens > 0


def test_auto_calls_the_needed_tool(client):
    r = client.chat.completions.create(model=MODEL_ID, messages=ASK_ADD, tools=TOOLS, temperature=0, max_tokens=120)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
    assert [_validate(c) for c in ch.message.tool_calls][0] == {"a": 1234, "b": 4321}


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_stream_reassembles_to_the_whole_answer(client, choice):
    kw = dict(model=MODEL_ID, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, finish, first = "", {}, None, {}
    with client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw) as stream:
        for chunk in stream:
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    if d.index not in calls:                # the first delta of a call: id, type and name
                        assert d.id and d.type == "function" and d.function.name, d
                        first[d.index] = d.function.name
                        calls[d.index] = ""
                    calls[d.index] += d.function.arguments or ""
                finish = c.finish_reason or finish
    assert finish == whole.finish_reason
    if choice != "auto":                        # a named call finishes with "stop", as OpenAI's and vLLM's
        assert whole.message.tool_calls and finish == ("stop" if isinstance(choice, dict) else "tool_calls")
    assert (content or None) == whole.message.content
    assert [(first[i], json.loads(calls[i])) for i in sorted(calls)] == _calls(whole.message)
    assert [calls[i] for i in sorted(calls)] == [c.function.arguments for c in whole.message.tool_calls or []]


def test_agent_loop(client):
    """The model calls add, gets the real sum back as a tool message, and answers with it."""
    def add(a: int, b: int) -> int:
        return a + b

    messages = [{"role": "system", "content": "You are a helpful assistant. Call a tool when you need one; once "
                                              "you have its result, answer the user in words."}, *ASK_ADD]
    r = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=[ADD], temperature=0, max_tokens=120)
    msg = r.choices[0].message
    assert msg.tool_calls, msg
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        result = add(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": result})})
    r = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=[ADD], temperature=0, max_tokens=60)
    answer = r.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls, answer
    assert "5555" in answer.message.content.replace(",", "")


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "array", "uniqueItems": True}}}, "strict": True}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [ADD], "messages": ASK_ADD + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages"),
    ({"tools": [ADD], "messages": ASK_ADD + [{"role": "robot", "content": "1"}]}, "messages"),
    ({"functions": [ADD["function"]], "function_call": "auto"}, "functions"),
    ({"tools": [ADD], "messages": ASK_ADD + [{"role": "function", "name": "add", "content": "5555"}]}, "messages"),
    ({"tools": [ADD], "stream": True, "messages": ASK_ADD + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[" * 5000 + "]" * 5000}}]}]},
     "messages"),
    ({"tools": [ADD], "messages": ASK_ADD + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": "\\ud800"}'}}]}]},
     "messages"),
]


def test_bad_requests_are_400_and_neighbours_finish(server):
    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            good = {"model": MODEL_ID, "messages": ASK_ADD, "tools": [ADD], "tool_choice": "required",
                    "temperature": 0, "max_tokens": 60}
            bad = [{"model": MODEL_ID, "messages": ASK_ADD, **body} for body, _ in BAD]
            return await asyncio.gather(*[http.post("/v1/chat/completions", json=b) for b in [good, *bad, good]])

    rs = asyncio.run(go())
    for r, (_, param) in zip(rs[1:-1], BAD):
        assert_error(r, 400, param)
    for r in (rs[0], rs[-1]):
        assert r.status_code == 200, r.text
        call = r.json()["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "add"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["add"])


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_speculative_decoding_gives_the_same_calls(client, choice):
    """Greedy with n-gram speculation: the same answer, calls included, as without."""
    kw = dict(model=MODEL_ID, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120)
    plain = client.chat.completions.create(**kw).choices[0]
    spec = client.chat.completions.create(extra_body={"speculative": "ngram"}, **kw).choices[0]
    assert spec.finish_reason == plain.finish_reason and spec.message.content == plain.message.content
    assert _calls(spec.message) == _calls(plain.message) and spec.message.tool_calls


@pytest.mark.parametrize("fmt", ["llama3", "mistral"])
def test_other_formats_through_the_flag(model, fmt):
    """--tool-call-parser llama3 / mistral on Qwen: the grammar holds the model to that format (over the real
    vocabulary), the parser reads the call back, and the stream joins to the whole answer."""
    with live_server(model, max_num_seqs=2, tool_call_parser=fmt) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
        kw = dict(model=MODEL_ID, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", temperature=0,
                  max_tokens=80, parallel_tool_calls=False)
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1, whole
        assert _validate(whole.message.tool_calls[0])["city"] == "Paris"
        args, name = "", None
        with client.chat.completions.create(stream=True, **kw) as stream:
            for chunk in stream:
                for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    name = name or d.function.name
                    args += d.function.arguments or ""
        call = whole.message.tool_calls[0].function
        assert (name, args) == (call.name, call.arguments)


def test_pydantic_tools_with_defs_parse(client):
    """openai.pydantic_function_tool writes nested models as $defs and $ref (strict): the call validates and the
    client's parse() reads it back as the model, whole and streamed."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Place(BaseModel):
        city: str
        country: str | None

    class Forecast(BaseModel):
        """The weather forecast for a place."""
        place: Place
        unit: Literal["celsius", "fahrenheit"]
        days: int = Field(ge=1, le=7)

    tools = [openai.pydantic_function_tool(Forecast)]
    assert "$defs" in tools[0]["function"]["parameters"]
    ask = [{"role": "user", "content": "The forecast for Paris, France for 3 days, in celsius?"}]
    kw = dict(model=MODEL_ID, messages=ask, tools=tools, tool_choice="required", temperature=0, max_tokens=100)
    whole = client.beta.chat.completions.parse(**kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    [call] = whole.message.tool_calls
    assert isinstance(call.function.parsed_arguments, Forecast)
    with client.beta.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content is None
    assert [c.function.parsed_arguments for c in final.message.tool_calls] == [call.function.parsed_arguments]


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_format_beside_tools_gives_calls_or_its_json(client, stream):
    """As OpenAI's Agents SDK sends it (its output type as response_format, on every turn): 200 with calls that
    validate, or content that follows the schema; and no call for a tool the request does not declare."""
    report = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    rf = {"type": "json_schema", "json_schema": {"name": "report", "schema": report, "strict": True}}
    for messages in (ASK_ADD, [{"role": "user", "content": "Reply with the JSON report: the answer is 7."}]):
        kw = dict(model=MODEL_ID, messages=messages, tools=TOOLS, response_format=rf, temperature=0, max_tokens=120)
        if stream:
            with client.chat.completions.stream(**kw) as s:
                for _ in s:
                    pass
                r = s.get_final_completion()
        else:
            r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        if msg.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls"
            for call in msg.tool_calls:
                _validate(call)
        else:
            jsonschema.validate(json.loads(msg.content), report)
