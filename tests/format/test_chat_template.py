"""Chat templates: the real SmolLM2 template, a Gemma 3 style template, HF helpers, the sandbox, and Qwen2.5-Coder's
template with tools against llama.cpp's rendering."""
import json

import gguf
import pytest

from lumen.format.chat import (NO_CHAT_TEMPLATE_MESSAGE, ChatTemplateError, chat_template_from_metadata,
                        compile_template, render_chat, require_chat_template)
from lumen.errors import LumenError
from lumen.format.gguf import GGUFFile
from goldens import DATA

SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smol_template(smollm2_path) -> str:
    return chat_template_from_metadata(GGUFFile(smollm2_path).metadata)


def render(template, messages, **kw):
    kw.setdefault("bos_token", "<bos>")
    kw.setdefault("eos_token", "<eos>")
    return render_chat(template, messages, **kw)


# ---------------------------------------------------------------------------------------------------------
# SmolLM2's own template (ChatML)

def test_smollm2_system_user_assistant(smol_template):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And 3+3?"}]
    assert render(smol_template, messages, bos_token="<|im_start|>", eos_token="<|im_end|>") == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_smollm2_default_system_message(smol_template):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert render(smol_template, messages) == (
        f"<|im_start|>system\n{SMOL_DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_smollm2_without_generation_prompt(smol_template):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render(smol_template, messages, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n")


def test_template_compiled_once(smol_template):
    assert compile_template(smol_template) is compile_template(smol_template)


# ---------------------------------------------------------------------------------------------------------
# a Gemma 3 style template (written for this test: system text folded into the first user turn,
# assistant -> model, roles must alternate)

GEMMA3_STYLE = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}
{% set prefix = messages[0]['content'] + '\n\n' %}
{% set turns = messages[1:] %}
{% else %}
{% set prefix = '' %}
{% set turns = messages %}
{% endif %}
{% for message in turns %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}
<start_of_turn>{{ role }}
{{ (prefix if loop.first else '') + message['content'] | trim }}<end_of_turn>
{% endfor %}
{% if add_generation_prompt %}
<start_of_turn>model
{% endif %}
"""


def test_gemma3_style():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi "},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}]
    assert render(GEMMA3_STYLE, messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert render(GEMMA3_STYLE, messages[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n")


def test_raise_exception_message():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render(GEMMA3_STYLE, messages)


# ---------------------------------------------------------------------------------------------------------
# the helpers Hugging Face templates expect

def test_tojson_keeps_unicode_and_html():
    out = render("{{ messages[0] | tojson }}|{{ {'b': 1, 'a': [1, 2]} | tojson(indent=1, sort_keys=true) }}",
                 [{"role": "user", "content": "héllo <b> & 'x' 日本"}])
    assert out == ('{"role": "user", "content": "héllo <b> & \'x\' 日本"}|'
                   '{\n "a": [\n  1,\n  2\n ],\n "b": 1\n}')


def test_loop_controls_strftime_and_trim():
    template = ("{% for m in messages %}\n"
                "  {% if loop.index0 == 1 %}{% continue %}{% endif %}\n"
                "  {% if loop.index0 == 3 %}{% break %}{% endif %}\n"
                "[{{ m.content }}]\n"
                "{% endfor %}\n"
                "{{ strftime_now('%Y') | length }}")
    out = render(template, [{"role": "user", "content": str(i)} for i in range(5)])
    assert out == "[0]\n[2]\n4"   # trim_blocks and lstrip_blocks leave no indentation or block newlines


def test_syntax_error():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        render("ok\n{% if %}", [])


def test_undefined_call_fails():
    with pytest.raises(ChatTemplateError):
        render("{{ nothing_here() }}", [])


def test_messages_must_be_dicts():
    with pytest.raises(ChatTemplateError):
        render("{{ messages }}", ["hello"])


# ---------------------------------------------------------------------------------------------------------
# the sandbox: templates come with the model file and are untrusted

INJECTIONS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ ''['__class__'] }}",
    "{{ ''|attr('__class__') }}",
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ joiner.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ namespace.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
    "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('touch MARKER') }}",
    "{{ strftime_now.__globals__.datetime }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ '{0.__init__.__globals__[os].system}'.format(cycler) }}",
    "{% set f = '{0.__class__}'|attr('format') %}{{ f(1) }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c(['touch', 'MARKER']) }}{% endif %}{% endfor %}",
    "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
]


@pytest.mark.parametrize("payload", INJECTIONS)
def test_injection_fails_safely(payload, tmp_path):
    marker = tmp_path / "pwned"
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError) as err:
        render(payload.replace("MARKER", str(marker)), messages)
    assert isinstance(err.value, LumenError)
    assert not marker.exists()
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("payload", [
    "{{ 'a' * 100000000 }}",
    "{{ [0] * 100000000 }}",
    "{{ 2 ** 100000000 }}",
    "{% for i in range(1000000000) %}{% endfor %}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ 'x' | center(1000000000) }}",
])
def test_runaway_sizes_fail(payload):
    with pytest.raises(ChatTemplateError):
        render(payload, [])


# ---------------------------------------------------------------------------------------------------------
# the template in the model file

def test_template_from_metadata(smol_template):
    assert smol_template.startswith("{% for message in messages %}")
    assert chat_template_from_metadata({"tokenizer.chat_template": smol_template}) == smol_template
    assert chat_template_from_metadata({"tokenizer.chat_template": smol_template.encode()}) == smol_template
    assert chat_template_from_metadata({}) is None
    with pytest.raises(ChatTemplateError) as err:
        require_chat_template({})
    assert str(err.value) == NO_CHAT_TEMPLATE_MESSAGE and "plain completion" in NO_CHAT_TEMPLATE_MESSAGE


def test_template_from_gguf_py_fields(tmp_path, smol_template):
    """gguf-py's reader fields work too (anything with .contents()). A vocabulary-free file: gguf-py's reader
    takes about 700 MB and 15-50 s on Gemma's 262144 tokens."""
    path = tmp_path / "template.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_chat_template(smol_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert chat_template_from_metadata(gguf.GGUFReader(path).fields) == smol_template


