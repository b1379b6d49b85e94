"""`python -m lumen.generate` with --json-schema FILE, --grammar FILE (GBNF and Lark), --regex and --choice, in
subprocesses on the real SmolLM2: the text printed matches; a file or value that is not valid is one clear error
line, exit code 2, before the model loads."""
import json
import re

import jsonschema
import pytest
from test_cli import generate

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "population": {"type": "integer", "minimum": 1, "maximum": 40000000},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "minItems": 1, "maxItems": 3}},
          "required": ["city", "population", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("kind", ["json-schema", "gbnf", "lark", "regex", "choice"])
def test_constrained_output(smollm2_path, tmp_path, kind):
    check = None
    if kind == "json-schema":
        (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
        args = ["--json-schema", tmp_path / "s.json"]
        check = lambda s: jsonschema.validate(json.loads(s), SCHEMA) is None       # noqa: E731
    elif kind == "gbnf":
        (tmp_path / "g.gbnf").write_text('root ::= city ", " country\ncity ::= [A-Z] [a-z]{2,10}\n'
                                         'country ::= "France" | "Italy"\n')
        args = ["--grammar", tmp_path / "g.gbnf"]
        check = lambda s: re.fullmatch(r"[A-Z][a-z]{2,10}, (France|Italy)", s)     # noqa: E731
    elif kind == "lark":
        (tmp_path / "g.lark").write_text('start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/\n')
        args = ["--grammar", tmp_path / "g.lark"]
        check = lambda s: re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", s)         # noqa: E731
    elif kind == "regex":
        args = ["--regex", r"[0-9]{3}-[0-9]{4}"]
        check = lambda s: re.fullmatch(r"[0-9]{3}-[0-9]{4}", s)                    # noqa: E731
    else:
        args = ["--choice", "Paris", "--choice", "Rome", "--choice", "New York"]
        check = lambda s: s in ("Paris", "Rome", "New York")                       # noqa: E731
    r = generate(smollm2_path, "--prompt", "The capital of France", "-n", 80, "--temperature", 0.7, "--seed", 3,
                 *args)
    assert r.returncode == 0, r.stderr
    text = r.stdout[:-1]                                     # the CLI ends with a newline
    assert check(text), text
    assert "(grammar)" in r.stderr or "(eos)" in r.stderr, r.stderr   # ended by the grammar, not by -n


@pytest.mark.parametrize("args, message", [
    (["--json-schema", "{tmp}/bad.json"], "error: --json-schema {tmp}/bad.json: invalid json_schema constraint: "
                                          "Invalid type: strng"),
    (["--json-schema", "{tmp}/notjson.json"], "error: --json-schema {tmp}/notjson.json: invalid json_schema "
                                              "constraint: the schema is not valid JSON"),
    (["--json-schema", "{tmp}/missing.json"], "error: --json-schema {tmp}/missing.json: cannot read it"),
    (["--grammar", "{tmp}/bad.gbnf"], "error: --grammar {tmp}/bad.gbnf: invalid grammar_gbnf constraint"),
    (["--regex", "(a"], "error: --regex: invalid regex constraint"),
    (["--choice", "yes", "--choice", ""], "error: --choice: a choice cannot be empty"),
], ids=["schema-type", "schema-not-json", "missing-file", "gbnf", "regex", "empty-choice"])
def test_bad_constraint_is_usage_error(smollm2_path, tmp_path, args, message):
    (tmp_path / "bad.json").write_text('{"type": "strng"}')
    (tmp_path / "notjson.json").write_text('{"type": ')
    (tmp_path / "bad.gbnf").write_text('root ::= "a" missing\n')
    r = generate(smollm2_path, "--prompt", "x", *[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(message.format(tmp=tmp_path)) and r.stderr.count("\n") == 1, r.stderr


def test_one_constraint_flag_at_most(smollm2_path):
    r = generate(smollm2_path, "--prompt", "x", "--regex", "a", "--choice", "b")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
