"""StructuredOutput: what the engine does for its requests with a constraint (SamplingParams.constraint), in the
order of a step. The engine calls it at five places and nowhere else touches a grammar:

    structured = StructuredOutput(tokenizer, n_vocab)     # Engine(); the vocabulary builds at the first constraint
    structured.admit(seq) -> bool                         # add_request: True = the grammar is ready, schedule it;
                                                          # False = it waits here (not in the scheduler's queue)
    for seq, error in structured.ready(): ...             # each step, before scheduling: compiled -> the queue,
                                                          # failed -> finished with the error
    k_of = structured.trim_drafts(k_of, draft_of)         # drafts cut at their first token the grammar refuses
    job = structured.start_masks(plan, drafts)            # just before the forward pass: masks fill beside it
    structured.apply_masks(job, logits)                   # after it: disallowed logits -> -inf, before sampling

A request whose grammar is compiling waits without holding a slot, a block or a place in the FCFS queue, so the
others run on; its compilation is llguidance's, on the compiler's thread (lumen.engine.structured.compiler). The
matcher moves only when Sequence.append commits a token (which also finishes the request with "stop" once the
grammar is complete). A request without a constraint never meets any of this: its logits rows are not touched,
so its bits are those of an engine without structured output (batch invariance).
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

import numpy as np

from .bitmask import MaskFiller, apply_bitmasks
from .compiler import GrammarCompiler
from .constraint import StructuredOutputError


class MaskJob:
    """One step's mask fill: the filler's future and the logits rows it covers."""

    def __init__(self, future: Future, rows: np.ndarray):
        self.future, self.rows = future, rows


class StructuredOutput:
    def __init__(self, tokenizer, n_vocab: int):
        self.compiler = GrammarCompiler(tokenizer)          # its thread builds the vocabulary at the first submit
        self.n_vocab = n_vocab                              # the logits' width (the model's output)
        self.n_tokenizer = tokenizer.n_vocab
        self.filler: MaskFiller | None = None               # made at the first constrained step
        self.compiling: list = []                           # sequences whose grammar is not ready yet, in order

    # ---- requests
    def admit(self, seq) -> bool:
        """Start (or find in the cache) the compilation of seq's constraint. True when its matcher is ready now;
        StructuredOutputError when the constraint is known to fail (a cached failure): the request is refused."""
        if self.n_tokenizer != self.n_vocab:
            raise StructuredOutputError(f"structured output needs the tokenizer's vocabulary ({self.n_tokenizer} "
                                        f"tokens) to be the model's output ({self.n_vocab} logits)")
        fut = self.compiler.submit(seq.params.constraint)
        if fut.done():
            seq.grammar = fut.result().matcher()            # raises a cached failure here, to the caller
            return True
        seq.grammar_future = fut
        self.compiling.append(seq)
        return False

    def ready(self) -> list:
        """[(seq, None)] for each waiting sequence whose grammar compiled (its matcher is set), [(seq, message)]
        for each whose compilation failed; both leave `compiling`."""
        done, out = [], []
        for seq in self.compiling:
            fut = seq.grammar_future
            if not fut.done():
                continue
            done.append(seq)
            seq.grammar_future = None
            try:
                seq.grammar = fut.result().matcher()
                out.append((seq, None))
            except StructuredOutputError as e:
                out.append((seq, str(e)))
        if done:
            self.compiling = [s for s in self.compiling if s not in done]
        return out

    def discard(self, seq) -> bool:
        """Forget a compiling sequence (aborted); False when it was not compiling."""
        if seq in self.compiling:
            self.compiling.remove(seq)
            seq.grammar_future = None
            return True
        return False

    def wait(self, timeout: float) -> None:
        """Wait until a compilation ends, at most `timeout` seconds (a step with nothing else to run)."""
        futs = [s.grammar_future for s in self.compiling if s.grammar_future is not None]
        if futs:
            wait(futs, timeout, return_when=FIRST_COMPLETED)

    # ---- a step
    @staticmethod
    def trim_drafts(k_of: dict, draft_of) -> dict:
        """{seq: k} with each constrained sequence's k cut to the drafted tokens its grammar accepts (draft_of(seq,
        k): the drafted tokens). A draft token the grammar refuses could never be accepted: the masked target
        gives it probability 0. Beyond k it may stay the draft's proposal for the next position, which the
        acceptance rule then rejects exactly."""
        out = {}
        for seq, k in k_of.items():
            if seq.grammar is not None and k:
                k = seq.grammar.validate_draft(draft_of(seq, k))
            if k:
                out[seq] = k
        return out

    def start_masks(self, plan: list, drafts: dict) -> MaskJob | None:
        """Start filling the masks of the plan's constrained rows (None when it has none). A planned sequence that
        samples owns 1 + k logits rows, in plan order (the runner's order); the filler must finish before any
        matcher moves (apply_masks waits for it)."""
        items, rows, row = [], [], 0
        for s in plan:
            if not s.samples:
                continue
            g = s.seq.grammar
            if g is not None:
                d = drafts.get(s.seq, ()) if s.k else ()
                items.append((g, row, d))
                rows.extend(range(row, row + 1 + len(d)))
            row += 1 + s.k
        if not items:
            return None
        if self.filler is None:
            self.filler = MaskFiller(self.compiler.vocab)
        return MaskJob(self.filler.start(items, row), np.array(rows, np.int64))

    @staticmethod
    def apply_masks(job: MaskJob | None, logits: np.ndarray) -> None:
        """Wait for the step's masks and apply them to their logits rows in place (disallowed tokens -> -inf)."""
        if job is not None:
            apply_bitmasks(logits, job.future.result(), job.rows)

    def close(self) -> None:
        self.compiler.close()
        if self.filler is not None:
            self.filler.close()