def test_base_model_has_no_template(gemma3_path):
    # the Gemma 3 270M base model ships without one: the caller falls back to plain completion
    assert chat_template_from_metadata(GGUFFile(gemma3_path).metadata) is None


# ---------------------------------------------------------------------------------------------------------
# Qwen2.5-Coder's template with tools, as llama-server --jinja renders it (tests/data/qwen2.5-chat.llamacpp.json)

def qwen_goldens() -> dict:
    return json.loads((DATA / "qwen2.5-chat.llamacpp.json").read_text(encoding="utf-8"))["models"]


QWEN_CASES = [(model, case["name"]) for model, g in qwen_goldens().items() for case in g["cases"]]


@pytest.mark.parametrize("model,case", QWEN_CASES, ids=[f"{m}-{c}" for m, c in QWEN_CASES])
def test_qwen_template_renders_as_llamacpp(model, case):
    """System, user and assistant turns, tools, assistant tool calls (arguments as OpenAI's JSON strings) and tool
    results, byte for byte as llama-server --jinja renders them."""
    g = qwen_goldens()[model]
    c = next(c for c in g["cases"] if c["name"] == case)
    got = render_chat(g["template"], c["messages"], bos_token="", eos_token="<|im_end|>",
                      add_generation_prompt=c["add_generation_prompt"], tools=c.get("tools"))
    assert got == c["prompt"]


def test_qwen_template_is_the_models(qwen05_file):
    """The template the goldens were rendered from is the one in the 0.5B's file."""
    g = qwen_goldens()["qwen2.5-coder-0.5b"]
    assert chat_template_from_metadata(GGUFFile(qwen05_file).metadata) == g["template"]


def test_tool_call_arguments_reach_an_object_template_parsed():
    """A template that writes arguments with tojson gets OpenAI's JSON-string arguments parsed (else it would
    print them as an escaped string), and refuses a string that is not JSON; one that writes them as they are gets
    the string."""
    as_json = "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }};{% endfor %}" \
              "{% endfor %}"
    as_is = as_json.replace(" | tojson", "")
    calls = [{"type": "function", "function": {"name": "f", "arguments": '{"b":1,"a":"é"}'}},
             {"type": "function", "function": {"name": "h", "arguments": {"x": [1, 2]}}}]
    messages = [{"role": "assistant", "content": None, "tool_calls": calls}]
    assert render(as_json, messages) == '{"b": 1, "a": "é"};{"x": [1, 2]};'
    assert render(as_is, messages) == "{\"b\":1,\"a\":\"é\"};{'x': [1, 2]};"
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"b":1,"a":"é"}', "the caller's dicts stay"
    bad = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "g", "arguments": "{x"}}]}]
    with pytest.raises(ChatTemplateError, match="arguments of the tool call 'g' are not JSON"):
        render(as_json, bad)
    assert render(as_is, bad) == "{x;"


