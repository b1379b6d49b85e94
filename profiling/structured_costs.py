"""Measure structured output's costs on this machine, no model forward: vocabulary build, schema compile (new
vs cached, up to the first mask), batched mask fill (1 and 16 rows), mask apply per row, for both test models.

    python profiling/structured_costs.py [--repeats 5] [--threads 1]

Fill times are taken along random walks (masked random logits with a push toward closing strings, sampled at
temperature 1), so they cover the states a generation goes through; reported per step as median and p90.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from lumen.format.gguf import GGUFFile
from lumen.format.tokenizer import Tokenizer
from lumen.model.store import resolve
from lumen.engine.structured import Constraint, GrammarCompiler, GrammarVocab, MaskFiller, apply_bitmask
from lumen.engine.structured.compiler import CompiledGrammar
from verdict import checked_model, count

MODELS = ("smollm2-135m", "gemma3-270m")
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["name", "age", "tags"]},
    "tool_call": {"type": "object", "properties": {
        "name": {"enum": ["get_weather", "search", "send_email", "create_event"]},
        "arguments": {"anyOf": [
            {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
             "required": ["city"], "additionalProperties": False},
            {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
             "required": ["query"], "additionalProperties": False},
            {"type": "object", "properties": {"to": {"type": "string", "format": "email"},
                                              "subject": {"type": "string"}, "body": {"type": "string"}},
             "required": ["to", "subject"], "additionalProperties": False}]}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "invoice": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
        "date": {"type": "string", "format": "date"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "minLength": 2, "maxLength": 2}},
                "required": ["street", "city", "zip", "country"]}},
            "required": ["name", "address"]},
        "lines": {"type": "array", "minItems": 1, "maxItems": 50, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "price": {"type": "number", "minimum": 0},
            "discount": {"anyOf": [{"type": "number"}, {"type": "null"}]}}, "required": ["sku", "qty", "price"]}},
        "paid": {"type": "boolean"}, "notes": {"type": ["string", "null"]}},
        "required": ["id", "date", "customer", "lines", "paid"]},
}


def _ms(xs) -> str:
    xs = [x * 1e3 for x in xs]
    return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.2f} ms"


def _closers(tok: Tokenizer) -> np.ndarray:
    bias = np.zeros(tok.n_vocab, np.float32)
    for i in range(tok.n_vocab):
        first = tok.token_bytes(i)[:1]
        bias[i] = 14.0 if first == b'"' else 10.0 if first and first in b",]}" else 0.0
    return bias


def measure(name: str, repeats: int, threads: int) -> None:
    tok = Tokenizer.from_metadata(GGUFFile(resolve(name, quiet=True)).metadata)
    print(f"\n## {name} (n_vocab {tok.n_vocab})")
    builds = [GrammarVocab(tok).build_s for _ in range(repeats)]
    print(f"vocabulary build: {_ms(builds)}")
    vocab = GrammarVocab(tok)
    row = np.zeros(vocab.mask_words, np.int32)
    for sname, schema in SCHEMAS.items():
        new, cached = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            c = Constraint.json_schema(schema)                   # validation (server side)
            g = CompiledGrammar(c, vocab)                        # compile against the vocabulary
            g.matcher().fill_mask(row)                           # first mask
            new.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            g.matcher().fill_mask(row)                           # cached: deep copy + first mask
            cached.append(time.perf_counter() - t0)
        print(f"schema {sname:10s} new (validate + compile + first mask): {_ms(new)}; cached (copy + first mask): "
              f"{_ms(cached)}")
    with GrammarCompiler(tok) as compiler:
        c = Constraint.json_schema(SCHEMAS["person"])
        compiler.compile(c)
        t0 = time.perf_counter()
        for _ in range(100):
            compiler.submit(c).result()
        print(f"compiler cache hit (submit + result): {(time.perf_counter() - t0) * 1e4:.1f} us")

    bias = _closers(tok)
    filler = MaskFiller(vocab, threads=threads)
    try:
        for n_rows in (1, 16):
            times = []
            for rep in range(repeats):
                rng = np.random.default_rng(rep)
                grammars = [CompiledGrammar(Constraint.json_schema(SCHEMAS[s]), vocab) for s in SCHEMAS]
                ms = [grammars[i % len(grammars)].matcher() for i in range(n_rows)]
                base = rng.standard_normal((n_rows, tok.n_vocab)).astype(np.float32) + bias
                for _ in range(200):
                    live = [(m, i, []) for i, m in enumerate(ms) if not m.is_stopped]
                    if not live:
                        break
                    t0 = time.perf_counter()
                    masks = filler.fill(live, n_rows)
                    times.append(time.perf_counter() - t0)
                    for m, i, _ in live:
                        x = base[i].copy()
                        apply_bitmask(x, masks[i])
                        ids = np.flatnonzero(x > -np.inf)
                        m.advance(int(ids[np.argmax(x[ids] + rng.gumbel(size=ids.size))]))
            t = np.array(times) * 1e3
            print(f"batched fill, {n_rows:2d} rows: median {np.median(t):.3f} ms, p90 {np.percentile(t, 90):.3f} ms, "
                  f"max {t.max():.3f} ms over {t.size} steps (LLExecutor threads {threads})")
    finally:
        filler.close()

    rng = np.random.default_rng(0)
    x0 = rng.standard_normal(tok.n_vocab).astype(np.float32)
    for kind, mask in (("sparse", np.where(rng.random(vocab.mask_words) < 0.01, -1, 0).astype(np.int32)),
                       ("random", rng.integers(-2**31, 2**31, vocab.mask_words, dtype=np.int64).astype(np.int32))):
        x = x0.copy()
        apply_bitmask(x, mask)                                     # compiled / loaded
        ts = []
        for _ in range(200):
            x[:] = x0
            t0 = time.perf_counter()
            apply_bitmask(x, mask)
            ts.append(time.perf_counter() - t0)
        print(f"apply_bitmask ({kind} mask): median {np.median(ts) * 1e6:.1f} us per row")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=count, default=5)
    ap.add_argument("--threads", type=count, default=1, help="LLExecutor threads for the batched fill")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    args = ap.parse_args(argv)
    for name in args.models:                    # every one before the first is measured
        checked_model(name)
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    for name in args.models:
        measure(name, args.repeats, args.threads)


if __name__ == "__main__":
    main()
