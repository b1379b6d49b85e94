"""Constraint: what a request's output must match (a JSON schema, any JSON object, a regex, one of a list of
strings, or a Lark or GBNF grammar), checked when it is made, as one immutable, hashable value.

    c = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    c = Constraint.make("regex", r"\\d{3}-\\d{4}")      # kind names as in KINDS
    c.grammar                                            # llguidance's grammar text, made once
    c.key                                                # (kind, canonical text): the compile cache key

Making one validates it without a tokenizer (llguidance's `LLMatcher.validate_grammar_with_warnings`, ~0.3 ms
for a small schema), so the server can answer 400 before the request reaches the engine: a malformed value, a
schema keyword llguidance cannot enforce, a regex or grammar that does not parse all raise StructuredOutputError
with llguidance's message. What llguidance can only find against a model's vocabulary (rare: a grammar naming a
token the vocabulary lacks) is reported by the compiler (lumen.engine.structured.compiler) the same way.

JSON whitespace is bounded by default: between two JSON tokens llguidance allows at most what
`JSON_WHITESPACE` matches, one space or one or two newlines and then up to 20 spaces or tabs (llama.cpp's
json-schema-to-grammar rule), so a model that prefers whitespace must still write a JSON token after at most 22
whitespace characters, and none may come before the first `{` or after the last `}`. llguidance's own default
(`whitespace_flexible`: any run of whitespace) lets a model write newlines until max_tokens. A schema's own
top-level "x-guidance" options (llguidance's JSON options: whitespace_flexible, whitespace_pattern,
item_separator, key_separator, lenient, ...) apply on top; one that sets whitespace_flexible or
whitespace_pattern replaces the default (`"x-guidance": {"whitespace_flexible": false}`: compact JSON).
Keywords llguidance cannot enforce (uniqueItems, not, if/then, contains, propertyNames) are an error rather than
silently ignored, so that every output validates against the schema; "x-guidance": {"lenient": true} accepts
them and ignores them. A string `format` llguidance does not know ("password", "uri-reference") is dropped: JSON
Schema makes an unknown format an annotation, which validators ignore too. The formats date, date-time, time
and hostname become regexes of our own (`exact_formats`: llguidance's take a leap second at any time). An
exclusive whole-number bound with the other bound less than 1 away becomes an inclusive one just past it
(`exclusive_bounds`: llguidance's number regex takes the bound itself there). A const or enum integer beyond 2^53
is an error (`exact_data`: llguidance writes the nearest double), and so are a multipleOf of 0 or less and a
string length past 2^32 - 1 (`keyword_ranges`). An object schema that lists its properties takes no other key
unless it says so (`closed_objects`). A lenient schema also drops the string patterns llguidance cannot enforce
(look-around, backreferences); one that is no regex at all is still an error.
"""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from ...errors import LumenError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar_lark", "grammar_gbnf")
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"        # one JSON whitespace gap: at most 22 characters
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}  # llguidance JSON options, before the schema's x-guidance
MAX_TEXT = 1 << 20                                     # 1 MiB: longest schema / regex / grammar text accepted
FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"})
# ^ the string formats llguidance enforces; any other ("password", "uri-reference", ...) is only an annotation
# Formats whose llguidance 1.9 regexes take strings the format refuses, as our own regexes (a subset of each format:
# RFC 3339 with no leap second, no year 0, February 29 only in leap years; RFC 1123 labels of 1-63 characters)
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = "[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}[tT]{_TIME}$", "time": f"^{_TIME}$",
                   "hostname": rf"^{_LABEL}(?:\.{_LABEL})*$"}
FORMAT_MAX_LENGTH = {"hostname": 253}
_DATA_KEYS = ("enum", "const", "default", "examples")   # schema keywords whose values are JSON data
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")   # name -> schema maps


class StructuredOutputError(LumenError, ValueError):
    """A constraint (JSON schema, regex, choice list or grammar) that is malformed or that llguidance rejects;
    the message says which and carries llguidance's own."""