def test_tools_as_llamacpp_gives_them(smol_template):
    """Tools reach the template rebuilt as llama.cpp rebuilds them; anything but a list of function tools is
    refused; no tools is None."""
    tool = {"function": {"parameters": {"type": "object"}, "name": "f", "strict": True}, "type": "function"}
    assert render("{{ tools | tojson }}", [], tools=[tool]) == (
        '[{"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object"}}}]')
    assert render("{{ tools is none }}", [], tools=[]) == "True"
    for bad in ("get_weather", [{"type": "code_interpreter"}], [{"type": "function", "function": {}}], ["f"]):
        with pytest.raises(ChatTemplateError, match="tools must be a list|a tool must be"):
            render(smol_template, [{"role": "user", "content": "hi"}], tools=bad)


def test_tojson_writes_floats_as_llamacpp():
    """C's %g, as llama.cpp's template engine writes a double (a tool's "default": 5.0 shows as 5 there)."""
    value = {"a": 5.0, "b": 0.1, "c": 1234567.0, "d": 3.14159265, "e": 1e-5, "f": [2, True, None]}
    env_out = render("{{ messages[0].v | tojson }}", [{"v": value}])
    assert env_out == '{"a": 5, "b": 0.1, "c": 1.23457e+06, "d": 3.14159, "e": 1e-05, "f": [2, true, null]}'


def test_tojson_writes_integers_past_int64_as_doubles():
    """llama.cpp's template engine holds an integer past int64 as a double: 10**20 in a tool's schema or a call's
    arguments shows as 1e+20 (llama-server --jinja b1-0c1e570, /apply-template with Qwen2.5's template, which
    writes tools with tojson); it was written as 100000000000000000000. (2**64 - 1 llama.cpp writes as -1.)"""
    big = [2**63 - 1, 2**64, -2**63, -2**63 - 1, 10**20, True]
    assert render("{{ messages[0].v | tojson }}", [{"v": big}]) == (
        "[9223372036854775807, 1.84467e+19, -9223372036854775808, -9.22337e+18, 1e+20, true]")


