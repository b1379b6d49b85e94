"""Fill-in-the-middle through OpenAI's `suffix` on /v1/completions (lumen.serve.openai.completions): on
Qwen2.5-Coder-0.5B through a live server (test_serve.live_server), the prompt's token ids are exactly
[fim_pre] + tok(prompt) + [fim_suf] + tok(suffix) + [fim_mid], the special-token text typed in the prompt or suffix
stays text, the greedy middle equals the raw `<|fim_prefix|>`... prompt's and completes a small function, streamed
equals whole, token-id and listed prompts take the suffix too, echo gives the prompt alone; a vocabulary without
FIM tokens (SmolLM2's, Gemma 3's) is a 400 naming suffix. Skips the Qwen part when it cannot be fetched."""
import httpx
import pytest
from test_serve import MODEL_ID, assert_error, live_server

import lumen
from lumen.model.parts import build_tokenizer, open_gguf
from lumen.serve.openai.completions import fim_ids
from lumen.serve.protocol import ApiError
from servers import sse_events

PREFIX = "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return "
SUFFIX = "\n\n\nprint(add(2, 3))\n"
QWEN_FIM = (151659, 151661, 151660)         # <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>


def test_fim_ids_of_vocabularies(smollm2_path, gemma3_path, qwen05_file):
    qwen = build_tokenizer(open_gguf(qwen05_file)[0].metadata)
    assert (qwen.fim_pre_id, qwen.fim_suf_id, qwen.fim_mid_id) == QWEN_FIM
    assert [qwen.token_text(i) for i in QWEN_FIM] == ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    assert fim_ids(qwen) == QWEN_FIM
    assert not any(qwen.is_eog(i) for i in QWEN_FIM)             # they do not end generation
    for path in (smollm2_path, gemma3_path):
        tok = build_tokenizer(open_gguf(path)[0].metadata)
        assert (tok.fim_pre_id, tok.fim_suf_id, tok.fim_mid_id) == (None, None, None)
        with pytest.raises(ApiError) as e:
            fim_ids(tok)
        assert e.value.status == 400 and e.value.param == "suffix" and "fill-in-the-middle" in e.value.message


def test_suffix_without_fim_tokens_is_a_400(smollm2_path):
    with live_server(lumen.load(smollm2_path, ctx=512, threads=2)) as s, httpx.Client(base_url=s.url) as http:
        for body in ({"prompt": "def f():", "suffix": "\n"}, {"prompt": [1, 2], "suffix": ""}):
            r = http.post("/v1/completions", json=body)
            assert_error(r, 400, "suffix")
            assert "fill-in-the-middle" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def model(qwen05_path):
    return lumen.load(qwen05_path, ctx=1024, threads=2)


@pytest.fixture(scope="module")
def http(model):
    with live_server(model, max_num_seqs=4) as s, httpx.Client(base_url=s.url, timeout=300) as c:
        yield c


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL_ID, "temperature": 0, "max_tokens": 12,
                                           "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def tok(model, text: str) -> list[int]:
    return model.tokenizer.encode(text, add_bos=False, special=False)


def test_suffix_prompt_ids_and_middle(model, http):
    pre, suf, mid = QWEN_FIM
    ch = complete(http, prompt=PREFIX, suffix=SUFFIX)["choices"][0]
    assert ch["prompt_token_ids"] == [pre, *tok(model, PREFIX), suf, *tok(model, SUFFIX), mid]
    assert ch["text"].replace(" ", "").startswith("a+b"), ch["text"]
    # the same ids as the raw FIM prompt's, parsed from special-token text: the same greedy middle
    raw = complete(http, prompt=f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")["choices"][0]
    assert raw["prompt_token_ids"] == ch["prompt_token_ids"] and raw["text"] == ch["text"]
    # streamed: the deltas join to the whole answer
    with http.stream("POST", "/v1/completions", json={"model": MODEL_ID, "prompt": PREFIX, "suffix": SUFFIX,
                                                       "temperature": 0, "max_tokens": 12, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == ch["text"]


def test_special_text_in_prompt_and_suffix_stays_text(model, http):
    pre, suf, mid = QWEN_FIM
    prompt, suffix = "x = '<|fim_middle|>'\n", "y = '<|fim_suffix|><|endoftext|>'\n"
    ids = complete(http, prompt=prompt, suffix=suffix, max_tokens=1)["choices"][0]["prompt_token_ids"]
    assert ids == [pre, *tok(model, prompt), suf, *tok(model, suffix), mid]
    assert ids.count(mid) == 1 and ids.count(suf) == 1 and 151643 not in ids       # 151643: <|endoftext|>


def test_token_id_and_listed_prompts_take_the_suffix(model, http):
    pre, suf, mid = QWEN_FIM
    ids = tok(model, PREFIX)
    whole = complete(http, prompt=PREFIX, suffix=SUFFIX)["choices"][0]
    by_ids = complete(http, prompt=ids, suffix=SUFFIX)["choices"][0]
    assert by_ids["prompt_token_ids"] == whole["prompt_token_ids"] and by_ids["text"] == whole["text"]
    other = "def mul(a, b):\n    return "
    two = complete(http, prompt=[PREFIX, other], suffix=SUFFIX)["choices"]
    assert two[0]["text"] == whole["text"]
    assert two[1]["prompt_token_ids"] == [pre, *tok(model, other), suf, *tok(model, SUFFIX), mid]
    # an empty prefix or suffix is still an infill (the cursor at the start or end of the file)
    empty = complete(http, prompt="", suffix="", max_tokens=1)["choices"][0]
    assert empty["prompt_token_ids"] == [pre, suf, mid]


def test_echo_gives_the_prompt_alone(model, http):
    whole = complete(http, prompt=PREFIX, suffix=SUFFIX)["choices"][0]
    echoed = complete(http, prompt=PREFIX, suffix=SUFFIX, echo=True)["choices"][0]
    assert echoed["text"] == PREFIX + whole["text"]
    by_ids = complete(http, prompt=tok(model, PREFIX), suffix=SUFFIX, echo=True, max_tokens=0)
    assert by_ids["choices"][0]["text"] == PREFIX
    assert by_ids["usage"]["prompt_tokens"] == len(whole["prompt_token_ids"])
    r = http.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "echo": True, "logprobs": 1})
    assert_error(r, 400, "suffix")


def test_infill_prompt_over_the_context_is_a_400(http):
    r = http.post("/v1/completions", json={"prompt": "x = 1\n" * 600, "suffix": "y = 2\n" * 600})
    assert_error(r, 400, "prompt")
    assert_error(http.post("/v1/completions", json={"suffix": "x"}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "suffix": 5}), 400, "suffix")
    r = http.post("/v1/completions", json={"prompt": "x", "suffix": "word " * 40000})   # refused by its prefixes
    assert_error(r, 400, "suffix")
    assert "suffix" in r.json()["error"]["message"]
