"""The engine's public methods given input they must refuse: a clear ValueError or TypeError, raised before the
engine changes, and the engine serves the next request as before."""
import pytest

import lumen
from lumen import SamplingParams
from lumen.engine.engine import Engine, RequestError


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return Engine(lumen.load(smollm2_path, ctx=256, threads=2), max_num_seqs=4, kv_cache_mb=16)


def serves(engine) -> bool:
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0]
    return (out.finish_reason == "length" and engine.blocks.num_free == engine.blocks.n_blocks
            and not engine.has_unfinished())


@pytest.mark.parametrize("prompt", [["1", "2"], ("7",), [b"1"]])
def test_a_token_id_prompt_of_strings_is_refused(engine, prompt):
    with pytest.raises(RequestError, match="must hold integers"):
        engine.add_request(prompt)
    assert serves(engine)