def test_developer_role_is_system_unless_the_template_names_it(qwen05_file, smol_template):
    """OpenAI's `developer` message is the system message for a template without that role (Qwen2.5's dropped it,
    with and without tools); a template that names the role gets it as it is."""
    qwen = chat_template_from_metadata(GGUFFile(qwen05_file).metadata)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for template in (qwen, smol_template):
        for kw in ({}, {"tools": tools} if template is qwen else {}):
            dev = render_chat(template, [{"role": "developer", "content": "Answer in French."},
                                         {"role": "user", "content": "Hi"}], bos_token="", eos_token="", **kw)
            system = render_chat(template, [{"role": "system", "content": "Answer in French."},
                                            {"role": "user", "content": "Hi"}], bos_token="", eos_token="", **kw)
            assert dev == system and "Answer in French." in dev
    own = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{# developer #}"
    assert render_chat(own, [{"role": "developer", "content": "x"}], bos_token="", eos_token="") == "[developer]x"


@pytest.mark.parametrize("args", [{}, {"arguments": ""}, {"arguments": None}])
def test_a_call_without_arguments_renders_as_empty_arguments(qwen05_file, smol_template, args):
    """A call whose arguments are missing or empty (a function that takes none) renders as {} with either kind of
    template, instead of failing on an undefined value."""
    qwen = chat_template_from_metadata(GGUFFile(qwen05_file).metadata)
    tool_calls = [{"id": "c1", "type": "function", "function": {"name": "now", **args}}]
    for template in (qwen, smol_template):
        out = render_chat(template, [{"role": "user", "content": "Time?"},
                                     {"role": "assistant", "content": "", "tool_calls": tool_calls}],
                          bos_token="", eos_token="", add_generation_prompt=False)
        if template is qwen:
            assert '{"name": "now", "arguments": {}}' in out


def test_arguments_nested_past_the_parser_are_refused():
    """Arguments nested deeper than Python's JSON parser goes are a ChatTemplateError, not a RecursionError."""
    as_json = "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}" \
              "{% endfor %}"
    deep = "[" * 100_000 + "]" * 100_000
    calls = [{"type": "function", "function": {"name": "g", "arguments": deep}}]
    with pytest.raises(ChatTemplateError, match="arguments of the tool call 'g' are not JSON"):
        render(as_json, [{"role": "assistant", "content": None, "tool_calls": calls}])


def test_continue_final_cuts_after_the_final_message():
    """transformers' and vLLM's continue_final_message: the rendered chat ends where the final message's text
    does, trailing whitespace included when the template kept it."""
    from lumen.format.chat import continue_final
    rendered = "<u>hi</u><a>The sum is </a><gen>"
    assert continue_final(rendered, "The sum is ") == "<u>hi</u><a>The sum is "
    assert continue_final("<u>hi</u><a>The sum is</a>", "The sum is \n") == "<u>hi</u><a>The sum is"
    assert continue_final("<a>is</a><a>is</a>", "is") == "<a>is</a><a>is", "the last occurrence"
    for text in ("", " \n"):
        with pytest.raises(ChatTemplateError, match="no text"):
            continue_final(rendered, text)
    with pytest.raises(ChatTemplateError, match="does not appear"):
        continue_final(rendered, "The product is")


def test_content_parts_and_none_render_as_llamacpp(smol_template):
    """Content as a list of text parts is joined by "\\n" (none before the first non-empty part) and None content is
    "", as llama-server --jinja (b1-0c1e570, /apply-template) renders SmolLM2's template; before, the template got
    the list (printed as a Python repr, or failed) and None (failed on `+`)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "system", "content": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}]},
                {"role": "user", "content": [{"type": "text", "text": t} for t in ("", "a", "", "b")]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r"}]}]
    assert render_chat(smol_template, messages, bos_token="<|im_start|>", eos_token="<|im_end|>") == (
        "<|im_start|>system\nS1\nS2<|im_end|>\n<|im_start|>user\na\n\nb<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nr<|im_end|>\n<|im_start|>assistant\n")
    assert messages[1]["content"][1] == {"type": "text", "text": "a"}, "the caller's messages stay"
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(ChatTemplateError, match="only text content parts.*'image_url'"):
        render(smol_template, [image])


@pytest.mark.parametrize("kind,expected", [("both", "<system>S <user>[a][b]<assistant><user>"),
                                            ("parts", "<system>[S ]<user>[ a ][b]<assistant>[]<user>[]")])
def test_content_as_the_template_reads_it(kind, expected):
    """A template that reads strings and parts (Gemma 3's) gets the content as given (None as ""), and one that reads
    only parts gets every string as one text part, as llama-server --jinja (b1-0c1e570, /apply-template with
    --chat-template-file) renders these two templates."""
    both = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}[{{ p.text | trim }}]{% endfor %}{% endif %}{% endfor %}")
    parts = "{% for m in messages %}<{{ m.role }}>{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "system", "content": "S "},
                {"role": "user", "content": [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": ""}]
    template = both if kind == "both" else parts
    assert render(template, messages, add_generation_prompt=False) == expected


@pytest.mark.parametrize("final", ["|im_end|>", "<|im_end|>", "   ", "Sure, "])
def test_continue_final_message_ends_inside_the_final_message(smol_template, final):
    """render_chat(continue_final_message=True) ends right after the final message's text, as llama-server --jinja
    (b1-0c1e570, /apply-template) prefills SmolLM2's template, also when the text looks like the template's own
    closing markup (found from the end, that was the template's "<|im_end|>": the turn came out closed) or is only
    whitespace (refused before)."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": final}]
    got = render_chat(smol_template, messages, bos_token="<|im_start|>", eos_token="<|im_end|>",
                      add_generation_prompt=False, continue_final_message=True)
    assert got == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + final
    with pytest.raises(ChatTemplateError, match="needs add_generation_prompt false"):
        render(smol_template, messages, continue_final_message=True)


def test_continue_final_message_with_tool_calls_is_refused(qwen05_file):
    """A final message with tool calls cannot be continued (llama-server: "Cannot continue an assistant message
    that contains tool calls"); with no text, Qwen2.5's template came out cut after "<|im_start|>assistant"."""
    qwen = chat_template_from_metadata(GGUFFile(qwen05_file).metadata)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for content in (None, "", "Let me look."):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content, "tool_calls": [call]}]
        with pytest.raises(ChatTemplateError, match="has tool calls"):
            render_chat(qwen, messages, bos_token="", eos_token="<|im_end|>", add_generation_prompt=False,
                        continue_final_message=True)


