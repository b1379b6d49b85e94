"""Structured output through a live server (test_serve.live_server: uvicorn on 127.0.0.1 over an Engine on SmolLM2):
with the official `openai` client, every output of the schemas (sampled at temperature 0.8, two seeds, concurrent)
validates with jsonschema, on chat (response_format json_schema) and completions (vLLM's structured_outputs in
extra_body), streamed and whole; regex, choice, GBNF and llama-server's json_schema / grammar fields; invalid
schemas, regexes and grammars are 400s naming the field with llguidance's message (one that fails only against the
vocabulary too), and a bad request sent between good concurrent ones harms none of them."""
import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from test_serve import MODEL_ID, assert_error, live_server, sse_events
from test_structured_engine import SCHEMAS

import lumen

openai = pytest.importorskip("openai")
SEEDS = (0, 1)
USER = [{"role": "user", "content": "Describe the data as JSON."}]


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=2048, threads=2)


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, max_num_seqs=16) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture
def aclient(server):
    """An async client for one asyncio.run (its connections belong to that loop)."""
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_client_schemas_validate(aclient):
    """Chat with response_format json_schema, completions with structured_outputs.json: all concurrent."""
    async def chat(name, seed):
        r = await aclient.chat.completions.create(
            model=MODEL_ID, messages=USER, temperature=0.8, seed=seed, max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}})
        return r.choices[0].finish_reason, r.choices[0].message.content

    async def completion(name, seed):
        r = await aclient.completions.create(model=MODEL_ID, prompt="JSON:\n", temperature=0.8, seed=seed,
                                             max_tokens=200, extra_body={"structured_outputs": {"json": SCHEMAS[name]}})
        return r.choices[0].finish_reason, r.choices[0].text

    async def go():
        jobs = [(name, seed, f) for name in SCHEMAS for seed in SEEDS for f in (chat, completion)]
        return jobs, await asyncio.gather(*(f(name, seed) for name, seed, f in jobs))
    jobs, results = asyncio.run(go())
    assert [r for r in results if r[0] != "stop"] == []
    for (name, seed, f), (_, text) in zip(jobs, results):
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_streamed_json_object(server):
    """A streamed json_object ends in one valid object. Greedy, and the prompt asks for a small one: a json_object
    is free, and at temperature 0.7 this model can write one until max_tokens (a string value of 400 tokens at
    seed 5, seen when the kernels' bits changed)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    ask = [{"role": "user", "content": 'Reply with one small JSON object, like {"name": "Ann", "age": 30}.'}]
    stream = client.chat.completions.create(model=MODEL_ID, messages=ask, max_tokens=400, stream=True,
                                            temperature=0, response_format={"type": "json_object"})
    parts, reasons = [], []
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    text = "".join(parts)
    assert reasons[-1] == "stop", text
    assert isinstance(json.loads(text), dict)
    assert len(parts) > 2, parts                                    # streamed: the object came in pieces


GBNF = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z]{2,8}\n'


@pytest.mark.parametrize("path, extra, check", [
    ("/v1/completions", {"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, r"\d{3}-\d{4}"),
    ("/v1/chat/completions", {"guided_regex": r"(yes|no)"}, r"(yes|no)"),
    ("/v1/completions", {"guided_choice": ["Paris", "London", "Tokyo"]}, r"Paris|London|Tokyo"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": ["red", "green"]}}, r"red|green"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": GBNF}}, r"(hello|hi) [A-Z][a-z]{2,8}!"),
    ("/v1/completions", {"guided_grammar": 'start: "x" /[0-9]{2}/'}, r"x[0-9]{2}"),                 # Lark
    ("/v1/completions", {"grammar": GBNF}, r"(hello|hi) [A-Z][a-z]{2,8}!"),                       # llama-server
    ("/v1/chat/completions", {"json_schema": {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                                              "required": ["n"], "additionalProperties": False}},
     r'\{\s*"n"\s*:\s*[12]\s*\}'),                                                            # llama-server
], ids=["so-regex", "guided_regex", "guided_choice", "so-choice", "so-gbnf", "guided_grammar-lark",
        "llama-grammar", "llama-json_schema"])
def test_regex_choice_grammar_fields(http, path, extra, check):
    body = {"max_tokens": 40, "temperature": 0.7, "seed": 1, **extra}
    body |= {"prompt": "Answer: "} if path == "/v1/completions" else {"messages": USER}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and re.fullmatch(check, text), text
    r = http.post(path, json=body | {"stream": True})                      # the stream says the same
    pieces = [e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content") or ""
              for e in sse_events(r) if e.get("choices")]
    assert "".join(pieces) == text


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
      "properties": {"a": {"type": "strng"}}}}}}, "response_format", "strng"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True},
                                                                  "strict": True}}},
     "response_format", "uniqueItems"),                               # strict: every keyword enforced, or a 400
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "regex"),
    ({"guided_regex": "a", "json_schema": {"type": "object"}}, "json_schema", "conflicting"),
    ({"grammar": 'root ::= "a" undefined_rule'}, "grammar", "undefined_rule"),
    ({"structured_outputs": {"grammar": 'start: "a" <[999999]>'}}, "structured_outputs", "999999"),   # vocabulary
    ({"guided_choice": []}, "guided_choice", "empty"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("extra, param, message", BAD, ids=[b[1] + "-" + b[2] for b in BAD])
def test_invalid_is_400_naming_the_field(http, server, path, extra, param, message):
    body = {"max_tokens": 5, **extra} | ({"prompt": "x"} if path == "/v1/completions" else {"messages": USER})
    steps = server.engine.steps
    r = http.post(path, json=body)
    assert_error(r, 400, param)
    assert message in r.json()["error"]["message"]
    assert server.engine.steps == steps                        # never reached the engine


def test_bad_request_between_good_concurrent_ones(server, aclient):
    schema = SCHEMAS["enums"]

    async def good(seed):
        r = await aclient.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=100, temperature=0.8,
                                                  seed=seed, extra_body={"guided_json": schema})
        return json.loads(r.choices[0].message.content)

    async def bad():
        with pytest.raises(openai.BadRequestError, match="strng"):
            await aclient.chat.completions.create(model=MODEL_ID, messages=USER, max_tokens=100,
                                                  extra_body={"guided_json": {"type": "strng"}})
        return "refused"

    async def go():
        return await asyncio.gather(good(1), good(2), bad(), good(3), good(4))
    results = asyncio.run(go())
    assert results[2] == "refused"
    for obj in results[:2] + results[3:]:
        jsonschema.validate(obj, schema)


def test_a_grammar_llguidance_gives_up_on_is_a_400(http):
    """A pattern llguidance compiles but whose lexer exceeds its limits at the first character: a 400 naming the
    field (a stream: an error event with code 400), and the next request is served."""
    schema = {"type": "string", "pattern": "^((a{100}){100}){100}$"}
    body = {"messages": USER, "max_tokens": 5, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}}
    r = http.post("/v1/chat/completions", json=body)
    assert_error(r, 400, "response_format")
    assert "llguidance cannot follow this grammar" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json=body | {"stream": True})
    errors = [e["error"] for e in sse_events(r) if "error" in e]
    assert errors and errors[0]["code"] == 400 and errors[0]["param"] == "response_format"
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 5})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
