"""Verification: the target's logits rows decide which drafted tokens a request keeps.

Per position i = 0 .. k of the k + 1 logits rows of a request that ran k drafted tokens:
    greedy     accept draft i while it equals the target's argmax; the first mismatch emits the target's token,
               and if all k are accepted the target's next token is emitted too. The target's logits are the bits
               plain decoding computes (batch invariance), so the output is bit-identical to it.
    sampling   the rule of Leviathan et al. and Chen et al.: accept draft d with probability min(1, p(d) / q(d)); on
               rejection emit a token drawn from the residual max(0, p - q) / Z and stop; after k acceptances draw
               the next token from p. The output distribution equals the target's.
Every uniform is keyed by (request key, position, use) (lumen.engine.sampling.sampler.uniform). The tests hold two
deliberately wrong rules beside this one, which the statistical test must fail (tests/engine/test_speculative.py).
"""
from __future__ import annotations

import numpy as np

from ..sampling.sampler import ACCEPT, PICK, RESIDUAL, uniform


def verify(row, draft, k: int, key: int, pos: int, sampler) -> tuple[list, int]:
    """(emitted tokens, drafts accepted) of one request whose next position is pos, k of whose drafted tokens
    the target ran: row(i) gives the processed logits of its i-th verified position (the drafts before i
    accepted), i = 0 .. k. draft.tokens may hold one more token than k, the draft's token for position k: a
    sampled request then decides that position by the same acceptance rule, so every position's token is the
    same function of the draft and the keyed uniforms whether the target verified it in this step or not
    (without a draft token there, the plain draw). `sampler` is its lumen.engine.sampling.sampler.Sampler; uniforms are
    keyed by (key, position, use)."""
    emitted: list = []
    for i in range(k + 1):
        x = row(i)
        if sampler.greedy:
            t = sampler.pick(x, 0.0)
            emitted.append(t)
            if i == k or draft.tokens[i] != t:
                return emitted, i
            continue
        ids, p = sampler.distribution(x)
        if i >= len(draft.tokens):                   # no draft token for this position: the plain draw
            emitted.append(draw(ids, p, uniform(key, pos + i, PICK)))
            return emitted, i
        d = draft.tokens[i]
        p_d = prob(ids, p, d)
        q_ids, q = (None, None) if draft.q is None else draft.q[i]
        q_d = 1.0 if q is None else prob(q_ids, q, d)
        u = uniform(key, pos + i, ACCEPT)
        if u * q_d < p_d:                            # accept with probability min(1, p(d) / q(d))
            emitted.append(d)
            if i == k:                               # the draft's token for the position after the verified ones
                return emitted, k
            continue
        r_ids, r = residual(ids, p, q_ids, q, d)
        emitted.append(draw(r_ids, r, uniform(key, pos + i, RESIDUAL)))
        return emitted, min(i, k)
    raise AssertionError("unreachable")


def prob(ids: np.ndarray | None, p: np.ndarray, t: int) -> float:
    if ids is None:
        return float(p[t]) if 0 <= t < p.size else 0.0
    hit = np.flatnonzero(ids == t)
    return float(p[hit[0]]) if hit.size else 0.0


def residual(ids, p, q_ids, q, d) -> tuple[np.ndarray | None, np.ndarray]:
    """max(0, p - q), over p's support (q is zero elsewhere by the sign); q None: a point mass on d."""
    r = p.copy()
    if q is None:
        where = np.flatnonzero(ids == d) if ids is not None else np.array([d])
        r[where] = 0.0
    else:
        dense_q = dense(q_ids, q, ids, p.size)
        r = np.maximum(r - dense_q, 0.0)
    s = r.sum()
    if s <= 0.0:                                     # p == q: the draft was certain to be accepted
        return ids, p
    return ids, r / s


def dense(q_ids, q, ids, n) -> np.ndarray:
    """q laid over p's support: ids (n,) token ids (None: the whole vocabulary, n = V)."""
    if ids is None:
        out = np.zeros(n)
        if q_ids is None:
            out[:q.size] = q
        else:
            out[q_ids] = q
        return out
    qmap = dict(zip(range(q.size), q)) if q_ids is None else dict(zip(q_ids.tolist(), q.tolist()))
    return np.array([qmap.get(int(t), 0.0) for t in ids])


def draw(ids, p, u: float) -> int:
    c = np.cumsum(p)
    i = min(int(np.searchsorted(c, u * c[-1], side="right")), p.size - 1)
    while p[i] == 0.0 and i > 0:
        i -= 1
    return i if ids is None else int(ids[i])
