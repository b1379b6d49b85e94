"""Request parameters as an OpenAI client sends them, through a live server (test_serve.live_server): the
defaults it leaves out, and the edges of their ranges."""
import httpx
import openai
import pytest

import lumen
from lumen.serve.protocol import MAX_STOP
from servers import sse_events
from test_serve import MAX_MODEL_LEN, live_server


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=2048, threads=2)


@pytest.fixture(scope="module")
def http(model):
    with live_server(model) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        yield c


def test_completions_max_tokens_defaults_to_16_and_null_is_the_rest(http):
    """OpenAI's legacy completions (and vLLM) default max_tokens to 16; an explicit null is the rest of the
    context (vLLM)."""
    body = {"prompt": "Count: 1, 2, 3,", "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body).json()
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
    long = {"prompt": [28] * (MAX_MODEL_LEN - 24), "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=long | {"max_tokens": None}).json()
    assert r["usage"]["completion_tokens"] == 24 and r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("fields, param", [({"max_completion_tokens": 0}, "max_completion_tokens"),
                                           ({"max_completion_tokens": -5, "max_tokens": 3}, "max_completion_tokens"),
                                           ({"max_tokens": 0}, "max_tokens")])
def test_chat_max_tokens_error_names_the_field_sent(http, fields, param):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"].startswith(param), r.text


@pytest.mark.parametrize("seed", [-1, -(2 ** 63), 2 ** 63 - 1])
def test_any_int64_seed_is_reproducible(http, seed):
    """OpenAI's seed is any 64-bit integer (vLLM's too): a negative one is a seed like another, not a 400."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": seed}
    a, b = (http.post("/v1/completions", json=body) for _ in range(2))
    assert a.status_code == 200, a.text
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]


@pytest.mark.parametrize("seed", [2 ** 63, -(2 ** 63) - 1])
def test_seed_past_int64_is_400(http, seed):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_stop_list_is_bounded(http):
    """The engine checks every stop string at every token, on the thread that steps every request: thousands of
    them would slow every stream (25 ms a token for 10,000). At most MAX_STOP, like a list OpenAI's four fit in."""
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0}
    assert http.post("/v1/completions", json=body | {"stop": [f"s{i}" for i in range(MAX_STOP)]}).status_code == 200
    r = http.post("/v1/completions", json=body | {"stop": [f"s{i}" for i in range(MAX_STOP + 1)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                "stop": ["a"] * 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_include_stop_str_in_output_ends_the_text_with_the_stop(http, path):
    """vLLM's include_stop_str_in_output: the text goes on to the end of the stop string that matched, streamed
    or whole; without it the text ends before it."""
    body = {"max_tokens": 40, "temperature": 0, "stop": [" 5", ", 6"]}
    body |= {"prompt": "1, 2, 3, 4,"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]}
    text = (lambda c: c["text"]) if path == "/v1/completions" else (lambda c: c["message"]["content"])
    plain = http.post(path, json=body).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["stop_reason"] in body["stop"]
    whole = http.post(path, json=body | {"include_stop_str_in_output": True}).json()["choices"][0]
    assert text(whole) == text(plain) + plain["stop_reason"] and whole["finish_reason"] == "stop"
    with http.stream("POST", path, json=body | {"include_stop_str_in_output": True, "stream": True}) as r:
        choices = [c for e in sse_events(r) for c in e["choices"]]
    part = (lambda c: c["text"]) if path == "/v1/completions" else (lambda c: c["delta"].get("content") or "")
    assert "".join(part(c) for c in choices) == text(whole) and choices[-1]["finish_reason"] == "stop"
    assert text(http.post(path, json=body | {"include_stop_str_in_output": None}).json()["choices"][0]) == text(plain)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_MODEL_LEN},
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": MAX_MODEL_LEN},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": [28] * MAX_MODEL_LEN, "max_tokens": 1}, "prompt"),
])
def test_too_long_for_the_context_names_the_field_at_fault(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "max_model_len" in r.json()["error"]["message"]


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


@pytest.mark.parametrize("extra", [
    {},
    {"tools": [TOOL]},
    {"tools": [TOOL], "tool_choice": "none"},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}],
     "continue_final_message": True, "add_generation_prompt": False},
])
def test_tokenize_messages_counts_what_a_chat_request_uses(http, extra):
    """/tokenize with a chat request's messages (and its tools, continue_final_message) gives the prompt ids the
    chat request runs: its usage.prompt_tokens and prompt_token_ids."""
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}]} | extra
    chat = http.post("/v1/chat/completions", json=body | {"max_tokens": 1, "return_token_ids": True})
    assert chat.status_code == 200, chat.text
    chat = chat.json()
    tok = http.post("/tokenize", json=body)
    assert tok.status_code == 200, tok.text
    assert tok.json()["count"] == chat["usage"]["prompt_tokens"]
    assert tok.json()["tokens"] == chat["choices"][0]["prompt_token_ids"]


def test_tokenize_refuses_continue_final_message_with_a_generation_prompt(http):
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2, "logprobs": True,
                              "top_logprobs": 2, "seed": 1}),
    ("/v1/completions", {"prompt": ["Hi", "Bye"], "n": 2, "logprobs": 2, "seed": 1}),
    ("/v1/completions", {"prompt": ["Hi", "Bye"], "n": 2, "echo": True, "seed": 1}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_responses_validate_against_the_openai_clients_models(http, path, body, stream):
    """Every body and chunk validates (not merely constructs, as the client does) against openai's own pydantic
    models: ids, created, object, choices' finish_reason literals, logprobs, usage with prompt_tokens_details.
    (Not echo with logprobs: the first prompt token's logprob is null, as OpenAI's legacy API and vLLM answer it,
    which openai's Logprobs type does not allow for.)"""
    from openai.types import Completion, CompletionUsage
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    chat = path.endswith("chat/completions")
    body = body | {"max_tokens": 3}
    if not stream:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        got = (ChatCompletion if chat else Completion).model_validate(r.json())
        assert got.usage.prompt_tokens_details.cached_tokens >= 0
        assert sorted(c.index for c in got.choices) == list(range(2 if chat else 4))
        return
    with http.stream("POST", path, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    for e in events:        # (openai's Completion, which its streams use too, has no null finish_reason)
        if chat or all(c["finish_reason"] is not None for c in e["choices"]):
            (ChatCompletionChunk if chat else Completion).model_validate(e)
    assert len({e["id"] for e in events}) == 1 and events[-1]["choices"] == []
    usage = CompletionUsage.model_validate(events[-1]["usage"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert sum(e["choices"][0]["finish_reason"] is not None for e in events[:-1]) == (2 if chat else 4)


@pytest.mark.parametrize("kw, param", [
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"extra_body": {"n_predict": 4}}, "n_predict"),
    ({"extra_body": {"mirostat": 2}}, "mirostat"),
])
def test_the_openai_client_is_told_what_is_not_supported(http, kw, param):
    """Sent through the openai client, a field this server would otherwise drop is a BadRequestError naming it."""
    client = openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **kw)
    assert e.value.body["param"] == param
