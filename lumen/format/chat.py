"""Chat templates: GGUF `tokenizer.chat_template` (Jinja, Hugging Face style) + messages -> prompt text.

A chat template ships inside the model file, so it is untrusted input: it is rendered in jinja2's
ImmutableSandboxedEnvironment, and any attempt to reach Python internals (`''.__class__.__mro__`, the
`cycler.__init__.__globals__` gadgets, `|attr('__class__')`, `'{0.__class__}'.format(...)`, ...) raises
ChatTemplateError before anything runs: unlike stock jinja2, which renders an unsafe attribute as an empty
Undefined and only fails when it is called, the lookup itself fails here. Every failure of a template (syntax
error, `raise_exception(...)`, undefined call, blocked access, runaway sizes) is a ChatTemplateError.

The environment mirrors what Hugging Face transformers gives templates: trim_blocks and lstrip_blocks on, the
loopcontrols extension ({% break %}, {% continue %}), `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson`
filter that keeps non-ASCII text (ensure_ascii=False) and does not HTML-escape; it writes floats as llama.cpp does.
Whitespace is stripped as llama.cpp's template engine strips it: `trim` and a string's strip(), lstrip() and
rstrip() without an argument take only C's isspace() characters (" \t\n\v\f\r"), not Python's Unicode whitespace, so
a message ending in U+3000 or U+0085 keeps it there and here (Gemma 3's template trims every message).

Tools (OpenAI format) reach the template as llama.cpp's `llama-server --jinja` gives them, so that a conversation
renders to the same prompt there and here:
- `tools` is rebuilt as `{"type": "function", "function": {"name", "description", "parameters"}}` (description ""
  and parameters {} when missing, other keys dropped); a tool of another type is refused;
- assistant messages' `tool_calls` and `tool` messages go as given, except that a template that reads a call's
  arguments as an object (Qwen2.5's writes them with tojson) gets OpenAI's JSON-string arguments parsed, and a
  string that is not JSON is refused. Which templates: those that show a probe call's arguments when they are an
  object and not when they are a JSON string (llama.cpp probes each template for what it reads); missing or
  empty arguments are "{}".
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import LumenError

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
NO_CHAT_TEMPLATE_MESSAGE = (
    "This model has no chat template (its GGUF file has no 'tokenizer.chat_template'), so it cannot format a "
    "conversation; it is probably a base model. Use plain completion: give the prompt text as is.")
MIN_JINJA2 = (3, 1, 6)   # 3.1.5 and 3.1.6 fixed sandbox escapes through str.format (CVE-2024-56326, CVE-2025-27516)
MAX_REPEAT = 1_000_000   # longest str/list a template may build with `*`, str padding methods or filters
MAX_POW_BITS = 4096      # largest integer a template may build with `**`


class ChatTemplateError(LumenError):
    """A chat template is missing, invalid, unsafe, or failed (for instance through raise_exception)."""


class ContinueFinalError(ChatTemplateError):
    """continue_final_message cannot go on with the final message (it has no text, or tool calls)."""


class ChatMessageError(ChatTemplateError, ValueError):
    """A conversation that is not one OpenAI would take: an unknown role, content that is not text, a malformed
    tool call (the server answers it with a 400 naming the message)."""


ROLES = ("system", "developer", "user", "assistant", "tool", "function")     # OpenAI's chat roles


def check_messages(messages: list[dict]) -> None:
    """Every role one of OpenAI's (a template drops a message of a role it does not know, and the model would
    answer as if it had not been sent) but its deprecated "function" (nor an assistant's `function_call`: tool
    calls say the same), `tool_calls` only on assistant messages and well formed (type "function", ids distinct
    within the message, as OpenAI requires), and every `tool` message answers a call made before it (its
    tool_call_id), and only an assistant message without content (None: OpenAI and llama.cpp refuse it for the
    others); ChatMessageError naming the message. A call's arguments are an object or an object's JSON text ("" for
    none): a template would write any other value."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise ChatMessageError(f"messages[{i}].role {role!r} is not a chat role; OpenAI's are "
                                   f"{', '.join(ROLES)}")
        if m.get("content") is None and role != "assistant" and role != "function":
            raise ChatMessageError(f"messages[{i}].content is missing or None; a {role} message needs its text (a "
                                   "string, or a list of text parts; only an assistant's may be None)")
        if role == "function":
            raise ChatMessageError(f"messages[{i}] has role \"function\" (OpenAI's deprecated function calling), "
                                   "which is not supported: send a function's result as {\"role\": \"tool\", "
                                   "\"tool_call_id\": ..., \"content\": ...} answering an assistant's tool_calls")
        if m.get("function_call") is not None:
            raise ChatMessageError(f"messages[{i}].function_call (OpenAI's deprecated function calling) is not "
                                   "supported: send the call as tool_calls, [{\"id\", \"type\": \"function\", "
                                   "\"function\": {\"name\", \"arguments\"}}]")
        if role != "assistant" and m.get("tool_calls"):
            raise ChatMessageError(f"messages[{i}].tool_calls: only an assistant message calls tools, not a {role} "
                                   "message")
        if role == "assistant" and m.get("tool_calls") is not None:
            calls |= _check_calls(i, m["tool_calls"])
        elif role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str):
                got = "" if tid is None else f", got {type(tid).__name__} {tid!r}"
                raise ChatMessageError(f"messages[{i}] (role tool) needs a tool_call_id, the id (a string) of the "
                                       f"call it answers{got}")
            if tid not in calls:
                raise ChatMessageError(f"messages[{i}] answers tool_call_id {tid!r}, which no earlier assistant "
                                       "message called")


