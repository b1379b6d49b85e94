"""lumen.serve.structured.constraint_from_body: every accepted convention (OpenAI/vLLM response_format, vLLM
structured_outputs and guided_*, llama-server json_schema / grammar) maps to the right Constraint, and malformed or
conflicting fields are a StructuredFieldError naming the field. No server, no model."""
import json

import pytest

from lumen.engine.structured import Constraint, StructuredOutputError
from lumen.serve.structured import StructuredFieldError, constraint_from_body

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
GBNF = 'root ::= "yes" | "no"'
LARK = 'start: "yes" | "no"'


@pytest.mark.parametrize("body, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": None, "guided_json": None, "grammar": None}, None),
    ({"response_format": {"type": "json_object"}}, Constraint.json_object()),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     Constraint.json_schema(SCHEMA)),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, Constraint.json_schema(SCHEMA)),   # llama-server
    ({"response_format": {"type": "json_schema", "schema": SCHEMA}}, Constraint.json_schema(SCHEMA)),   # llama-server
    ({"structured_outputs": {"json": SCHEMA}}, Constraint.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, Constraint.json_schema(SCHEMA)),
    ({"structured_outputs": {"regex": r"\d+"}}, Constraint.regex(r"\d+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, Constraint.choice(["a", "b"])),
    ({"structured_outputs": {"grammar": GBNF}}, Constraint.gbnf(GBNF)),
    ({"structured_outputs": {"grammar": LARK}}, Constraint.lark(LARK)),
    ({"structured_outputs": {"json_object": True}}, Constraint.json_schema({"type": "object"})),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     Constraint.json_schema({**SCHEMA, "x-guidance": {"whitespace_flexible": False}})),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}},
     Constraint.json_schema({**SCHEMA, "x-guidance": {"whitespace_pattern": " ?"}})),
    ({"guided_json": SCHEMA}, Constraint.json_schema(SCHEMA)),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
     Constraint.json_schema({**SCHEMA, "x-guidance": {"whitespace_pattern": " ?"}})),
    ({"guided_regex": "[a-z]+"}, Constraint.regex("[a-z]+")),
    ({"guided_choice": ["x", "y"]}, Constraint.choice(["x", "y"])),
    ({"guided_grammar": GBNF}, Constraint.gbnf(GBNF)),
    ({"json_schema": SCHEMA}, Constraint.json_schema(SCHEMA)),                   # llama-server
    ({"grammar": GBNF}, Constraint.gbnf(GBNF)),                                   # llama-server: GBNF
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, Constraint.regex("a")),   # text does not count
])
def test_fields_map_to_constraints(body, want):
    got = constraint_from_body(body)
    assert got == want
    if want is not None:
        assert got.grammar                       # validated and ready to compile


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "guided_regex": "a"},
     "guided_regex", "conflicting structured-output fields: response_format, guided_regex"),
    ({"json_schema": SCHEMA, "grammar": GBNF}, "grammar", "conflicting structured-output fields: json_schema, grammar"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice", "conflicting"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "conflicting constraints regex and choice"),
    ({"structured_outputs": {}}, "structured_outputs", "names no constraint"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs", "structured_outputs.jsonn: unknown field"),
    ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "must be true"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": "yes"}}, "structured_outputs",
     "disable_any_whitespace must be a boolean"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type: must be"),
    ({"response_format": {"json_schema": {"name": "p", "schema": SCHEMA}}}, "response_format",   # not "text"
     "response_format.type: is required"),
    ({"response_format": {"type": None, "schema": SCHEMA}}, "response_format", "response_format.type: is required"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "must be an object with the schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "response_format.json_schema.schema: is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}}, "response_format",
     "response_format.json_schema.schema: invalid json_schema constraint: Invalid type: strin"),
    ({"guided_json": "{oops"}, "guided_json", "guided_json: the schema is not valid JSON"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_regex": 5}, "guided_regex", "guided_regex: must be a string"),
    ({"guided_choice": "a"}, "guided_choice", "expected a list of strings"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", "Rule 'foo' not found"),
    ({"grammar": "start: foo"}, "grammar", "grammar: invalid grammar_gbnf constraint"),   # llama-server: GBNF only
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema", "Unimplemented keys"),
    # values JSON allows where the schema rewrites expect others: llguidance's 400, not a TypeError's 500
    ({"json_schema": {"type": "object", "properties": {"a": {}}, "required": [{"x": 1}]}}, "json_schema",
     "Expected string for 'required' item"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "integer", "minimum": 10 ** 400}}}}, "response_format", "number out of range"),   # OverflowError
    # JSON Schema's multipleOf is > 0 (-2 was taken; 0 was "invalid multiple of" for an integer only)
    ({"guided_json": {"type": "number", "multipleOf": -2}}, "guided_json", "multipleOf must be greater than 0, got -2"),
    ({"json_schema": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 0}}}}, "json_schema",
     "json_schema: invalid json_schema constraint: multipleOf must be greater than 0, got 0"),
    ({"guided_json": {"type": "string", "maxLength": 10 ** 12}}, "guided_json",    # was "decimal literal invalid"
     "maxLength 1000000000000 is beyond the longest string length llguidance enforces (4294967295)"),
    ({"guided_json": {"type": "string", "minLength": 2 ** 32}}, "guided_json", "minLength 4294967296 is beyond"),
    # JSON text that is JSON, but no schema: it said "not valid JSON" (it was read a second time)
    ({"guided_json": '"x"'}, "guided_json", "guided_json: the schema must be a JSON object, got a JSON string"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs",
     "structured_outputs.json: the schema must be a JSON object, got a JSON array"),
])
def test_bad_fields_are_named(body, param, message):
    with pytest.raises(StructuredFieldError) as e:
        constraint_from_body(body)
    assert e.value.param == param
    assert message in str(e.value)
    assert isinstance(e.value, StructuredOutputError)


