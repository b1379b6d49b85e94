"""lumen.serve through live servers (uvicorn in a thread of this process, on a free port of 127.0.0.1, over an
Engine that shares the test's SmolLM2 weights): the official `openai` client sync and async, streamed and not,
completions and chat, each answer equal to `Model.generate` run alone; the parameters (n, seeds, logprobs,
stop, logit_bias, prompt forms, usage with cached tokens, X-Request-Id); /tokenize, /detokenize, /v1/models,
/health, /metrics; and every error row of the issue's table over raw HTTP, each leaving the server serving.
The load test, the shutdown test and the command line are in test_serve_load.py."""
import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

import lumen
from lumen import SamplingParams
from lumen.engine.engine import Engine
from lumen.engine.sampling.sampler import SamplerError
from lumen.format.chat import chat_template_from_metadata, render_chat
from lumen.serve.app import make_app
from servers import sse_events

openai = pytest.importorskip("openai")

MODEL_ID = "smol"
MAX_MODEL_LEN = 1024
MAX_BODY = 256 * 1024


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=2048, threads=2)


@contextmanager
def live_server(model, *, max_num_seqs=8, **app_kw):
    """A server on a free port of 127.0.0.1 in a thread of this process; stopped (and its engine thread joined)
    on exit."""
    import uvicorn
    engine = Engine(model, threads=2, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs, kv_cache_mb=32)
    app_kw.setdefault("max_body_bytes", MAX_BODY)
    app, worker = make_app(engine, model_name=MODEL_ID, **app_kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        assert thread.is_alive() and time.monotonic() - t0 < 60, "the server did not start"
        time.sleep(0.02)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{sock.getsockname()[1]}", engine=engine, worker=worker)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def server(model):
    with live_server(model) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def reference(model, ids, **kw) -> list[int]:
    """The tokens Model.generate makes alone for these prompt ids (end tokens are not yielded)."""
    return [t.id for t in model.generate(list(ids), params=SamplingParams(**kw))]


def strip_end(model, ids) -> list[int]:
    return [t for t in ids if t not in model.tokenizer.eot_ids]


def chat_ids(model, messages) -> list[int]:
    tok = model.tokenizer
    text = render_chat(chat_template_from_metadata(model.metadata), messages, bos_token=tok.token_text(tok.bos_id),
                       eos_token=tok.token_text(tok.eos_id))
    return model.tokenize(text, special=True)


def assert_error(r: httpx.Response, status: int, param: str | None = None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err


# ---------------------------------------------------------------------------------------------------------
# the official openai client

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow."}]


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_openai_client(server, model, kind, stream, mode):
    ids = model.tokenize(PROMPT) if kind == "completions" else chat_ids(model, MESSAGES)
    want = model.detokenize(strip_end(model, reference(model, ids, max_tokens=12, temperature=0)))
    kw = dict(model=MODEL_ID, max_tokens=12, temperature=0)
    kw.update(prompt=PROMPT) if kind == "completions" else kw.update(messages=MESSAGES)
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})

    def collect(res):
        if not stream:
            c = res.choices[0]
            return (c.text if kind == "completions" else c.message.content), c.finish_reason, res.usage, res.model
        text, finish, usage = "", None, None
        for chunk in res:
            if chunk.usage is not None:
                usage = chunk.usage
                assert chunk.choices == []
                continue
            c = chunk.choices[0]
            text += (c.text if kind == "completions" else c.delta.content or "")
            finish = c.finish_reason or finish
        return text, finish, usage, chunk.model

    if mode == "sync":
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        api = client.completions if kind == "completions" else client.chat.completions
        text, finish, usage, name = collect(api.create(**kw))
    else:
        async def go():
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            api = client.completions if kind == "completions" else client.chat.completions
            res = await api.create(**kw)
            if not stream:
                return collect(res)
            chunks = [c async for c in res]
            await client.close()
            return collect(iter(chunks))
        text, finish, usage, name = asyncio.run(asyncio.wait_for(go(), 60))
    assert text == want
    assert finish in ("stop", "length") and name == MODEL_ID
    assert usage.prompt_tokens == len(ids) and 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_openai_client_models_and_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2, temperature=-1)
    assert "temperature" in str(e.value)


