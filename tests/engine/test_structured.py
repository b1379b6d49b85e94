"""Structured output without a model forward (lumen.engine.structured): the llguidance vocabulary agrees byte
for byte with Lumen's detokenizer on both models; constraints are validated with llguidance's messages; the
compiler caches; random walks over masked random logits (temperature 1, several seeds) produce text that
parses and validates (jsonschema) for a set of schemas, regexes, choices and GBNF grammars; JSON whitespace is
bounded; drafts are validated, speculative masks equal sequential ones, rollback restores the state; the mask
kernel equals a numpy reference."""
import ast
import json
import re
import threading

import jsonschema
import numpy as np
import pytest
from goldens import MODEL_NAMES

from lumen.engine.structured import (JSON_WHITESPACE, Constraint, GrammarCompiler, MaskFiller, StructuredOutputError,
                                     apply_bitmask, apply_bitmasks, fill_masks, grammar_vocab)
from lumen.engine.structured.constraint import FORMAT_PATTERNS
from lumen.errors import LumenError
from lumen.format.gguf import GGUFFile
from lumen.format.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def toks(smollm2_path, gemma3_path) -> dict:
    return {"smollm2-135m": Tokenizer.from_metadata(GGUFFile(smollm2_path).metadata),
            "gemma3-270m": Tokenizer.from_metadata(GGUFFile(gemma3_path).metadata)}


@pytest.fixture(scope="module")
def compilers(toks):
    cs = {name: GrammarCompiler(tok) for name, tok in toks.items()}
    yield cs
    for c in cs.values():
        c.close()


# --- the vocabulary -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_vocab_bytes_agree_with_detokenizer(toks, name):
    """Every token: llguidance's bytes are Lumen's rendering; control tokens are special (and render nothing)."""
    tok = toks[name]
    vocab = grammar_vocab(tok)
    assert grammar_vocab(tok) is vocab                       # built once, cached
    ll = vocab.ll
    assert ll.vocab_size == tok.n_vocab == vocab.n_vocab
    special = set(vocab.special_ids)
    bad = []
    for i in range(tok.n_vocab):
        if i in vocab.marker_ids:          # 0xFF first: llguidance's special marker, a byte UTF-8 never holds
            ok = tok.token_bytes(i)[:1] == b"\xff" and ll.decode_bytes([i]) == tok.token_bytes(i)[1:]
        elif i in special:
            ok = ll.is_special_token(i) and tok.token_bytes(i) == b"" and ll.decode_bytes([i]) == tok.tokens[i].encode()
        else:
            ok = not ll.is_special_token(i) and ll.decode_bytes([i]) == tok.token_bytes(i) != b""
        if not ok:
            bad.append(i)
    assert not bad, [(i, tok.tokens[i], ll.decode_bytes([i])) for i in bad[:5]]
    assert len(special) == {"smollm2-135m": 17, "gemma3-270m": 6250}[name]
    assert [tok.tokens[i] for i in vocab.marker_ids] == {"smollm2-135m": [], "gemma3-270m": ["<0xFF>"]}[name]
    assert vocab.eos_id == tok.eos_id == ll.eos_token
    assert set(vocab.eog_ids) == set(tok.eot_ids) | {tok.eos_id}
    if name == "gemma3-270m":                                 # SentencePiece: byte tokens and U+2581
        assert ll.decode_bytes([tok.token_to_id["<0x41>"]]) == b"A"
        assert ll.decode_bytes([tok.token_to_id["\u2581the"]]) == b" the"
    else:                                                     # GPT-2 byte-level: "Ġ" is a space
        assert ll.decode_bytes([tok.token_to_id["\u0120the"]]) == b" the"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_vocab_tokenize_is_lumens_encoder(toks, name):
    """The tokenize callback: Lumen's ids, no BOS, no leading space added, special-token text read as text."""
    tok = toks[name]
    vocab = grammar_vocab(tok)
    for text in ['{"name": "Ada", "age": 36}', "hello world", " leading space", "ünïcödé ✓ 日本",
                 "<|im_end|><end_of_turn>", "a\n\n  b"]:
        want = tok.encode(text, add_bos=False, special=False)
        assert vocab.tokenize(text) == want
        assert vocab.ll.tokenize_str(text) == want
        assert vocab.ll.decode_bytes(want) == text.encode()
        assert not set(want) & set(vocab.special_ids)


