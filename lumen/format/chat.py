"""Chat templates: GGUF `tokenizer.chat_template` (Jinja, Hugging Face style) + messages -> prompt text.

A chat template ships inside the model file, so it is untrusted input: it is rendered in jinja2's
ImmutableSandboxedEnvironment, and any attempt to reach Python internals (`''.__class__.__mro__`, the
`cycler.__init__.__globals__` gadgets, `|attr('__class__')`, `'{0.__class__}'.format(...)`, ...) raises
ChatTemplateError before anything runs: unlike stock jinja2, which renders an unsafe attribute as an empty
Undefined and only fails when it is called, the lookup itself fails here. Every failure of a template (syntax
error, `raise_exception(...)`, undefined call, blocked access, runaway sizes) is a ChatTemplateError.

The environment mirrors what Hugging Face transformers gives templates: trim_blocks and lstrip_blocks on, the
loopcontrols extension ({% break %}, {% continue %}), `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson`
filter that keeps non-ASCII text (ensure_ascii=False) and does not HTML-escape.
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


def _raise_exception(message: str = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: Sequence[str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent,
                      separators=tuple(separators) if separators is not None else None, sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
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

def render_chat(template: str, messages: list[dict], *, bos_token: str, eos_token: str,
                add_generation_prompt: bool = True) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with a GGUF/Hugging Face chat template.

    The template sees `messages`, `bos_token`, `eos_token` and `add_generation_prompt`, plus the helpers
    listed in the module docstring. The result is text: the caller tokenizes it with special tokens parsed,
    and should not add a BOS if the template already wrote `bos_token`.
    """
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} dicts")
    compiled = compile_template(template)
    try:
        return compiled.render(messages=list(messages), bos_token=bos_token, eos_token=eos_token,
                               add_generation_prompt=bool(add_generation_prompt))
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
