"""vLLM's chat_template_kwargs on /v1/chat/completions and /tokenize (a byte tokenizer and a scripted worker): its
variables reach the chat template (Qwen3's enable_thinking), a key that would replace one of the template's own
variables is a 400 naming the field, and so is a value that is not an object."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_serve_handlers import ScriptedWorker

from lumen.serve.app import add_error_handlers
from lumen.serve.openai import chat, tokenize
from lumen.serve.openai.serving import Settings
from lumen.serve.prompts import Prompter

# the end of Qwen3's template: the thinking switch
QWEN3 = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
         "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
         "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}")
USER = {"role": "user", "content": "1+2?"}
NO_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture
def client():
    worker = ScriptedWorker()
    worker.engine.max_model_len = 4096
    app = FastAPI()
    add_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(tokenize.router)
    prompter = Prompter(worker.engine.tokenizer, QWEN3, 4096)
    app.state.chat = chat.ServingChat(worker, prompter, Settings(model_id="bytes"))
    app.state.tokenize = tokenize.ServingTokenize(worker, prompter, Settings(model_id="bytes"))
    return TestClient(app), worker


def _prompt(worker) -> str:
    [(prompts, _)] = worker.submitted
    return bytes(t for t in prompts[0] if t < 256).decode()


@pytest.mark.parametrize("kwargs, thinking", [(None, True), ({}, True), ({"enable_thinking": True}, True),
                                              ({"enable_thinking": False}, False),
                                              ({"enable_thinking": False, "other": [1, {"a": None}]}, False)])
def test_chat_template_kwargs_reach_the_template(client, kwargs, thinking):
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [USER], "chat_template_kwargs": kwargs})
    assert r.status_code == 200, r.text
    assert _prompt(worker).endswith(NO_THINKING) != thinking, _prompt(worker)
    r = http.post("/tokenize", json={"messages": [USER], "chat_template_kwargs": kwargs})     # the same prompt
    assert r.status_code == 200 and r.json()["tokens"] == worker.submitted[0][0][0], r.text


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"add_generation_prompt": False}, {"bos_token": "x"},
                                    {"tools": None}, {"eos_token": ""}, {"raise_exception": 1},
                                    {"enable_thinking": False, "strftime_now": "x"}])
def test_a_kwarg_replacing_the_templates_own_variable_is_a_400(client, kwargs):
    http, worker = client
    for path in ("/v1/chat/completions", "/tokenize"):
        r = http.post(path, json={"messages": [USER], "chat_template_kwargs": kwargs})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "chat_template_kwargs" and "may not set" in err["message"], err
    assert not worker.submitted


@pytest.mark.parametrize("kwargs", [[], "enable_thinking", 1, True, [["enable_thinking", False]]])
def test_chat_template_kwargs_not_an_object_is_a_400(client, kwargs):
    http, worker = client
    r = http.post("/v1/chat/completions", json={"messages": [USER], "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    assert "chat_template_kwargs" in r.text and not worker.submitted
