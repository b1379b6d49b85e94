"""The Python API as a new user calls it, wrong: a clear TypeError or ValueError naming what was expected, never
a result for something else or an error from deep inside numpy."""
from __future__ import annotations

import pytest

import lumen


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, max_model_len=128, threads=1)


@pytest.fixture(scope="module")
def engine(model):
    return lumen.Engine(model, max_num_seqs=2, max_model_len=128)


@pytest.mark.parametrize("ids", ["Hello world", [1.5, 2.0], [True, False]], ids=["text", "floats", "bools"])
def test_logits_takes_token_ids(model, ids):
    with pytest.raises(TypeError, match="token ids.*tokenize"):
        model.logits(ids)


@pytest.mark.parametrize("token", ["a", 1.5, None])
def test_decode_takes_one_token_id(model, token):
    model.reset()
    with pytest.raises(TypeError, match="token id"):
        model.decode(token)


@pytest.mark.parametrize("params", [{"max_tokens": 4}, [{"max_tokens": 4}], 4], ids=["dict", "list of dicts", "int"])
def test_engine_generate_refuses_params_that_are_not_sampling_params(engine, params):
    """A dict was read as a list of its keys, so the request failed with an "error" output about a str."""
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.generate(["Hello"], params)


@pytest.mark.parametrize("prompts", [None, 5])
def test_engine_generate_refuses_prompts_that_are_not_prompts(engine, prompts):
    with pytest.raises(TypeError, match="prompts"):
        engine.generate(prompts, lumen.SamplingParams(max_tokens=2))


def test_engine_generate_still_takes_one_params_per_prompt(engine):
    outs = engine.generate(["Hello", [1, 2, 3]], [lumen.SamplingParams(max_tokens=2, temperature=0), None])
    assert [o.error for o in outs] == [None, None] and outs[0].finish_reason == "length"