def _check_calls(i: int, tcs) -> set[str]:
    """The ids of messages[i]'s tool_calls, checked (check_messages)."""
    if not isinstance(tcs, list):
        raise ChatMessageError(f"messages[{i}].tool_calls must be a list")
    ids: set[str] = set()
    for j, tc in enumerate(tcs):
        if isinstance(tc, dict) and tc.get("type", "function") != "function":
            raise ChatMessageError(f"messages[{i}].tool_calls[{j}].type must be \"function\" (the only kind of "
                                   f"call this server renders), got {tc['type']!r}")
        if isinstance(tc, dict) and tc.get("id") is not None and not isinstance(tc["id"], str):
            raise ChatMessageError(f"messages[{i}].tool_calls[{j}].id must be a string, got "
                                   f"{type(tc['id']).__name__} {tc['id']!r}")
        if isinstance(tc, dict) and isinstance(tc.get("id"), str):
            if tc["id"] in ids:         # (OpenAI refuses it too: a tool message could not say which)
                raise ChatMessageError(f"messages[{i}].tool_calls[{j}].id {tc['id']!r} is the id of an earlier "
                                       "call in this message; each call needs its own")
            ids.add(tc["id"])
        f = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ChatMessageError(f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                                   f"\"function\": {{\"name\", \"arguments\"}}}}")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except (ValueError, RecursionError):            # (nested past the parser's depth)
                raise ChatMessageError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid "
                                       "JSON") from None
            if not isinstance(args, dict):
                raise ChatMessageError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON "
                                       f"object's text, got JSON {type(args).__name__}")
            try:                    # an escape such as "\ud800" decodes to a lone surrogate: not text
                json.dumps(args, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise ChatMessageError(f"messages[{i}].tool_calls[{j}].function.arguments escape a lone "
                                       "surrogate (\\ud800-\\udfff), which is not text") from None
        elif not isinstance(args, dict):
            raise ChatMessageError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON string "
                                   "or an object")
    return ids


