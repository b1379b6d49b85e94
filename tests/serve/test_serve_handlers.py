"""The server's endpoints one at a time, without the app, the engine or a model: each serving class of
lumen/serve/openai/ is built over a byte tokenizer and a scripted worker, and called directly or through its own
router alone (lumen/serve/app.py's error handlers, no Gate, no other route)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from lumen.engine.sampling.sampler import SamplerError
from lumen.errors import ContextError
from lumen.engine.sequence import RequestMetrics, RequestOutput
from lumen.format.tokenizer import Tokenizer
from lumen.serve import protocol as P
from lumen.serve.app import add_error_handlers
from lumen.serve.openai import completions, health, models, tokenize
from lumen.serve.openai.serving import Settings
from lumen.serve.prompts import Prompter
from lumen.serve.worker import QueueFull, Submission, TooManyRequests

BOS, EOS = 256, 257


class ByteTokenizer:
    """Token i < 256 is byte i; 256 and 257 are BOS and EOS."""
    n_vocab, vocab_end, bos_id, eos_id, add_bos_default = 258, 258, BOS, EOS, True
    default_bos = Tokenizer.default_bos          # the real rule (it reads the three fields above)

    def token_bytes(self, i: int, special: bool = False) -> bytes:
        return bytes([i]) if i < 256 else (b"<s>", b"</s>")[i - 256]

    def token_text(self, i: int) -> str:
        return self.token_bytes(i).decode()

    def encode(self, text: str, add_bos: bool = False, special: bool = True, shielded: bool = False) -> list[int]:
        return [BOS] * add_bos + list(text.encode())

    def decode(self, ids, special: bool = False) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def shield_messages(self, messages):
        return messages                          # no special-token text parses here: nothing to shield


class ScriptedWorker:
    """Answers every engine request with REPLY, one output per token; or refuses with `refuse`."""
    REPLY = b"ok!"

    def __init__(self, refuse: Exception | None = None):
        tok = ByteTokenizer()
        self.engine = SimpleNamespace(tokenizer=tok, config=SimpleNamespace(n_vocab=tok.n_vocab), max_model_len=64,
                                      parts=SimpleNamespace(path="/models/bytes.gguf"))
        self.refuse, self.draining = refuse, False
        self.submitted, self.sent_outs, self.aborted = [], [], 0

    async def submit(self, prompts, params) -> Submission:
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append((prompts, params))
        sub = Submission([f"r{i}" for i in range(len(prompts))])
        for rid, prompt in zip(sub.request_ids, prompts):
            ids = list(self.REPLY)
            for k in range(1, len(ids) + 1):
                done = k == len(ids)
                sub.queue.put_nowait(RequestOutput(
                    rid, prompt, ids[:k], self.REPLY[:k].decode(), done, "length" if done else None,
                    RequestMetrics(prompt_tokens=len(prompt)), delta_token_ids=[ids[k - 1]],
                    delta_text=chr(ids[k - 1])))
        return sub

    async def outputs(self, sub):
        while sub.open:
            out = await sub.queue.get()
            if out.finished:
                sub.open.discard(out.request_id)
            yield out

    def abort(self, sub):
        self.aborted += 1

    def sent(self, out):
        self.sent_outs.append(out)


SETTINGS = Settings(model_id="bytes")


def test_both_serving_paths_are_workers():
    """The HTTP layer drives a Worker; the in-process EngineWorker and Ray's RemoteWorker both have its shape:
    every method, with the same parameters, async exactly where the protocol's is."""
    import inspect

    from lumen.serve.ray.remote import RemoteWorker
    from lumen.serve.worker import EngineWorker, Worker
    methods = [n for n, f in vars(Worker).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert {"submit", "outputs", "abort", "drain", "stop"} <= set(methods)
    for cls in (EngineWorker, RemoteWorker, ScriptedWorker):
        for name in methods:
            if cls is ScriptedWorker and not hasattr(cls, name):
                continue                                   # the test double implements what the handlers call
            want, got = getattr(Worker, name), getattr(cls, name)
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), (cls.__name__, name)
            assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), \
                (cls.__name__, name)


def prompter(worker) -> Prompter:
    return Prompter(worker.engine.tokenizer, None, worker.engine.max_model_len)


def completion_client(worker) -> TestClient:
    """The completions router alone, with its serving object."""
    app = FastAPI()
    add_error_handlers(app)
    app.include_router(completions.router)
    app.state.completion = completions.ServingCompletion(worker, prompter(worker), SETTINGS)
    return TestClient(app)


