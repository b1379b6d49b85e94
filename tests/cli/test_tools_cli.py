"""`python -m lumen.generate --tools` on Qwen2.5-Coder-0.5B, in process: the command line builds the server's tool
grammar (lumen.serve.tools.call_grammar, with Qwen's one-token <tool_call> and </tool_call>), with --tool-choice
none the prompt shows no tools, and --json-schema / --json-object beside tools are read as the server reads
response_format beside tools. Each run generates one token (the request as the
command line makes it is what is checked). Skips when the model cannot be fetched (qwen05_path)."""
import json

import pytest

from lumen.llm import Model
from lumen import generate as cli
from lumen.commands import run as run_command
from lumen.engine.structured import Constraint
from lumen.serve.tools import HermesParser, call_grammar, close_token, open_token, parse_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def cli_run(qwen05_path, tmp_path_factory):
    """run(choice) -> (the prompt ids and keywords the command line passed to Model.generate, the tokenizer)."""
    f = tmp_path_factory.mktemp("tools") / "tools.json"
    f.write_text(json.dumps(TOOLS))
    seen = []
    real = Model.generate

    def spy(self, prompt, params=None, **kw):
        seen.append((self, prompt, kw))
        return real(self, prompt, params, **dict(kw, max_tokens=1))

    def run(choice: str, *extra: str):
        mp = pytest.MonkeyPatch()
        mp.setattr(Model, "generate", spy)
        try:
            rc = cli.main(["-m", str(qwen05_path), "-t", "2", "--ctx", "512", "--tools", str(f), "--tool-choice",
                           choice, "--greedy", "-p", "What is the weather in Paris?", *extra])
        finally:
            mp.undo()
        assert rc == 0
        model, prompt, kw = seen.pop()
        return prompt, kw, model
    run.dir = f.parent
    return run


@pytest.mark.parametrize("choice", ["auto", "required", "get_weather"])
def test_the_tool_grammar_is_the_servers(cli_run, choice):
    """The command line's grammar lacked Qwen's single <tool_call> / </tool_call> tokens (the server's had them):
    spelled, a call's close is forced as pieces the model never saw, and a "<" after a call forces one more."""
    _, kw, model = cli_run(choice)
    tok = model.tokenizer
    assert kw["constraint"] == call_grammar(HermesParser, tok, parse_tools(TOOLS), choice)
    oid, cid = open_token(tok, HermesParser), close_token(tok, HermesParser)
    assert oid is not None and cid is not None
    assert f"<[{cid}]>" in kw["constraint"].value
    if choice != "auto":                                 # (auto: text may spell no call, so the open is text too)
        assert f"<[{oid}]>" in kw["constraint"].value


def test_tool_choice_none_shows_no_tools(cli_run):
    """--tool-choice none showed the tools in the prompt (the model then wrote calls as plain text); the server
    shows none, and so does the command line now: the prompt is the plain --chat prompt."""
    prompt, kw, model = cli_run("none")
    assert "get_weather" not in model.tokenizer.decode(prompt) and kw["constraint"] is None
    rendered, _ = cli.chat_prompt(model, "What is the weather in Paris?", None)
    assert prompt == model.tokenize(rendered, special=True, shielded=True)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "number"}},
          "required": ["city", "temp"]}


@pytest.mark.parametrize("flag", ["--json-schema", "--json-object"])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_json_answer_beside_tools_is_the_servers(cli_run, flag, choice):
    """--tools with --json-schema or --json-object was refused; the server takes response_format beside tools
    (auto: calls, or JSON text that follows it; required: calls), and so does the command line now."""
    f = cli_run.dir / "answer.json"
    f.write_text(json.dumps(SCHEMA))
    _, kw, model = cli_run(choice, *([flag, str(f)] if flag == "--json-schema" else [flag]))
    schema = json.loads(Constraint.json_schema(json.dumps(SCHEMA)).value)   # (as the server reads it)
    answer = (schema if flag == "--json-schema" else {"type": "object"}) if choice == "auto" else None
    assert kw["constraint"] == call_grammar(HermesParser, model.tokenizer, parse_tools(TOOLS), choice, True, answer)
    if choice == "auto":
        assert kw["constraint"] != call_grammar(HermesParser, model.tokenizer, parse_tools(TOOLS), choice)


def test_a_constraint_that_is_no_json_beside_tools_is_a_usage_error(tmp_path, capsys):
    f = tmp_path / "tools.json"
    f.write_text(json.dumps(TOOLS))
    assert run_command(cli.main, ["-p", "hi", "--tools", str(f), "--regex", "[a-z]+"]) == 2
    assert capsys.readouterr().err == ("error: --regex can be combined with tools only as a JSON schema or object, "
                                       "or with --tool-choice none\n")
