"""The sampler: logits (n_vocab,) -> one token id.

The sampler is built once by `make_sampler(...)` and is a pure callable `logits -> token id` that owns its RNG.
Penalties are separate (lumen.engine.sampling.processors), applied by the caller before the sampler; stop strings
are lumen.engine.stop_strings. Nothing here knows about models or tokenizers. The engine draws each token with a
uniform keyed by the request and the position (`uniform`, at the end).

Chain order: llama.cpp's default sampler list (`common_params_sampling::samplers`, common/common.h) is
    penalties -> dry -> top_n_sigma -> top_k -> typical_p -> top_p -> min_p -> xtc -> temperature, then dist.
Lumen implements penalties (lumen.engine.sampling.processors), top-k, top-p, min-p and temperature, in that order;
dry, top_n_sigma, typical_p and xtc are not implemented (in llama.cpp they are off by default). The steps
follow src/llama-sampling.cpp:
  - top-k keeps the k largest logits;
  - top-p takes the softmax (temperature 1) over what top-k kept and keeps the shortest prefix, in descending
    order, whose probability sum is >= top_p (the token that crosses top_p is kept; at least one always is);
  - min-p keeps the tokens with logit >= max_logit + log(min_p), i.e. p >= min_p * p_max at temperature 1;
  - temperature divides what is left, and one token is drawn from its softmax.
Ties are broken by the lowest token id (llama.cpp leaves their order to std::partial_sort).

Speed: every stage keeps a prefix of the (logit desc, id asc) order, so only logit values are ever sorted
(np.sort, fast), and a prefix is rebuilt from its last logit and the number of ties with it it holds. Top-k is
O(V) without a sort; top-p after top-k sorts k values; top-p without top-k sorts min-p's survivors or the
1024, then 32768 largest logits (TOP_P_TRIES), and the whole vocabulary only when those hold less than top_p
of the mass (a flat distribution). Weights are float32 exp, summed in float64 (block sums pairwise in float32),
so the top-p cutoff is exact up to about 1e-6 of probability mass.
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import LumenError

TOPK_ROWS = 64      # small top-k: logits viewed as (TOPK_ROWS, V / TOPK_ROWS), column maxima give a threshold
SAMPLE_SIZE = 4096  # larger top-k reads its threshold guess off about this many strided logits
TOP_P_TRIES = (1024, 32768)  # top-p without top-k or min-p: prefix sizes tried before sorting the vocab
BLOCK = 1024        # cumulative sums over more weights than this go block-wise
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = np.float32(np.finfo(np.float32).smallest_subnormal)


class SamplerError(LumenError, ValueError):
    """A sampling or penalty parameter is out of range, or the logits cannot be sampled (NaN, all -inf). param: the
    SamplingParams field at fault, where one is (the server names it in its 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------------------------------------------------
# validation

def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SamplerError(f"{name} must be a number, got {value!r}", param=name)
    value = float(value)
    if math.isnan(value):
        raise SamplerError(f"{name} must be a number, got NaN", param=name)
    return value


def _integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SamplerError(f"{name} must be an integer, got {value!r}", param=name)
    return int(value)


def check_sampler_params(temperature, top_k, top_p, min_p, seed) -> tuple[float, int, float, float, int | None]:
    """The one check of the sampler's settings (lumen.SamplingParams and make_sampler both call it): the values,
    converted, or SamplerError naming the bad one."""
    temperature = _number("temperature", temperature)
    if not 0.0 <= temperature < math.inf:
        raise SamplerError(f"temperature must be >= 0 and finite (0 = greedy), got {temperature}", param="temperature")
    top_k = _integer("top_k", top_k)
    if top_k < 0:
        raise SamplerError(f"top_k must be >= 0 (0 = off), got {top_k}", param="top_k")
    top_p = _number("top_p", top_p)
    if not 0.0 < top_p <= 1.0:
        raise SamplerError(f"top_p must be in (0, 1] (1 = off), got {top_p}", param="top_p")
    min_p = _number("min_p", min_p)
    if not 0.0 <= min_p <= 1.0:
        raise SamplerError(f"min_p must be in [0, 1] (0 = off), got {min_p}", param="min_p")
    if seed is not None:
        seed = _integer("seed", seed)
        if not 0 <= seed < 2 ** 63:
            raise SamplerError(f"seed must be None or an integer in [0, 2^63), got {seed}", param="seed")
    return temperature, top_k, top_p, min_p, seed


def _as_logits(logits) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 1 or x.size == 0:
        raise SamplerError(f"logits must have shape (n_vocab,), got {x.shape}")
    return x


def _checked_max(x: np.ndarray) -> float:
    m = float(x.max())  # NaN propagates through max
    if not math.isfinite(m):
        what = "NaN" if math.isnan(m) else ("+inf" if m > 0 else "only -inf")
        raise SamplerError(f"cannot sample: logits contain {what}")
    return m


# ---------------------------------------------------------------------------------------------------------
# the stages, each on explicit arrays

def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """ids (k,) of the k largest of x (V,), unordered; ties at the boundary go to the lowest ids. O(V), no sort.

    Any threshold t with count(x >= t) >= k holds the top k among the ids with x >= t. Small k: view x as
    (TOPK_ROWS, V / TOPK_ROWS) and take the max of each column (one vectorized pass); the k-th largest column
    max is such a t, and only the >= k columns reaching it can hold candidates. Larger k: guess t from a
    strided sample and check the count, falling back to the exact k-th value (np.partition of x).
    """
    n = x.size
    n_cols = n // TOPK_ROWS
    if 4 * k <= n_cols:
        main = x[: n_cols * TOPK_ROWS].reshape(TOPK_ROWS, n_cols)                  # (rows, n_cols)
        col_max = main.max(axis=0)                                                 # (n_cols,)
        t = np.partition(col_max, n_cols - k)[n_cols - k]
        cols = np.flatnonzero(col_max >= t)                                        # (>= k,)
        cand = (np.arange(TOPK_ROWS)[:, None] * n_cols + cols).ravel()            # ids in those columns
        if n > n_cols * TOPK_ROWS:
            cand = np.concatenate([cand, np.arange(n_cols * TOPK_ROWS, n)])        # + the ragged tail
        cand = cand[x[cand] >= t]                                                  # (c,) unordered
    else:
        stride = max(1, n // SAMPLE_SIZE)
        sample = x[::stride]                         # (n_s,) about SAMPLE_SIZE logits
        j = min(sample.size, 4 * k // stride + 4)    # expect about j*stride >= 4k survivors
        t = np.partition(sample, sample.size - j)[sample.size - j]
        cand = np.flatnonzero(x >= t)                # (c,)
        if cand.size < k:
            t = np.partition(x, n - k)[n - k]        # exact k-th largest
            cand = np.flatnonzero(x >= t)
    if cand.size == k:
        return cand
    vals = x[cand]
    kth = np.partition(vals, vals.size - k)[vals.size - k]
    above = cand[vals > kth]
    tied = np.sort(cand[vals == kth])[: k - above.size]   # lowest ids first
    return np.concatenate([above, tied])


def _cumsum_search(w: np.ndarray, target: float, side: str) -> int:
    """np.searchsorted(np.cumsum(w), target, side) for weights w (c,) >= 0, without the full cumsum (numpy's
    is slow: about 0.9 ms for 262144 float32): pairwise block sums, their float64 cumsum, then a cumsum inside
    the one block the target falls in. Returns c when the total stays below target."""
    nb = w.size // BLOCK
    if nb <= 1:
        return int(np.searchsorted(np.cumsum(w, dtype=np.float64), target, side=side))
    sums = w[: nb * BLOCK].reshape(nb, BLOCK).sum(axis=1)          # (nb,)
    if w.size > nb * BLOCK:
        sums = np.append(sums, w[nb * BLOCK:].sum())               # (nb + 1,) with the tail block
    cum = np.cumsum(sums, dtype=np.float64)
    b = int(np.searchsorted(cum, target, side=side))
    if b == cum.size:
        return w.size
    inner = np.cumsum(w[b * BLOCK: (b + 1) * BLOCK], dtype=np.float64)
    i = int(np.searchsorted(inner, target - (cum[b - 1] if b else 0.0), side=side))
    return b * BLOCK + min(i, inner.size - 1)


def _top_p_count(vals_desc: np.ndarray, m: float, need: float) -> int | None:
    """How many of vals_desc (c,) (descending logits) top-p keeps: the shortest prefix whose exp(v - m) sum to
    >= need; None when all of them together stay below need."""
    w = np.exp(vals_desc - np.float32(m))            # (c,) float32
    n = _cumsum_search(w, need, "left") + 1          # first i with cumsum[i] >= need, kept
    return n if n <= vals_desc.size else None


def _prefix(ids: np.ndarray | None, x: np.ndarray, vals_desc: np.ndarray, n: int) -> np.ndarray:
    """The first n tokens in (logit desc, id asc) order among ids, given their logits sorted descending:
    everything above the n-th logit, and the lowest ids tied with it. As ids (c,), or for ids None (all of x)
    as a mask (V,) bool, which is cheaper when n is large."""
    v_cut = vals_desc[n - 1]
    n_tied = n - int(np.searchsorted(-vals_desc, -v_cut, side="left"))   # kept among those == v_cut
    if ids is None:
        mask = x > v_cut
        mask[np.flatnonzero(x == v_cut)[:n_tied]] = True
        return mask
    vals = x[ids]
    return np.concatenate([ids[vals > v_cut], np.sort(ids[vals == v_cut])[:n_tied]])


def _draw(w: np.ndarray, u: float) -> int:
    """Index drawn with probability w / sum(w) from the weights w (c,) >= 0, using the uniform u in [0, 1)."""
    i = min(_cumsum_search(w, u * float(w.sum()), "right"), w.size - 1)
    while w[i] == 0.0 and i > 0:                     # rounding ran past the last nonzero weight
        i -= 1
    return i


# ---------------------------------------------------------------------------------------------------------
# the sampler

class Sampler:
    """logits (n_vocab,) float32 -> token id, with `make_sampler`'s settings. Calling it draws from its own
    numpy Generator (one uniform per token); `pick(logits, u)` takes the uniform from the caller (the engine keys
    uniforms by request and position, lumen.engine.sampling.sampler.uniform), and `distribution(logits)` gives the probabilities
    the draw uses (what speculative decoding verifies against). Logits are not modified."""

    def __init__(self, temperature: float, top_k: int, top_p: float, min_p: float, seed: int | None):
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        # greedy also when 1 / temperature overflows float32: (max - max) * inf would be NaN
        self.greedy = temperature == 0.0 or 1.0 / temperature > FLOAT32_MAX
        self._rng = np.random.default_rng(seed)
        # a temperature so large that 1 / temperature underflows float32 keeps its smallest positive value: the
        # draw is then uniform over the allowed tokens, and a disallowed one's -inf stays -inf (-inf * 0 is NaN)
        self._inv_temp = np.float32(0.0) if self.greedy else max(np.float32(1.0 / temperature), FLOAT32_TINY)
        self._min_p_log = math.log(min_p) if min_p > 0.0 else -math.inf

    def __call__(self, logits: np.ndarray) -> int:
        return self.pick(logits, 0.0 if self.greedy else float(self._rng.random()))

    def pick(self, logits: np.ndarray, u: float) -> int:
        """The token drawn with the uniform u in [0, 1) (greedy: the argmax, u unused)."""
        x = _as_logits(logits)
        if self.greedy:
            i = int(np.argmax(x))                    # first maximum (a NaN would come first)
            if not math.isfinite(float(x[i])):       # NaN, +inf or all -inf: raise
                _checked_max(x)
            return i
        ids, w = self._weights(x)
        i = _draw(w, u)
        return i if ids is None else int(ids[i])

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(ids, p): the probabilities of the draw, p (c,) float64 summing to 1 over the token ids (c,), or over
        the whole vocabulary when ids is None. Greedy: all mass on the argmax."""
        x = _as_logits(logits)
        if self.greedy:
            return np.array([self.pick(x, 0.0)]), np.ones(1)
        ids, w = self._weights(x)
        w = w.astype(np.float64)
        return ids, w / w.sum()

    def _weights(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """top-k -> top-p -> min-p -> temperature: (ids (c,) or None for all, unnormalised weights f32)."""
        m = _checked_max(x)
        kept = _candidates(x, m, self.top_k, self.top_p, float(np.float32(m + self._min_p_log)))
        whole = kept is None or kept.dtype == np.bool_
        w = np.subtract(x if whole else x[kept], np.float32(m))   # (V,) or (c,)
        w *= self._inv_temp
        np.exp(w, out=w)                             # exp((logit - max) / temperature)
        if kept is not None and whole:
            w *= kept                                # zero weight outside the kept mask
        return (None if whole else kept), w


def make_sampler(*, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None) -> Sampler:
    """Build a sampler `logits (n_vocab,) float32 -> token id`.

    temperature 0 is greedy (argmax, ties: lowest id; the other settings do not change the argmax and are
    ignored), and so is a temperature so small that 1 / temperature overflows float32. Otherwise top-k -> top-p
    -> min-p -> temperature -> draw (module docstring). top_k 0, top_p 1 and min_p 0 are off. Called, it uses a
    numpy Generator seeded with `seed` (None: fresh OS entropy) and draws exactly one uniform per token, so the
    same seed and logits give the same tokens. Logits are not modified.
    """
    return Sampler(*check_sampler_params(temperature, top_k, top_p, min_p, seed))


def _candidates(x: np.ndarray, m: float, top_k: int, top_p: float, min_logit: float) -> np.ndarray | None:
    """top-k -> top-p -> min-p on x (V,) whose max is m: the kept ids (c,) unordered, or a kept mask (V,)
    bool, or None for all of them. min_logit = m + log(min_p) as float32 (-inf: min-p off).

    Every stage keeps a prefix of the (logit desc, id asc) order, so only values are sorted (np.sort, fast), a
    prefix is rebuilt from its last logit and how many ties with it it holds, and the result is the shortest
    of the three prefixes; min-p's is {x >= min_logit}.
    """
    n = x.size
    min_p_on = min_logit > -math.inf
    if 0 < top_k < n:                                # top-k, then top-p over the softmax of the k
        ids = _top_k_ids(x, top_k)
        if top_p < 1.0:
            vals_desc = np.sort(x[ids])[::-1]
            need = top_p * float(np.exp(vals_desc - np.float32(m)).sum(dtype=np.float64))
            ids = _prefix(ids, x, vals_desc, _top_p_count(vals_desc, m, need) or ids.size)
    elif top_p < 1.0:                                # top-p over the full vocab
        need = top_p * float(np.exp(np.subtract(x, np.float32(m))).sum(dtype=np.float64))
        if min_p_on:                                 # min-p keeps a prefix too: top-p can only shorten it
            ids = np.flatnonzero(x >= min_logit)
            vals_desc = np.sort(x[ids])[::-1]
            count = _top_p_count(vals_desc, m, need)
            return ids if count is None else _prefix(ids, x, vals_desc, count)
        for size in (*[s for s in TOP_P_TRIES if s < n], n):   # short prefixes first; most steps end there
            ids = _top_k_ids(x, size) if size < n else None
            vals_desc = np.sort(x if ids is None else x[ids])[::-1]
            count = _top_p_count(vals_desc, m, need)
            if count is not None:
                break
        return _prefix(ids, x, vals_desc, count or n)
    elif min_p_on:
        return np.flatnonzero(x >= min_logit)
    else:
        return None
    return ids[x[ids] >= min_logit] if min_p_on else ids


# ---------------------------------------------------------------------------------------------------------
# keyed uniforms: what decides a request's token at a position

PICK, ACCEPT, RESIDUAL, DRAFT = range(4)   # what a keyed uniform is for (see `uniform`)
_M64 = (1 << 64) - 1


def uniform(key: int, pos: int, use: int) -> float:
    """A uniform in [0, 1) that depends on (key, position, use) alone (splitmix64 of their mix). A request draws
    the uniform that decides its token at a position from its key and that position, so its tokens do not
    depend on how the engine grouped its steps (speculative drafts of any length, preemption, batching)."""
    z = (key + 0x9E3779B97F4A7C15 * (4 * pos + use + 1)) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return ((z ^ (z >> 31)) >> 11) * (1.0 / (1 << 53))


def request_key(seed: int | None) -> int:
    """A request's key: mixed from its seed, or fresh entropy without one."""
    if seed is None:
        import os
        return int.from_bytes(os.urandom(8), "little")
    return int(uniform(int(seed) & _M64, 0, 0) * (1 << 53)) ^ (int(seed) >> 11)
