"""Sampler, penalties and stop strings, against straightforward references (llama.cpp semantics)."""
import math

import numpy as np
import pytest

from lumen.errors import LumenError
from lumen.engine.sampling.processors import make_logits_processors
from lumen.engine.sampling.sampler import SamplerError, _candidates, make_sampler
from lumen.engine.stop_strings import StopChecker


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def reference_kept(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """llama.cpp's top-k -> top-p -> min-p the slow way: one full sort (logit desc, id asc), float64."""
    ids = np.lexsort((np.arange(x.size), -x))
    if 0 < top_k < x.size:
        ids = ids[:top_k]
    m = float(x.max())
    if top_p < 1.0:
        cum = np.cumsum(softmax(x[ids]))
        ids = ids[: int(np.searchsorted(cum, top_p, side="left")) + 1]
    if min_p > 0.0:
        ids = ids[x[ids] >= np.float32(m + math.log(min_p))]
    return set(ids.tolist())


def kept(x: np.ndarray, top_k=0, top_p=1.0, min_p=0.0) -> set[int]:
    m = float(x.max())
    ids = _candidates(x, m, top_k, top_p, float(np.float32(m + (math.log(min_p) if min_p > 0 else -math.inf))))
    if ids is None:
        return set(range(x.size))
    return set(np.flatnonzero(ids).tolist()) if ids.dtype == np.bool_ else set(ids.tolist())


def draws(sampler, x, n) -> np.ndarray:
    return np.array([sampler(x) for _ in range(n)])


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------------------------------------------
# greedy

def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for v in (5, 49152):
        x = rng.standard_normal(v).astype(np.float32)
        assert make_sampler()(x) == int(np.argmax(x))
        # temperature 0 ignores the filters: they never remove the argmax
        assert make_sampler(temperature=0.0, top_k=5, top_p=0.5, min_p=0.5, seed=3)(x) == int(np.argmax(x))


def test_greedy_ties_lowest_id():
    x = np.array([0.0, 2.0, 1.0, 2.0, 2.0], np.float32)
    assert make_sampler()(x) == 1


def test_top_k_1_and_tiny_top_p_are_greedy():
    rng = np.random.default_rng(1)
    greedy = make_sampler()
    top1 = make_sampler(temperature=1.5, top_k=1, seed=0)
    tiny_p = make_sampler(temperature=1.5, top_p=1e-9, seed=0)
    for v in (7, 5000, 70001):
        for _ in range(20):
            x = np.round(rng.standard_normal(v) * 2).astype(np.float32)   # rounding makes ties at the top
            assert top1(x) == greedy(x) == tiny_p(x)


# ---------------------------------------------------------------------------------------------------------
# reproducibility

def test_same_seed_same_sequence_different_seeds_differ():
    x = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    kw = dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.01)
    a = draws(make_sampler(**kw, seed=42), x, 200)
    b = draws(make_sampler(**kw, seed=42), x, 200)
    c = draws(make_sampler(**kw, seed=43), x, 200)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_sampler_does_not_modify_logits():
    x = np.random.default_rng(3).standard_normal(3000).astype(np.float32)
    before = x.copy()
    for kw in (dict(), dict(top_k=40), dict(top_p=0.9), dict(min_p=0.1), dict(top_k=40, top_p=0.9, min_p=0.1)):
        make_sampler(temperature=0.7, seed=0, **kw)(x)
    assert np.array_equal(x, before)


# ---------------------------------------------------------------------------------------------------------
# the filters against the reference