# --- constraints ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, value, message", [
    ("json_schema", {"type": "object", "properties": {"a": {"type": "strin"}}}, "Invalid type: strin"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", [1, 2], "a schema is a JSON object or a boolean"),
    ("json_schema", {"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
    ("json_schema", {"type": "number", "minimum": float("nan")}, "cannot be written as JSON"),
    ("json_schema", False, "the schema false matches nothing"),
    ("json_schema", {"const": 12345678901234567890}, "the const holds the integer 12345678901234567890, beyond 2^53"),
    ("json_schema", {"type": "object", "properties": {"a": {"enum": [1, [2 ** 60]]}}}, "the enum holds the integer"),
    ("json_object", {"type": "object"}, "takes no value"),
    ("regex", "a(b", "unclosed group"),
    ("regex", "a\\", "the regex ends in an unpaired backslash"),              # llguidance dropped it: "a"
    ("regex", "\\", "the regex ends in an unpaired backslash"),
    ("json_schema", {"type": "string", "pattern": "^[0-9]+\\"}, "the pattern ends in an unpaired backslash"),
    ("json_schema", {"type": "object", "patternProperties": {"x\\": {}}}, "patternProperties name ends in an"),
    ("regex", 12, "expected a string"),
    ("choice", [], "the list of choices is empty"),
    ("choice", "yes", "expected a list of strings"),
    ("choice", ["a", 1], "every choice must be a string"),
    ("grammar_lark", "start: foo", 'unknown name: "foo"'),
    ("grammar_gbnf", 'root ::= "a', "Unexpected end of input"),
    ("grammar_gbnf", "root ::= foo", "Rule 'foo' not found"),
    ("grammar_xml", "<a/>", "unknown constraint kind 'grammar_xml'"),
])
def test_constraint_errors(kind, value, message):
    with pytest.raises(StructuredOutputError) as e:
        Constraint.make(kind, value)
    assert message in str(e.value) and "\n" not in str(e.value)        # a command line prints it as one line
    assert isinstance(e.value, LumenError) and isinstance(e.value, ValueError)
    if kind != "grammar_xml":
        assert str(e.value).startswith(f"invalid {kind} constraint: ")


def test_constraint_values_and_keys():
    a = Constraint.json_schema({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}})
    b = Constraint.json_schema('{ "type" : "object", "properties": {"b": {"type": "integer"},\n'
                               '  "a": {"type": "string"}}}')
    c = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}})
    assert a == b and a.key == b.key and hash(a) == hash(b)   # canonical text: whitespace does not matter
    assert a != c                                             # property order does (llguidance keeps it)
    assert Constraint.choice(["x", "y"]).key == ("choice", '["x", "y"]')
    assert Constraint.json_object() == Constraint.make("json_object")
    assert Constraint.lark_or_gbnf('start: "a"').kind == "grammar_lark"        # Lark or GBNF, told apart
    assert Constraint.lark_or_gbnf('root ::= "a"').kind == "grammar_gbnf"
    assert Constraint.make("json_schema", True) == Constraint.json_schema({})
    with pytest.raises(AttributeError):
        a.kind = "regex"                                      # frozen


def test_unknown_string_formats_are_annotations(toks, compilers):
    """A format llguidance does not know is dropped (JSON Schema: an annotation), a known one kept and enforced;
    a property named "format" and data that looks like a schema are left alone."""
    schema = {"type": "object", "properties": {
        "pw": {"type": "string", "format": "password"}, "ref": {"type": "string", "format": "uri-reference"},
        "format": {"type": "string", "enum": ["a"]}, "day": {"type": "string", "format": "date"},
        "note": {"const": {"format": "password"}}, "more": {"type": "array", "items": {"format": "int64"}}},
        "required": ["pw", "ref", "format", "day"], "additionalProperties": False}
    c = Constraint.json_schema(schema)
    kept = json.loads(c.value)["properties"]
    assert "format" not in kept["pw"] and "format" not in kept["ref"] and "format" not in kept["more"]["items"]
    assert kept["day"] == {"type": "string", "pattern": FORMAT_PATTERNS["date"]}     # (exact_formats: our regex)
    assert kept["note"] == {"const": {"format": "password"}}
    assert kept["format"] == {"type": "string", "enum": ["a"]}
    tok, m = toks["smollm2-135m"], compilers["smollm2-135m"].compile(c).matcher()
    ok = '{"pw": "x", "ref": "../a", "format": "a", "day": "2024-01-31"}'
    ids = tok.encode(ok, add_bos=False, special=False)
    assert m.validate_draft([*ids, tok.eos_id]) == len(ids) + 1
    bad = tok.encode(ok.replace("2024-01-31", "yesterday"), add_bos=False, special=False)
    assert m.validate_draft(bad) < len(bad)


@pytest.mark.parametrize("schema, good, bad", [
    ({"format": "date"}, ["2024-02-29", "2000-02-29", "0001-01-01", "2023-12-31"],
     ["2023-02-29", "1900-02-29", "0000-01-01", "2023-04-31", "2023-13-01"]),
    ({"format": "date-time"}, ["2024-02-29T23:59:59.5Z", "2023-01-01t00:00:00+05:30"],
     ["2023-01-01T12:30:60Z", "2023-02-29T00:00:00Z", "2023-01-01T24:00:00Z", "2023-01-01T12:00:00"]),
    ({"format": "time"}, ["01:02:03+05:30", "23:59:59.999z"], ["01:18:60Z", "23:59:60-01:00", "12:00:00"]),
    ({"format": "hostname"}, ["a-b.example.com", "a" * 63, ".".join(["a" * 63] * 3) + ".abcdefghi"],
     ["a" * 64, "-a.com", "a-.com", "a..b", ".".join(["a" * 63] * 4)]),          # the last: 255 characters
    ({"format": "date", "pattern": "^20"}, ["2024-02-29"], ["2023-02-29", "1999-01-01"]),
    ({"type": ["string", "null"], "format": "time"}, ["12:00:00Z", None], ["12:00:60Z"]),
])
def test_string_formats_take_only_valid_strings(toks, compilers, schema, good, bad):
    """date, date-time, time and hostname take what RFC 3339 and RFC 1123 (and jsonschema's format checker, with
    its optional validators) take: llguidance's own regexes took a leap second at any time ("01:18:60Z", a small
    model's favourite), February 29 of every year, year 0000 and labels past 63 characters."""
    tok, c = toks["smollm2-135m"], compilers["smollm2-135m"]
    m = c.compile(Constraint.json_schema(schema)).matcher()
    for value in good + bad:
        ids = tok.encode(json.dumps(value), add_bos=False, special=False) + [tok.eos_id]
        assert (m.validate_draft(ids) == len(ids)) == (value in good), (schema, value)


def test_the_date_pattern_is_pythons_calendar():
    """FORMAT_PATTERNS["date"] takes exactly the dates Python's calendar has (jsonschema's date check), years
    0-2500 and a few beyond: leap years by the Gregorian rule, no year 0."""
    import datetime
    date = re.compile(FORMAT_PATTERNS["date"])
    for y in [*range(0, 2501), 4000, 9996, 9999]:
        for mo in range(0, 14):
            for d in range(0, 33):
                s = f"{y:04d}-{mo:02d}-{d:02d}"
                try:
                    real = datetime.date.fromisoformat(s) is not None
                except ValueError:
                    real = False
                assert bool(date.fullmatch(s)) == real, s


