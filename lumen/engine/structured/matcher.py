"""GrammarMatcher: one request's position in its grammar. Made by CompiledGrammar.matcher().

    m.fill_mask(row)                  # row: int32 (mask_words,), the tokens allowed next (bit t = token t)
    m.advance(token)                  # after sampling; an end-of-generation token counts as EOS (unless the
                                      # grammar names that very token, as Lark's <|endoftext|> or <[id]>)
    m.is_stopped                      # the grammar is complete and takes no more text: finish with "stop"
    m.validate_draft(tokens) -> n     # how many of the speculative draft tokens the grammar accepts (a prefix)
    m.rollback(n)                     # undo the last n advanced tokens

The matcher state moves only with `advance` (and `rollback`): masks of speculative positions are computed
without committing (lumen.engine.structured.bitmask.fill_masks), so a rejected draft needs no rollback. A token
the grammar does not allow is an engine bug, not a user error: `advance` raises StructuredOutputError and the
matcher stays where it was. When llguidance itself gives up on the grammar (a limit of its lexer or parser, which
a pathological pattern reaches), the error begins with GRAMMAR_FAILED: the grammar's fault, not the engine's.

Not thread-safe: the engine either uses a matcher on its step thread, or hands it to the mask filler for the
length of a fill (which must end before the next `advance`).
"""
from __future__ import annotations

from typing import Sequence

import llguidance
import numpy as np

from .constraint import StructuredOutputError
from .vocab import GrammarVocab

GRAMMAR_FAILED = "grammar matcher failed"   # how an error llguidance's matcher itself reports begins


class GrammarMatcher:
    def __init__(self, ll_matcher: llguidance.LLMatcher, vocab: GrammarVocab):
        self.ll = ll_matcher
        self.vocab = vocab
        self._eog = frozenset(vocab.eog_ids)
        self.n_tokens = 0                  # tokens advanced (committed) so far

    def _ll_tokens(self, tokens: Sequence[int]) -> list[int]:
        """llguidance's ids for Lumen tokens committed in order from here: an end-of-generation token is its one
        EOS, unless the grammar names that token itself there (Lark's `<|endoftext|>`, `<[id]>`)."""
        eos, out = self.vocab.eos_id, []
        for t in tokens:
            t = int(t)
            if t in self._eog and t != eos and self.ll.validate_tokens([*out, t]) <= len(out):
                t = eos
            out.append(t)
        return out

    def _takes_eos(self) -> bool:
        """Whether llguidance consumes EOS here. validate_tokens says 0 for it where the grammar is not complete,
        even where the grammar names it as a token of its own (`start: "x" <|im_end|>`), which the mask allows
        and consume_token takes; asked of a copy, on this rare path only."""
        probe = self.ll.deep_copy()
        return probe.consume_token(self.vocab.eos_id) and not probe.is_error()

    def advance(self, token: int) -> None:
        """Commit one sampled token. StructuredOutputError if the grammar does not allow it here."""
        t, = self._ll_tokens([token])
        if self.ll.is_error():                  # llguidance gave up (a limit of its lexer or parser), not the token
            raise StructuredOutputError(f"{GRAMMAR_FAILED} before token {token}: {self.error}")
        # a stopped matcher still takes EOS (validate_tokens says 0 for it there)
        eos = t == self.vocab.eos_id
        if not ((eos and self.ll.is_stopped()) or self.ll.validate_tokens([t]) == 1 or (eos and self._takes_eos())):
            raise StructuredOutputError(f"token {token} is not allowed by the grammar here (after "
                                        f"{self.n_tokens} tokens){self._why()}")
        if not self.ll.consume_token(t):
            raise StructuredOutputError(f"{GRAMMAR_FAILED} on token {token}: {self.error}")
        self.n_tokens += 1

    def advance_many(self, tokens: Sequence[int]) -> None:
        """Commit several tokens in order (e.g. the accepted drafts and the bonus token of a verify step)."""
        for t in tokens:
            self.advance(t)

    def validate_draft(self, tokens: Sequence[int]) -> int:
        """The length of the longest prefix of `tokens` the grammar accepts from here (no state change)."""
        if not tokens or self.ll.is_error():
            return 0
        return self.ll.validate_tokens(self._ll_tokens(tokens))

    def rollback(self, n: int) -> None:
        """Undo the last n committed tokens."""
        if not 0 <= n <= self.n_tokens:
            raise ValueError(f"cannot roll back {n} tokens: {self.n_tokens} were advanced")
        if n and not self.ll.rollback(n):
            raise StructuredOutputError(f"grammar matcher could not roll back {n} tokens: {self.error}")
        self.n_tokens -= n

    @property
    def is_stopped(self) -> bool:
        """The grammar takes no more tokens (complete, or ended by EOS): the request finishes with "stop"."""
        return self.ll.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What was generated is a complete match (the grammar may still allow more, e.g. more digits)."""
        return self.ll.is_accepting()

    @property
    def error(self) -> str:
        """llguidance's error message, "" while healthy: its first line (what follows is a dump of the matcher's
        state and the whole grammar, dozens of lines that would end up in a command's error or an HTTP body)."""
        err = self.ll.get_error().strip()
        return err.splitlines()[0] if err else ""

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the next token's allowed set into `row` (int32, vocab.mask_words, C-contiguous), end tokens
        included. One matcher, on this thread; a batch goes through lumen.engine.structured.bitmask.fill_masks."""
        if not (isinstance(row, np.ndarray) and row.ndim == 1 and row.flags.c_contiguous):
            raise ValueError("fill_mask takes one C-contiguous int32 row (mask_words,)")
        rows = row.reshape(1, -1)                   # (1, mask_words) view
        self.vocab.check_masks(rows)
        self.ll.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.vocab.allow_end_tokens(rows)

    def _why(self) -> str:
        err = self.error
        return f": {err}" if err else (" (the grammar is complete)" if self.ll.is_stopped() else "")
