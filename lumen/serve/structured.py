"""A request body's structured-output fields -> one Constraint (lumen.engine.structured) or None.

    constraint = constraint_from_body(body)     # body: the request's JSON object (a dict)

Both conventions are accepted, each under its own names:
- OpenAI / vLLM `response_format` (its `type` required, as theirs): {"type": "text"} (no constraint),
  {"type": "json_object"},
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}; llama-server's
  {"type": "json_object", "schema": {...}} and {"type": "json_schema", "schema": {...}} too. Unless `strict` is
  true, a json_schema may use keywords llguidance cannot enforce (uniqueItems, not, ...; an overlapping oneOf is
  read as anyOf), which are then ignored, as for a non-strict tool; a strict one must be enforced in full.
- vLLM `structured_outputs`: {"json": schema | JSON text} | {"regex": str} | {"choice": [str, ...]} |
  {"grammar": str} | {"json_object": true}, with its JSON options `disable_any_whitespace` (compact JSON) and
  `whitespace_pattern`; the older top-level aliases guided_json, guided_regex, guided_choice, guided_grammar (with
  guided_whitespace_pattern). vLLM's grammar may be Lark or GBNF: it is read as Lark when it has a `start:` rule
  (llguidance's test), else as GBNF.
- llama-server: `json_schema` (a schema) and `grammar` (GBNF).

At most one of these may constrain a request: two (say response_format json_schema and guided_regex) is a
StructuredFieldError naming both. Every error is a StructuredFieldError (a StructuredOutputError, so a
LumenError) whose `param` names the field, for the server's 400; a constraint llguidance rejects keeps
llguidance's message. Fields that are absent or null do not count.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..engine.structured import Constraint, StructuredOutputError

SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")           # structured_outputs' constraints
SO_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_fallback", "disable_additional_properties",
              "backend")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredFieldError(StructuredOutputError):
    """A structured-output field of a request that is malformed, conflicts with another, or that llguidance
    rejects; `param` is the field (as the client wrote it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _fail(param: str, message: str):
    raise StructuredFieldError(f"{param}: {message}", param.split(".")[0])


def constraint_from_body(body: Mapping[str, Any]) -> Constraint | None:
    """The one constraint a request body asks for, or None; StructuredFieldError (see the module docstring)."""
    if not isinstance(body, Mapping):
        raise TypeError(f"expected the request body as a mapping, got {type(body).__name__}")
    found: list[tuple[str, Any]] = []      # (field, a function making its Constraint)
    rf = body.get("response_format")
    if rf is not None:
        maker = _response_format(rf)
        if maker is not None:
            found.append(("response_format", maker))
    so = body.get("structured_outputs")
    if so is not None:
        found.append(("structured_outputs", _structured_outputs(so)))
    guided = [name for name in GUIDED if body.get(name) is not None]
    ws = _whitespace_options(body.get("guided_whitespace_pattern"), None, "guided_whitespace_pattern")
    for name in guided:
        found.append((name, _vllm(GUIDED[name], body[name], name, ws)))
    if body.get("json_schema") is not None:
        found.append(("json_schema", lambda: _schema(body["json_schema"], "json_schema")))
    if body.get("grammar") is not None:
        found.append(("grammar", lambda: _text(Constraint.gbnf, body["grammar"], "grammar")))
    if not found:
        return None
    if len(found) > 1:
        names = [f for f, _ in found]
        raise StructuredFieldError(f"conflicting structured-output fields: {', '.join(names)}; a request takes one "
                                   f"constraint", names[1])
    return found[0][1]()


# --- response_format (OpenAI, vLLM, llama-server) ---------------------------------------------------------------
def _response_format(rf: Any):
    if not isinstance(rf, Mapping):
        _fail("response_format", f"must be an object, got {type(rf).__name__}")
    kind = rf.get("type")
    if kind is None:                    # as OpenAI and vLLM: {"json_schema": {...}} alone is a mistake, not "text"
        _fail("response_format.type", 'is required: "text", "json_object" or "json_schema"')
    if kind == "text":
        return None
    if kind == "json_object":
        if rf.get("schema") is not None:                              # llama-server's extension
            return lambda: _schema(rf["schema"], "response_format.schema")
        return Constraint.json_object
    if kind == "json_schema":
        js = rf.get("json_schema")
        if js is None and rf.get("schema") is not None:               # llama-server's shortcut
            return lambda: _schema(rf["schema"], "response_format.schema")
        if not isinstance(js, Mapping):
            _fail("response_format.json_schema", "must be an object with the schema under \"schema\"")
        if js.get("schema") is None:
            _fail("response_format.json_schema.schema", "is required")
        if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
            _fail("response_format.json_schema.strict", f"must be true or false, got {js.get('strict')!r}")
        lenient = None if js.get("strict") else {"lenient": True}
        return lambda: _schema(js["schema"], "response_format.json_schema.schema", lenient)
    _fail("response_format.type", f"must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}")


# --- vLLM: structured_outputs and the guided_* aliases ---------------------------------------------------------
def _structured_outputs(so: Any):
    if not isinstance(so, Mapping):
        _fail("structured_outputs", f"must be an object, got {type(so).__name__}")
    unknown = [k for k in so if k not in SO_KINDS and k not in SO_OPTIONS]
    if unknown:
        _fail(f"structured_outputs.{unknown[0]}", f"unknown field (known: {', '.join(SO_KINDS + SO_OPTIONS)})")
    kinds = [k for k in SO_KINDS if so.get(k) not in (None, False)]
    if not kinds:
        _fail("structured_outputs", f"names no constraint (one of {', '.join(SO_KINDS)})")
    if len(kinds) > 1:
        _fail("structured_outputs", f"conflicting constraints {' and '.join(kinds)}; give one")
    ws = _whitespace_options(so.get("whitespace_pattern"), so.get("disable_any_whitespace"), "structured_outputs")
    kind = kinds[0]
    return _vllm(kind, so[kind], f"structured_outputs.{kind}", ws)


def _whitespace_options(pattern: Any, compact: Any, param: str) -> dict:
    """llguidance JSON options (the schema's x-guidance) from vLLM's whitespace fields."""
    if pattern is not None and not isinstance(pattern, str):
        _fail(param, f"whitespace_pattern must be a string, got {type(pattern).__name__}")
    if compact is not None and not isinstance(compact, bool):
        _fail(param, f"disable_any_whitespace must be a boolean, got {type(compact).__name__}")
    if pattern is not None:
        return {"whitespace_pattern": pattern}
    return {"whitespace_flexible": False} if compact else {}


def _vllm(kind: str, value: Any, param: str, ws: dict):
    if kind == "json":
        return lambda: _schema(value, param, ws)
    if kind == "json_object":
        if value is not True:
            _fail(param, f"must be true, got {value!r}")
        return lambda: _schema({"type": "object"}, param, ws)
    if kind == "regex":
        return lambda: _text(Constraint.regex, value, param)
    if kind == "choice":
        return lambda: _wrap(Constraint.choice, value, param)
    return lambda: _text(Constraint.lark_or_gbnf, value, param)


# --- the values -----------------------------------------------------------------------------------------------
def _schema(value: Any, param: str, options: dict | None = None) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            _fail(param, f"the schema is not valid JSON: {e}")
        if not isinstance(value, (Mapping, bool)):        # ('"x"': JSON, but no schema; not to be read again)
            _fail(param, f"the schema must be a JSON object, got a JSON {_JSON_TYPES.get(type(value), 'value')}")
    if options and isinstance(value, Mapping):
        own = value.get("x-guidance")
        value = {**value, "x-guidance": {**options, **(own if isinstance(own, Mapping) else {})}}
    return _wrap(Constraint.json_schema, value, param)


_JSON_TYPES = {str: "string", int: "number", float: "number", list: "array", type(None): "null"}


def _text(make, value: Any, param: str) -> Constraint:
    if not isinstance(value, str):
        _fail(param, f"must be a string, got {type(value).__name__}")
    return _wrap(make, value, param)


def _wrap(make, value: Any, param: str) -> Constraint:
    try:
        return make(value)
    except StructuredFieldError:
        raise
    except StructuredOutputError as e:
        _fail(param, str(e))