def test_objects_that_list_their_properties_take_no_others(toks, compilers):
    """An object schema that lists its properties and says nothing of others takes no other key (llama.cpp's and
    xgrammar's reading: a small model left free adds keys of its own); additionalProperties true keeps it open, and
    allOf entries, whose properties add up, stay open."""
    tok, c = toks["smollm2-135m"], compilers["smollm2-135m"]

    def accepts(schema, text):
        m = c.compile(Constraint.json_schema(schema)).matcher()
        ids = tok.encode(text, add_bos=False, special=False) + [tok.eos_id]
        return m.validate_draft(ids) == len(ids)

    item = {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}
    order = {"type": "object", "properties": {"items": {"type": "array", "items": item}}, "required": ["items"]}
    assert accepts(order, '{"items": [{"sku": "a"}]}')
    assert not accepts(order, '{"items": [{"sku": "a"}], "total": 3}')
    assert not accepts(order, '{"items": [{"sku": "a", "qty": 1}]}')
    assert accepts({**order, "additionalProperties": True}, '{"items": [{"sku": "a"}], "total": 3}')
    assert accepts({"type": "object"}, '{"total": 3}')
    both = {"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},
                                        {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert accepts(both, '{"a": "x", "b": 1}')
    union = {"type": "object", "properties": {"k": {"type": "string"}},
             "anyOf": [{"properties": {"r": {"type": "number"}}, "required": ["r"]}]}
    assert accepts(union, '{"k": "c", "r": 1}')
    tree = {"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "c": {
        "type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"}
    assert accepts(tree, '{"v": 1, "c": [{"v": 2}]}') and not accepts(tree, '{"v": 1, "c": [{"v": 2, "w": 3}]}')
    sloppy = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}   # b not listed
    assert accepts(sloppy, '{"b": 1}')
    base = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    named = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    composed = {"$defs": {"base": base, "named": named, "other": base},      # OpenAPI's allOf of $refs
                "allOf": [{"$ref": "#/$defs/base"}, {"$ref": "#/$defs/named"}, {"properties": {"x": {"type": "null"}}}],
                "properties": {"o": {"$ref": "#/$defs/other"}}}
    assert accepts(composed, '{"id": 1, "name": "a", "x": null}')
    assert accepts(composed, '{"id": 1, "name": "a", "o": {"id": 2}}')
    assert not accepts(composed, '{"id": 1, "name": "a", "o": {"id": 2, "more": 3}}')    # not a part: closed


def test_objects_that_need_more_keys_than_they_list_stay_open(toks, compilers):
    """An object that needs more keys than it lists (minProperties past them) stays open: closed, no JSON matched it
    and a satisfiable schema was a 400 ("Unsatisfiable schema: minProperties (1) is greater than number of
    properties (1)")."""
    tok, c = toks["smollm2-135m"], compilers["smollm2-135m"]

    def accepts(schema, text):
        m = c.compile(Constraint.json_schema(schema)).matcher()
        ids = tok.encode(text, add_bos=False, special=False) + [tok.eos_id]
        return m.validate_draft(ids) == len(ids)

    two = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 2}
    assert accepts(two, '{"a": 1, "b": 2}') and not accepts(two, '{"a": 1}')
    enough = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "minProperties": 2}
    assert accepts(enough, '{"a": 1, "b": 2}') and not accepts(enough, '{"a": 1, "b": 2, "c": 3}')   # closed
    needs_b = {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]},
               "x-guidance": {"lenient": True}}       # lenient: dependentRequired ignored, the object open
    assert "additionalProperties" not in json.loads(Constraint.json_schema(needs_b).value)


def test_integer_bounds_llguidance_would_clamp_are_refused():
    """llguidance clamps an integer bound to 64 bits ({"minimum": 1e20, "maximum": 1e20 + 100} let only
    9223372036854775807 through) and reads it as a double: such a bound is an error, not a wrong range."""
    for bound in (10 ** 20, -(10 ** 20), 1e20, 2 ** 63, 2 ** 53 + 1):
        schema = {"type": "object", "properties": {"n": {"type": ["integer", "null"], "minimum": bound,
                                                         "maximum": bound + 100}}}
        with pytest.raises(StructuredOutputError, match="beyond what llguidance enforces"):
            Constraint.json_schema(schema)
    Constraint.json_schema({"type": "integer", "minimum": -(2 ** 53), "maximum": 2 ** 62})
    Constraint.json_schema({"type": "number", "minimum": 0.5, "maximum": 1e15})


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"a": {}}, "required": [{"x": 1}]}, "Expected string for 'required' item"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", ["b"]]}, "Expected string for 'required' item"),
    ({"type": "integer", "minimum": 10 ** 400}, "number out of range"),
    ({"type": "number", "exclusiveMinimum": -(10 ** 400), "maximum": 0}, "number out of range"),
    ({"const": 10 ** 400}, "number out of range"),
    ({"enum": [1, -(10 ** 400)]}, "number out of range"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": {"a"}}, "cannot be written as JSON"),
])
def test_values_the_rewrites_do_not_expect_are_errors_not_crashes(schema, message):
    """JSON the schema rewrites did not expect (a non-string in `required`, an integer beyond a double's range, a
    Python set) is llguidance's StructuredOutputError, the 400 of a bad schema; these were a TypeError and an
    OverflowError, a server's 500."""
    with pytest.raises(StructuredOutputError, match=re.escape(message)):
        Constraint.json_schema(schema)


