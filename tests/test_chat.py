"""Chat templates: the real SmolLM2 template, a Gemma 3 style template, HF helpers, and the sandbox."""
import gguf
import pytest

from lumen.format.chat import (NO_CHAT_TEMPLATE_MESSAGE, ChatTemplateError, chat_template_from_metadata,
                        compile_template, render_chat, require_chat_template)
from lumen.errors import LumenError
from lumen.format.gguf import GGUFFile

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