def test_tokenize_handler_alone():
    worker = ScriptedWorker()
    t = tokenize.ServingTokenize(worker, prompter(worker), SETTINGS)
    got = asyncio.run(t.tokenize(P.TokenizeRequest(prompt="hi")))
    assert got == {"tokens": [BOS, ord("h"), ord("i")], "count": 3, "max_model_len": 64}
    got = asyncio.run(t.tokenize(P.TokenizeRequest(content="hi", with_pieces=True)))      # llama-server: no BOS
    assert got["tokens"] == [{"id": ord("h"), "piece": "h"}, {"id": ord("i"), "piece": "i"}]
    assert t.detokenize(P.DetokenizeRequest(tokens=[BOS, 104, 105])) == {"prompt": "<s>hi", "content": "<s>hi"}
    with pytest.raises(P.ApiError) as e:
        t.detokenize(P.DetokenizeRequest(tokens=[104, 258]))
    assert (e.value.status, e.value.param) == (400, "tokens")
    with pytest.raises(P.ApiError) as e:
        t.detokenize(P.DetokenizeRequest(model="other", tokens=[1]))
    assert (e.value.status, e.value.param) == (404, "model")
    with pytest.raises(P.ApiError) as e:
        asyncio.run(t.tokenize(P.TokenizeRequest()))
    assert (e.value.status, e.value.param) == (400, "prompt")


def test_ids_past_the_tokenizer_are_refused_though_the_model_has_rows_for_them():
    """Qwen2's embedding has rows past its tokenizer (151665..151935, "[PADn]" in the GGUF): /detokenize gave ""
    for them (200) and a prompt of them ran; vLLM refuses ids outside the tokenizer's vocabulary, so do we."""
    worker = ScriptedWorker()
    worker.engine.tokenizer.vocab_end = 257                        # 257 (EOS here) pads the model's rows
    t = tokenize.ServingTokenize(worker, prompter(worker), SETTINGS)
    assert t.detokenize(P.DetokenizeRequest(tokens=[BOS, 104]))["content"] == "<s>h"
    with pytest.raises(P.ApiError) as e:
        t.detokenize(P.DetokenizeRequest(tokens=[104, 257]))
    assert (e.value.status, e.value.param, e.value.message) == (400, "tokens", "token id 257 is outside the "
                                                                                "vocabulary (0..256)")
    with completion_client(ScriptedWorker(refuse=ContextError("does not fit"))) as c:
        c.app.state.completion.engine.tokenizer.vocab_end = 257    # a fitting prompt, save that its id is padding
        r = c.post("/v1/completions", json={"prompt": [1, 257], "max_tokens": 64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_tokenize_refuses_more_than_max_model_len_tokens():
    """/tokenize and /detokenize take what a prompt may hold (400 beyond): a text far past it is refused after a
    prefix, not tokenized whole on the server's time."""
    worker = ScriptedWorker()
    tok = worker.engine.tokenizer
    encoded = []
    tok.encode = lambda text, add_bos=False, special=True, shielded=False: encoded.append(len(text)) or \
        ByteTokenizer.encode(tok, text, add_bos, special)
    t = tokenize.ServingTokenize(worker, prompter(worker), SETTINGS)
    assert asyncio.run(t.tokenize(P.TokenizeRequest(content="x" * 64)))["count"] == 64
    for req, param in [(P.TokenizeRequest(content="x" * 65), "content"),
                       (P.TokenizeRequest(prompt="x" * 64), "prompt"),                  # + BOS
                       (P.TokenizeRequest(prompt="é" * 128), "prompt"), (P.TokenizeRequest(prompt="é" * 10**6), "prompt")]:
        encoded.clear()
        with pytest.raises(P.ApiError) as e:
            asyncio.run(t.tokenize(req))
        assert (e.value.status, e.value.param) == (400, param) and "max_model_len is 64" in e.value.message
        assert max(encoded, default=0) <= 8 * 64                 # (prompts.PROBE_CHARS per context token)
    assert t.detokenize(P.DetokenizeRequest(tokens=[104] * 64))["content"] == "h" * 64
    with pytest.raises(P.ApiError) as e:
        t.detokenize(P.DetokenizeRequest(tokens=[104] * 65))
    assert (e.value.status, e.value.param) == (400, "tokens") and "max_model_len is 64" in e.value.message


def test_models_and_health_handlers_alone():
    worker = ScriptedWorker()
    m = models.ServingModels(worker, prompter(worker), SETTINGS)
    assert [c["id"] for c in m.listing()["data"]] == ["bytes"] and m.get("bytes")["root"] == "/models/bytes.gguf"
    with pytest.raises(P.ApiError) as e:
        m.get("other")
    assert e.value.status == 404
    h = health.ServingHealth(worker, SimpleNamespace(render=lambda: b"lumen:x 1\n"))
    assert h.health() == {"status": "ok"} and h.render_metrics().body == b"lumen:x 1\n"
    worker.draining = True
    assert h.health().status_code == 503


def test_completion_router_alone_whole_and_streamed():
    worker = ScriptedWorker()
    with completion_client(worker) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "n": 2, "max_tokens": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [ch["text"] for ch in body["choices"]] == ["ok!", "ok!"] and body["id"].startswith("cmpl-")
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        (prompts, params), = worker.submitted
        assert prompts == [[BOS, ord("H"), ord("i")]] * 2 and [p.max_tokens for p in params] == [3, 3]
        assert [o.delta_token_ids for o in worker.sent_outs] == [list(b"ok!")] * 2   # all at once, whole

        r = c.post("/v1/completions", json={"prompt": [1, 2], "stream": True,
                                            "stream_options": {"include_usage": True}})
        assert r.headers["content-type"].startswith("text/event-stream") and r.headers["cache-control"] == "no-cache"
        lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        events = [json.loads(x) for x in lines[:-1]]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "ok!"
        assert events[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("refusal, status, param", [
    (QueueFull("the waiting queue is full"), 429, None),
    (TooManyRequests("too many"), 400, "prompt"),          # n is 1: the list of prompts is at fault
    (SamplerError("logit_bias holds token ids outside the vocabulary (0..257), got [999]"), 400, "logit_bias"),
])
def test_completion_refusals_name_their_parameter(refusal, status, param):
    """A worker's refusal becomes the status and the parameter, whatever its message says."""
    with completion_client(ScriptedWorker(refuse=refusal)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "logit_bias": {"999": 1}})
    assert r.status_code == status
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"] == str(refusal)
    assert ("retry-after" in r.headers) == (status == 429)


def test_sampler_error_blames_the_parameter_not_the_message():
    """The parameter comes from the request's values, not from parsing the message."""
    worker = ScriptedWorker(refuse=SamplerError("something the engine said"))
    with completion_client(worker) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "stop_token_ids": [5000]})
        assert r.json()["error"]["param"] == "stop_token_ids"
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] is None