def test_filters_match_reference():
    rng = np.random.default_rng(4)
    for trial in range(150):
        v = int(rng.choice([10, 300, 5000, 49152]))
        x = (rng.standard_normal(v) * rng.choice([0.3, 1.0, 3.0, 10.0])).astype(np.float32)
        if trial % 4 == 0:
            x = np.round(x).astype(np.float32)           # many ties
        if trial % 7 == 0:
            x[rng.integers(0, v, v // 3)] = -np.inf      # banned tokens
        top_k = int(rng.choice([0, 0, 1, 5, 40, 1000]))
        top_p = float(rng.choice([1.0, 0.5, 0.9, 0.95, 0.999]))
        min_p = float(rng.choice([0.0, 0.0, 0.05, 0.5, 1e-6]))
        got = kept(x, top_k, top_p, min_p)
        if top_p == 1.0:
            assert got == reference_kept(x, top_k, top_p, min_p), (trial, top_k, min_p)
        else:
            # float32 weights: the top-p cutoff may move by tokens within 1e-5 of probability mass of it
            low = reference_kept(x, top_k, top_p - 1e-5, min_p)
            high = reference_kept(x, top_k, min(top_p + 1e-5, 1.0), min_p)
            assert low <= got <= high, (trial, top_k, top_p, min_p)


def test_flat_distribution_top_p_sorts_whole_vocab():
    # almost uniform logits: the 1024 largest hold far less than top_p, so the full-vocab path runs
    x = (np.random.default_rng(5).standard_normal(70001) * 0.01).astype(np.float32)
    expected = reference_kept(x, 0, 0.9, 0.0)
    assert kept(x, top_p=0.9) == expected
    assert set(draws(make_sampler(temperature=1.0, top_p=0.9, seed=5), x, 300).tolist()) <= expected


def test_min_p_filtering():
    # p relative to the max: exp(-1) = 0.37, exp(-2) = 0.14, exp(-3) = 0.05, exp(-4) = 0.018
    x = np.array([0.0, -1.0, -2.0, -3.5, -4.0, -np.inf], np.float32)
    assert kept(x, min_p=0.1) == {0, 1, 2}
    assert kept(x, min_p=0.02) == {0, 1, 2, 3}
    assert kept(x, min_p=1.0) == {0}
    sampler = make_sampler(temperature=1.0, min_p=0.1, seed=0)
    assert set(draws(sampler, x, 500).tolist()) == {0, 1, 2}


def test_top_p_keeps_the_token_that_crosses():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    x = np.log(p).astype(np.float32)
    assert kept(x, top_p=0.5) == {0}
    assert kept(x, top_p=0.6) == {0, 1}
    assert kept(x, top_p=0.81) == {0, 1, 2}


def test_order_top_k_before_top_p():
    # top-p renormalizes over what top-k kept: over {0, 1} token 0 has 0.5/0.8 = 0.625 < 0.7
    x = np.log(np.array([0.5, 0.3, 0.2])).astype(np.float32)
    assert kept(x, top_k=2, top_p=0.7) == {0, 1}
    assert kept(x, top_p=0.7) == {0, 1}
    assert kept(x, top_k=2, top_p=0.6) == {0}


# ---------------------------------------------------------------------------------------------------------
# the draw

@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution_matches_softmax(temperature):
    x = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0], np.float32)
    n = 20000
    counts = np.bincount(draws(make_sampler(temperature=temperature, seed=7), x, n), minlength=x.size)
    # df = 7: P(chi2 > 40) is about 1e-6
    assert chi2(counts, softmax(x / temperature)) < 40


def test_filtered_distribution_is_renormalized_softmax():
    x = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0], np.float32)
    kept_ids = [5, 0, 1, 6]                            # the 4 largest
    counts = np.bincount(draws(make_sampler(temperature=0.8, top_k=4, seed=8), x, 20000), minlength=x.size)
    assert counts[[2, 3, 4, 7]].sum() == 0
    assert chi2(counts[kept_ids], softmax(x[kept_ids] / 0.8)) < 35   # df = 3


def test_full_vocab_draw_across_blocks():
    # a large vocab exercises the block-wise cumulative sum; the mass sits in a few tokens far apart
    x = np.full(50001, -np.inf, np.float32)
    ids = np.array([3, 1500, 27777, 50000])          # the last one is in the partial tail block
    x[ids] = [0.0, 1.0, 0.5, -0.5]
    counts = np.bincount(draws(make_sampler(temperature=1.0, seed=9), x, 5000), minlength=x.size)
    assert counts.sum() == counts[ids].sum()           # -inf tokens are never drawn
    assert chi2(counts[ids], softmax(x[ids])) < 35


def test_bad_logits_raise():
    for sampler in (make_sampler(), make_sampler(temperature=1.0, top_k=3, seed=0)):
        with pytest.raises(ValueError, match="NaN"):
            sampler(np.array([0.0, np.nan, 1.0], np.float32))
        with pytest.raises(ValueError, match="-inf"):
            sampler(np.full(4, -np.inf, np.float32))
        with pytest.raises(ValueError, match="shape"):
            sampler(np.zeros((2, 3), np.float32))


# ---------------------------------------------------------------------------------------------------------
# penalties

def test_penalties_by_hand():
    logits = np.array([2.0, -1.0, 0.5, 3.0, 0.0, 0.0], np.float32)
    history = [0, 1, 0, 3, 3, 3, 4]
    out = make_logits_processors(repeat_penalty=1.5, frequency_penalty=0.1, presence_penalty=0.2)(
        logits.copy(), history)
    expected = [2.0 / 1.5 - (2 * 0.1 + 0.2),   # positive: divided; count 2
                -1.0 * 1.5 - (1 * 0.1 + 0.2),  # negative: multiplied; count 1
                0.5,                           # not in history
                3.0 / 1.5 - (3 * 0.1 + 0.2),   # count 3
                0.0 - (1 * 0.1 + 0.2),         # zero counts as <= 0: 0 * 1.5 = 0
                0.0]
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_penalties_window_and_modes():
    logits = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    history = [0, 1, 0, 3, 3, 3]
    out = make_logits_processors(repeat_penalty=1.5, frequency_penalty=0.1, presence_penalty=0.2, last_n=3)(
        logits.copy(), history)                        # only [3, 3, 3] is seen
    np.testing.assert_allclose(out, [2.0, -1.0, 0.5, 3.0 / 1.5 - 0.5], rtol=1e-6)
    out = make_logits_processors(presence_penalty=0.5, last_n=-1)(logits.copy(), np.array(history))
    np.testing.assert_allclose(out, [1.5, -1.5, 0.5, 2.5], rtol=1e-6)
    out = make_logits_processors(repeat_penalty=2.0)(logits.copy(), [])
    np.testing.assert_array_equal(out, logits)
    with pytest.raises(ValueError, match="history token ids"):
        make_logits_processors(repeat_penalty=2.0)(logits.copy(), [4])


