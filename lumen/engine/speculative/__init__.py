"""Speculative decoding: a drafter proposes up to k tokens for a request, and one forward pass of the target
verifies them all (the engine runs the request's pending token and its drafts as k + 1 rows of its batch).

    drafters.py     NgramDrafter (prompt lookup) and DraftModel (a second model), a request's SpecState
    verify.py       the acceptance rule: greedy bit-identical to plain decoding, sampled equal in distribution
    speculator.py   Speculator: drafts before the step is scheduled, verifies after its forward pass; adaptive k

Rejected tokens' KV entries are dropped: the sequence's computed length stops at its accepted tokens and the
block manager takes back the blocks past it (lumen.engine.block_manager.BlockManager.computed).
"""
from .drafters import PRIOR, Draft, DraftModel, NgramDrafter, SpecState
from .speculator import Speculator, choose_k, expected_tokens, skipped, update_alpha
from .verify import verify

__all__ = ["PRIOR", "Draft", "DraftModel", "NgramDrafter", "SpecState", "Speculator", "choose_k", "expected_tokens",
           "skipped", "update_alpha", "verify"]