@pytest.mark.parametrize("model, status", [(None, 200), ("", 200), ("bytes", 200), ("other", 404), (" bytes", 404)])
def test_model_empty_is_the_served_one(model, status):
    """model null or "" is the served model (vLLM's rule); any other name but the served one is 404 naming model."""
    body = {"prompt": "x", "max_tokens": 1} | ({} if model is None else {"model": model})
    with completion_client(ScriptedWorker()) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    if status == 404:
        assert r.json()["error"]["param"] == "model" and repr(model) in r.json()["error"]["message"]
    else:
        assert r.json()["model"] == "bytes"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 64}, "max_tokens"),                 # the prompt fits; max_tokens goes past
    ({"prompt": [1] * 63, "max_tokens": 2}, "max_tokens"),
    ({"prompt": ["x", "y" * 70], "max_tokens": 2}, "prompt"),          # a prompt alone fills the context
    ({"prompt": [1, 999], "max_tokens": 64}, "prompt"),                # a token outside the vocabulary
    ({"prompt": "x", "max_tokens": None}, "prompt"),
])
def test_context_refusal_blames_max_tokens_when_the_prompt_fits(body, param):
    """The engine's refusal of a request that does not fit the context names max_tokens when each prompt is
    valid and leaves room, and only max_tokens takes the request past max_model_len (64 here); else the prompt."""
    with completion_client(ScriptedWorker(refuse=ContextError("does not fit"))) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_continuous_usage_stats_give_each_chunk_its_usage():
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries its choice's prompt
    tokens and the tokens it generated so far; the last chunk has the whole usage and no choices. Without
    continuous_usage_stats the chunks' usage is null."""
    with completion_client(ScriptedWorker()) as c:
        for continuous in (True, False, None):
            r = c.post("/v1/completions", json={"prompt": "Hi", "n": 2, "stream": True, "stream_options": {
                "include_usage": True, "continuous_usage_stats": continuous}})
            lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            events = [json.loads(x) for x in lines[:-1]]
            *chunks, last = events
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
            if continuous:
                got = {i: [e["usage"]["completion_tokens"] for e in chunks if e["choices"][0]["index"] == i]
                       for i in (0, 1)}
                assert got == {0: [1, 2, 3], 1: [1, 2, 3]}
                assert all(e["usage"]["prompt_tokens"] == 3 and e["usage"]["total_tokens"] ==
                           3 + e["usage"]["completion_tokens"] for e in chunks)
            else:
                assert all(e["usage"] is None for e in chunks)


