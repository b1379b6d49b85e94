"""The tools of a chat request as the server shows them to Qwen2.5's template (lumen.serve.tools.parse_tools, then
Tool.openai, as lumen.serve.prompts renders them), byte for byte as llama-server --jinja renders the same request
(b1-0c1e570, POST /apply-template with Qwen2.5-Coder-0.5B's template); no model needed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lumen.format.chat import render_chat
from lumen.serve.tools import parse_tools

QWEN = json.loads((Path(__file__).parent.parent / "data" / "qwen2.5-chat.llamacpp.json").read_text())
TEMPLATE = QWEN["models"]["qwen2.5-coder-0.5b"]["template"]


def _tools_shown(tools: list[dict]) -> list[str]:
    text = render_chat(TEMPLATE, [{"role": "user", "content": "x"}], bos_token="", eos_token="<|im_end|>",
                       add_generation_prompt=True, tools=[t.openai() for t in parse_tools(tools)])
    return text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")


@pytest.mark.parametrize("function,shown", [
    ({"name": "now"}, '{"type": "function", "function": {"name": "now", "description": "", "parameters": {}}}'),
    ({"name": "now", "parameters": None},
     '{"type": "function", "function": {"name": "now", "description": "", "parameters": null}}'),
    ({"name": "now", "description": "Time.", "parameters": {}, "strict": True},
     '{"type": "function", "function": {"name": "now", "description": "Time.", "parameters": {}}}'),
])
def test_a_tool_without_parameters_is_shown_as_llamacpp_shows_it(function, shown):
    """A function without parameters is shown as the request sent it ({} when left out), as llama.cpp shows it;
    it was shown as the empty parameter list its call is held to ({"type": "object", "properties": {},
    "additionalProperties": false}), so the prompt differed from llama.cpp's."""
    assert _tools_shown([{"type": "function", "function": function}]) == [shown]
    if function.get("parameters") is None:                  # the call itself still takes no arguments
        [tool] = parse_tools([{"type": "function", "function": function}])
        assert tool.parameters == {"type": "object", "properties": {}, "additionalProperties": False}
