"""OpenAI request bodies -> SamplingParams (lumen.serve.protocol), without a server or a model: which values are
taken, which are refused with a 400 naming the field, and what the refusal says."""
from __future__ import annotations

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