def test_continue_final_message_with_a_trimming_template():
    """A template that trims the text: the continued text is the trimmed one, its closing markup cut off."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " <end_of_turn> \n"}]
    assert render(GEMMA3_STYLE, messages, add_generation_prompt=False, continue_final_message=True) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n<end_of_turn>")


def test_trim_and_strip_take_the_whitespace_llamacpp_takes():
    """`trim` and strip()/lstrip()/rstrip() without an argument strip C's isspace() characters only, not Python's
    Unicode whitespace (U+3000, U+0085, U+2028, U+00A0 stay), as llama-server --jinja (b1-0c1e570, /apply-template
    with --chat-template-file) renders this template; before, jinja2 stripped them all (Gemma 3's template trims
    every message, so its prompts differed from llama.cpp's)."""
    template = ("{% for m in messages %}[{{ m.content | trim }}|{{ m.content.strip() }}|{{ m.content.lstrip() }}|"
                "{{ m.content.rstrip() }}|{{ m.content.strip('x') }}]{% endfor %}")
    messages = [{"role": "user", "content": "\u3000\t a\x85 \n\f\v\r"}, {"role": "user", "content": "x\u2028 y \xa0x"}]
    assert render(template, messages, add_generation_prompt=False) == (
        "[\u3000\t a\x85|\u3000\t a\x85|\u3000\t a\x85 \n\x0c\x0b\r|\u3000\t a\x85|\u3000\t a\x85 \n\x0c\x0b\r]"
        "[x\u2028 y \xa0x|x\u2028 y \xa0x|x\u2028 y \xa0x|x\u2028 y \xa0x|\u2028 y \xa0]")


def test_content_probe_ignores_the_templates_own_text():
    """A template whose own text holds '"type"' (a JSON example in its instructions) still reads strings: text
    parts are joined for it. The probe looked for "type"/"text" anywhere in the output, took the template for one
    that reads neither, and handed it the list (printed as its repr)."""
    template = '{{ \'{"type": "text"}\' }}{% for m in messages %}{{ m.content }}{% endfor %}'
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert render(template, [{"role": "user", "content": parts}]) == '{"type": "text"}a\nb'


def test_template_kwargs_are_variables_of_the_template():
    """render_chat(template_kwargs=...): vLLM's chat_template_kwargs, as variables beside the template's own; one
    that would replace those (messages, bos_token, raise_exception ...) or a non-mapping is a ChatTemplateError."""
    from lumen.format.chat import RESERVED_TEMPLATE_VARIABLES
    t = ("{% for m in messages %}{{ m.content }}{% endfor %}|{{ compiled | default('-') }}"
         "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    kw = dict(bos_token="<s>", eos_token="</s>", add_generation_prompt=False)
    assert render_chat(t, msgs, **kw) == render_chat(t, msgs, template_kwargs={}, **kw) == "hi|-"
    assert render_chat(t, msgs, template_kwargs={"enable_thinking": False}, **kw) == "hi|-<think></think>"
    assert render_chat(t, msgs, template_kwargs={"compiled": 1}, **kw) == "hi|1"
    said = [*msgs, {"role": "assistant", "content": "The"}]
    assert render_chat(t, said, template_kwargs={"enable_thinking": False}, continue_final_message=True,
                       **kw) == "hiThe"
    for key in RESERVED_TEMPLATE_VARIABLES:
        with pytest.raises(ChatTemplateError, match="may not set"):
            render_chat(t, msgs, template_kwargs={key: 1}, **kw)
    for bad in ([("enable_thinking", False)], "x", {1: True}):
        with pytest.raises(ChatTemplateError, match="chat_template_kwargs"):
            render_chat(t, msgs, template_kwargs=bad, **kw)
