"""OpenAI request bodies -> SamplingParams (lumen.serve.protocol), without a server or a model: which values are
taken, which are refused with a 400 naming the field, and what the refusal says."""
from __future__ import annotations

import json

import pytest

from lumen.serve import protocol as P


def chat(**body) -> list:
    return P.chat_params(P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body), 64)


def completion(**body) -> list:
    return P.completion_params(P.CompletionRequest(prompt="hi", **body), 64)


def refusal(make, **body) -> P.ApiError:
    with pytest.raises(P.ApiError) as e:
        make(**body)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_0_does_not_point_at_echo(field):
    """Chat has no echo: its refusal of 0 says the bound only; the completions endpoint's names echo, which allows 0."""
    e = refusal(chat, **{field: 0})
    assert e.param == field and e.message == f"{field} must be at least 1, got 0"
    e = refusal(completion, max_tokens=0)
    assert e.param == "max_tokens" and "echo" in e.message
    assert completion(max_tokens=0, echo=True)[0].max_tokens == 0


@pytest.mark.parametrize("field, value", [("prompt_logprobs", 1), ("prompt_logprobs", 0), ("use_beam_search", True),
                                          ("skip_special_tokens", False),
                                          ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
                                          ("truncate_prompt_tokens", 8), ("logits_processors", ["m.f"]),
                                          ("return_tokens_as_token_ids", True), ("prompt_embeds", "AAAA"),
                                          ("n_predict", 8), ("n_predict", -1), ("n_probs", 3), ("mirostat", 2),
                                          ("typical_p", 0.5), ("top_n_sigma", 1.5), ("xtc_probability", 0.5),
                                          ("dynatemp_range", 0.5), ("dry_multiplier", 0.8)])
@pytest.mark.parametrize("model", [P.CompletionRequest, P.ChatCompletionRequest])
def test_unsupported_vllm_extensions_are_refused_not_ignored(model, field, value):
    """A vLLM or llama-server extension Lumen does not implement is a 400 naming it, not an answer silently
    without it."""
    base = {"prompt": "hi"} if model is P.CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(P.ApiError) as e:
        P.parse(json.dumps(base | {field: value}).encode(), model)
    assert (e.value.status, e.value.param) == (400, field) and "not supported" in e.value.message


@pytest.mark.parametrize("model", [P.CompletionRequest, P.ChatCompletionRequest])
def test_unsupported_vllm_extensions_at_their_defaults_are_taken(model):
    base = {"prompt": "hi"} if model is P.CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    defaults = {"prompt_logprobs": None, "use_beam_search": False, "skip_special_tokens": True,
                "allowed_token_ids": None, "bad_words": [], "truncate_prompt_tokens": None,
                "logits_processors": [], "return_tokens_as_token_ids": False, "prompt_embeds": None, "n_predict": None,
                "n_probs": 0, "mirostat": 0, "typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
                "dynatemp_range": 0.0, "dry_multiplier": 0.0}
    assert P.parse(json.dumps(base | defaults).encode(), model).n == 1


@pytest.mark.parametrize("field, value", [("modalities", ["text", "audio"]), ("modalities", ["audio"]),
                                          ("audio", {"voice": "alloy", "format": "wav"}),
                                          ("web_search_options", {}), ("best_of", 3), ("echo", True)])
def test_chat_fields_whose_answer_would_lack_them_are_refused(field, value):
    """Audio output, web search, best_of beyond n and vLLM's chat echo change the answer: a 400 naming the field,
    not a text answer that silently lacks them (as the openai client sends them)."""
    with pytest.raises(P.ApiError) as e:
        P.chat_params(P.parse(json.dumps({"messages": [{"role": "user", "content": "hi"}], field: value}).encode(),
                              P.ChatCompletionRequest), 64)
    assert (e.value.status, e.value.param) == (400, field) and "support" in e.value.message


@pytest.mark.parametrize("extra", [{"modalities": ["text"]}, {"modalities": None}, {"audio": None},
                                   {"web_search_options": None}, {"best_of": 2, "n": 2}, {"echo": False},
                                   {"echo": None}, {"prediction": {"type": "content", "content": "hi"}},
                                   {"service_tier": "auto", "store": False, "metadata": {"a": "b"}, "user": "u"}])
def test_chat_fields_that_ask_for_nothing_more_are_taken(extra):
    body = {"messages": [{"role": "user", "content": "hi"}]} | extra
    params = P.chat_params(P.parse(json.dumps(body).encode(), P.ChatCompletionRequest), 64)
    assert len(params) == extra.get("n", 1)


