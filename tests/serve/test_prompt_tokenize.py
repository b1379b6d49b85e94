"""/tokenize's llama-server fields (content, add_special, parse_special, with_pieces) on SmolLM2's tokenizer,
without an engine: the ids llama-server --jinja gives for the same body, its defaults, and a 400 for a wrong type."""
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import lumen
from lumen.serve.app import add_error_handlers
from lumen.serve.openai import tokenize
from lumen.serve.openai.serving import Settings
from lumen.serve.prompts import Prompter

TEXT = "<|im_start|>user hi"
AS_TOKEN, AS_TEXT = [1, 4093, 15876], [44, 108, 306, 79, 3738, 108, 46, 4093, 15876]   # llama-server's answers


@pytest.fixture(scope="module")
def http(smollm2_path):
    tok = lumen.load(smollm2_path, ctx=256, threads=1).tokenizer
    engine = SimpleNamespace(tokenizer=tok, max_model_len=256, config=SimpleNamespace(n_vocab=tok.n_vocab))
    app = FastAPI()
    add_error_handlers(app)
    app.include_router(tokenize.router)
    app.state.tokenize = tokenize.ServingTokenize(SimpleNamespace(engine=engine), Prompter(tok, None, 256),
                                                  Settings(model_id="smollm2"))
    return TestClient(app)


@pytest.mark.parametrize("body, ids", [
    ({"content": TEXT}, AS_TOKEN),                                          # parse_special: true by default
    ({"content": TEXT, "parse_special": None}, AS_TOKEN),                  # (null: the default, as llama-server)
    ({"content": TEXT, "parse_special": True, "add_special": True}, AS_TOKEN),
    ({"content": TEXT, "parse_special": False}, AS_TEXT),
    ({"content": TEXT, "parse_special": False, "add_special": True}, AS_TEXT),
    ({"prompt": TEXT, "parse_special": False}, AS_TEXT),
])
def test_parse_special_as_llama_server(http, body, ids):
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids


def test_with_pieces_of_text_not_parsed(http):
    r = http.post("/tokenize", json={"content": "a<|im_start|>", "parse_special": False, "with_pieces": True})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == [{"id": i, "piece": p} for i, p in zip(
        [81, 44, 108, 306, 79, 3738, 108, 46], ["a", "<", "|", "im", "_", "start", "|", ">"])]


@pytest.mark.parametrize("field, value", [("parse_special", 1), ("parse_special", "false"), ("with_pieces", "x"),
                                          ("add_special", 0), ("parse_special", [])])
def test_a_flag_of_another_type_is_a_400_naming_it(http, field, value):
    """llama-server takes a wrong type as the default (with a warning in its log); here it is refused, as every
    other field of a body of the wrong type is."""
    r = http.post("/tokenize", json={"content": "hi", field: value})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] or r.json()["error"].get("param") == field, r.text


def test_parse_special_false_with_messages_is_a_400(http):
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "parse_special": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "parse_special", r.text