def test_a_python_schema_reads_as_its_json():
    """A Python caller's schema is read as its JSON text: int keys are strings, tuples are lists (the rewrites
    crashed on an int property name)."""
    as_json = {"type": "object", "properties": {"1": {"enum": [1, 2]}}, "required": ["1"]}
    assert Constraint.json_schema({"type": "object", "properties": {1: {"enum": (1, 2)}}, "required": ("1",)}) \
        == Constraint.json_schema(as_json)


def test_a_deeply_nested_schema_is_an_error_not_a_crash():
    """Nesting past Python's recursion limit (the schema rewrites walk it) or llguidance's (~128 levels) is a
    StructuredOutputError, the 400 of a bad schema, not a RecursionError."""
    for depth in (70, 400):
        schema = {"type": "integer"}
        for _ in range(depth):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        with pytest.raises(StructuredOutputError, match="recursion limit|nested too deeply"):
            Constraint.json_schema(schema)


@pytest.mark.parametrize("schema, bad, good", [
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}, ["0"], ["0.1", "0.5"]),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.75}, ["0"], ["0.74"]),
    ({"type": "number", "exclusiveMinimum": 100, "maximum": 100.5}, ["100"], ["100.2"]),
    ({"type": "number", "exclusiveMaximum": -1, "minimum": -1.5}, ["-1"], ["-1.2", "-1.5"]),
    ({"type": "number", "exclusiveMaximum": 0, "minimum": -0.5}, ["-0", "0"], ["-0.2"]),
    ({"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 0.5}, ["0"], ["0.1", "null"]),
    ({"exclusiveMinimum": 1, "maximum": 1.5, "minimum": 0}, ["1"], ["1.25"]),
    ({"type": "integer", "exclusiveMinimum": 0, "maximum": 3}, ["0"], ["1", "3"]),
])
def test_exclusive_integer_bounds_exclude_the_bound(toks, compilers, schema, bad, good):
    """An exclusive bound k (an integer) with the other bound less than 1 away: llguidance 1.9's number regex
    takes k itself ({"exclusiveMinimum": 0, "maximum": 0.5} wrote 0), so it becomes an inclusive bound just past
    k; the outputs validate."""
    tok, c = toks["smollm2-135m"], compilers["smollm2-135m"]
    m = c.compile(Constraint.json_schema(schema)).matcher()
    for text in bad + good:
        ids = tok.encode(text, add_bos=False, special=False) + [tok.eos_id]
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert valid == (text in good), text
        assert (m.validate_draft(ids) == len(ids)) == valid, (schema, text)


def test_a_lenient_schema_drops_patterns_llguidance_cannot_enforce():
    """Look-around and backreferences (ECMA-262 patterns, not Rust regexes): refused in an exact schema, dropped
    from a lenient one, whose other patterns stay."""
    pw = {"type": "object", "properties": {"pw": {"type": "string", "pattern": "^(?=.*\\d).{8,}$"},
                                           "twice": {"type": "string", "pattern": "(a)\\1"},
                                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}
    with pytest.raises(StructuredOutputError, match="look-around"):
        Constraint.json_schema(pw)
    kept = json.loads(Constraint.json_schema({**pw, "x-guidance": {"lenient": True}}).value)["properties"]
    assert kept["pw"] == {"type": "string"} and kept["twice"] == {"type": "string"}
    assert kept["zip"]["pattern"] == "^[0-9]{5}$"


def test_compiler_caches_and_compiles_off_thread(toks):
    tok = toks["smollm2-135m"]
    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "when": {"type": "string", "format": "date"}},
              "required": ["id", "when"]}
    with GrammarCompiler(tok) as compiler:
        compiler.vocab                                        # built (on the pool's thread)
        main = threading.get_ident()
        seen = []
        orig = compiler._compile
        compiler._compile = lambda c: seen.append(threading.get_ident()) or orig(c)
        f1 = compiler.submit(Constraint.json_schema(schema))
        f2 = compiler.submit(Constraint.json_schema(json.dumps(schema, indent=2)))   # same schema, other text
        assert f1 is f2
        g = f1.result(timeout=30)
        assert seen and seen[0] != main and len(seen) == 1     # compiled once, not on the caller's thread
        assert compiler.misses == 1 and compiler.hits == 1
        assert compiler.compile(Constraint.json_schema(schema)) is g
        assert len(seen) == 1 and compiler.hits == 2          # cached: no compile
        m1, m2 = g.matcher(), g.matcher()
        m1.advance(tok.encode('{"', add_bos=False, special=False)[0])
        assert m1.n_tokens == 1 and m2.n_tokens == 0          # independent copies of the template


