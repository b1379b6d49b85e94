"""Random prompt token ids for the profiling scripts, within the ids the tokenizer knows: a model's embedding can have
rows past them (Qwen2.5's 151,936 rows for 151,665 ids), and the engine refuses a prompt that uses them."""
from __future__ import annotations

import numpy as np

from lumen.engine.admission import prompt_id_end


def random_ids(rng: np.random.Generator, n: int, owner, low: int = 4) -> np.ndarray:
    """n random token ids in [low, prompt_id_end) for `owner`, a lumen Model or Engine."""
    return rng.integers(low, prompt_id_end(owner.tokenizer, owner.config.n_vocab), n)