class BrokenOutputWorker(ScriptedWorker):
    """Its second output cannot be answered (an id no choice has): a fault of the server's, mid-stream."""

    async def outputs(self, sub):
        n = 0
        async for out in super().outputs(sub):
            n += 1
            yield out if n == 1 else RequestOutput("nobody", [], [], "", True, "length", RequestMetrics())
            if n > 1:
                return


def test_a_stream_that_fails_midway_ends_with_an_error_event():
    """After the 200 went out, a failure to build an event is an error event (500, OpenAI's shape) and [DONE],
    so a client reads an error rather than a cut connection; the engine requests are aborted."""
    worker = BrokenOutputWorker()
    with completion_client(worker) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "stream": True})
    assert r.status_code == 200
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    first, err = json.loads(lines[0]), json.loads(lines[-2])
    assert first["choices"][0]["text"] == "o"
    assert err["error"]["code"] == 500 and err["error"]["message"].startswith("internal error: KeyError")
    assert worker.aborted >= 1


@pytest.mark.parametrize("body, param", [({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
                                         ({"prompt": "hi", "content": "hi"}, "content"),
                                         ({"content": "hi", "messages": [{"role": "user", "content": "hi"}]},
                                          "messages")])
def test_tokenize_refuses_two_texts_rather_than_ignore_one(body, param):
    worker = ScriptedWorker()
    t = tokenize.ServingTokenize(worker, prompter(worker), SETTINGS)
    with pytest.raises(P.ApiError) as e:
        asyncio.run(t.tokenize(P.parse(json.dumps(body).encode(), P.TokenizeRequest)))
    assert (e.value.status, e.value.param) == (400, param) and "one of prompt, content or messages" in e.value.message


@pytest.mark.parametrize("n, param", [(1, "prompt"), (2, "n")])
def test_more_requests_than_the_queue_holds_blame_n_only_when_it_is_asked(n, param):
    """prompts x n beyond the queue: with n 1 the client's list of prompts is what to shorten, not n."""
    with completion_client(ScriptedWorker(refuse=TooManyRequests("too many"))) as c:
        r = c.post("/v1/completions", json={"prompt": ["x"] * 300, "n": n})
    assert (r.status_code, r.json()["error"]["param"]) == (400, param)


@pytest.mark.parametrize("extra, first", [({}, BOS), ({"add_special_tokens": None}, BOS),
                                          ({"add_special_tokens": True}, BOS), ({"add_special_tokens": False}, 104)])
def test_completion_add_special_tokens_false_leaves_out_the_bos(extra, first):
    """vLLM's add_special_tokens: false is a prompt without the BOS the model adds by default, not ignored."""
    worker = ScriptedWorker()
    with completion_client(worker) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1} | extra)
    assert r.status_code == 200, r.text
    (prompts, _), = worker.submitted
    assert prompts[0][0] == first and bytes(t for t in prompts[0] if t < 256) == b"hi"


@pytest.mark.parametrize("body", [{"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}])
def test_tokenize_return_token_strs_gives_the_vocabulary_strings(body):
    """vLLM's return_token_strs: each token's string as the vocabulary holds it, beside the ids (not ignored);
    absent, null or false: no token_strs."""
    worker = ScriptedWorker()
    t = tokenize.ServingTokenize(worker, Prompter(worker.engine.tokenizer, "{% for m in messages %}{{ m.content }}"
                                                  "{% endfor %}", 64), SETTINGS)
    got = asyncio.run(t.tokenize(P.parse(json.dumps(body | {"return_token_strs": True}).encode(), P.TokenizeRequest)))
    assert got["tokens"] == [BOS, ord("h"), ord("i")] and got["token_strs"] == ["<s>", "h", "i"]
    for off in ({}, {"return_token_strs": None}, {"return_token_strs": False}):
        got = asyncio.run(t.tokenize(P.parse(json.dumps(body | off).encode(), P.TokenizeRequest)))
        assert "token_strs" not in got
