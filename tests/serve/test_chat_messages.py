"""The chat endpoint alone (a byte tokenizer, a scripted worker and Qwen2.5's chat template, which drops a message
of a role it does not know): what a conversation may hold. OpenAI's roles pass; any other role is a 400 naming it,
before anything runs."""
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