# ---------------------------------------------------------------------------------------------------------
# what a request asks for

def test_seeded_stream_equals_generate_token_for_token(http, model):
    body = {"prompt": "Once upon a time, in a small village,", "max_tokens": 20, "temperature": 0.9, "top_k": 40,
            "top_p": 0.95, "seed": 7, "stream": True, "return_token_ids": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    got = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    prompt_ids = events[0]["choices"][0]["prompt_token_ids"]
    assert prompt_ids == model.tokenize(body["prompt"])
    want = reference(model, prompt_ids, max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    assert strip_end(model, got) == want
    assert "".join(c["text"] for e in events for c in e["choices"]) == model.detokenize(want)


def test_n_choices_seed_plus_index(http, model):
    body = {"prompt": "My favourite animal is", "max_tokens": 10, "temperature": 1.0, "seed": 11, "n": 3,
            "return_token_ids": True}
    a, b = http.post("/v1/completions", json=body).json(), http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert a["choices"] == b["choices"]                                     # reproducible
    ids = model.tokenize(body["prompt"])
    for i, c in enumerate(a["choices"]):
        assert strip_end(model, c["token_ids"]) == reference(model, ids, max_tokens=10, temperature=1.0, seed=11 + i)
    assert len({tuple(c["token_ids"]) for c in a["choices"]}) > 1
    assert a["usage"]["prompt_tokens"] == len(ids)                         # the prompt counted once
    assert a["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in a["choices"])
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        events = sse_events(r)
    for c in a["choices"]:                                                 # streamed choices interleave
        mine = [x for e in events for x in e["choices"] if x["index"] == c["index"]]
        assert "".join(x["text"] for x in mine) == c["text"] and mine[-1]["finish_reason"] == c["finish_reason"]
        assert [t for x in mine for t in x["token_ids"]] == c["token_ids"]
    chat = {"messages": MESSAGES, "max_tokens": 6, "seed": 3, "n": 2}
    whole = http.post("/v1/chat/completions", json=chat).json()["choices"]
    with http.stream("POST", "/v1/chat/completions", json=chat | {"stream": True}) as r:
        events = sse_events(r)
    for c in whole:
        deltas = [x["delta"] for e in events for x in e["choices"] if x["index"] == c["index"]]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert "".join(d.get("content", "") for d in deltas) == c["message"]["content"]


def test_prompt_forms_and_choice_order(http, model):
    texts = ["Water boils at", "The moon orbits"]
    ids = [model.tokenize(t) for t in texts]
    want = [model.detokenize(strip_end(model, reference(model, i, max_tokens=6, temperature=0))) for i in ids]
    for prompt in (texts, ids):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2}).json()
        assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in r["choices"]] == [want[0], want[0], want[1], want[1]]
        assert r["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    for prompt in (texts[1], ids[1]):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
        assert r["choices"][0]["text"] == want[1]
    r = http.post("/v1/completions", json={"prompt": texts[0], "max_tokens": 6, "temperature": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == texts[0] + want[0]


def test_usage_counts_cached_prompt_tokens(http, model):
    prompt = "Cached prefix test: " + "one two three four five six seven eight nine ten " * 3
    n = len(model.tokenize(prompt))
    first = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()["usage"]
    second = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).json()["usage"]
    assert first["prompt_tokens"] == second["prompt_tokens"] == n
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0


def test_logprobs_completions_shape_and_stream(http, model):
    body = {"prompt": "The sun rises in the", "max_tokens": 8, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = whole["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 8
    assert "".join(lp["tokens"]) == whole["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(8)]
    for tok, x, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 4 and x <= 0
        assert top[tok] == x == max(top.values())                             # greedy: the sampled is the top one
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        parts = [c["logprobs"] for e in sse_events(r) for c in e["choices"] if c["logprobs"]]
    streamed = {k: [v for p in parts for v in p[k]] for k in lp}
    assert streamed == lp


def test_echo_logprobs_give_the_prompt_tokens_then_the_generated(http, model):
    """echo with logprobs: the prompt's tokens first (the first one's logprob null; the others those of the
    one-sequence forward's logits), then the generated tokens' as without echo; max_tokens 0 scores the prompt
    alone; a stream sends the echo and the prompt's logprobs with the first chunk."""
    prompt = "The sun rises in the east and sets in the"
    ids = model.tokenize(prompt)
    x = model.logits(ids).astype(np.float64)
    want = [x[p, ids[p + 1]] - x[p].max() - np.log(np.exp(x[p] - x[p].max()).sum()) for p in range(len(ids) - 1)]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    whole = http.post("/v1/completions", json=body | {"echo": True}).json()["choices"][0]
    lp, P = whole["logprobs"], len(ids)
    assert whole["text"] == prompt + plain["text"]
    assert lp["tokens"][:P] == [model.tokenizer.decode([t]) for t in ids] and "".join(lp["tokens"][:P]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert np.allclose(lp["token_logprobs"][1:P], want, rtol=0, atol=1e-9)
    for tok, v, top in zip(lp["tokens"][1:P], lp["token_logprobs"][1:P], lp["top_logprobs"][1:P]):
        assert top[tok] == v and 2 <= len(top) <= 3 and max(top.values()) >= v
    assert {k: v[P:] for k, v in lp.items() if k != "text_offset"} == \
        {k: v for k, v in plain["logprobs"].items() if k != "text_offset"}
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(P + 4)]
    r = http.post("/v1/completions", json=body | {"echo": True, "max_tokens": 0}).json()
    scored = r["choices"][0]
    assert scored["text"] == prompt and scored["finish_reason"] == "length"
    assert scored["logprobs"] == {k: v[:P] for k, v in lp.items()}
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == P
    echo_only = http.post("/v1/completions", json={"prompt": prompt, "echo": True, "max_tokens": 0}).json()
    assert echo_only["choices"][0]["text"] == prompt and echo_only["choices"][0]["logprobs"] is None
    for n_tokens, full in ((4, whole), (0, scored)):
        with http.stream("POST", "/v1/completions", json=body | {"echo": True, "max_tokens": n_tokens,
                                                                 "stream": True}) as r:
            choices = [c for e in sse_events(r) for c in e["choices"]]
        assert choices[0]["text"].startswith(prompt) and len(choices[0]["logprobs"]["tokens"]) >= P
        assert "".join(c["text"] for c in choices) == full["text"]
        parts = [c["logprobs"] for c in choices if c["logprobs"]]
        assert {k: [v for p in parts for v in p[k]] for k in lp} == full["logprobs"]


def test_logprobs_chat_shape(http):
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    c = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = c["logprobs"]["content"]
    assert 1 <= len(content) <= 6
    for e in content:
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"] and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
        assert e["top_logprobs"][0]["logprob"] == e["logprob"] >= e["top_logprobs"][1]["logprob"]
    none = http.post("/v1/chat/completions", json=body | {"logprobs": False, "top_logprobs": None}).json()
    assert none["choices"][0]["logprobs"] is None


def test_stop_logit_bias_and_vllm_extras(http, model):
    r = http.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 30, "temperature": 0,
                                            "stop": [" 7"]}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["stop_reason"] == " 7" and " 7" not in r["text"] and r["text"]
    r = http.post("/v1/completions", json={"prompt": "1, 2, 3", "max_tokens": 3, "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 3
    x = model.tokenize(" banana")[-1]
    r = http.post("/v1/completions", json={"prompt": "I like", "max_tokens": 4, "temperature": 0,
                                           "logit_bias": {str(x): 100}, "return_token_ids": True}).json()
    assert r["choices"][0]["token_ids"] == [x] * 4
    r = http.post("/v1/completions", json={"prompt": "I like", "max_tokens": 4, "temperature": 0,
                                           "logit_bias": {str(x): 100}, "stop_token_ids": [x],
                                           "return_token_ids": True}).json()["choices"][0]
    assert r["token_ids"] == [x] and r["finish_reason"] == "stop" and r["stop_reason"] == x
    eos = sorted(model.tokenizer.eot_ids)
    bias = {str(t): 100 for t in eos}
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "temperature": 0, "logit_bias": bias,
                                           "min_tokens": 3, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 5                               # EOS biased up, yet ignored


def test_null_parameters_are_defaults(http):
    """OpenAI's spec lets clients send null for parameters they leave alone (some do)."""
    nulls = dict.fromkeys(["n", "stream", "stream_options", "temperature", "top_p", "stop", "seed", "logit_bias",
                           "presence_penalty", "frequency_penalty", "user", "max_tokens"])
    r = http.post("/v1/completions", json=nulls | {"prompt": "Hi", "max_tokens": 2, "echo": None, "logprobs": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = http.post("/v1/chat/completions", json=nulls | {"messages": MESSAGES, "max_tokens": 2, "logprobs": None,
                                                        "top_logprobs": None, "tools": None, "tool_choice": None,
                                                        "response_format": None, "max_completion_tokens": None})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text


def test_request_id_honoured_and_echoed(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "req-42"})
    assert r.headers["x-request-id"] == "req-42" and r.json()["id"] == "cmpl-req-42"
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1},
                  headers={"X-Request-Id": "req-43"})
    assert r.headers["x-request-id"] == "req-43" and r.json()["id"] == "chatcmpl-req-43"
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.headers["x-request-id"] and r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    assert http.post("/v1/completions", json={}, headers={"X-Request-Id": "bad-1"}).headers["x-request-id"] == "bad-1"


# ---------------------------------------------------------------------------------------------------------
# the other endpoints

def test_tokenize_detokenize_both_shapes(http, model):
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == model.tokenize("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    r = http.post("/tokenize", json={"content": "Hello world", "with_pieces": True}).json()
    assert [p["piece"] for p in r["tokens"]] == ["Hello", " world"]
    r = http.post("/tokenize", json={"content": "<|im_start|>user"}).json()
    assert r["tokens"][0] == model.tokenize("<|im_start|>", special=True)[0]   # special text parsed, as llama-server
    r = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert r["tokens"] == chat_ids(model, MESSAGES)
    ids = model.tokenize("Round trip, ünïcode ✓")
    r = http.post("/detokenize", json={"tokens": ids}).json()
    assert r["prompt"] == r["content"] == "Round trip, ünïcode ✓"
    assert_error(http.post("/detokenize", json={"tokens": [10 ** 7]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={}), 400)


def test_models_health_metrics(http, server):
    m = http.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == MODEL_ID and m["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert http.get(f"/v1/models/{MODEL_ID}").json()["id"] == MODEL_ID
    assert http.get("/health").json() == {"status": "ok"}
    before = metrics(http)
    u = http.post("/v1/completions", json={"prompt": "Metrics test prompt", "max_tokens": 4,
                                           "ignore_eos": True}).json()["usage"]
    after = metrics(http)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count", "prompt_tokens_total",
                 "generation_tokens_total", "request_queue_time_seconds_count", "kv_cache_total_blocks"):
        assert name in after, name
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == u["completion_tokens"] == 4
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == u["prompt_tokens"]
    assert after["e2e_request_latency_seconds_count"] - before["e2e_request_latency_seconds_count"] == 1
    assert after["inter_token_latency_seconds_count"] - before["inter_token_latency_seconds_count"] == 3
    assert after["kv_cache_usage_perc"] == 0 and after["num_requests_running"] == 0


def test_readme_lists_every_metric(http):
    """Each lumen: family /metrics serves is named in the server README's Metrics section (no *_created series:
    tests/serve/test_metrics.py)."""
    from pathlib import Path
    readme = (Path(__file__).parents[2] / "lumen" / "serve" / "README.md").read_text()
    section = readme.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    names = {line.split()[2][len("lumen:"):] for line in http.get("/metrics").text.splitlines()
             if line.startswith("# TYPE lumen:")}
    assert len(names) > 20
    missing = sorted(n for n in names if f"`{n}`" not in section and f"`{n}{{" not in section)
    assert not missing, missing


def metrics(http) -> dict:
    """/metrics as {name without the lumen: prefix: value}, labels dropped (summed)."""
    out: dict = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("lumen:"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0][len("lumen:"):]
            if name.startswith("request_success_total"):
                name += "{" + line.split('finished_reason="')[1].split('"')[0] + "}"
            out[name] = out.get(name, 0.0) + float(value)
    return out


def wait_idle(engine, timeout=30.0):
    t0 = time.monotonic()
    while engine.num_running or engine.num_waiting or engine.has_unfinished():
        assert time.monotonic() - t0 < timeout, engine.stats()
        time.sleep(0.05)


def test_disconnect_aborts_and_frees_blocks(http, server):
    before = metrics(http).get("request_success_total{abort}", 0)
    body = {"prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break                                          # leaving the block closes the connection
    with pytest.raises(httpx.ReadTimeout):                     # a non-streamed request whose client gives up
        http.post("/v1/completions", json=body | {"stream": False}, timeout=1.0)
    wait_idle(server.engine)
    s = server.engine.stats()
    assert s["kv_free_blocks"] == s["kv_blocks"]
    server.engine.blocks.check()
    t0 = time.monotonic()
    while (m := metrics(http)).get("request_success_total{abort}", 0) - before < 2:
        assert time.monotonic() - t0 < 10, m
        time.sleep(0.05)
    assert m["request_success_total{abort}"] - before == 2
    assert m["kv_cache_usage_perc"] == 0 and m["kv_cache_free_blocks"] == m["kv_cache_total_blocks"]


# ---------------------------------------------------------------------------------------------------------
# errors: every row of the issue's table, each answered in OpenAI's shape, the server serving on

LONG = [1] * (MAX_MODEL_LEN + 10)
BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "x"', None),
    ("not an object", "/v1/completions", b"[1, 2]", None),
    ("empty body", "/v1/completions", b"", None),
    ("wrong type", "/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("string for int", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("bool for int", "/v1/completions", {"prompt": "x", "n": True}, "n"),
    ("float for int", "/v1/completions", {"prompt": "x", "max_tokens": 5.5}, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("top_p 0", "/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("top_p > 1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("min_p > 1", "/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("repetition_penalty 0", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("repeat_penalty 0", "/v1/completions", {"prompt": "x", "repeat_penalty": 0}, "repeat_penalty"),
    ("max_tokens 0", "/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("n 0", "/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("n too large", "/v1/completions", {"prompt": "x", "n": 1000}, "n"),
    ("logprobs 21", "/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("seed past int64", "/v1/completions", {"prompt": "x", "seed": 2 ** 63}, "seed"),
    ("stream not bool", "/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("no prompt", "/v1/completions", {"max_tokens": 3}, "prompt"),
    ("null prompt", "/v1/completions", {"prompt": None}, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, "prompt"),
    ("empty list prompt", "/v1/completions", {"prompt": []}, "prompt"),
    ("mixed prompt list", "/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("token outside vocab", "/v1/completions", {"prompt": [10 ** 7]}, None),
    ("negative token", "/v1/completions", {"prompt": [-1]}, None),
    ("prompt over the context", "/v1/completions", {"prompt": LONG}, None),
    ("200k-character prompt", "/v1/completions", {"prompt": "word " * 40000}, "prompt"),
    ("prompt + max_tokens over the context", "/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, None),
    ("empty stop string", "/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("stop not strings", "/v1/completions", {"prompt": "x", "stop": [1]}, "stop"),
    ("logit_bias key", "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias token outside vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"9999999": 1}}, None),
    ("stop_token_ids outside vocab", "/v1/completions", {"prompt": "x", "stop_token_ids": [10 ** 7]}, None),
    ("presence_penalty > 2", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("more choices than the queue holds", "/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "n": 64}, None),
    ("min_tokens > max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("max_tokens -1 with echo", "/v1/completions", {"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens"),
    ("no messages", "/v1/chat/completions", {"max_tokens": 3}, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, "messages"),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages"),
    ("content not a string", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("image content", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2},
     "top_logprobs"),
    ("top_logprobs 25", "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 25},
     "top_logprobs"),
    ("response_format xml", "/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "xml"}}, "response_format"),
    ("tools", "/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ("chat over the context", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1100}]},
     None),
]


@pytest.mark.parametrize("path, body, param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_400(http, path, body, param):
    r = post_bad(http, path, body, param)
    assert r.headers["x-request-id"]


def post_bad(http, path: str, body, param):
    """POST one of BAD_REQUESTS (JSON, or raw bytes) and check its 400 names `param`."""
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert_error(r, 400, param)
    return r


def test_404_unknown_model_or_path(http):
    assert_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert_error(http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": MESSAGES}), 404, "model")
    assert_error(http.get("/v1/models/gpt-4"), 404)
    assert_error(http.get("/v2/nothing"), 404)
    assert_error(http.post("/v1/embeddings", json={"input": "x"}), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_413_oversized_body(http):
    big = json.dumps({"prompt": "x" * (MAX_BODY + 1)}).encode()
    assert_error(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)

    def chunks():                                              # no Content-Length: counted as it comes
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    assert_error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_401_api_key(model):
    with live_server(model, api_key="s3cret") as s, httpx.Client(base_url=s.url, timeout=60) as c:
        body = {"prompt": "x", "max_tokens": 1}
        assert_error(c.post("/v1/completions", json=body), 401)
        assert_error(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(c.get("/v1/models", headers={"Authorization": "s3cret"}), 401)
        assert_error(c.post("/tokenize", json={"prompt": "x"}), 401)
        assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/v1/models", headers={"X-Api-Key": "s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=MODEL_ID, prompt="x", max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_429_queue_full_then_serving(model):
    """One running slot and a waiting queue of one: a third request is refused until the others end."""
    with live_server(model, max_num_seqs=1, max_queue=1) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        body = {"prompt": "Count to a thousand:", "max_tokens": 800, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()        # kept: a dropped iterator closes the stream, the server aborts it
            next(lines)
            with c.stream("POST", "/v1/completions", json=body) as second:
                assert second.status_code == 200
                t0 = time.monotonic()
                while s.engine.num_waiting < 1:
                    assert time.monotonic() - t0 < 10
                    time.sleep(0.01)
                r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert_error(r, 429)
                assert r.headers["retry-after"] == "1"
        wait_idle(s.engine)
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
        assert s.engine.stats()["kv_free_blocks"] == s.engine.stats()["kv_blocks"]


def test_503_while_draining(http, server):
    server.worker.draining = True
    try:
        assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}), 503)
        assert http.get("/health").status_code == 503
    finally:
        server.worker.draining = False
    assert http.get("/health").status_code == 200


def test_500_for_that_request_only(http, server, model, monkeypatch):
    """An engine failure inside one request (its sampler raises) and a handler that raises: each a 500 for
    that request; a request beside it and the next ones are served."""
    engine = server.engine
    orig = engine._choose

    def choose(seq, s, logits, row):
        if seq.params.seed == 999:
            raise SamplerError("injected failure")
        return orig(seq, s, logits, row)
    monkeypatch.setattr(engine, "_choose", choose)
    good = {"prompt": "The capital of Italy is", "max_tokens": 8, "temperature": 0}

    async def side_by_side():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(c.post("/v1/completions", json={"prompt": "x", "seed": 999}),
                                        c.post("/v1/completions", json=good))
    bad, ok = asyncio.run(side_by_side())
    assert_error(bad, 500)
    assert "injected failure" in bad.json()["error"]["message"]
    want = model.detokenize(strip_end(model, reference(model, model.tokenize(good["prompt"]), max_tokens=8,
                                                       temperature=0)))
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == want
    with http.stream("POST", "/v1/completions", json={"prompt": "x", "seed": 999, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1]["error"]["code"] == 500

    def boom(*a, **k):
        raise RuntimeError("handler bug")
    monkeypatch.setattr(server.worker, "submit", boom)
    assert_error(http.post("/v1/completions", json=good), 500)
    monkeypatch.undo()
    assert http.post("/v1/completions", json=good).json()["choices"][0]["text"] == want
    wait_idle(engine)
    assert engine.stats()["kv_free_blocks"] == engine.stats()["kv_blocks"]


def test_chat_template_override_and_none(model):
    """--chat-template's text replaces the GGUF's; a model without one answers chat with a 400 that says so; a
    template that does not compile stops the server from starting."""
    from lumen.serve.prompts import Prompter
    from lumen.serve.protocol import ApiError, ChatMessage
    from lumen.format.chat import ChatTemplateError
    with live_server(model, chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}") as s:
        r = httpx.post(s.url + "/tokenize", json={"messages": [{"role": "user", "content": "hey"}]}).json()
        assert r["tokens"] == model.tokenize("[user] hey\n")
    with pytest.raises(ApiError) as e:
        Prompter(model.tokenizer, None, MAX_MODEL_LEN).chat([ChatMessage(role="user", content="hi")])
    assert e.value.status == 400 and "no chat template" in e.value.message and "--chat-template" in e.value.message
    with pytest.raises(ChatTemplateError):
        Prompter(model.tokenizer, "{% for %}", MAX_MODEL_LEN)


def test_still_serving_after_the_errors(http, model):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert http.get("/health").json() == {"status": "ok"}


def test_speculative_request_equals_plain_and_is_counted(http, model):
    """A request asking for n-gram speculation gets exactly the greedy tokens of a plain run; /metrics counts
    its drafted and accepted tokens; a bad speculative field is a 400 naming it."""
    text = "one two three four five six seven eight nine ten. one two three four five six seven eight nine"
    before = metrics(http)
    body = {"prompt": text, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    spec = http.post("/v1/completions", json={**body, "speculative": "ngram", "num_speculative_tokens": 4}).json()
    assert spec["choices"][0]["text"] == plain
    after = metrics(http)
    drafted = after["spec_decode_num_draft_tokens_total"] - before.get("spec_decode_num_draft_tokens_total", 0)
    accepted = after["spec_decode_num_accepted_tokens_total"] - before.get("spec_decode_num_accepted_tokens_total", 0)
    assert drafted > 0 and 0 < accepted <= drafted
    assert_error(http.post("/v1/completions", json={**body, "speculative": "eagle"}), 400, "speculative")
    for extra in ({}, {"speculative": "none"}):            # a k with no speculation to take it: not ignored
        r = http.post("/v1/completions", json={**body, **extra, "num_speculative_tokens": 3})
        assert_error(r, 400, "num_speculative_tokens")
    r = http.post("/v1/completions", json={**body, "speculative": "draft"})      # no draft model
    assert_error(r, 400, "speculative")
    assert "--draft-model" in r.json()["error"]["message"]


def test_a_stopped_server_frees_its_engine(model):
    """Nothing the app's routes leave behind (FastAPI caches every endpoint callable for the process's life)
    keeps a stopped server's engine, and with it its KV pool, alive."""
    import gc
    import weakref
    with live_server(model) as s:
        assert httpx.get(s.url + "/dashboard/data", timeout=30).status_code == 200
        assert httpx.get(s.url + "/metrics", timeout=30).status_code == 200
        engine = weakref.ref(s.engine)
        del s
    gc.collect()
    assert engine() is None, [type(r).__name__ for r in gc.get_referrers(engine())]