def test_a_wrong_type_is_described_by_what_the_field_takes_there():
    """/tokenize's prompt is a string only: its refusal must not offer the token-id lists a completion's takes."""
    with pytest.raises(P.ApiError) as e:
        P.parse(b'{"prompt": ["hi"]}', P.TokenizeRequest)
    assert (e.value.status, e.value.param) == (400, "prompt") and "token id" not in e.value.message
    assert "string" in e.value.message
    with pytest.raises(P.ApiError) as e:
        P.parse(b'{"prompt": {"a": 1}}', P.CompletionRequest)
    assert e.value.message == f"prompt must be {P.EXPECTED['prompt']}"
    with pytest.raises(P.ApiError) as e:
        P.parse(b'{"messages": [{"role": "user", "content": 5}]}', P.TokenizeRequest)
    assert e.value.message == f"messages.0.content must be {P.EXPECTED['content']}"


def test_a_requests_own_chat_template_is_refused_on_chat_only():
    """vLLM's per-request chat_template would change the prompt: a 400 on chat, not the server's template used
    silently; a completion has no template, so there it changes nothing."""
    with pytest.raises(P.ApiError) as e:
        P.parse(json.dumps({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ x }}"}).encode(),
                P.ChatCompletionRequest)
    assert (e.value.status, e.value.param) == (400, "chat_template") and "--chat-template" in e.value.message
    assert P.parse(b'{"prompt": "hi", "chat_template": "{{ x }}"}', P.CompletionRequest).prompt == "hi"


def test_a_utf8_byte_order_mark_before_the_json_is_skipped():
    """RFC 8259 lets a parser skip it; vLLM's (json.loads on bytes) and llama-server's (nlohmann) do."""
    bom = b"\xef\xbb\xbf"
    assert P.parse(bom + b'{"prompt": "hi"}', P.CompletionRequest).prompt == "hi"
    with pytest.raises(P.ApiError) as e:
        P.parse(bom, P.CompletionRequest)
    assert "empty" in e.value.message
    with pytest.raises(P.ApiError) as e:
        P.parse(bom + bom + b'{"prompt": "hi"}', P.CompletionRequest)     # one mark, not any number
    assert "malformed JSON" in e.value.message


@pytest.mark.parametrize("body, where", [
    (rb'{"prompt": "\ud800"}', r"\ud800 at line 1 column 13"),                 # a high one at the end
    (rb'{"prompt": "a\udc00b"}', r"\udc00 at line 1 column 14"),               # a low one alone
    (rb'{"prompt": "\ud800\u0041"}', r"\ud800 at line 1 column 13"),           # a high one before a non-low
    (rb'{"prompt": "\ud800\ud800\udc00"}', r"\ud800 at line 1 column 13"),     # the first of two highs
    (b'{"prompt": "\\\\ud800 \\ud83d\\ude00",\n "suffix": "\\ude00"}', r"\ude00 at line 2 column 13"),
])
def test_a_lone_surrogate_escape_is_named_not_the_parsers_words(body, where):
    """A lone UTF-16 surrogate escape was refused in the JSON parser's words ("unexpected end of hex escape"):
    the 400 names it and where it stands; an escaped backslash and a whole pair are no surrogate of their own."""
    with pytest.raises(P.ApiError) as e:
        P.parse(body, P.CompletionRequest)
    assert e.value.status == 400 and e.value.message.startswith(f"invalid JSON: a lone UTF-16 surrogate {where} ")
    assert P.parse(rb'{"prompt": "\\ud800 \ud83d\ude00"}', P.CompletionRequest).prompt == "\\ud800 \U0001F600"


def test_an_unknown_field_is_ignored_and_named_in_the_log(caplog):
    """A misspelt field ("max_token") was dropped without a word, and the request ran with the default (16 tokens):
    it is still ignored, as OpenAI's and vLLM's servers ignore it, and now named in the server's log, as vLLM does."""
    import logging
    with caplog.at_level(logging.WARNING, logger="lumen.serve"):
        req = P.parse(json.dumps({"prompt": "hi", "max_token": 3, "temprature": 0}).encode(), P.CompletionRequest)
        P.parse(json.dumps({"prompt": "hi", "max_tokens": 3}).encode(), P.CompletionRequest)
    assert req.max_tokens == 16 and P.completion_params(req, 64)[0].max_tokens == 16
    said = [r.getMessage() for r in caplog.records if r.name == "lumen.serve"]
    assert said == ["request fields ignored (this server does not know them): max_token, temprature"], said
