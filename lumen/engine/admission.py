"""Admission: a prompt and its SamplingParams -> checked token ids and a resolved max_tokens, or an error that
names what is wrong (RequestError, ContextError, SamplerError: all ValueErrors). The engine's state is untouched
by a request that fails here.
"""
from __future__ import annotations

import numpy as np

from ..errors import ContextError, LumenError, plural
from .block_manager import BlockManager
from .sampling.params import SamplingParams


class RequestError(LumenError, ValueError):
    """A request cannot be served (bad prompt, too long, cannot ever fit); the engine is unaffected."""


def prompt_id_end(tokenizer, n_vocab: int) -> int:
    """One past the largest token id a prompt may hold: the tokenizer's last, within the model's n_vocab embedding
    rows (Qwen2.5 pads its 151,665 ids to 151,936 rows; a padding row's id is no token)."""
    return min(n_vocab, tokenizer.vocab_end)


def prompt_ids(prompt, tokenizer, n_vocab: int, special: bool) -> list[int]:
    """A prompt (text, or token ids) as checked token ids; RequestError when it is not one."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_bos=tokenizer.default_bos(prompt, special), special=special)
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            texts = len(prompt) > 0 and all(isinstance(t, str) for t in prompt)    # ("1" or 1.0: no token id)
            raise RequestError("a token-id prompt must hold integers" + (
                f", got {len(prompt)} strings: one prompt is one string (lumen.Engine.generate takes a list of "
                "prompts)" if texts else ""))
        ids = [int(t) for t in prompt]
        end = prompt_id_end(tokenizer, n_vocab)
        bad = [t for t in ids if not 0 <= t < end]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{end - 1})")
    else:
        raise RequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise RequestError("the prompt is empty (no tokens)")
    return ids


def admit(prompt, params: SamplingParams, tokenizer, n_vocab: int, max_model_len: int,
          pool_blocks: int) -> tuple[list[int], int]:
    """(prompt token ids, max_tokens) of a request the engine can serve: its ids in the vocabulary, prompt +
    max_tokens (None: the rest of max_model_len) within max_model_len and within the KV pool's pool_blocks."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be a lumen.SamplingParams, got {type(params).__name__}")
    params.check_vocab(n_vocab)
    ids = prompt_ids(prompt, tokenizer, n_vocab, params.special)
    n, limit = len(ids), max_model_len
    if n >= limit:
        raise ContextError(f"the prompt has {plural(n, 'token')}; max_model_len is {limit}, which must also leave room "
                           f"for at least one generated token")
    max_tokens = limit - n if params.max_tokens is None else params.max_tokens
    if n + max_tokens > limit:
        raise ContextError(f"the prompt ({plural(n, 'token')}) plus max_tokens ({max_tokens}) exceeds max_model_len "
                           f"({limit})")
    need = BlockManager.blocks_for(n + max_tokens)
    if need > pool_blocks:
        raise RequestError(f"the prompt ({plural(n, 'token')}) plus max_tokens ({max_tokens}) needs "
                           f"{plural(need, 'KV block')} but the pool has {pool_blocks}; raise kv_cache_mb or lower "
                           "max_tokens")
    return ids, max_tokens