def test_body_must_be_a_mapping():
    with pytest.raises(TypeError):
        constraint_from_body([("guided_regex", "a")])


def test_response_format_schema_is_exact_only_when_strict():
    """OpenAI's json_schema: strict, every keyword is enforced (one llguidance cannot is refused); not strict (the
    default), such keywords are accepted and ignored, as for a non-strict tool."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}, "required": ["tags"]}

    def body(**js):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, **js}}}

    for js in ({}, {"strict": False}, {"strict": None}):
        assert constraint_from_body(body(**js)).kind == "json_schema"
    with pytest.raises(StructuredFieldError, match="uniqueItems") as e:
        constraint_from_body(body(strict=True))
    assert e.value.param == "response_format"
    with pytest.raises(StructuredFieldError, match="strict") as e:
        constraint_from_body(body(strict="yes"))
    assert e.value.param == "response_format"


@pytest.mark.parametrize("strict", [True, False])
def test_a_pattern_that_is_no_regex_is_refused_strict_or_not(strict):
    """A non-strict (lenient) schema drops the patterns llguidance cannot enforce (look-around, backreferences,
    named ones too); it dropped one that does not parse either ("("), and the request ran unconstrained."""
    def body(pattern):
        schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                                           "strict": strict}}}

    for pattern, why in [("(", "unclosed group"), ("a{2,1}", "invalid repetition count range"),
                         ("*", "repetition operator missing expression")]:
        with pytest.raises(StructuredFieldError, match=why) as e:
            constraint_from_body(body(pattern))
        assert e.value.param == "response_format"
        if not strict:
            assert f"the pattern {pattern!r} is not a valid regex: {why}" in str(e.value)
    for pattern in ("^(?=.*\\d).{8,}$", "(a)\\1", "(?<n>a)\\k<n>"):
        if strict:
            with pytest.raises(StructuredFieldError):
                constraint_from_body(body(pattern))
        else:
            assert "pattern" not in json.loads(constraint_from_body(body(pattern)).value)["properties"]["s"]
    assert json.loads(constraint_from_body(body("^\\p{L}+$")).value)["properties"]["s"]["pattern"] == "^\\p{L}+$"
