"""Log-probabilities of given tokens under rows of logits: a prompt's tokens (SamplingParams.prompt_logprobs).

    logprobs_of(logits, ids, k)   (m, V) logits, (m,) ids -> per row (log p of ids[r], [(id, log p)] of the top k)

In float64, as TokenChooser.logprobs computes a sampled token's: the top k highest first, ties to the lower id.
Rows are taken a few at a time, so the float64 temporaries stay small beside a long prompt's (m, V) logits.
"""
from __future__ import annotations

import numpy as np

ROWS = 16                   # rows per float64 block: 16 x 151936 x 8 B = 19 MB at Qwen's vocabulary


def logprobs_of(logits: np.ndarray, ids, k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    ids = np.asarray(ids, np.int64)
    out = []
    for a in range(0, len(ids), ROWS):
        x = logits[a:a + ROWS].astype(np.float64)                    # (r, V)
        mx = x.max(1, keepdims=True)
        lse = mx[:, 0] + np.log(np.exp(x - mx).sum(1))                # (r,)
        lp = x - lse[:, None]                                         # (r, V) log-softmax
        top = np.argpartition(-lp, k - 1, axis=1)[:, :k] if k else None
        for r in range(x.shape[0]):
            best = []
            if k:
                t = top[r]
                t = t[np.lexsort((t, -lp[r, t]))]
                best = [(int(i), float(lp[r, i])) for i in t]
            out.append((float(lp[r, ids[a + r]]), best))
    return out
