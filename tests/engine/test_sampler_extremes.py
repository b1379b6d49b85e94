"""The sampler at the edges of its parameters' ranges: what a server client may send."""
import numpy as np
import pytest

from lumen.engine.sampling.processors import make_logits_processors
from lumen.engine.sampling.sampler import make_sampler


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 5e-324])
def test_temperature_too_small_for_float32_is_greedy(temperature):
    """1 / temperature overflows float32: the sampler is greedy, and its distribution (what speculative decoding
    verifies against) is the argmax's, not NaN."""
    x = np.array([1.0, 3.0, 2.0, 3.0, -1.0], np.float32)
    s = make_sampler(temperature=temperature, seed=0)
    assert s.greedy
    assert [s(x) for _ in range(4)] == [1] * 4
    ids, p = s.distribution(x)
    assert np.isfinite(p).all() and list(ids) == [1] and p.sum() == 1.0


def test_small_temperature_still_samples():
    x = np.array([1.0, 3.0, 2.0], np.float32)
    s = make_sampler(temperature=1e-30, seed=0)
    ids, p = s.distribution(x)
    assert np.isfinite(p).all() and p[1] == 1.0


@pytest.mark.parametrize("temperature", [1e38, 1e46, 1e300, 1.7e308])
def test_temperature_too_large_for_float32_draws_only_allowed_tokens(temperature):
    """1 / temperature underflows float32 past about 1e45: the draw is uniform over the tokens a grammar or
    logit_bias left (finite logits) and never picks a -inf one; it was (x - max) * 0, NaN for -inf, and the server
    answered a 500 ("token ... is not allowed by the grammar") to a constrained request at temperature 1e300."""
    x = np.full(8, -np.inf, np.float32)
    x[[2, 5]] = [1.0, -3.0]
    s = make_sampler(temperature=temperature, seed=0)
    assert {s(x) for _ in range(64)} == {2, 5}
    ids, p = s.distribution(x)
    assert ids is None and np.isfinite(p).all() and set(np.flatnonzero(p)) == {2, 5}


@pytest.mark.parametrize("repeat_penalty", [1e-300, 1e-40, 1e300])
def test_extreme_repeat_penalty_keeps_logits_sampleable(repeat_penalty):
    """logit / 1e-300 overflows float32 to +inf, which no sampler can draw from: the penalized logits stay
    finite (a huge penalty still bans, a tiny one still forces the history's tokens), and a masked (-inf) logit
    stays masked."""
    logits = np.array([2.0, -1.0, 0.5, 3.0, -np.inf], np.float32)
    out = make_logits_processors(repeat_penalty=repeat_penalty)(logits.copy(), [0, 1, 4])
    assert np.isfinite(out[:4]).all() and out[4] == -np.inf
    token = make_sampler(temperature=0.0)(out)
    ids, p = make_sampler(temperature=1.0, seed=0).distribution(out)
    assert np.isfinite(p).all()
    assert token == (0 if repeat_penalty < 1 else 3)


def test_tied_forced_tokens_have_real_log_probabilities():
    """Two history tokens a tiny repeat_penalty pushes to the clip share the mass: log(1/2) each, not 0."""
    logits = np.array([2.0, 1.0, 0.5, 3.0], np.float32)
    out = make_logits_processors(repeat_penalty=1e-300)(logits.copy(), [0, 1])
    x = out.astype(np.float64)
    lse = x.max() + np.log(np.exp(x - x.max()).sum())
    assert np.allclose(x[:2] - lse, np.log(0.5)) and np.exp(x - lse).sum() <= 1 + 1e-12
