"""SamplingParams.replace on a request's params: the server makes one copy per choice (seed + i), per speculative
setting and per constraint, so a copy must not walk a large logit_bias or stop_token_ids again (64 choices of a
150,000-entry logit_bias held the server's event loop for 6 s)."""
import time

import pytest

from lumen import SamplingParams
from lumen.engine.sampling.sampler import SamplerError


def test_replace_keeps_the_checked_collections():
    p = SamplingParams(logit_bias={str(i): 1.5 for i in range(50_000)}, stop_token_ids=list(range(50_000)), seed=3)
    q = p.replace(seed=4)
    assert q.seed == 4 and q.logit_bias is p.logit_bias and q.stop_token_ids is p.stop_token_ids
    assert q.logit_bias == {i: 1.5 for i in range(50_000)} and q.stop_token_ids == tuple(range(50_000))
    t = time.perf_counter()
    for s in range(64):
        p.replace(seed=s)
    assert time.perf_counter() - t < 0.5


def test_replace_still_checks_what_it_is_given():
    p = SamplingParams(logit_bias={"5": 200}, stop_token_ids=[7])
    assert p.logit_bias == {5: 100.0} and p.stop_token_ids == (7,)
    with pytest.raises(SamplerError):
        p.replace(logit_bias={"x": 1})
    with pytest.raises(SamplerError):
        p.replace(stop_token_ids=[-1])
    assert p.replace(logit_bias={"9": -300}).logit_bias == {9: -100.0}
    assert p == SamplingParams(logit_bias={5: 100.0}, stop_token_ids=(7,))


def test_none_means_none_for_the_optional_collections():
    """vLLM's SamplingParams takes None for stop, stop_token_ids and logit_bias (none at all): so does Lumen's."""
    p = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)
    assert (p.stop, p.stop_token_ids, p.logit_bias) == ((), (), {})
    assert p.replace(seed=1).stop == () and p.replace(stop="x").stop == ("x",)
    for bad in ({"stop": [None]}, {"stop": 3}, {"stop_token_ids": [None]}, {"logit_bias": [1]}):
        with pytest.raises(SamplerError):
            SamplingParams(**bad)