def test_vocab_is_built_once_across_threads(smollm2_path):
    tok = Tokenizer.from_metadata(GGUFFile(smollm2_path).metadata)     # a tokenizer no other test has used
    got = []
    threads = [threading.Thread(target=lambda: got.append(grammar_vocab(tok))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(v is got[0] for v in got)


def test_compiler_cache_keeps_the_most_recent(toks):
    with GrammarCompiler(toks["smollm2-135m"], max_entries=2) as compiler:
        a, b, c = (Constraint.regex(r) for r in ("a+", "b+", "c+"))
        fa = compiler.submit(a)
        compiler.submit(b)
        assert compiler.submit(a) is fa                       # a is now the most recent
        compiler.submit(c)                                    # evicts b
        assert compiler.submit(a) is fa
        assert compiler.misses == 3 and compiler.hits == 2
        compiler.submit(b)                                    # compiled again
        assert compiler.misses == 4
        with pytest.raises(ValueError):
            GrammarCompiler(toks["smollm2-135m"], max_entries=0)


def test_compiler_reports_vocabulary_errors(compilers):
    """A grammar llguidance can only reject against the vocabulary (a token id past its end): the future raises
    StructuredOutputError with llguidance's message, and the failure is cached."""
    c = Constraint.lark("start: <[999999]>")                  # fine without a tokenizer
    compiler = compilers["smollm2-135m"]
    with pytest.raises(StructuredOutputError, match="invalid grammar_lark constraint: .*999999"):
        compiler.compile(c, timeout=30)
    assert compiler.submit(c).exception() is not None


def test_unknown_special_token_names_the_known_ones(compilers):
    """A grammar naming a special token the vocabulary lacks: llguidance lists the vocabulary's special tokens, cut
    at the front and mostly placeholders (Gemma's 6000 <unusedN>, Qwen's [PADn]); the error names the real ones."""
    with pytest.raises(StructuredOutputError) as e:
        compilers["gemma3-270m"].compile(Constraint.lark('start: "ok" <|nope|>'), timeout=30)
    msg = str(e.value)
    assert 'unknown special token: "<|nope|>"' in msg and "<end_of_turn>" in msg and "<start_of_turn>" in msg
    assert len(msg) < 400 and msg.count("<unused") <= 1 and "\n" not in msg

@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]},
    {"$defs": {"d": {"allOf": [{"$ref": "#/$defs/d"}]}}, "type": "array", "items": {"$ref": "#/$defs/d"}},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}])
def test_a_ref_that_loops_before_any_value_is_refused(schema):
    """A $ref leading back to itself through $refs and allOf alone, even deep in the schema (llguidance fails only
    where generation reaches it, after part of a stream went out): refused when the constraint is made."""
    with pytest.raises(StructuredOutputError, match="leads back to itself before any value"):
        Constraint.json_schema(schema)
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}},
                                             "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    Constraint.json_schema(tree)                                       # recursion behind a value: fine


def test_a_ref_to_an_anchor_is_not_a_loop(toks, compilers):
    """A plain-name fragment ("#item") names an $anchor, not a JSON pointer: it was read as "#", the root, and the
    schema refused as a $ref leading back to itself. llguidance resolves it; the output takes the anchored schema."""
    schema = {"$defs": {"item": {"$anchor": "item", "type": "integer", "minimum": 5, "maximum": 9},
                        "list": {"$anchor": "list", "type": "array", "items": {"$ref": "#item"}, "minItems": 1,
                                 "maxItems": 3}},
              "$ref": "#list"}
    compiled = compilers["smollm2-135m"].compile(Constraint.json_schema(schema), timeout=30)
    text, _, finished = walk(compiled, toks["smollm2-135m"], np.random.default_rng(0))
    assert finished
    jsonschema.validate(json.loads(text), schema)
    with pytest.raises(StructuredOutputError, match="leads back to itself"):
        Constraint.json_schema({"$defs": {"a": {"$anchor": "a", "$ref": "#/$defs/a"}}, "$ref": "#a"})


@pytest.mark.parametrize("schema", [{"anyOf": [{"$ref": "#"}]}, {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}])
def test_a_schema_that_matches_no_text_is_refused(compilers, schema):
    """$refs that loop back before any value through anyOf (which no_ref_loops leaves to llguidance): llguidance
    compiles a grammar that fails at its first mask, which would end a request at once with an error (or "stop"
    and no text). The compiler refuses it instead; a grammar that matches the empty text alone is still taken."""
    with pytest.raises(StructuredOutputError, match="matches no text.*a \\$ref that leads back"):
        compilers["smollm2-135m"].compile(Constraint.json_schema(schema), timeout=30)
    for grammar in (Constraint.lark("start: start"), Constraint.gbnf("root ::= x\nx ::= root")):
        with pytest.raises(StructuredOutputError, match="matches no text") as e:    # a grammar has no $ref
            compilers["smollm2-135m"].compile(grammar, timeout=30)
        assert "$ref" not in str(e.value) and "a rule that leads back to itself" in str(e.value)
    compiled = compilers["smollm2-135m"].compile(Constraint.regex(""), timeout=30)
    m = compiled.matcher()
    m.fill_mask(np.zeros(compiled.vocab.mask_words, np.int32))
    assert m.is_accepting


# --- random walks: masked random logits, sampled at temperature 1 -------------------------------------------
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {"type": "object", "properties": {
                "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"]}},
        "required": ["user"]},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                                               "mixed": {"enum": [1, "two", None, True]}},
              "required": ["color", "size", "mixed"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False}},
        "required": ["tags", "scores", "pair"], "additionalProperties": False},
    "anyof": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}, {"type": "null"}]},
        "shape": {"anyOf": [{"type": "object", "properties": {"r": {"type": "number"}}, "required": ["r"]},
                            {"type": "object", "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}},
                             "required": ["w", "h"]}]}},
        "required": ["value", "shape"]},
    "const": {"type": "object", "properties": {"version": {"const": "1.0"}, "kind": {"const": 3},
                                               "flags": {"const": [1, {"a": None}]}},
              "required": ["version", "kind", "flags"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                                 "code": {"type": "string", "pattern": "^(ab|cd)+x?$", "maxLength": 9}},
                "required": ["id", "code"], "additionalProperties": False},
    "ranges": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                                "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000},
                                                "temp": {"type": "number", "minimum": -5.5, "maximum": 5.5}},
               "required": ["age", "count", "temp"], "additionalProperties": False},
    "refs": {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                                  "ok": {"type": "boolean"}},
                                "required": ["v", "ok"]}},
             "type": "array", "items": {"$ref": "#/$defs/node"}, "minItems": 1, "maxItems": 3},
}
SEEDS = (0, 1, 2)
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def closers(toks) -> dict:
    """A random walk's push toward ending strings, numbers and containers (it would otherwise write random tokens
    inside a string for ever): +14 (above ln V) on tokens that start with a quote, +10 on those that start with
    a comma, bracket or brace."""
    out = {}
    for name, tok in toks.items():
        bias = np.zeros(tok.n_vocab, np.float32)
        for i in range(tok.n_vocab):
            first = tok.token_bytes(i)[:1]
            bias[i] = 14.0 if first == b'"' else 10.0 if first and first in b",]}" else 0.0
        out[name] = bias
    return out