def one_line(msg: str) -> str:
    """llguidance's message on one line. It may echo the input with carets under it ("   1 | start: /(/" then
    "^"), and a regex error puts what is wrong on a line "error: WHAT": the echoes go, the first line and each WHAT
    stay."""
    lines = [ln.strip() for ln in msg.strip().splitlines()]
    lines = [ln for ln in lines if ln.strip("^ ") and not re.match(r"\d+ \| ", ln)]
    said = [ln.removeprefix("error:").strip() for ln in lines[1:] if ln.startswith("error:")]
    return _SPECIALS.sub(_named_specials, " ".join(lines[:1] + said if said else lines))


# llguidance's list of a vocabulary's special tokens, in an unknown-token error: "⟦…[PAD151843]‧...‧</s>⟧", cut at
# the front, mostly placeholders (Qwen2.5: 272 "[PADn]" of 292), "≺EOS≻" for the end-of-sequence token
_SPECIALS = re.compile(r"⟦([^⟧]*)⟧")


def _named_specials(m: re.Match) -> str:
    """The named tokens of such a list, sorted, placeholders counted rather than listed."""
    names = [n for n in m.group(1).lstrip("…").split("‧") if n]
    pads = [n for n in names if re.fullmatch(r"\[PAD\d+\]|<unused\d+>|<\|reserved_special_token_\d+\|>", n)]
    named = sorted(set(names) - set(pads), key=lambda n: (n == "≺EOS≻", n))
    more = f" (and placeholders such as {pads[-1]})" if pads else ""
    return ", ".join(n if n != "≺EOS≻" else "the end-of-sequence token" for n in named) + more


def _fail(kind: str, msg: str) -> None:
    raise StructuredOutputError(f"invalid {kind} constraint: {one_line(msg)}")


