"""Structured output (issue 20): a request's text constrained to a JSON schema, any JSON object, a regex, a
list of choices, or a Lark / GBNF grammar, with llguidance (guidance-ai/llguidance) filling the token masks.

One file per concept, in data-flow order:
- constraint.py  Constraint (kind + canonical text, validated on creation) and StructuredOutputError
- vocab.py       GrammarVocab: the model's vocabulary as llguidance's tokenizer, built once per tokenizer
- compiler.py    GrammarCompiler: constraint -> CompiledGrammar off the step thread, cached by its text
- matcher.py     GrammarMatcher: one request's grammar state (advance, is_stopped, validate_draft, rollback)
- bitmask.py     MaskFiller / fill_masks: all constrained rows of a step in one batched call, beside the
                 forward pass; apply_bitmask(s): disallowed logits -> -inf

How the engine uses them, each step (a request with `params.constraint` set):
1. add_request: `fut = compiler.submit(constraint)`; the scheduler leaves the request waiting until
   `fut.done()`, then `seq.grammar = fut.result().matcher()`, or finishes it with the error if result() raises.
2. speculation (before the forward): `n = seq.grammar.validate_draft(draft)`; run only draft[:n]. The token
   draft[n] (the first invalid one) may stay as the proposal for position n: the masked target gives it
   probability 0, so the acceptance rule rejects it and draws from the residual, which keeps the draft-model
   rule exact (for n-gram drafts, a point-mass q, the residual is the masked p itself).
3. `job = filler.start([(seq.grammar, first_row, draft), ...], n_out)` right before `runner.forward(...)`; the
   fill runs on the filler's thread while the forward (nogil) runs.
4. after the forward: `masks = job.result()`; `apply_bitmasks(logits, masks, constrained_rows)` before
   logit_bias, penalties, sampling and logprobs (masked tokens get -inf; top logprobs must skip -inf).
5. after choosing: `seq.grammar.advance_many(emitted)` (accepted drafts + the corrected/bonus token); a rejected
   draft needs no rollback, the masks were computed without committing. Then if `seq.grammar.is_stopped`
   (grammar complete), finish the request with "stop" without sampling an end token; an end token sampled
   where the grammar accepts ends it with "stop" as usual.
"""
from .bitmask import MaskFiller, apply_bitmask, apply_bitmasks, fill_masks
from .compiler import CompiledGrammar, GrammarCompiler
from .constraint import JSON_WHITESPACE, KINDS, Constraint, StructuredOutputError, is_lark
from .matcher import GrammarMatcher
from .vocab import GrammarVocab, grammar_vocab

__all__ = ["Constraint", "StructuredOutputError", "KINDS", "JSON_WHITESPACE", "is_lark", "GrammarVocab",
           "grammar_vocab", "GrammarCompiler", "CompiledGrammar", "GrammarMatcher", "MaskFiller", "fill_masks",
           "apply_bitmask", "apply_bitmasks"]