def walk(compiled, tok, rng, bias=None, max_tokens=MAX_TOKENS, filler=None):
    """Sample a constrained sequence from random logits (one fixed N(0, 1) vector per walk, plus `bias`) at
    temperature 1: mask, sample (Gumbel max over the allowed tokens), advance, until the grammar stops or an end
    token is drawn. Returns (text, tokens, finished)."""
    vocab = compiled.vocab
    m = compiled.matcher()
    base = rng.standard_normal(tok.n_vocab).astype(np.float32)
    if bias is not None:
        base += bias
    masks = np.zeros((1, vocab.mask_words), np.int32)
    out = []
    for _ in range(max_tokens):
        if filler is not None:
            masks = filler.fill([(m, 0, [])], 1)
        else:
            m.fill_mask(masks[0])
        x = base.copy()
        apply_bitmask(x, masks[0])
        ids = np.flatnonzero(x > -np.inf)
        assert ids.size, "the mask allows nothing"
        t = int(ids[np.argmax(x[ids] + rng.gumbel(size=ids.size))])
        m.advance(t)
        if t in vocab.eog_ids:
            return tok.decode(out), out, True
        out.append(t)
        if m.is_stopped:
            return tok.decode(out), out, True
    return tok.decode(out), out, False


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("schema", list(SCHEMAS))
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_json_schema_walks_validate(toks, compilers, closers, name, schema, seed):
    compiled = compilers[name].compile(Constraint.json_schema(SCHEMAS[schema]), timeout=60)
    text, out, finished = walk(compiled, toks[name], np.random.default_rng(seed), closers[name])
    assert finished, f"no end after {MAX_TOKENS} tokens: {text[:200]!r}"
    jsonschema.validate(json.loads(text), SCHEMAS[schema])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_json_object_walks(toks, compilers, closers, name, seed):
    compiled = compilers[name].compile(Constraint.json_object(), timeout=60)
    text, _, finished = walk(compiled, toks[name], np.random.default_rng(seed), closers[name])
    assert finished and isinstance(json.loads(text), dict), text[:200]


REGEXES = [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"#[0-9a-fA-F]{6}",
           r"(\+|-)?[1-9][0-9]{0,3}(\.[0-9]{1,2})?"]
GBNF = {  # grammar -> a check of its language in Python
    'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z]{2,8}\n':
        lambda s: re.fullmatch(r"(hello|hi) [A-Z][a-z]{2,8}!", s),
    'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]{1,3} | "(" expr ")"\n':
        lambda s: re.fullmatch(r"[0-9()+-]+", s) and isinstance(
            ast.parse(re.sub(r"\b0+(?=[0-9])", "", s), mode="eval").body, (ast.BinOp, ast.Constant)),
    'root ::= "[" ( item ( "," item )* )? "]"\nitem ::= "\\"" [a-z]+ "\\""\n':
        lambda s: all(re.fullmatch(r"[a-z]+", x) for x in json.loads(s)),
}

@pytest.mark.parametrize("name", MODEL_NAMES)
def test_regex_digit_and_word_classes_are_ascii(toks, compilers, name):
    r"""`\d` and `\w` in a regex constraint are ASCII, as in a JSON schema's pattern (and xgrammar's, vLLM's
    default): llguidance's Rust regexes read them as Unicode, so `\d{3}` took Arabic-Indic or fullwidth digits, and
    a walk over random logits wrote them. The pattern's own errors still quote it as it was given."""
    tok = toks[name]
    for pattern, ok in [(r"\d{3}-\d{4}", b"0123456789"), (r"\w+", b"0123456789_" + bytes(range(65, 91)) +
                                                             bytes(range(97, 123))), (r"[^\D]+", b"0123456789")]:
        compiled = compilers[name].compile(Constraint.regex(pattern))
        row = np.zeros(compiled.vocab.mask_words, np.int32)
        compiled.matcher().fill_mask(row)
        firsts = {tok.token_bytes(int(i)) for i in _allowed(row, tok.n_vocab)}
        assert firsts and all(set(b) <= set(ok) for b in firsts), sorted(b for b in firsts if not set(b) <= set(ok))[:5]
    for seed in SEEDS:
        text, _, finished = walk(compilers[name].compile(Constraint.regex(r"\d{3}-\d{4}")), tok,
                                 np.random.default_rng(seed))
        assert finished and re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
    with pytest.raises(StructuredOutputError) as e:
        Constraint.regex(r"\d(")
    assert str(e.value).startswith("invalid regex constraint: at") and '"\\\\d("' in str(e.value)



@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_regex_choice_gbnf_walks(toks, compilers, closers, name, seed):
    tok, compiler, rng = toks[name], compilers[name], np.random.default_rng(seed)
    for pattern in REGEXES:
        text, _, finished = walk(compiler.compile(Constraint.regex(pattern)), tok, rng)
        assert finished and re.fullmatch(pattern, text), (pattern, text)
    options = ["Paris", "London", "New York", 'say "hi"', "日本", "a", "ab"]
    for _ in range(3):
        text, _, finished = walk(compiler.compile(Constraint.choice(options)), tok, rng)
        assert finished and text in options, text
    for grammar, check in GBNF.items():
        text, _, finished = walk(compiler.compile(Constraint.gbnf(grammar)), tok, rng, closers[name])
        assert finished and check(text), (grammar, text)