def plain_messages(messages) -> list[dict]:
    """A conversation given to the Python API (Model.chat) as the server takes it: a non-empty list of message
    dicts, each content a string, a list of {"type": "text", "text": ...} parts (joined; an assistant's
    {"type": "refusal", "refusal": ...} parts as text, as vLLM), or None for an assistant message (""; one that
    calls tools has none); the roles and tool calls as check_messages. Copies with the content one string;
    ChatMessageError naming the message otherwise."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatMessageError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                               f"{type(messages).__name__}")
    if not messages:
        raise ChatMessageError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatMessageError(f"messages[{i}] must be a {{'role': ..., 'content': ...}} dict, got "
                                   f"{type(m).__name__}")
        out.append({**m, "content": _content_text(i, m)})
    check_messages(out)
    return [{**m, "content": m["content"] or ""} for m in out]


def _content_text(i: int, m: Mapping) -> str | None:
    """messages[i]'s content as one string (plain_messages)."""
    content, role = m.get("content"), m.get("role")
    if isinstance(content, str):
        return content
    if content is None:                                   # (check_messages says whether the role may have none)
        return None
    if not isinstance(content, (list, tuple)):
        raise ChatMessageError(f"messages[{i}].content must be a string or a list of text parts, got "
                               f"{type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = "refusal" if kind == "refusal" and role == "assistant" else "text" if kind == "text" else None
        if key is None:
            raise ChatMessageError(f"messages[{i}].content[{j}]: only text parts (and an assistant's refusal "
                                   f"parts) are supported, got {f'type {kind!r}' if kind else repr(part)[:80]}")
        if not isinstance(part.get(key), str):
            raise ChatMessageError(f"messages[{i}].content[{j}]: a {kind} part needs its {key}, a string")
        texts.append(part[key])
    text = ""
    for t in texts:                     # joined as message_text joins them (llama.cpp, vLLM)
        text += ("\n" if text else "") + t
    return text


class _TemplateRaised(Exception):
    """Raised by the template's own raise_exception(msg)."""


def _jinja2_version() -> tuple[int, ...]:
    parts = []
    for p in jinja2.__version__.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


# ---------------------------------------------------------------------------------------------------------
# the sandbox

class _Sandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment that fails on the unsafe lookup itself and bounds `*` and `**`."""

    intercepted_binops = frozenset(["*", "**"])

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, str) and attribute in ("strip", "lstrip", "rstrip"):
            return _c_strip(getattr(obj, attribute))
        return super().getattr(obj, attribute)

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                    raise SecurityError(f"a template may not build a sequence longer than {MAX_REPEAT}")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_POW_BITS:
                raise SecurityError(f"a template may not build an integer above {MAX_POW_BITS} bits")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's names)
        if isinstance(getattr(__obj, "__self__", None), str):   # 'x'.ljust(10**9) and friends
            _check_widths(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _check_widths(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and a > MAX_REPEAT:
            raise SecurityError(f"a template may not build a string longer than {MAX_REPEAT}")


def _bounded_filter(f):
    """A string filter that takes a width (center, indent, ...) with the width bounded by MAX_REPEAT."""
    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _check_widths(args[1:], kwargs)
        return f(*args, **kwargs)
    return bounded


C_SPACE = " \t\n\v\f\r"   # C's isspace(): the whitespace llama.cpp's template engine strips


def _c_strip(method):
    """A str's strip/lstrip/rstrip whose default strips C_SPACE only (llama.cpp's jinja string::strip)."""
    def strip(chars: str | None = None) -> str:
        return method(C_SPACE if chars is None else chars)
    return strip


def _trim(value: Any, chars: str | None = None) -> str:
    """jinja2's trim filter with C_SPACE as the default characters."""
    return jinja2.filters.soft_str(value).strip(C_SPACE if chars is None else chars)


def _raise_exception(message: str = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: Sequence[str] | None = None,
            sort_keys: bool = False) -> str:
    """json.dumps(value, ensure_ascii=False, ...) but for floats, written as llama.cpp's template engine writes
    them (C's %g: 5.0 -> 5, 1e-05, 3.14159), so a tool's `"default": 5.0` reads as llama-server shows it; an
    integer past int64 is a double there (10**20 -> 1e+20; one in uint64's upper half it wraps to a negative
    int64, a bug not copied here: written as a double too)."""
    item_sep, key_sep = separators if separators is not None else ("," if indent is not None else ", ", ": ")

    def dump(v: Any, level: int) -> str:
        if isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
            v = float(v)                 # past int64 llama.cpp's template engine holds a double
        if v is None or isinstance(v, (bool, int, str)):
            return json.dumps(v, ensure_ascii=False)
        if isinstance(v, float):
            return "%g" % v
        if isinstance(v, Mapping):
            items = sorted(v.items(), key=lambda kv: str(kv[0])) if sort_keys else list(v.items())
            parts = [dump(k if isinstance(k, str) else dump(k, 0), 0) + key_sep + dump(x, level + 1)
                     for k, x in items]
            return wrap("{", parts, "}", level)
        if isinstance(v, (list, tuple)):
            return wrap("[", [dump(x, level + 1) for x in v], "]", level)
        raise TypeError(f"Object of type {type(v).__name__} is not JSON serializable")

    def wrap(open_: str, parts: list[str], close: str, level: int) -> str:
        if not parts:
            return open_ + close
        if indent is None:
            return open_ + item_sep.join(parts) + close
        inner, outer = "\n" + " " * (indent * (level + 1)), "\n" + " " * (indent * level)
        return open_ + inner + (item_sep + inner).join(parts) + outer + close

    return dump(value, 0)


