"""Structured output through the engine, on the real SmolLM2 (lumen.engine.structured.manager): every output of
the schemas of test_structured.py, sampled at temperature 0.8 with several seeds in one batch, parses and
validates (jsonschema) and ends with "stop"; regex, choice, Lark and GBNF through Engine and Model.generate;
unconstrained requests keep their bits beside constrained ones; greedy constrained output with speculation (n-gram
and a draft model) equals it without, token for token; a request whose grammar compiles waits without holding up
the others, and one whose grammar fails ends with the error (Model.generate raises, a cached failure is refused at
add_request); Gemma 3's vocabulary through the engine too."""
import json
import math
import re
from concurrent.futures import Future

import jsonschema
import pytest
from test_structured import GBNF, REGEXES
from test_structured import SCHEMAS as WALK_SCHEMAS

import lumen
from lumen import SamplingParams
from lumen.engine.engine import Engine
from lumen.engine.sampling.sampler import SamplerError
from lumen.engine.structured import Constraint, StructuredOutputError
from lumen.errors import LumenError

SEEDS = (0, 1, 2)


def closed(schema):
    """The schema with every object closed (additionalProperties false where it says nothing): a model left free
    to add properties writes until max_tokens. And every number an integer of at most 3 digits within its bounds:
    at temperature 0.8 this small model can write a number's digits until max_tokens ("0.18274936666666...",
    seen when the kernels' bits changed); such an output is cut, not invalid (test_structured walks the free
    numbers' grammar itself)."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("const", "enum") else v for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    if out.get("type") == "number" or (out.get("type") == "integer" and "maximum" not in out):
        lo, hi = out.get("minimum", -999), out.get("maximum", 999)
        out.update(type="integer", minimum=math.ceil(lo), maximum=math.floor(hi))
    return out


# test_structured's schemas (nested objects, enums, arrays with bounds, anyOf, const, patterns, integer ranges,
# $refs), closed and with their numbers bounded
SCHEMAS = {name: closed(s) for name, s in WALK_SCHEMAS.items()}
PROMPT = "Here is the data as JSON:\n"


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=2048, threads=2)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, threads=2, max_model_len=1024, max_num_seqs=16, kv_cache_mb=64)


def test_schemas_sampled_validate(engine):
    names = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    params = [SamplingParams(max_tokens=200, temperature=0.8, seed=seed,
                             constraint=Constraint.json_schema(SCHEMAS[name])) for name, seed in names]
    outs = engine.generate([PROMPT] * len(names), params)
    unfinished = [(name, seed, out.finish_reason, out.error, out.text[:200]) for (name, seed), out in zip(names, outs)
                  if out.finish_reason != "stop"]
    assert not unfinished
    for (name, seed), out in zip(names, outs):
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    assert len({o.text for o in outs}) > len(SCHEMAS), "the seeds should give different outputs"


def test_json_object_regex_choice_grammars(engine, model):
    lark = 'start: "(" pair ("," pair)* ")"\npair: KEY "=" VALUE\nKEY: /[a-z]{1,5}/\nVALUE: /[0-9]{1,4}/\n'
    options = ["Paris", "London", "New York", "Tokyo"]
    cases = ([(Constraint.json_object(), lambda s: isinstance(json.loads(s), dict))]
             + [(Constraint.regex(r), lambda s, r=r: re.fullmatch(r, s)) for r in REGEXES]
             + [(Constraint.choice(options), lambda s: s in options)]
             + [(Constraint.lark(lark), lambda s: re.fullmatch(r"\((\w+=\d+)(,\w+=\d+)*\)", s))]
             + [(Constraint.gbnf(g), check) for g, check in GBNF.items() if "expr" not in g])   # (unbounded)
    params = [SamplingParams(max_tokens=120, temperature=0.7, seed=i, constraint=c) for i, (c, _) in enumerate(cases)]
    outs = engine.generate(["The answer: "] * len(cases), params)
    for (c, check), out in zip(cases, outs):
        assert out.finish_reason == "stop" and check(out.text), (c.kind, c.value, out.text, out.error)
    # Model.generate takes the constraint too (the CLI's path); the greedy choice equals the engine's
    c = Constraint.choice(options)
    text = "".join(t.text for t in model.generate("The capital of France is", constraint=c, max_tokens=10))
    assert text == engine.generate("The capital of France is", SamplingParams(max_tokens=10, temperature=0,
                                                                            constraint=c))[0].text
    assert text in options


def test_logprobs_are_of_the_masked_distribution(engine):
    c = Constraint.choice(["yes", "no"])
    out = engine.generate("Is the sky blue? Answer:", SamplingParams(max_tokens=5, temperature=0, logprobs=5,
                                                                      constraint=c))[0]
    assert out.text in ("yes", "no")
    lp, top = out.logprobs[0]
    assert top and lp == top[0][1] and sum(math.exp(v) for _, v in top) <= 1 + 1e-6
    for t, _ in top:                                   # only tokens the grammar allows are offered
        piece = engine.tokenizer.decode([t])
        assert piece and ("yes".startswith(piece) or "no".startswith(piece)), piece
    out = engine.generate("Is the sky blue? Answer:", SamplingParams(max_tokens=5, temperature=0, logprobs=20,
                                                                      constraint=Constraint.choice(["y", "n"])))[0]
    assert {engine.tokenizer.decode([t]) for t, _ in out.logprobs[0][1]} == {"y", "n"}   # -inf ones skipped


def test_unconstrained_keep_their_bits_beside_constrained(engine):
    plain = [SamplingParams(max_tokens=24, temperature=0.9, seed=s, logprobs=2) for s in (7, 8)]
    prompts = ["Once upon a time", "def fib(n):"]
    alone = engine.generate(prompts, plain)
    c = Constraint.json_schema(SCHEMAS["nested"])
    mixed = engine.generate(["Data:", *prompts, PROMPT],
                            [SamplingParams(max_tokens=60, temperature=0.8, seed=3, constraint=c), *plain,
                             SamplingParams(max_tokens=40, constraint=Constraint.regex(r"[a-z ]{5,30}\."))])
    for a, b in zip(alone, mixed[1:3]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def _greedy_spec_equal(engine_plain, engine_spec, speculative, monkeypatch):
    cuts = []                                  # (k drafted, k kept) of the constrained drafts
    trim = engine_spec.structured.trim_drafts

    def counted(k_of, draft_of):
        out = trim(k_of, draft_of)
        cuts.extend((k, out.get(seq, 0)) for seq, k in k_of.items())
        return out
    monkeypatch.setattr(engine_spec.structured, "trim_drafts", counted)
    c = Constraint.json_schema(SCHEMAS["arrays"])
    prompt = ('Example: {"tags": ["alpha", "beta"], "scores": [1, 2], "pair": [3, true]}\n'
              'Another: {"tags": ["alpha", "beta"], "scores": [1, 2], "pair": [3, true]}\nOne more: ')
    cs = [c, Constraint.regex(r"(alpha|beta|gamma)( (alpha|beta|gamma)){3,6}")]
    ps = [prompt, "alpha beta gamma alpha beta gamma. Again: "]
    plain = engine_plain.generate(ps, [SamplingParams(max_tokens=80, temperature=0, constraint=x) for x in cs])
    spec = engine_spec.generate(ps, [SamplingParams(max_tokens=80, temperature=0, constraint=x,
                                                    speculative=speculative) for x in cs])
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "stop"
    assert sum(o.metrics.spec_proposed for o in spec) > 0, "no draft was verified"
    assert any(a > b for a, b in cuts), "no draft was cut by the grammar: the test does not test that"
    sampled = engine_spec.generate([prompt] * 3, [SamplingParams(max_tokens=120, temperature=0.8, seed=s,
                                                                 constraint=c, speculative=speculative)
                                                  for s in SEEDS])
    for o in sampled:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMAS["arrays"])


def test_speculation_ngram_greedy_identical(engine, monkeypatch):
    _greedy_spec_equal(engine, engine, "ngram", monkeypatch)


def test_speculation_draft_model_greedy_identical(engine, model, monkeypatch):
    spec = Engine(model, threads=2, max_model_len=1024, max_num_seqs=4, kv_cache_mb=32, draft_model=model)
    _greedy_spec_equal(engine, spec, "draft", monkeypatch)


def test_request_waits_for_its_grammar_without_blocking_others(engine, monkeypatch):
    """A compilation that has not finished: the request stays out of the queue (no slot, no tokens) while an
    unconstrained one runs to the end; once compiled it runs. One that fails ends with the error; an abort of a
    compiling request is an abort."""
    compiler = engine.structured.compiler
    real = compiler.compile(Constraint.regex(r"[0-9]{4}"))
    pending = [Future(), Future(), Future()]
    it = iter(pending)
    monkeypatch.setattr(compiler, "submit", lambda c: next(it))
    waiting = engine.add_request("Year:", SamplingParams(max_tokens=8, constraint=Constraint.regex(r"[0-9]{4}")))
    failing = engine.add_request("Year:", SamplingParams(max_tokens=8, constraint=Constraint.regex(r"[0-9]{5}")))
    aborted = engine.add_request("Year:", SamplingParams(max_tokens=8, constraint=Constraint.regex(r"[0-9]{6}")))
    plain = engine.add_request("Hello", SamplingParams(max_tokens=6, temperature=0))
    assert engine.num_waiting >= 3
    engine.abort(aborted)
    finals = {}
    while plain not in finals:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[plain].finish_reason == "length" and finals[aborted].finish_reason == "abort"
    assert waiting not in finals and len(engine.structured.compiling) == 2
    pending[0].set_result(real)
    pending[1].set_exception(StructuredOutputError("invalid regex constraint: made to fail"))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert re.fullmatch(r"[0-9]{4}", finals[waiting].text) and finals[waiting].finish_reason == "stop"
    assert finals[failing].finish_reason == "error" and "made to fail" in finals[failing].error


def test_compile_failure_is_an_error_and_is_cached(engine, model):
    c = Constraint.lark("start: <[999999]>")                  # llguidance rejects it only against the vocabulary
    out = engine.generate("x", SamplingParams(max_tokens=4, constraint=c))[0]
    assert out.finish_reason == "error" and "999999" in out.error
    with pytest.raises(StructuredOutputError, match="999999"):
        engine.add_request("x", SamplingParams(max_tokens=4, constraint=c))      # the cached failure: refused now
    with pytest.raises(LumenError, match="999998"):
        list(model.generate("x", max_tokens=4, constraint=Constraint.lark("start: <[999998]>")))
    with pytest.raises(SamplerError, match="constraint"):
        SamplingParams(constraint={"type": "object"})
    assert not engine.has_unfinished()


def test_whitespace_is_bounded_by_default(engine):
    """A model pushed toward whitespace (a large bias on the newline and space tokens) still writes JSON tokens:
    the default whitespace rule allows at most 22 characters in a gap."""
    tok = engine.tokenizer
    ws = [i for i in range(tok.n_vocab) if tok.token_bytes(i) and not tok.token_bytes(i).strip()]
    out = engine.generate(PROMPT, SamplingParams(max_tokens=300, temperature=0, logit_bias={i: 30 for i in ws},
                                                  constraint=Constraint.json_schema(SCHEMAS["enums"])))[0]
    assert out.finish_reason == "stop", out.text[:200]
    jsonschema.validate(json.loads(out.text), SCHEMAS["enums"])
    assert max(len(m) for m in re.findall(r"\s+", out.text)) <= 22


def test_gemma_schema_and_choice(gemma3_path):
    """Gemma 3's vocabulary (262144 tokens, `▁` and byte tokens, two end tokens) through the engine."""
    gemma = lumen.load(gemma3_path, ctx=512, threads=2)
    eng = Engine(gemma, threads=2, max_model_len=512, max_num_seqs=4, kv_cache_mb=32)
    schema = SCHEMAS["enums"]
    outs = eng.generate([PROMPT] * 3, [SamplingParams(max_tokens=60, temperature=0.8, seed=s,
                                                      constraint=Constraint.json_schema(schema)) for s in SEEDS[:2]]
                        + [SamplingParams(max_tokens=8, constraint=Constraint.choice(["café", "naïve", "日本"]))])
    for o in outs[:2]:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), schema)
    assert outs[2].finish_reason == "stop" and outs[2].text in ("café", "naïve", "日本")
