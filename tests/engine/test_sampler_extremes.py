"""The sampler at the edges of its parameters' ranges: what a server client may send."""
import numpy as np
import pytest

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