@dataclass(frozen=True)
class Constraint:
    """One output constraint. `kind` is one of KINDS; `value` its canonical text: the schema as compact JSON
    (key order kept: llguidance writes properties in schema order), the regex, the choices as a JSON list, the
    grammar text (GBNF as given; `grammar` holds its Lark translation). Equal constraints compile once."""
    kind: str
    value: str
    grammar: str = field(default="", init=False, compare=False, repr=False)   # llguidance's grammar, made here

    def __post_init__(self):
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown constraint kind {self.kind!r} (known: {', '.join(KINDS)})")
        if not isinstance(self.value, str):
            _fail(self.kind, f"the value must be text, got {type(self.value).__name__}")
        if len(self.value) > MAX_TEXT:
            _fail(self.kind, f"{len(self.value)} characters, more than the {MAX_TEXT} accepted")
        object.__setattr__(self, "grammar", _to_grammar(self.kind, self.value))
        _validate(self.kind, self.grammar)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.value

    # --- constructors, one per kind ---------------------------------------------------------------------------
    @classmethod
    def make(cls, kind: str, value: Any = None) -> Constraint:
        """A constraint of `kind` from a Python value: a schema (dict, bool or JSON text), a regex, a list of
        strings, a grammar text; json_object takes no value."""
        if kind == "json_schema":
            return cls.json_schema(value)
        if kind == "json_object":
            if value is not None:
                _fail(kind, "takes no value")
            return cls.json_object()
        if kind == "choice":
            return cls.choice(value)
        if kind in KINDS:
            if not isinstance(value, str):
                _fail(kind, f"expected a string, got {type(value).__name__}")
            return cls(kind, value)
        raise StructuredOutputError(f"unknown constraint kind {kind!r} (known: {', '.join(KINDS)})")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> Constraint:
        """A JSON schema (a dict, true/false, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                _fail("json_schema", f"the schema is not valid JSON: {e}")
        if schema is True:
            schema = {}                                       # any JSON value (llguidance takes objects only)
        if schema is False:
            _fail("json_schema", "the schema false matches nothing")
        if not isinstance(schema, dict):
            _fail("json_schema", f"a schema is a JSON object or a boolean, got {type(schema).__name__}")
        try:
            # as JSON text reads it: a Python caller's int keys and tuples become strings and lists, which the
            # rewrites below expect; what JSON cannot hold (NaN, a set) is refused here
            schema = json.loads(json.dumps(schema, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as e:
            _fail("json_schema", f"the schema cannot be written as JSON: {e}")
        except RecursionError:
            _fail("json_schema", "the schema is nested too deeply")
        try:
            schema = checked_schema(schema)
            own = schema.get("x-guidance")
            if isinstance(own, dict) and own.get("lenient") is True:
                schema = enforceable_patterns(schema)
        except RecursionError:          # llguidance's own limit (nesting ~128) would refuse it anyway
            _fail("json_schema", "the schema is nested too deeply")
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """The whole output matches `pattern` (Rust regex syntax, as llguidance; no lookaround, no backrefs). `\\d`
        and `\\w` are ASCII (`[0-9]`, `[0-9a-zA-Z_]`), as in a JSON schema's pattern and in xgrammar's and Outlines'
        regexes (vLLM's): Rust's Unicode classes let a model write a phone number in Devanagari digits."""
        return cls.make("regex", pattern)

    @classmethod
    def choice(cls, options) -> Constraint:
        """The output is exactly one of `options` (a non-empty list of strings)."""
        if isinstance(options, (str, bytes)) or not isinstance(options, (list, tuple)):
            _fail("choice", f"expected a list of strings, got {type(options).__name__}")
        if not options:
            _fail("choice", "the list of choices is empty")
        bad = [o for o in options if not isinstance(o, str)]
        if bad:
            _fail("choice", f"every choice must be a string, got {bad[0]!r}")
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def lark(cls, text: str) -> Constraint:
        """A Lark grammar (llguidance's dialect: docs/syntax.md of guidance-ai/llguidance), starting at `start`."""
        return cls.make("grammar_lark", text)

    @classmethod
    def gbnf(cls, text: str) -> Constraint:
        """A GBNF grammar (llama.cpp's grammar format), starting at `root`; translated to Lark."""
        return cls.make("grammar_gbnf", text)

    @classmethod
    def lark_or_gbnf(cls, text: str) -> Constraint:
        """A grammar in either format: Lark when it has a `start:` rule (or `%llguidance`), else GBNF. For vLLM's
        "grammar" field and the CLI's --grammar FILE."""
        if not isinstance(text, str):
            _fail("grammar_lark", f"expected a string, got {type(text).__name__}")
        return cls.lark(text) if is_lark(text) else cls.gbnf(text)


def map_subschemas(schema: Any, fn) -> Any:
    """`schema` with `fn` (dict -> dict) applied to it and to each schema object inside it, inner ones first:
    what keywords hold (properties' values, items, anyOf's entries, $defs' values, ...), not JSON data (enum,
    const, default, examples) nor a property's name."""
    def walk(x: Any, names: bool = False) -> Any:
        if isinstance(x, list):
            return [walk(v) for v in x]
        if not isinstance(x, dict):
            return x
        if names:
            return {k: walk(v) for k, v in x.items()}
        return fn({k: v if k in _DATA_KEYS else walk(v, k in _NAMED) for k, v in x.items()})
    return walk(schema)


def known_formats(schema: Any) -> Any:
    """`schema` without the string `format`s llguidance does not know (FORMATS): JSON Schema makes an unknown
    format an annotation that validators ignore, so dropping it keeps every output valid, where llguidance would
    refuse the schema ("Unknown format: password")."""
    def drop(d: dict) -> dict:
        f = d.get("format")
        return {k: v for k, v in d.items() if k != "format"} if isinstance(f, str) and f not in FORMATS else d
    return map_subschemas(schema, drop)


def checked_schema(schema: dict) -> dict:
    """A JSON schema as llguidance is given it, from a request's response_format or a tool's parameters alike: every
    check and rewrite of the module doc, in order (no_ref_loops ... closed_objects). StructuredOutputError for what
    llguidance would get wrong or fail on later. RecursionError for a schema nested past Python's stack."""
    schema = regex_texts(no_ref_loops(schema))
    return closed_objects(known_formats(exact_formats(exclusive_bounds(integer_bounds(exact_data(
        keyword_ranges(schema)))))))


def exact_formats(schema: Any) -> Any:
    """`schema` with each string `format` in FORMAT_PATTERNS made a `pattern` of our own (beside a pattern it has, in
    an allOf entry), and a hostname's length bounded: llguidance 1.9's regexes take a leap second at any time
    ("01:18:60Z"), February 29 of any year, year 0000 and hostname labels of any length, which RFC 3339 and RFC 1123
    (and jsonschema's format checker) refuse. Ours lose only the rare valid leap second (23:59:60 UTC)."""
    def swap(d: dict) -> dict:
        f = d.get("format")
        if not isinstance(f, str) or f not in FORMAT_PATTERNS:
            return d
        out = {k: v for k, v in d.items() if k != "format"}
        if "pattern" in out:
            out["allOf"] = [*(d["allOf"] if isinstance(d.get("allOf"), list) else []),
                            {"pattern": FORMAT_PATTERNS[f]}]
        else:
            out["pattern"] = FORMAT_PATTERNS[f]
        if f in FORMAT_MAX_LENGTH:
            most = out.get("maxLength")
            out["maxLength"] = min(most, FORMAT_MAX_LENGTH[f]) if _number(most) else FORMAT_MAX_LENGTH[f]
        return out
    return map_subschemas(schema, swap)


def _number(x: Any) -> bool:
    """A JSON number a double holds (finite, within its range): an integer past 2^1024 is not one (llguidance
    refuses it, "number out of range"), and math.isfinite would raise OverflowError on it."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return math.isfinite(x) if isinstance(x, float) else abs(x) < _DOUBLE_LIMIT


_DOUBLE_LIMIT = 2 ** 1024          # the first integer beyond the largest finite double


def exclusive_bounds(schema: Any) -> Any:
    """`schema` with each exclusive bound k that is a whole number, and whose other bound is less than 1 away,
    made an inclusive bound just past k (k + 1e-12 max(1, |k|), away from the range's other end): for these
    llguidance 1.9 writes a number regex that takes k itself (`{"exclusiveMinimum": 0, "maximum": 0.5}` let a
    model write 0, `{"exclusiveMaximum": 0, "minimum": -0.5}` -0). Only numbers within 1e-12 of k are lost. An
    integer-only schema keeps its bounds (llguidance's integer ranges are exact)."""
    def fix(d: dict) -> dict:
        t = d.get("type")
        if t == "integer" or (isinstance(t, list) and "number" not in t):
            return d
        lo, hi = d.get("exclusiveMinimum"), d.get("exclusiveMaximum")
        mn, mx = (d.get("minimum"), d.get("maximum"))
        uppers = [v for v in (mx, hi) if _number(v)]
        lowers = [v for v in (mn, lo) if _number(v)]
        out = d
        if _number(lo) and lo == int(lo) and uppers and min(uppers) < lo + 1:
            out = {k: v for k, v in out.items() if k != "exclusiveMinimum"}
            out["minimum"] = max(mn, _past(lo, +1)) if _number(mn) else _past(lo, +1)
        if _number(hi) and hi == int(hi) and lowers and max(lowers) > hi - 1:
            out = {k: v for k, v in out.items() if k != "exclusiveMaximum"}
            out["maximum"] = min(mx, _past(hi, -1)) if _number(mx) else _past(hi, -1)
        return out
    return map_subschemas(schema, fix)


def no_ref_loops(schema: Any) -> Any:
    """`schema`, checked: no local $ref (a JSON pointer) may lead back to itself through $refs and allOf entries
    alone, before any value (`{"$ref": "#"}`, `"d": {"$ref": "#/$defs/d"}`). No JSON matches such a schema;
    llguidance compiles it and fails where it is reached ("NoExtensionBias"), perhaps after part of a streamed
    response was sent. StructuredOutputError otherwise. A $ref behind a property, an item or an anyOf branch is
    ordinary recursion."""
    refs: list[str] = []

    def collect(d: dict) -> dict:
        if _pointer(d.get("$ref")):
            refs.append(d["$ref"])
        return d
    map_subschemas(schema, collect)

    def resolve(ref: str) -> Any:
        node = schema
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def loops(node: Any, seen: frozenset) -> str | None:
        if not isinstance(node, dict):
            return None
        ref = node.get("$ref")
        if _pointer(ref):
            if ref in seen:
                return ref
            found = loops(resolve(ref), seen | {ref})
            if found:
                return found
        for part in node.get("allOf") if isinstance(node.get("allOf"), list) else []:
            found = loops(part, seen)
            if found:
                return found
        return None

    for ref in dict.fromkeys(refs):
        if loops(resolve(ref), frozenset({ref})):
            _fail("json_schema", f"the $ref {ref!r} leads back to itself before any value: no JSON matches it")
    return schema


def _pointer(ref: Any) -> bool:
    """Whether a $ref is a local JSON pointer ("#", "#/$defs/x"); a plain-name fragment ("#foo") names an $anchor,
    which llguidance resolves."""
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def integer_bounds(schema: Any) -> Any:
    """`schema`, checked: an integer schema's bounds must be integers llguidance holds exactly, of magnitude below
    2^53 (a double's integers) or at least exact as a double and below 2^63. llguidance 1.9 reads a bound as a
    double and clamps it to 64 bits: `{"minimum": 1e20, "maximum": 1e20 + 100}` made every output
    9223372036854775807. StructuredOutputError otherwise."""
    def check(d: dict) -> dict:
        t = d.get("type")
        if t == "integer" or (isinstance(t, list) and "integer" in t):
            for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                v = d.get(k)
                if _number(v) and not (abs(v) < 2 ** 63 and float(v) == v):
                    _fail("json_schema", f"the integer bound {k}: {v} is beyond what llguidance enforces "
                                         f"(integers below 2^63 that a double holds exactly)")
        return d
    return map_subschemas(schema, check)


MAX_STRING_LENGTH = 2 ** 32 - 1      # llguidance's longest minLength / maxLength (a regex repetition count)


def keyword_ranges(schema: Any) -> Any:
    """`schema`, checked: a numeric `multipleOf` is greater than 0 (JSON Schema's rule; llguidance 1.9 took -2, and
    refused 0 for an integer only, as "invalid multiple of"), and a string's minLength / maxLength is at most
    MAX_STRING_LENGTH (llguidance refused 10**12 as "regex parse error: decimal literal invalid").
    StructuredOutputError otherwise."""
    def check(d: dict) -> dict:
        m = d.get("multipleOf")
        if _number(m) and m <= 0:
            _fail("json_schema", f"multipleOf must be greater than 0, got {m}")
        for k in ("minLength", "maxLength"):
            v = d.get(k)
            if _number(v) and v > MAX_STRING_LENGTH:
                _fail("json_schema", f"{k} {v} is beyond the longest string length llguidance enforces "
                                     f"({MAX_STRING_LENGTH})")
        return d
    return map_subschemas(schema, check)


def exact_data(schema: Any) -> Any:
    """`schema`, checked: no `const` or `enum` value may hold an integer beyond 2^53. llguidance 1.9 keeps JSON numbers
    as doubles and writes the shortest decimal of the nearest one: `{"const": 12345678901234567890}` made every
    output 12345678901234567000, which the schema refuses. StructuredOutputError otherwise (a string holds it)."""
    def big(x: Any) -> int | None:
        if _number(x) and isinstance(x, int):     # beyond a double's range: llguidance's "number out of range"
            return x if abs(x) > 2 ** 53 else None
        for v in x.values() if isinstance(x, dict) else x if isinstance(x, list) else ():
            found = big(v)
            if found is not None:
                return found
        return None

    def check(d: dict) -> dict:
        for k in ("const", "enum"):
            if k in d and (v := big(d[k])) is not None:
                _fail("json_schema", f"the {k} holds the integer {v}, beyond 2^53, which llguidance would write as "
                                     f"the nearest double ({float(v):.17g}); give it as a string")
        return d
    return map_subschemas(schema, check)


def _past(k: float, sign: int) -> float:
    """A number just past k in the direction of `sign`: k +- 1e-12 max(1, |k|), strictly beyond it as a float."""
    x = k + sign * 1e-12 * max(1.0, abs(k))
    return x if x != k else math.nextafter(k, sign * math.inf)


def enforceable_patterns(schema: Any) -> Any:
    """`schema` without the string `pattern`s llguidance cannot enforce (look-around, backreferences: JSON Schema
    patterns are ECMA-262, llguidance's regexes Rust's), for a lenient schema, which ignores what it cannot
    enforce: a password rule `^(?=.*\\d).{8,}$` is dropped rather than the request refused. A pattern that is no
    regex at all ("(") is refused, as in a strict schema, rather than dropped. StructuredOutputError then."""
    def drop(d: dict) -> dict:
        p = d.get("pattern")
        why = _pattern_error(p) if isinstance(p, str) else None
        if why is None:
            return d
        if not UNENFORCEABLE.search(why) and "\\k<" not in p:     # (a named backreference: "unrecognized escape")
            _fail("json_schema", f"the pattern {p!r} is not a valid regex: {why}")
        return {k: v for k, v in d.items() if k != "pattern"}
    return map_subschemas(schema, drop)


UNENFORCEABLE = re.compile(r"look-around|backreferences")   # what llguidance's regex error names when it is that


@functools.lru_cache(maxsize=1024)
def _pattern_error(pattern: str) -> str | None:
    """llguidance's complaint about a schema's string pattern ("error: unclosed group"), None when it takes it."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "string", "pattern": pattern}))
    except Exception as e:  # noqa: BLE001 - ValueError from llguidance: the pattern does not parse
        messages = [str(e)]
    else:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if not is_error:
            return None
    last = (messages[0] if messages else "").strip().splitlines() or ["rejected by llguidance"]
    return last[-1].removeprefix("error: ")


_COMBINERS = ("allOf", "anyOf", "oneOf")


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` in each object schema that lists its properties and says
    nothing of others, as llama.cpp's json-schema-to-grammar and xgrammar (vLLM's default) read a schema: left
    free, a model adds keys of its own ("price", "minItems") that a function called with the arguments does not
    take. A schema whose properties may come from elsewhere stays open: one with its own allOf / anyOf / oneOf /
    $ref, an allOf entry, an anyOf / oneOf entry of a schema that has properties, the target of a local $ref such
    an entry makes (`"allOf": [{"$ref": "#/$defs/base"}, {...}]`: OpenAPI's composition), and one that needs a key
    it does not list (in `required` or `dependentRequired`, or more keys in `minProperties` than it lists): closed,
    no JSON would match it. `"additionalProperties": true` keeps an object open."""
    def close(d: dict, partial: bool) -> dict:
        if partial or not ("properties" in d or "patternProperties" in d) or any(
                k in d for k in ("additionalProperties", "unevaluatedProperties", "$ref", *_COMBINERS)):
            return d
        if "patternProperties" not in d and needs_unlisted(d):
            return d                        # only an open object has that key
        return {**d, "additionalProperties": False}

    def needs_unlisted(d: dict) -> bool:
        listed = d.get("properties") if isinstance(d.get("properties"), dict) else {}
        needed = list(d.get("required")) if isinstance(d.get("required"), list) else []
        dependent = d.get("dependentRequired")
        for keys in dependent.values() if isinstance(dependent, dict) else ():
            needed += keys if isinstance(keys, list) else []
        fewest = d.get("minProperties")
        return any(not isinstance(k, str) or k not in listed for k in needed) or (
            _number(fewest) and fewest > len(listed))

    def parts(d: dict):
        """d's combiner lists, each with whether its entries are parts of one object (their properties add up)."""
        for k in _COMBINERS:
            if isinstance(d.get(k), list):
                yield k, d[k], k == "allOf" or "properties" in d or "patternProperties" in d

    def partial_refs(x: Any, out: set) -> set:
        """The local $refs ("#/$defs/base") that such parts name: their targets stay open too."""
        if isinstance(x, list):
            for v in x:
                partial_refs(v, out)
        elif isinstance(x, dict):
            for _, entries, part in parts(x):
                out.update(e["$ref"] for e in entries
                           if part and isinstance(e, dict) and isinstance(e.get("$ref"), str))
            for k, v in x.items():
                if k not in _DATA_KEYS:
                    partial_refs(v, out)
        return out

    opened = partial_refs(schema, set())

    def walk(x: Any, partial: bool = False, at: str = "#") -> Any:
        if isinstance(x, list):
            return [walk(v, False, f"{at}/{i}") for i, v in enumerate(x)]
        if not isinstance(x, dict):
            return x
        partial = partial or at in opened
        part_of = {k: part for k, _, part in parts(x)}
        out = {}
        for k, v in x.items():
            here = f"{at}/{_escape(k)}"
            if k in _DATA_KEYS:
                out[k] = v
            elif k in _NAMED and isinstance(v, dict):
                out[k] = {name: walk(s, k == "dependentSchemas", f"{here}/{_escape(name)}") for name, s in v.items()}
            elif k in part_of:
                out[k] = [walk(s, part_of[k], f"{here}/{i}") for i, s in enumerate(v)]
            else:
                out[k] = walk(v, False, here)
        return close(out, partial)
    return walk(schema)


def _escape(name: str) -> str:
    """A JSON pointer's escaping of one name (RFC 6901): ~ -> ~0, / -> ~1."""
    return name.replace("~", "~0").replace("/", "~1")


def is_lark(text: str) -> bool:
    """Whether grammar text is Lark (a `start:` rule or `%llguidance`) rather than GBNF (`root ::= ...`), as
    llguidance decides for its "grammar" format."""
    return re.search(r"(?m)^\s*(%llguidance\b|start\s*:)", text) is not None


def _to_grammar(kind: str, value: str) -> str:
    """llguidance's grammar for a constraint's canonical value."""
    ll = llguidance.LLMatcher
    try:
        if kind == "json_schema":
            schema = json.loads(value)
            own = schema.get("x-guidance") if isinstance(schema, dict) else None
            ws_own = isinstance(own, dict) and ("whitespace_pattern" in own or "whitespace_flexible" in own)
            return ll.grammar_from_json_schema(value, defaults=None if ws_own else JSON_OPTIONS)
        if kind == "json_object":
            return ll.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            _no_trailing_backslash(kind, "the regex", value)
            grammar = ll.grammar_from_regex(value)
            ascii_classes = llguidance.regex_to_lark(value, "dw")
            if ascii_classes == value:
                return grammar
            _validate(kind, grammar)                         # its errors quote the pattern as it was given
            return ll.grammar_from_regex(ascii_classes)
        if kind == "choice":
            # each choice a Lark string literal (JSON string syntax, which llguidance's Lark reads)
            return ll.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(value)))
        if kind == "grammar_lark":
            return ll.grammar_from_lark(value)
        return ll.grammar_from_lark(gbnf_to_lark(value))
    except StructuredOutputError:
        raise
    except Exception as e:  # ValueError from llguidance, GbnfToLarkError (with its position) from the GBNF parser
        _fail(kind, str(e))


def _no_trailing_backslash(kind: str, what: str, pattern: str) -> None:
    """StructuredOutputError for a regex ending in an unpaired backslash, which llguidance 1.9 silently drops (the
    regex "a\\" matched "a"; the empty regex) where Rust's, Python's and ECMA-262's regexes refuse it."""
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
        _fail(kind, f"{what} ends in an unpaired backslash (a literal backslash is written as two)")


def regex_texts(schema: Any) -> Any:
    """`schema`, checked: no `pattern` or `patternProperties` name ends in an unpaired backslash
    (_no_trailing_backslash). StructuredOutputError otherwise."""
    def check(d: dict) -> dict:
        if isinstance(d.get("pattern"), str):
            _no_trailing_backslash("json_schema", "the pattern", d["pattern"])
        for name in d.get("patternProperties") if isinstance(d.get("patternProperties"), dict) else ():
            _no_trailing_backslash("json_schema", "the patternProperties name", name)
        return d
    return map_subschemas(schema, check)


def _validate(kind: str, grammar: str) -> None:
    """Compile `grammar` without a tokenizer; StructuredOutputError with llguidance's message if it fails."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        _fail(kind, messages[0].strip() if messages else "rejected by llguidance")