def test_lark_walk(toks, compilers):
    tok = toks["smollm2-135m"]
    lark = 'start: "(" pair ("," pair)* ")"\npair: KEY "=" VALUE\nKEY: /[a-z]{1,5}/\nVALUE: /[0-9]{1,4}/\n'
    for seed in SEEDS:
        text, _, finished = walk(compilers["smollm2-135m"].compile(Constraint.lark(lark)), tok,
                                 np.random.default_rng(seed))
        assert finished and re.fullmatch(r"\(([a-z]{1,5}=[0-9]{1,4})(,[a-z]{1,5}=[0-9]{1,4})*\)", text), text


# --- whitespace is bounded --------------------------------------------------------------------------------------
WS_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
             "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_json_whitespace_is_bounded(toks, compilers, name):
    """Logits that prefer whitespace (+8 on every token that is only whitespace): with the default the JSON
    still ends, every gap is at most 22 characters; with llguidance's flexible whitespace the same walk never
    ends (which is what the default prevents)."""
    tok = toks[name]
    ws = np.zeros(tok.n_vocab, np.float32)
    for i in range(tok.n_vocab):
        p = tok.token_bytes(i)
        if p and not p.strip(b" \t\n\r"):
            ws[i] = 8.0
    compiler = compilers[name]
    for seed in SEEDS:
        text, out, finished = walk(compiler.compile(Constraint.json_schema(WS_SCHEMA)), tok,
                                   np.random.default_rng(seed), ws, max_tokens=300)
        assert finished, f"whitespace ran away: {text[:120]!r}"
        jsonschema.validate(json.loads(text), WS_SCHEMA)
        gaps = re.findall(r"\s+", text)
        assert gaps and max(map(len, gaps)) <= 22, gaps     # the model did write whitespace, within bounds
        assert all(re.fullmatch(JSON_WHITESPACE, g) for g in gaps)
    flexible = dict(WS_SCHEMA, **{"x-guidance": {"whitespace_flexible": True}})   # replaces the default
    text, _, finished = walk(compiler.compile(Constraint.json_schema(flexible)), tok, np.random.default_rng(0),
                             ws, max_tokens=300)
    assert not finished and len(text.strip()) < 20


def test_matcher_error_is_one_line(toks, compilers):
    """A regex too big for llguidance's lexer passes compilation and fails on the first token; llguidance's
    error then carries a dump of its state and the grammar, which must not reach a user (a command's error line,
    an HTTP body): only its first line does."""
    compiled = compilers["smollm2-135m"].compile(Constraint.regex("a{99999999}"))
    m = compiled.matcher()
    m.fill_mask(np.zeros(compiled.vocab.mask_words, np.int32))
    with pytest.raises(StructuredOutputError) as e:
        m.advance(toks["smollm2-135m"].encode("aaaa", add_bos=False, special=False)[0])
    assert re.fullmatch("grammar matcher failed (on|before) token 46880: lexer error: too many expressions constructed",
                        str(e.value))
    assert m.error == "lexer error: too many expressions constructed"