def test_neutral_penalties_are_identity():
    logits = np.array([1.0, -2.0], np.float32)
    for proc in (make_logits_processors(), make_logits_processors(repeat_penalty=1.3, last_n=0)):
        out = proc(logits, [0, 1, 1])
        assert out is logits
        np.testing.assert_array_equal(out, [1.0, -2.0])


# ---------------------------------------------------------------------------------------------------------
# validation

@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
    dict(top_k=-1), dict(top_k=2.5), dict(top_k=True),
    dict(top_p=0.0), dict(top_p=1.01), dict(top_p=float("nan")),
    dict(min_p=-0.01), dict(min_p=1.5), dict(min_p=float("nan")),
    dict(seed=-1), dict(seed="x"),
])
def test_bad_sampler_params(kwargs):
    with pytest.raises(ValueError) as err:
        make_sampler(**{"temperature": 0.8, **kwargs})
    assert isinstance(err.value, LumenError)
    assert next(iter(kwargs)) in str(err.value)


@pytest.mark.parametrize("kwargs", [
    dict(repeat_penalty=0.0), dict(repeat_penalty=-1.0), dict(repeat_penalty=float("nan")),
    dict(presence_penalty=float("nan")), dict(frequency_penalty=float("inf")), dict(last_n=-2),
])
def test_bad_penalty_params(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        make_logits_processors(**kwargs)


# ---------------------------------------------------------------------------------------------------------
# stop strings

def test_stop_string_split_across_chunks():
    stop = StopChecker(["</s>", "###"])
    assert stop.feed("Hello <") == ("Hello ", False)
    assert stop.feed("/") == ("", False)
    assert stop.feed("s> and more") == ("", True)
    assert stop.feed("later") == ("", True)
    assert stop.flush() == ""


def test_stop_partial_match_released():
    stop = StopChecker(["</s>"])
    assert stop.feed("a </") == ("a ", False)
    assert stop.feed("b>") == ("</b>", False)
    assert stop.feed("x<") == ("x", False)
    assert stop.flush() == "<"


def test_stop_earliest_wins_and_text_before_is_emitted():
    stop = StopChecker(["END", "\n\n"])
    assert stop.feed("one\n\ntwo END") == ("one", True)


def test_stop_any_chunking():
    text = "The answer is 42.<|im_end|>ignored <|im_end|>"
    rng = np.random.default_rng(10)
    for _ in range(200):
        cuts = sorted(rng.choice(len(text), size=rng.integers(0, 12), replace=False).tolist())
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stop, out = StopChecker(["<|im_end|>", "<|endoftext|>"]), []
        for chunk in chunks:
            piece, stopped = stop.feed(chunk)
            out.append(piece)
            assert "<|" not in "".join(out)            # nothing of a stop string ever leaks
            if stopped:
                break
        assert stopped and "".join(out) == "The answer is 42."


def test_stop_bad_args():
    for bad in ("</s>", [""], [None]):
        with pytest.raises(ValueError):
            StopChecker(bad)
    stop = StopChecker([])
    assert stop.feed("anything") == ("anything", False)


@pytest.mark.parametrize("kw, param", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                       (dict(top_k=-2), "top_k"), (dict(min_p=2), "min_p"), (dict(seed=-1), "seed"),
                                       (dict(repeat_penalty=0), "repeat_penalty"),
                                       (dict(presence_penalty=float("inf")), "presence_penalty"),
                                       (dict(repeat_last_n=-5), "repeat_last_n"), (dict(stop=[""]), "stop"),
                                       (dict(max_tokens=-1), "max_tokens")])
def test_sampler_error_names_its_field(kw, param):
    """The server's 400 names the field from SamplerError.param, never by reading the message."""
    from lumen.engine.sampling.params import SamplingParams
    with pytest.raises(SamplerError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and str(e.value).startswith(param + " ")


@pytest.mark.parametrize("v", [-5, 1.5, "3"])
def test_repeat_last_n_errors_say_repeat_last_n(v):
    """The keyword is repeat_last_n (SamplingParams, Model.generate, the server): the message uses that word."""
    from lumen.engine.sampling.params import SamplingParams
    with pytest.raises(SamplerError, match=r"^repeat_last_n ") as e:
        SamplingParams(repeat_last_n=v)
    assert e.value.param == "repeat_last_n"