@functools.lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters["trim"] = _trim
    for name in ("center", "indent", "wordwrap", "truncate"):
        env.filters[name] = _bounded_filter(env.filters[name])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template once (cached by its text). Raises ChatTemplateError on a syntax error."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template must be a string, got {type(template).__name__}")
    if _jinja2_version() < MIN_JINJA2:
        raise ChatTemplateError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes; chat templates need jinja2 >= "
            f"{'.'.join(map(str, MIN_JINJA2))}")
    try:
        return _environment().from_string(template)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from None


# ---------------------------------------------------------------------------------------------------------
# rendering

# the variables and helpers render_chat gives a template itself: template_kwargs may not replace them
RESERVED_TEMPLATE_VARIABLES = frozenset(["messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                         "raise_exception", "strftime_now", "continue_final_message"])


def check_template_kwargs(template_kwargs: Any) -> dict:
    """vLLM's chat_template_kwargs as render_chat takes them: a mapping of variable names (strings) to values, none
    of them a variable or helper render_chat sets itself (RESERVED_TEMPLATE_VARIABLES); ChatTemplateError else."""
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, Mapping):
        raise ChatTemplateError(f"chat_template_kwargs must be an object of template variables, got "
                                f"{type(template_kwargs).__name__}")
    for key in template_kwargs:
        if not isinstance(key, str):
            raise ChatTemplateError(f"chat_template_kwargs keys must be strings, got {key!r}")
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise ChatTemplateError(f"chat_template_kwargs may not set {key!r}: the chat template gets it from the "
                                    f"request itself (reserved: {', '.join(sorted(RESERVED_TEMPLATE_VARIABLES))})")
    return dict(template_kwargs)


def render_chat(template: str, messages: list[dict], *, bos_token: str, eos_token: str,
                add_generation_prompt: bool = True, tools: list[dict] | None = None,
                continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with a GGUF/Hugging Face chat template.

    The template sees `messages`, `tools` (None when there are none), `bos_token`, `eos_token` and
    `add_generation_prompt`, plus the helpers listed in the module docstring. A `developer` message (OpenAI's newer
    name of the system role) is a system message for a template that never names that role (Qwen2.5's would drop
    it; llama.cpp and vLLM map it the same way). A message's content may be a string, None (written as "") or a
    list of {"type": "text", "text": ...} parts; as llama.cpp does, parts are joined (`message_text`) for a template
    that reads only strings, a string becomes one part for a template that reads only parts, and a template that
    reads both gets the content as given (`_content_kinds`). Assistant messages may carry
    OpenAI `tool_calls` (arguments as a JSON string, or an object) and `tool` messages the results. The result is
    text: the caller tokenizes it with special tokens parsed, and should not add a BOS if the template already
    wrote `bos_token`. continue_final_message (with add_generation_prompt false): the text ends inside the final
    message, so that the model goes on with it (`_cut_final`); ContinueFinalError when it cannot be.
    template_kwargs: more variables for the template (vLLM's chat_template_kwargs, such as Qwen3's
    {"enable_thinking": false}), none of them one of its own (`check_template_kwargs`).
    """
    if continue_final_message and add_generation_prompt:
        raise ContinueFinalError("continue_final_message needs add_generation_prompt false")
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    tools = _openai_tools(tools)
    compiled = compile_template(template)
    context = dict(check_template_kwargs(template_kwargs), bos_token=bos_token, eos_token=eos_token,
                   add_generation_prompt=bool(add_generation_prompt), tools=tools)
    text = _render(compiled, _template_messages(template, messages), **context)
    return _cut_final(template, messages, text, context) if continue_final_message else text


def _template_messages(template: str, messages: Sequence[Mapping]) -> list:
    """The messages as the template gets them (render_chat's docstring)."""
    messages = list(messages)
    if "developer" not in template:      # OpenAI's newer name of the system role, for a template that lacks it
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    string_ok, parts_ok = _content_kinds(template)
    messages = [_with_content(m, string_ok, parts_ok) for m in messages]
    if any(m.get("tool_calls") for m in messages):
        messages = [_with_arguments(m) for m in messages]
        if _wants_object_arguments(template):
            messages = [_with_object_arguments(m) for m in messages]
    return messages


_FINAL_NEEDLE = "\ufdd2final\ufdd3"   # stands in for the final message's text (noncharacters: in no real text)


def _cut_final(template: str, messages: Sequence[Mapping], rendered: str, context: dict) -> str:
    """The rendered conversation cut inside its final message. What the template writes after that message's text
    is found by rendering the conversation once more with a needle as that text; cut off, the rendered text ends
    with the message's, and `continue_final` cuts right after it (so text that looks like the template's own
    markup, "<|im_end|>", is still the message's). A text of only whitespace then continues where the template
    put it, as llama-server does. When the template does not write the rest the same way, `continue_final` looks
    for the text from the end."""
    if not messages:
        raise ContinueFinalError("there is no final message to continue")
    if messages[-1].get("tool_calls"):                  # (llama-server refuses it too)
        raise ContinueFinalError("the final message has tool calls, so it cannot be continued")
    final = message_text(messages[-1].get("content"))
    if not isinstance(final, str):
        raise ContinueFinalError("the final message to continue must have text content")
    probe = [*messages[:-1], {**messages[-1], "content": _FINAL_NEEDLE}]
    marked = _render(compile_template(template), _template_messages(template, probe), **context)
    if marked.count(_FINAL_NEEDLE) == 1:
        tail = marked[marked.index(_FINAL_NEEDLE) + len(_FINAL_NEEDLE):]
        if rendered.endswith(tail):
            rendered = rendered[:len(rendered) - len(tail)]
            if not final.strip():
                return rendered
    return continue_final(rendered, final)


def _openai_tools(tools) -> list[dict] | None:
    """OpenAI function tools as llama.cpp hands them to a template (see the module docstring); None for none."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatTemplateError("tools must be a list of {'type': 'function', 'function': {...}} dicts")
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping) \
                or not isinstance(fn.get("name"), str):
            raise ChatTemplateError(f"a tool must be {{'type': 'function', 'function': {{'name': ..., ...}}}}, "
                                    f"got {str(t)[:200]}")
        out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""),
                                                      "parameters": fn.get("parameters", {})}})
    return out or None


def _render(compiled: jinja2.Template, messages: list, /, **context) -> str:
    try:
        return compiled.render(messages=messages, **context)
    except _TemplateRaised as e:
        raise ChatTemplateError(f"the chat template refused the conversation: {e}") from None
    except SecurityError as e:
        raise ChatTemplateError(f"the chat template tried something unsafe and was stopped: {e}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None
    except RecursionError:
        raise ChatTemplateError("the chat template failed: recursion too deep") from None
    except Exception as e:  # a template is untrusted code: whatever it breaks is the template's error
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None


def continue_final(rendered: str, final: str) -> str:
    """A conversation rendered without the generation prompt, cut right after the text of its final message
    (`final`), so that the model goes on with that message instead of closing it: vLLM's continue_final_message,
    as transformers cuts it. The text is found from the end, without its surrounding whitespace (a template may
    trim it); whitespace after it stays when the template kept it. ChatTemplateError when `final` has no text or
    the rendered conversation does not hold it (the template changed it)."""
    core = final.strip()
    if not core:
        raise ContinueFinalError("the final message has no text to continue")
    at = rendered.rfind(core)
    if at < 0:
        raise ContinueFinalError("the final message's text does not appear in the conversation the chat template "
                                "renders, so it cannot be continued")
    kept = final.lstrip()
    end = at + (len(kept) if rendered.startswith(kept, at) else len(core))
    return rendered[:end]


def message_text(content: Any) -> Any:
    """A message's content as the template gets it from llama-server: None as "", a list of text parts as their
    texts joined by "\n" (none before the first non-empty one, as llama.cpp's common_chat_msgs_to_json_oaicompat
    writes them; vLLM joins by "\n" too), anything else as given. A part that is not text is a ChatTemplateError:
    this engine reads text only."""
    if content is None:
        return ""
    if not isinstance(content, (list, tuple)):
        return content
    text = ""
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(f"only text content parts are supported, got {kind!r}")
        if text:
            text += "\n"
        text += part["text"]
    return text


def _with_content(message: Mapping, string_ok: bool, parts_ok: bool) -> Mapping:
    """The message with its content as llama-server hands it to a template that reads strings (string_ok), content
    parts (parts_ok), or both: None is "", then parts are joined for a strings-only template and a string is one text
    part for a parts-only one."""
    if "content" not in message:
        return message
    content = message["content"]
    if content is None:
        content = ""
    if isinstance(content, (list, tuple)):
        text = message_text(content)                       # (checks that every part is text)
        content = text if string_ok and not parts_ok else [{"type": "text", "text": p["text"]} for p in content]
    elif isinstance(content, str) and parts_ok and not string_ok:
        content = [{"type": "text", "text": content}]
    return {**message, "content": content}


_CONTENT_NEEDLE = "__user__"


@functools.lru_cache(maxsize=32)
def _content_kinds(template: str) -> tuple[bool, bool]:
    """(reads strings, reads parts): whether a user's text shows when the content is a string, and when it is a
    list of text parts (shown as text, not as the list's repr), as llama.cpp probes a template's capabilities."""
    def shows(content) -> bool:
        try:
            out = _render(compile_template(template), [{"role": "user", "content": content}], bos_token="",
                          eos_token="", add_generation_prompt=False, tools=None)
        except ChatTemplateError:
            return False
        return _CONTENT_NEEDLE in out and not any(f"{q}text{q}: {q}{_CONTENT_NEEDLE}" in out for q in "'\"")

    return shows(_CONTENT_NEEDLE), shows([{"type": "text", "text": _CONTENT_NEEDLE}])


_NEEDLES = ('"argument_needle":', "'argument_needle':", "<parameter=argument_needle>")


@functools.lru_cache(maxsize=32)
def _wants_object_arguments(template: str) -> bool:
    """Whether the template shows a tool call's arguments only when they are an object, not a JSON string: one
    probe call rendered both ways (as llama.cpp's minja did; its newer engine records what the template reads,
    which gives the same answer for templates that write the arguments with tojson)."""
    def shows(arguments) -> bool:
        call = {"id": "call_1___", "type": "function", "function": {"arguments": arguments, "name": "ipython"}}
        msgs = [{"role": "user", "content": "Hey"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
        try:
            out = _render(compile_template(template), msgs, bos_token="", eos_token="", add_generation_prompt=False,
                          tools=None)
        except ChatTemplateError:
            return False
        return any(n in out for n in _NEEDLES)

    args = {"argument_needle": "print('Hello, World!')"}
    return not shows(json.dumps(args)) and shows(args)


def _map_calls(message: Mapping, fix) -> Mapping:
    """The message with each tool call's function mapping replaced by fix(function)."""
    calls = message.get("tool_calls")
    if not calls or not isinstance(calls, (list, tuple)):
        return message
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        out.append({**call, "function": fix(fn)} if isinstance(fn, Mapping) else call)
    return {**message, "tool_calls": out}


def _with_arguments(message: Mapping) -> Mapping:
    """The message with each tool call's missing or empty arguments as "{}" (a call of a function that takes
    none; the template would otherwise write an undefined value or fail on it)."""
    return _map_calls(message, lambda fn: {**fn, "arguments": "{}"} if fn.get("arguments") in (None, "") else fn)


def _with_object_arguments(message: Mapping) -> Mapping:
    """The message with its tool calls' JSON-string arguments parsed; a string that is not JSON is refused, as
    llama.cpp refuses it (the template could only show it escaped)."""
    def parse(fn: Mapping) -> Mapping:
        if not isinstance(fn.get("arguments"), str):
            return fn
        try:
            return {**fn, "arguments": json.loads(fn["arguments"])}
        except (ValueError, RecursionError) as e:           # (RecursionError: nested past the parser's depth)
            raise ChatTemplateError(f"the arguments of the tool call {fn.get('name')!r} are not JSON "
                                    f"({e}): {fn['arguments'][:200]!r}") from None
    return _map_calls(message, parse)


# ---------------------------------------------------------------------------------------------------------
# the template in the model file

def chat_template_from_metadata(meta: Mapping[str, Any]) -> str | None:
    """The model's chat template from its GGUF metadata (key 'tokenizer.chat_template'), or None if it has
    none (base models). `meta` maps keys to values: str, bytes, or gguf's ReaderField (anything with
    `.contents()`). The caller decides what to do without one; NO_CHAT_TEMPLATE_MESSAGE says it to a user."""
    value = meta.get(CHAT_TEMPLATE_KEY)
    if value is None:
        return None
    if hasattr(value, "contents"):
        value = value.contents()
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("utf-8")
    if not isinstance(value, str):
        raise ChatTemplateError(f"{CHAT_TEMPLATE_KEY} must be a string, got {type(value).__name__}")
    return value or None


def require_chat_template(meta: Mapping[str, Any]) -> str:
    """chat_template_from_metadata, raising ChatTemplateError(NO_CHAT_TEMPLATE_MESSAGE) without one."""
    template = chat_template_from_metadata(meta)
    if template is None:
        raise ChatTemplateError(NO_CHAT_TEMPLATE_MESSAGE)
    return template