# --- end tokens, stop, rollback, drafts ---------------------------------------------------------------------------
def _allowed(row: np.ndarray, n_vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little", count=n_vocab))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_complete_grammar_stops_and_allows_every_end_token(toks, compilers, name):
    tok, compiled = toks[name], compilers[name].compile(Constraint.json_schema(WS_SCHEMA))
    m = compiled.matcher()
    ids = tok.encode('{"a": 3, "b": [true]}', add_bos=False, special=False)
    m.advance_many(ids[:-1])
    assert not m.is_stopped and not m.is_accepting
    m.advance(ids[-1])
    assert m.is_stopped and m.is_accepting                  # the engine finishes the request with "stop"
    row = np.zeros(compiled.vocab.mask_words, np.int32)
    m.fill_mask(row)
    assert set(_allowed(row, tok.n_vocab)) == set(compiled.vocab.eog_ids)   # Gemma: <eos>, <end_of_turn>, </s>
    with pytest.raises(StructuredOutputError, match="not allowed"):
        m.advance(ids[0])
    m.advance(max(compiled.vocab.eog_ids))                   # any end token is llguidance's EOS
    assert m.is_stopped and m.error == ""


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_grammar_naming_an_end_token_takes_that_token(toks, compilers, name):
    """A Lark grammar may name a special token (`<[id]>`, `<|name|>`); when it names an end-of-generation token
    (SmolLM2's <|endoftext|>, Gemma's <end_of_turn>, or the EOS itself), the mask allows it and advance takes it,
    as a draft does: it is not read as the EOS the grammar does not expect there."""
    tok, vocab = toks[name], grammar_vocab(toks[name])
    x = tok.encode("x", add_bos=False, special=False)
    for end in vocab.eog_ids:
        compiled = compilers[name].compile(Constraint.lark(f'start: "x" <[{end}]>'))
        m = compiled.matcher()
        if end != vocab.eos_id:      # (llguidance validates EOS only where the grammar is complete: a draft stops)
            assert m.validate_draft([*x, end]) == len(x) + 1
        m.advance_many(x)
        row = np.zeros(vocab.mask_words, np.int32)
        m.fill_mask(row)
        assert end in set(_allowed(row, tok.n_vocab))
        m.advance(end)
        assert m.is_stopped and m.is_accepting and m.error == ""
        m2 = compiled.matcher()                              # nothing else ends it early
        m2.advance_many(x)
        for other in vocab.eog_ids:
            if other not in _allowed(row, tok.n_vocab):
                with pytest.raises(StructuredOutputError, match="not allowed"):
                    m2.advance(other)
    if name == "smollm2-135m":                                # by name, as llguidance's Lark writes it
        m = compilers[name].compile(Constraint.lark('start: "x" <|endoftext|>')).matcher()
        m.advance_many([*x, tok.token_to_id["<|endoftext|>"]])
        assert m.is_stopped and m.error == ""


def test_advance_rejects_a_disallowed_token_and_keeps_state(toks, compilers):
    tok, compiled = toks["smollm2-135m"], compilers["smollm2-135m"].compile(Constraint.regex(r"[0-9]{2,4}"))
    m = compiled.matcher()
    m.advance(tok.encode("1", add_bos=False, special=False)[0])
    with pytest.raises(StructuredOutputError, match="token .* is not allowed by the grammar here"):
        m.advance(tok.encode("x", add_bos=False, special=False)[0])
    assert m.n_tokens == 1 and m.error == ""
    m.advance(tok.encode("2", add_bos=False, special=False)[0])
    assert m.is_accepting and not m.is_stopped


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_drafts_rollback_and_speculative_masks(toks, compilers, name):
    tok, compiled = toks[name], compilers[name].compile(Constraint.json_schema(SCHEMAS["nested"]))
    vocab = compiled.vocab
    good = tok.encode('{"user": {"name": "Ada", "address": {"city": "Oslo", "zip": "01234"}}}',
                      add_bos=False, special=False)
    bad_zip = tok.encode('{"user": {"name": "Ada", "address": {"city": "Oslo", "zip": "0x', add_bos=False,
                         special=False)
    m = compiled.matcher()
    assert m.validate_draft(good) == len(good)
    assert m.validate_draft(good + [good[0]]) == len(good)   # nothing after the end
    k = next(i for i, (a, b) in enumerate(zip(bad_zip, good)) if a != b)
    assert m.validate_draft(bad_zip) == k                    # truncated at the first invalid token
    assert m.n_tokens == 0

    # sequential masks: advance token by token
    seq = np.zeros((len(good) + 1, vocab.mask_words), np.int32)
    for i, t in enumerate(good):
        m.fill_mask(seq[i])
        m.advance(t)
    m.fill_mask(seq[len(good)])
    m.rollback(len(good) - 3)                                # rollback restores the state
    assert m.n_tokens == 3
    row = np.zeros(vocab.mask_words, np.int32)
    m.fill_mask(row)
    assert np.array_equal(row, seq[3])
    m.rollback(3)
    with pytest.raises(ValueError):
        m.rollback(1)

    # speculative masks of several requests in one batched call: row r+i is the mask after draft[:i]
    executor = MaskFiller(vocab).executor
    m2 = compiled.matcher()
    m2.advance_many(good[:5])
    masks = np.full((3 + 6 + 1 + 4, vocab.mask_words), 7, np.int32)
    fill_masks(executor, masks, [(m, 0, good[:2]), (m2, 3, good[5:10]), (compiled.matcher(), 9, [])], vocab)
    assert np.array_equal(masks[0:3], seq[0:3])
    assert np.array_equal(masks[3:9], seq[5:11])
    assert np.array_equal(masks[9], seq[0])
    assert (masks[10:] == 7).all()                           # rows of no item are left alone
    assert m.n_tokens == 0 and m2.n_tokens == 5              # the drafts were not committed
    assert m2.validate_draft(good[5:]) == len(good) - 5

    # a draft that completes the grammar: the next row allows only the end tokens
    m3 = compiled.matcher()
    m3.advance_many(good[:-2])
    end = np.zeros((3, vocab.mask_words), np.int32)
    fill_masks(executor, end, [(m3, 0, good[-2:])], vocab)
    assert set(_allowed(end[2], tok.n_vocab)) == set(vocab.eog_ids)


def test_mask_filler_runs_on_its_thread(toks, compilers):
    tok, compiled = toks["gemma3-270m"], compilers["gemma3-270m"].compile(Constraint.json_schema(SCHEMAS["enums"]))
    filler = MaskFiller(compiled.vocab, max_rows=2)
    try:
        ms = [compiled.matcher() for _ in range(16)]
        for i, m in enumerate(ms):
            m.advance_many(tok.encode('{"color": "' if i % 2 else '{"', add_bos=False, special=False))
        want = np.zeros((16, compiled.vocab.mask_words), np.int32)
        for i, m in enumerate(ms):
            m.fill_mask(want[i])
        job = filler.start([(m, i, []) for i, m in enumerate(ms)], 16)   # grows the buffer
        got = job.result(timeout=30)
        assert got.shape == want.shape and np.array_equal(got, want)
        with pytest.raises(ValueError, match="do not fit"):
            filler.fill([(ms[0], 16, [])], 16)
    finally:
        filler.close()


# --- the mask kernel ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_vocab", [49152, 262144, 1000, 33])
def test_apply_bitmask_matches_numpy(n_vocab):
    rng = np.random.default_rng(n_vocab)
    words = (n_vocab + 31) // 32
    masks = np.stack([np.zeros(words, np.int32), np.full(words, -1, np.int32),
                      rng.integers(-2**31, 2**31, words, dtype=np.int64).astype(np.int32),
                      np.where(rng.random(words) < 0.02, -1, 0).astype(np.int32)])
    logits = rng.standard_normal((4, n_vocab)).astype(np.float32)
    want = logits.copy()
    for r in range(4):
        bits = np.unpackbits(masks[r].view(np.uint8), bitorder="little", count=n_vocab)
        want[r, bits == 0] = -np.inf
    got = logits.copy()
    apply_bitmask(got[0], masks[0])
    apply_bitmasks(got, masks, [1, 2, 3])
    assert np.array_equal(got, want)
    with pytest.raises(ValueError):
        apply_bitmasks(got, masks[:, :-1], [0])
    with pytest.raises(ValueError):
        apply_bitmasks(got, masks, [4])
