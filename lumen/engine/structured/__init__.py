"""Structured output: a request's text constrained to a JSON schema, any JSON object, a regex, a
list of choices, or a Lark / GBNF grammar, with llguidance (guidance-ai/llguidance) filling the token masks.

One file per concept, in data-flow order:
- constraint.py  Constraint (kind + canonical text, validated on creation) and StructuredOutputError
- vocab.py       GrammarVocab: the model's vocabulary as llguidance's tokenizer, built once per tokenizer
- compiler.py    GrammarCompiler: constraint -> CompiledGrammar off the step thread, cached by its text
- matcher.py     GrammarMatcher: one request's grammar state (advance, is_stopped, validate_draft, rollback)
- bitmask.py     MaskFiller / fill_masks: all constrained rows of a step in one batched call, beside the
                 forward pass; apply_bitmask(s): disallowed logits -> -inf

- requests.py    StructuredOutput: what the engine does for a constrained request, at five call sites

How the engine uses them (lumen.engine.engine through requests.StructuredOutput), for a request with
`params.constraint` set:
1. add_request: `fut = compiler.submit(constraint)`; until `fut.done()` the request waits outside the scheduler's
   queue (no slot, no blocks, not in the FCFS line), then `seq.grammar = fut.result().matcher()` and it is queued,
   or it finishes with the error if result() raises (a cached failure raises at add_request itself).
2. speculation (before the forward): each draft is cut to `seq.grammar.validate_draft(draft)` tokens. A drafted
   token beyond the cut may stay the proposal for the next position: the masked target gives it probability 0,
   so the acceptance rule rejects it and draws from the residual, which keeps the rule exact.
3. `job = filler.start([(seq.grammar, first_row, draft), ...], n_rows)` right before the forward; the fill runs
   on the filler's thread while the forward (nogil) runs.
4. after the forward: `apply_bitmasks(logits, job.result(), constrained_rows)` before logit_bias, penalties,
   sampling and logprobs (masked tokens get -inf; top logprobs skip them).
5. Sequence.append commits each emitted token (`seq.grammar.advance`); a rejected draft needs no rollback, the
   masks were computed without committing. Once `seq.grammar.is_stopped` the request finishes with "stop"
   (metrics stop_reason "grammar") without sampling an end token; an end token sampled where the grammar accepts
   ends it as usual.
"""
from .bitmask import MaskFiller, apply_bitmask, apply_bitmasks, fill_masks
from .compiler import CompiledGrammar, GrammarCompiler
from .constraint import JSON_WHITESPACE, KINDS, Constraint, StructuredOutputError, is_lark
from .matcher import GrammarMatcher
from .vocab import GrammarVocab, grammar_vocab

__all__ = ["Constraint", "StructuredOutputError", "KINDS", "JSON_WHITESPACE", "is_lark", "GrammarVocab",
           "grammar_vocab", "GrammarCompiler", "CompiledGrammar", "GrammarMatcher", "MaskFiller", "fill_masks",
           "apply_bitmask", "apply_bitmasks"]
