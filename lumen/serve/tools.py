"""Tool calling (OpenAI's `tools` / `tool_choice`) for the chat endpoint: the request's tools checked, the grammar
that makes a call exact, and the parsers that read calls back out of the model's text.

    tools = parse_tools(req.tools)                           # [Tool]; ApiError(400, param "tools") if malformed
    choice = parse_tool_choice(req.tool_choice, tools)       # "none" | "auto" | "required" | a tool's name
    parser = PARSERS["hermes"]()                             # one per choice of a response
    content, calls = parser.feed(delta_text)                 # content text, [ToolCallDelta]; finish() at the end
    answer = tool_answer(constraint, choice)                 # a JSON response_format's schema beside tools, or None
    constraint = call_grammar(PARSERS["hermes"], tokenizer, tools, choice, parallel, answer)   # Lark, or None

The model writes a call in its own format (Qwen2.5 / Hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n
</tool_call>`; Llama 3: the message is `{"name": ..., "parameters": {...}}`; Mistral: `[TOOL_CALLS][{...}, ...]`);
a parser is chosen from the chat template (`parser_for_template`), or by the server's --tool-call-parser. A format
is one small ToolParser subclass: its markers (tagged calls anywhere, bare calls at the start) and the key of the
arguments; the incremental reading and the grammar are shared.

The grammar (llguidance Lark): each tool's call is `%json` of {"name": const, "arguments": its parameters schema},
so a call names a declared tool and its arguments validate. `required` and a named function start with the call (a
named function: that one call only, as OpenAI and vLLM answer it); `auto` allows free text that neither contains the
open marker nor starts as a bare call (`{"name": "<a tool>"`: JSON text such as `{"name": "Bob", "age": 3}`, or a
call of no tool `{"name": "wether", "arguments": {...}}`, stays text), or such text and then the calls: a call that
starts is always well formed, and text without a call is unconstrained (the grammar's one-lexeme text rule accepts
any text that does not spell a call's start). This is llama.cpp's lazy grammar written as one grammar, whose text
lexeme is cheap to mask (profiling/tool_calling.py). With a JSON response_format, `auto` takes calls or JSON text
that follows it (the answer) instead of free text. JSON whitespace is bounded as for structured output; a call's
arguments are an object whose properties are the listed ones (`closed_objects`). A tool with `strict: true` must
have a schema llguidance enforces in full (else a 400); a non-strict tool's unenforceable keywords (uniqueItems,
...) are accepted and ignored, as structured output's "lenient".
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..engine.structured import Constraint, StructuredOutputError
from ..format.chat import ChatMessageError, check_messages as _check_messages
from ..engine.structured.constraint import JSON_WHITESPACE, checked_schema, enforceable_patterns, map_subschemas
from .protocol import ApiError

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")        # OpenAI's rule for a function name
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    """One declared function: name, description, its parameters' JSON schema (an empty parameter list when the
    request left them out), strict; shown: the parameters as the prompt shows them, as llama.cpp does: as the
    request sent them, {} when left out (Ellipsis: the parameters)."""
    name: str
    description: str | None
    parameters: dict
    strict: bool = False
    shown: Any = ...

    def openai(self) -> dict:
        """As the chat template and the fallback prompt show it (OpenAI's shape)."""
        f: dict = {"name": self.name}
        if self.description is not None:
            f["description"] = self.description
        f["parameters"] = self.parameters if self.shown is ... else self.shown
        return {"type": "function", "function": f}


def parse_tools(tools: Any) -> list[Tool]:
    """The request's `tools` -> [Tool]; ApiError(400, param "tools") naming the bad entry. Each schema is
    compiled by llguidance here, so a schema it cannot enforce is refused before the request runs."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ApiError(400, f"tools must be a list of function tools, got {type(tools).__name__}", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ApiError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        f = t.get("function")
        if not isinstance(f, dict):
            raise ApiError(400, f"{where}.function must be an object with a name", "tools")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ApiError(400, f"{where}.function.name must be 1-64 letters, digits, _ . or -, got {name!r}",
                           "tools")
        if name in seen:
            raise ApiError(400, f"{where}.function.name {name!r} is declared twice", "tools")
        seen.add(name)
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ApiError(400, f"{where}.function.description must be a string", "tools")
        params = f.get("parameters")
        if params is None:                  # OpenAI: "omitting parameters defines an empty parameter list"
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        strict = f.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ApiError(400, f"{where}.function.strict must be true or false", "tools")
        if not isinstance(params, dict):
            raise ApiError(400, f"{where}.function.parameters must be a JSON schema object", "tools")
        kind = params.get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise ApiError(400, f"{where}.function.parameters must describe an object (the call's arguments), got "
                                f"type {kind!r}", "tools")
        own = params.get("x-guidance") or {}
        if not isinstance(own, dict):
            raise ApiError(400, f"{where}.function.parameters.x-guidance must be an object", "tools")
        checked = arguments_schema(params)
        checked = checked if strict else {**checked, "x-guidance": {**own, "lenient": True}}
        try:
            Constraint.json_schema(checked)
        except StructuredOutputError as e:
            raise ApiError(400, f"{where}.function.parameters: {e}", "tools") from None
        out.append(Tool(name, desc, params, bool(strict), f.get("parameters", {})))
    return out


def arguments_schema(parameters: dict) -> dict:
    """The schema a call's arguments follow: the tool's parameters, always an object (OpenAI sends the arguments
    as a JSON object's text; a schema without a type, such as {}, would allow any JSON value)."""
    return {**parameters, "type": "object"}


def parse_tool_choice(choice: Any, tools: list[Tool]) -> str:
    """`tool_choice` -> "none", "auto", "required" or the name of the one function to call; ApiError(400,
    param "tool_choice") for an unknown value or function. OpenAI's default: "auto" with tools, else "none"."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ApiError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or "
                                f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}",
                           "tool_choice")
        if choice != "none" and not tools:
            raise ApiError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
        choice.get("function"), dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
        raise ApiError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in {t.name for t in tools}:
        known = ", ".join(t.name for t in tools) or "none"
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not in tools (declared: {known})",
                       "tool_choice")
    return name


def check_messages(messages: list[dict]) -> None:
    """lumen.format.chat.check_messages (what a conversation may hold, shared with Model.chat) as ApiError(400,
    param "messages") naming the message."""
    try:
        _check_messages(messages)
    except ChatMessageError as e:
        raise ApiError(400, str(e), "messages") from None


# --- the fallback prompt, for a chat template that does not take tools -----------------------------------------
FALLBACK_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def fallback_messages(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """The conversation for a template without tool support: the tools and the call format in the system
    message (Hermes' wording, which Qwen2.5's own template uses), assistant calls as `<tool_call>` text and tool
    results as user messages in `<tool_response>` tags."""
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            blocks = [m.get("content") or ""] if m.get("content") else []
            for tc in m["tool_calls"]:
                f = tc["function"]
                args = f.get("arguments", "{}")
                args = json.loads(args or "{}") if isinstance(args, str) else args
                blocks.append("<tool_call>\n" + json.dumps({"name": f["name"], "arguments": args},
                                                            ensure_ascii=False) + "\n</tool_call>")
            out.append({"role": "assistant", "content": "\n".join(blocks)})
        elif role == "tool":
            text = "<tool_response>\n" + (m.get("content") or "") + "\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool", None)
    if tools:
        text = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools))
        if out and out[0].get("role") in ("system", "developer"):       # (developer: OpenAI's newer name)
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# --- parsers ----------------------------------------------------------------------------------------------------
@dataclass
class ToolCallDelta:
    """A piece of one call, as OpenAI streams it: the first piece of call `index` has its id and name, the
    following ones argument text."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict:
        d: dict = {"index": self.index}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
        f: dict = {"arguments": self.arguments}
        if self.name is not None:
            f["name"] = self.name
        d["function"] = f
        return d


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (what may still become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolParser:
    """Calls in a model's text, each a JSON object {"name": ..., args_key: {...}}, in one or both of two shapes:
    - tagged (`open` set): content, then `open` JSON `close` blocks, anywhere in the text (Hermes' <tool_call>);
    - bare (`leads` set): at the very start, one of `leads`, then the calls' JSON separated by `bare_sep` and ended
      by `bare_end` (Llama 3's `{...}; {...}`, Mistral's `[{...}, {...}]`, Qwen2.5-Coder's ```json fence).
    Whitespace is free around the markers. Arguments written as a JSON string ("{\\"a\\": 1}") are sent as the
    string's text, as llama.cpp reads them. A call read whole (its end in the same text as its start, as the server
    reads a non-streamed answer) that is no call ({"name": str, args: an object or its text}) is text: the grammar
    only lets a cut call (max_tokens) through, and a stream sends a call's name before its end.
    Incremental: feed() text deltas, finish() at the end; the same deltas whether the text comes at once or a token
    at a time (for calls that parse). A subclass names its format in the class attributes,
    which also shape the grammar."""
    open: str | None = "<tool_call>"
    close = "</tool_call>"
    args_key = "arguments"
    separator = "\n"                           # tagged: between two blocks, and around the JSON in one
    leads: tuple[str, ...] | None = ("", "```\n", "```json\n")    # bare: what may come before the first call
    bare_sep = ""                              # bare: between two calls, besides whitespace
    bare_end = "```"                           # bare: after the last call ("": nothing)
    bare_end_required = False                  # ... which the grammar then asks for
    marker: str | None = None                  # a token that may start the calls, shown as nothing when special

    def __init__(self, names=None, calls_only: bool = False):
        """names: the declared tools' names, if known: a bare call (JSON text) naming another is text. calls_only:
        the grammar allows calls only (tool_choice required or a named function), so what finish() holds back
        outside a call (a marker cut by max_tokens, "<tool_" of several tokens) is no content either."""
        self.names = frozenset(names) if names is not None else None
        self.calls_only = calls_only
        self._buf = ""
        self._scan = None                      # where _close_at / _bare_end stopped in buf, to go on from there
        self.in_call = False
        self.n_calls = 0
        self.head_done = False                 # the call's name is out; its arguments stream
        self.sent_args = 0                     # characters of the current call's arguments sent
        self.held_ws = ""                      # content whitespace held back (dropped next to a call)
        self.bare_ok = self.leads is not None  # content so far is whitespace: bare calls may start
        self.is_bare = False                   # the current call is bare JSON (no markers)
        self.lead = ""                         # ... and the text before its JSON (a fence, a separator)
        self.cut = False                       # finish(): the text ended inside a call's arguments
        self.group = False                     # after a bare call: another one, or the group's end, may follow
        self.after_call = False                # no content since the last call ended
        self._name = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
        self._head = re.compile(self._name.pattern + r'\s*,\s*"' + re.escape(self.args_key) + r'"\s*:\s*(?=\S)')
        self._head_cut = re.compile(self._name.pattern + r'\s*,\s*"' + re.escape(self.args_key) + r'"\s*:\s*$')
        close = "|".join(re.escape(self.close[:k]) for k in range(len(self.close), 0, -1)) if self.open else ""
        self._tail = re.compile(r"\s*(\}\s*(" + close + r")?)?$" if close else r"\s*(\}\s*)?$")
        self._outside = re.compile('"|' + re.escape(self.close[0])) if self.open else None
        leads = self.leads or ()
        self._first = re.compile(r"\s*(?:" + "|".join(_loose(s) for s in leads) + r")\s*(?=" + _CALL + ")")
        self._next = re.compile(r"\s*" + _loose(self.bare_sep) + r"\s*(?=" + _CALL + ")")
        self._end = re.compile(r"\s*" + _loose(self.bare_end)) if self.bare_end else None
        self._first_targets = [_compact(s) + '{"name":' for s in leads]
        self._next_targets = [_compact(self.bare_sep) + '{"name":'] + ([_compact(self.bare_end)] if self.bare_end
                                                                        else [])

    @property
    def made_calls(self) -> bool:
        return self.n_calls > 0

    @property
    def buf(self) -> str:
        """The text not yet given out. feed() appends to it; every other change cuts its front, so a scan of it
        starts again (one per call and part of a call: each chunk's scan goes on from where the last one stopped,
        instead of reading a long call's whole text again for every token)."""
        return self._buf

    @buf.setter
    def buf(self, text: str) -> None:
        self._buf, self._scan = text, None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content text and call deltas that `text` (appended to what came before) completes."""
        self._buf += text
        content, calls = [], []
        while True:
            if not self.in_call:
                if self.group:                              # after a bare call: the next, the end, or neither
                    m = self._next.match(self.buf)
                    if m:
                        self._start_bare(m.end())
                        continue
                    m = self._end.match(self.buf) if self._end else None
                    if m:
                        self.buf, self.group = self.buf[m.end():], False
                        continue
                    if _undecided(self.buf, self._next_targets):
                        break
                    self.group = False
                if self.bare_ok:                            # bare calls where content would start?
                    m = self._first.match(self.buf)
                    if m:
                        self._start_bare(m.end())
                        continue
                    if _undecided(self.buf, self._first_targets):
                        break
                    self.bare_ok = False
                i = self.buf.find(self.open) if self.open else -1
                if i < 0:
                    keep = _partial_suffix(self.buf, self.open) if self.open else 0
                    out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    content.append(self._content(out, final=False))
                    break
                content.append(self._content(self.buf[:i], final=False))
                self.lead, self.held_ws = self.held_ws, ""  # whitespace next to a call is not content (unless no call)
                self.buf = self.buf[i + len(self.open):]
                self.in_call, self.head_done, self.sent_args = True, False, 0
            else:
                if self.is_bare:                            # the call ends where its JSON object does
                    j = self._bare_end(1 if self.head_done else 0)
                else:                                       # (a close marker in a JSON string is its text)
                    j = self._close_at()
                body = self.buf if j < 0 else self.buf[:j]
                if not self.head_done:
                    m = self._head.match(body)
                    if j >= 0 and (m is None or not self._plain(body)):
                        # the whole call at once: another key order, arguments as a JSON string, or no call
                        whole = self._whole(body)
                        if whole is None:                   # not a call after all: text
                            bare = self.is_bare
                            text = self.lead + (body if bare else self.open + body + self.close)
                            self.buf = self.buf[j + (0 if bare else len(self.close)):]
                            self.in_call = self.is_bare = self.bare_ok = self.group = False
                            content.append(self._content(text, final=False))
                            continue
                        calls.append(whole)
                        self._end_call(j)
                        continue
                    if m is None:
                        break
                    name = _json_string(m.group(1))
                    if self.is_bare and not self._declared(name):     # JSON text that names no tool
                        text, self.buf = self.lead + self.buf, ""
                        self.in_call = self.is_bare = self.bare_ok = self.group = False
                        content.append(self._content(text, final=False))
                        continue
                    calls.append(ToolCallDelta(self.n_calls, f"call_{uuid.uuid4().hex[:24]}", name))
                    self.head_done = True
                    self.buf = self.buf[m.end():]
                    continue
                if self.sent_args == 0 and self.buf.startswith('"'):
                    # the arguments as a JSON string ("{\\"a\\": 1}"): held to the call's end, then sent as
                    # their text (as llama.cpp reads them); a client parses a call's arguments as an object
                    if j < 0:
                        break
                    end = self.buf[:j].rstrip()
                    end = end[:-1].rstrip() if end.endswith("}") else end
                    try:
                        text = json.loads(end)
                    except ValueError:
                        text = end
                    text = (text or "{}") if isinstance(text, str) else end
                    calls.append(ToolCallDelta(self.n_calls, arguments=text))
                    self._end_call(j)
                    continue
                if j < 0:                                     # stream arguments, holding back a possible end
                    tail = self._tail.search(self.buf, self._tail_from())
                    upto = tail.start() if tail else len(self.buf)
                else:
                    end = self.buf[:j].rstrip()
                    upto = len(end) - 1 if end.endswith("}") else len(end)
                    upto = len(self.buf[:upto].rstrip())
                if upto > self.sent_args:
                    calls.append(ToolCallDelta(self.n_calls, arguments=self.buf[self.sent_args:upto]))
                    self.sent_args = upto
                if j < 0:
                    break
                self._end_call(j)
        return "".join(content), _merge(calls)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is held back, at the end of the text: a partial marker as content, an unclosed call's rest."""
        content, calls = "", []
        if self.in_call:
            end = _object_end(self.buf, 1) if self.head_done else None    # the call's JSON ended, its close not
            rest = self.buf if end is None else self.buf[:end - 1].rstrip()
            if self.head_done:
                if len(rest) > self.sent_args:
                    calls.append(ToolCallDelta(self.n_calls, arguments=rest[self.sent_args:]))
            elif self._cut_call():
                # a call cut before its arguments (after its open marker, after another call, at its arguments' key,
                # or naming a declared tool): its name if complete, never its markup as content
                name = self._name.match(self.buf)
                if name:
                    calls.append(ToolCallDelta(self.n_calls, f"call_{uuid.uuid4().hex[:24]}",
                                               _json_string(name.group(1))))
                    self.n_calls += 1
                self.cut = True
            else:
                content = self.lead + self.buf                  # a first bare call that never became one: text
            if self.head_done:
                self.n_calls += 1
                self.cut = end is None
        else:
            content = self._content(self.buf, final=True)
        if self.calls_only:
            content = ""
        self.buf, self.in_call, self.is_bare, self.group = "", False, False, False
        return content, calls

    def _close_at(self) -> int:
        """Where the close marker that ends the call in buf (its JSON, from outside any string) starts; -1 if none
        has come. The marker's text inside a JSON string ("print('</tool_call>')" in an argument) is the string's,
        not the call's end. Goes on from where the last scan of buf stopped, in or out of a string."""
        text, n = self._buf, len(self._buf)
        pos, in_str = self._scan or (0, False)
        while pos < n:
            m = (_IN_STRING if in_str else self._outside).search(text, pos)
            if m is None:
                pos = n
                break
            k = m.start()
            if text[k] == "\\":                   # (in a string) an escape: its character skipped
                if k + 1 == n:
                    pos = k                         # ... once it has come
                    break
                pos = k + 2
            elif text[k] == '"':
                in_str, pos = not in_str, k + 1
            elif text.startswith(self.close, k):
                self._scan = (k, False)
                return k
            elif self.close.startswith(text[k:]):   # a part of the marker at the end: read again with more
                pos = k
                break
            else:
                pos = k + 1
        self._scan = (pos, in_str)
        return -1

    def _bare_end(self, depth: int) -> int:
        """Where a bare call's JSON object ends in buf (the index after its `}`; -1 if it has not), buf starting
        inside it at `depth` (as _object_end), going on from where the last scan stopped."""
        pos, depth, in_str, esc, end = self._scan or (0, depth, False, False, None)
        if end is None:
            end, depth, in_str, esc = _object_scan(self._buf, pos, depth, in_str, esc)
            self._scan = (len(self._buf), depth, in_str, esc, end)
        return -1 if end is None else end

    def _tail_from(self) -> int:
        """Where the held-back end of streamed arguments (_tail: whitespace, a `}`, a part of the close marker)
        can start at the earliest: after buf's last character that none of them has."""
        chars = "}" + (self.close if self.open else "")
        k = len(self._buf)
        while k > self.sent_args and (self._buf[k - 1].isspace() or self._buf[k - 1] in chars):
            k -= 1
        return k

    def _declared(self, name: str) -> bool:
        return self.names is None or name in self.names

    def _cut_call(self) -> bool:
        """Whether the unfinished call head in buf, cut before its arguments, is a call (else it is text)."""
        if not self.is_bare:
            return True
        m = self._name.match(self.buf)
        if m is not None:
            name = _json_string(m.group(1))
            if not self._declared(name):
                return False
            if self.names is not None:
                return True
        return bool(self.n_calls or self._head_cut.match(self.buf))

    def _start_bare(self, at: int) -> None:
        """A bare call's JSON starts at buf[at]."""
        self.lead = self.held_ws + self.buf[:at]        # the text again, should the call turn out to be none
        self.buf, self.held_ws = self.buf[at:], ""
        self.in_call, self.is_bare, self.head_done, self.sent_args = True, True, False, 0

    def _content(self, text: str, final: bool) -> str:
        text = self.held_ws + text
        if self.after_call:                     # whitespace next to a call is not content, after it either
            text = text.lstrip()
            self.after_call = not text
        if final:
            self.held_ws = ""
            return "" if self.n_calls else text
        stripped = text.rstrip()
        self.held_ws = text[len(stripped):]
        if self.n_calls and not stripped.strip():
            return ""
        return stripped

    def _end_call(self, j: int) -> None:
        self.buf = self.buf[j + (0 if self.is_bare else len(self.close)):]
        self.group = self.is_bare
        self.in_call = self.is_bare = False
        self.n_calls += 1
        self.after_call = True

    def _whole(self, body: str) -> ToolCallDelta | None:
        """A whole call read at once (another key order, more keys, arguments as an object's JSON text); None if it
        is no call ({"name": str, args: an object or its JSON text}): malformed JSON is text, not a call."""
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (
                self.is_bare and not self._declared(obj["name"])):
            return None
        args = obj.get(self.args_key)
        if self.args_key not in obj and not self.is_bare and set(obj) == {"name"}:
            return ToolCallDelta(self.n_calls, f"call_{uuid.uuid4().hex[:24]}", obj["name"], "{}")   # no arguments
        if isinstance(args, str):
            try:
                if not isinstance(json.loads(args or "{}"), dict):
                    return None
            except (ValueError, RecursionError):
                return None
            text = args or "{}"
        elif isinstance(args, dict):
            text = json.dumps(args, ensure_ascii=False)
        else:
            return None
        return ToolCallDelta(self.n_calls, f"call_{uuid.uuid4().hex[:24]}", obj["name"], text)

    def _plain(self, body: str) -> bool:
        """Whether a whole call's text is {"name": str, args: object} and nothing else (its arguments' own text is
        then sent as written)."""
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return False
        return (isinstance(obj, dict) and set(obj) == {"name", self.args_key} and isinstance(obj["name"], str)
                and isinstance(obj[self.args_key], dict))

    # --- the grammar ----------------------------------------------------------------------------------------
    def grammar(self, tools: list[Tool], choice: str, parallel: bool = True,
                marker_id: int | None = None, answer: dict | None = None,
                open_id: int | None = None, close_id: int | None = None) -> Constraint | None:
        """The Lark constraint for `choice` over `tools` (None for "none"): see the module docstring. marker_id:
        the vocabulary's id of `marker` when it is a special token (`marker_token`), which may then start the
        bare calls (the text cannot spell it). answer: with "auto", the JSON schema of a text answer (the
        request's response_format): the output is then calls, or JSON text that follows it; open_id, the
        vocabulary's one token for the open marker (`open_token`), is then the only way to start a tagged call.
        open_id and close_id (`close_token`) are also the only way to close a call and start the next: spelled, the
        close is forced as pieces the model never saw ("<", "/tool", "_call", ">"), and the next call's "<" would
        force a call on a model that meant to write other text there (a <tool_response> it expects), call after
        call up to max_tokens."""
        if choice == "none" or not tools:
            return None
        parallel = parallel and choice in ("auto", "required")      # a named function: one call of it
        named = [t for t in tools if choice in ("auto", "required") or t.name == choice]
        answer = answer if choice == "auto" else None
        own = answer.get("x-guidance") if answer is not None else None
        lenient = not all(t.strict for t in named) or (isinstance(own, dict) and own.get("lenient") is True)
        xg = {"whitespace_pattern": JSON_WHITESPACE, "lenient": lenient}
        params = [checked_schema(arguments_schema(t.parameters)) for t in named]
        params = [p if t.strict else enforceable_patterns(p) for p, t in zip(params, named)]
        tagged = self.open is not None
        bare = self.leads is not None and (choice == "auto" or not tagged)
        ws = JSON_WHITESPACE
        lines = []
        defs = {}                             # parameters with local $refs, moved under the call's $defs
        for i, p in enumerate(params):
            moved = _rebased(p, f"#/$defs/tool{i}")
            if moved != _rebased(p, "#"):
                defs[f"tool{i}"] = moved
        objects = [{"type": "object", "properties": {"name": {"const": t.name}, self.args_key: {
            "$ref": f"#/$defs/tool{i}"} if f"tool{i}" in defs else params[i]},
            "required": ["name", self.args_key], "additionalProperties": False} for i, t in enumerate(named)]
        if answer is not None:
            return self._answer_grammar(objects, defs, xg, answer, parallel, marker_id, open_id, close_id)
        open_ = f"<[{int(open_id)}]>" if open_id is not None else json.dumps(self.open)
        close = f"<[{int(close_id)}]>" if close_id is not None else json.dumps(self.close)
        if tagged:
            schema: dict = {"x-guidance": xg, "anyOf": objects}
            if len(named) == 1:
                schema = {"x-guidance": xg, **objects[0]}
            if defs:
                schema["$defs"] = defs
            sep = json.dumps(self.separator)
            lines += [f"body: %json {json.dumps(schema, ensure_ascii=False)}",
                      f"rest: {sep} body {sep} {close}",
                      f"more: ({sep} {open_} rest)*" if parallel else "more: \"\""]
        if bare:
            call = f'\\{{{ws}"name"{ws}:{ws}'
            end = (" BARE_END" + ("" if self.bare_end_required else "?")) if self.bare_end else ""
            mark = f"<[{int(marker_id)}]>? " if marker_id is not None else ""
            more = " (BARE_NEXT bare_rest)*" if parallel else ""
            # a lead that opens a block (Hermes' ```json fence) is closed by bare_end, even where a bare call
            # without a lead may go without it: else the model may write past its calls' end before the fence's
            opening = [s for s in self.leads if s] if self.bare_end and not self.bare_end_required else []
            groups = [("BARE", [s for s in self.leads if s not in opening], end), ("FENCE", opening, " BARE_END")]
            groups = [g for g in groups if g[1]]
            # the first call's lexeme runs to its tool's name, so that text starting {"name": "<no tool>" is text
            lines += ["bare: " + " | ".join(f"{mark}{g.lower()}_first{more}{e}" for g, _, e in groups),
                      f"BARE_NEXT: /{ws}{_lark_re(self.bare_sep)}{ws}{call}/",
                      f"BARE_END: /{ws}{_lark_re(self.bare_end)}/",
                      "bare_rest: " + " | ".join(f"{json.dumps(json.dumps(t.name))} tail_{i}"
                                                 for i, t in enumerate(named))]
            for g, ls, _ in groups:
                leads = "|".join(_lark_re(s) for s in ls if s)
                leads = f"({leads})" + ("?" if "" in ls else "") if leads else ""
                lines += [f"{g.lower()}_first: " + " | ".join(f"{g}_FIRST_{i} tail_{i}" for i in range(len(named)))]
                lines += [f"{g}_FIRST_{i}: /{leads}{ws}{call}{_lark_re(json.dumps(t.name))}/"
                          for i, t in enumerate(named)]
            for i, t in enumerate(named):
                args = {"x-guidance": xg, **params[i]}
                lines += [f"tail_{i}: /{ws},{ws}\"{self.args_key}\"{ws}:{ws}/ args_{i} /{ws}\\}}/",
                          f"args_{i}: %json {json.dumps(args, ensure_ascii=False)}"]
        after = ""                          # what may follow the bare calls besides whitespace
        if bare and parallel and not self.bare_end_required:
            # text that starts no call: a model that goes on past its calls (Qwen2.5-Coder writes the result it
            # expects, `{"result": ...}`) is not forced into one more call at its `{`; the parser reads it as content
            after = " (TRAIL | AFTER)?"
            starts = "|".join([_loose(self.bare_sep)] + [_loose(s) for s in self.leads if s.strip()])
            lines.append(f"AFTER: /[ \\t\\r\\n]*[^ \\t\\r\\n](.|\\n)*/ & ~/\\s*({starts})\\s*\\{{\\s*\"name\"(.|\\n)*/"
                         + (f" & ~/(.|\\n)*{_lark_re(self.open)}(.|\\n)*/" if tagged else ""))
        if choice == "auto":
            text = "/(.|\\n)*/"
            if tagged:                      # text never spells the open marker ...
                text += f" & ~/(.|\\n)*{_lark_re(self.open)}(.|\\n)*/"
            if self.leads is not None:      # ... nor starts as a bare call would (as the parser reads one): naming
                # a tool. One that names no tool is text even with arguments next (the parser, which knows the
                # tools, reads it so): refused, the model already past its name would spell the key wrong
                # ({"name": "schedule_meeting", "arguments': ...}) and the text would be no JSON at all
                loose = "|".join(_loose(s) for s in self.leads)
                names = "|".join(_lark_re(json.dumps(t.name)) for t in named)
                text += f" & ~/\\s*({loose})\\s*\\{{\\s*\"name\"\\s*:\\s*({names})(.|\\n)*/"
                # ... nor starts with "{{": Qwen2.5-Coder sometimes doubles a bare call's braces ({{"name": ...}}),
                # which would pass as text; masked, it writes the call
                text += f" & ~/\\s*({loose})\\s*\\{{\\s*\\{{(.|\\n)*/"
            lines = ["start: TEXT" + (" | TEXT_OPEN rest more TRAIL?" if tagged else "")
                     + ((" | bare" + (after or " TRAIL?")) if bare else ""),
                     f"TEXT: {text}"] + ([f"TEXT_OPEN: ({text}) {json.dumps(self.open)}"] if tagged else []) + lines
        else:
            start = f"{open_} rest more TRAIL?" if tagged else "bare" + (after or " TRAIL?")
            lines = [f"start: {start}"] + lines
        return _lark(lines)

    def _answer_grammar(self, objects: list[dict], defs: dict, xg: dict, answer: dict, parallel: bool,
                        marker_id: int | None, open_id: int | None, close_id: int | None) -> Constraint:
        """"auto" with a response_format: calls, or a JSON answer. A bare call with no lead and the answer are
        both JSON objects, so they are one %json (anyOf the answer and the calls; then one call only): llguidance's
        lexer is greedy, and a bare call's own lexeme beside the answer's would cut the answer off at its first
        key. Tagged calls, and bare calls after a lead (Mistral's `[`), stay beside the answer. The open marker is
        its one token when the vocabulary has it: spelled, its first character "<" would force a call on a model
        that meant to write other text there (Qwen2.5-Coder echoing "<tool_response>" after a tool's result)."""
        ws = JSON_WHITESPACE
        own = {k: v for k, v in answer.items() if k != "x-guidance"}
        body = {"x-guidance": xg, "anyOf": objects, **({"$defs": defs} if defs else {})}
        alts = ["first TRAIL?"]
        if self.leads is not None and "" in self.leads:
            merged = {"x-guidance": xg, "anyOf": [{"$ref": "#/$defs/answer"}, *objects],
                      "$defs": {**defs, "answer": _rebased(own, "#/$defs/answer")}}
            lines = [f"first: %json {json.dumps(merged, ensure_ascii=False)}"]
        else:
            lines = [f"first: %json {json.dumps({'x-guidance': xg, **own}, ensure_ascii=False)}"]
            if self.leads is not None:
                mark = f"<[{int(marker_id)}]>? " if marker_id is not None else ""
                leads = "|".join(_lark_re(x) for x in self.leads)
                alts.append(f"{mark}LEAD call (SEP call)* END TRAIL?" if parallel else f"{mark}LEAD call END TRAIL?")
                lines += [f"LEAD: /({leads}){ws}/", f"SEP: /{ws}{_lark_re(self.bare_sep)}{ws}/",
                          f"END: /{ws}{_lark_re(self.bare_end)}/",
                          f"call: %json {json.dumps(body, ensure_ascii=False)}"]
        if self.open is not None:
            sep = json.dumps(self.separator)
            mark = f"<[{int(open_id)}]>" if open_id is not None else json.dumps(self.open)
            alts.append(f"{mark} rest more TRAIL?")
            lines += [f"body: %json {json.dumps(body, ensure_ascii=False)}",
                      f"rest: {sep} body {sep} " + (f"<[{int(close_id)}]>" if close_id is not None
                                                    else json.dumps(self.close)),
                      f"more: ({sep} {mark} rest)*" if parallel else "more: \"\""]
        return _lark(["start: " + " | ".join(alts), *lines])


def _lark(lines: list[str]) -> Constraint:
    lines = [*lines, f"TRAIL: /{TRAIL}/"]       # whitespace after the calls (a token "}}\n"), then the end
    try:
        return Constraint.lark("\n".join(lines) + "\n")
    except StructuredOutputError as e:
        raise ApiError(400, f"tools: {e}", "tools") from None


_CALL = r'\{\s*"name"\s*:'                     # where a bare call's JSON starts
_IN_STRING = re.compile(r'[\\"]')                  # in a JSON string: where an escape or its end may be
TRAIL = r"[ \t\r\n]{1,4}"                        # whitespace the grammar takes after the last call
def _is_local_ref(ref: Any) -> bool:
    return isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))


def _rebased(schema: dict, at: str) -> dict:
    """`schema` moved from a document's root to the pointer `at` ("#/$defs/tool0") of another: its local `$ref`s
    ("#", "#/$defs/x") point there, and its root `$id` and `$schema` are dropped (so that they resolve against the
    new root). `at` "#" changes no ref."""
    def point(d: dict) -> dict:
        return {**d, "$ref": at + d["$ref"][1:]} if _is_local_ref(d.get("$ref")) else d
    return map_subschemas({k: v for k, v in schema.items() if k not in ("$id", "$schema")}, point)


_LARK_SPECIAL = set("\\.+*?()|[]{}^$&~-#/")


def _loose(text: str) -> str:
    """A regex for `text` with any whitespace between its characters (and none required)."""
    return r"\s*".join(re.escape(c) for c in text if not c.isspace())


def _lark_re(text: str) -> str:
    """`text` as a literal inside a llguidance Lark /regex/."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in _LARK_SPECIAL else c for c in text)


def _compact(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _undecided(text: str, targets: list[str]) -> bool:
    """Whether text (whitespace aside) may still become one of targets: a proper prefix of one."""
    c = _compact(text)
    return any(len(c) < len(t) and t.startswith(c) for t in targets)


def _object_end(text: str, depth: int) -> int | None:
    """The index after the `}` that closes the JSON object `text` is in at `depth` (0: text starts with it)."""
    return _object_scan(text, 0, depth, False, False)[0]


def _object_scan(text: str, start: int, depth: int, in_str: bool, esc: bool) -> tuple:
    """_object_end from text[start:] in the given state: (the end or None, and the state at the text's end)."""
    for k in range(start, len(text)):
        ch = text[k]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return k + 1, depth, in_str, esc
    return None, depth, in_str, esc


def _merge(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive deltas of one call as one."""
    out: list[ToolCallDelta] = []
    for c in calls:
        if out and out[-1].index == c.index and c.id is None:
            out[-1].arguments += c.arguments
        else:
            out.append(c)
    return out


class HermesParser(ToolParser):
    """Qwen2.5 / Hermes 2 Pro: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and (auto) a bare
    or ```json-fenced `{"name": ..., "arguments": ...}` at the start, as Qwen2.5-Coder writes it (llama.cpp's
    Hermes handler takes both too)."""


class Llama3Parser(ToolParser):
    """Llama 3.1-3.3's JSON tool calls: the message is `{"name": ..., "parameters": {...}}` (calls separated by
    `;`), maybe after `<|python_tag|>` (a control token in a GGUF: not shown)."""
    open = None
    marker = "<|python_tag|>"
    args_key = "parameters"
    leads = ("", "<|python_tag|>")
    bare_sep = ";"
    bare_end = ""


class MistralParser(ToolParser):
    """Mistral's (v3 tokenizer: 7B v0.3, Nemo): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; in a GGUF
    the marker is a control token, not shown, so the text starts at `[`."""
    open = None
    marker = "[TOOL_CALLS]"
    leads = ("[", "[TOOL_CALLS][")
    bare_sep = ","
    bare_end = "]"
    bare_end_required = True


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3": Llama3Parser, "mistral": MistralParser}


def shown_tools(tools: list[Tool], choice: str) -> list[Tool] | None:
    """The tools the prompt shows for `choice`: none for "none", since a model shown tools it may not call writes
    calls as text (the server and the command line alike)."""
    return tools if choice != "none" and tools else None


def tool_answer(constraint: Constraint | None, choice: str) -> dict | None:
    """The JSON schema of the text answer beside tools, from a structured-output constraint (OpenAI's reading of
    response_format with tools): under "auto" a JSON schema or object is the answer the text must follow (None
    without a constraint); "required" and a named function give a call whatever it says (None). ValueError for
    any other constraint under "auto" (call it with a choice other than "none")."""
    if constraint is None or choice != "auto":
        return None
    if constraint.kind not in ("json_schema", "json_object"):
        raise ValueError("can be combined with tools only as a JSON schema or object, or with tool_choice \"none\"")
    return json.loads(constraint.value) if constraint.kind == "json_schema" else {"type": "object"}


def call_grammar(parser: type[ToolParser], tokenizer, tools: list[Tool], choice: str, parallel: bool = True,
                 answer: dict | None = None) -> Constraint | None:
    """ToolParser.grammar as this vocabulary writes the parser's markers: each one that is a single token of it
    (marker_token, open_token, close_token: Qwen2.5's <tool_call> and </tool_call>) is written only as that token.
    The one builder of the server's and the command line's tool grammar, so both hold a model to the same calls."""
    return parser().grammar(tools, choice, parallel, marker_token(tokenizer, parser), answer,
                            open_token(tokenizer, parser), close_token(tokenizer, parser))


def marker_token(tokenizer, parser: type[ToolParser]) -> int | None:
    """The id of the parser's marker in this vocabulary when it is one token that renders as nothing (a control
    token), else None (no marker, or one the text spells)."""
    if parser.marker is None:
        return None
    ids = tokenizer.encode(parser.marker, add_bos=False, special=True)
    return ids[0] if len(ids) == 1 and tokenizer.token_bytes(ids[0]) == b"" else None


def open_token(tokenizer, parser: type[ToolParser]) -> int | None:
    """The id of the parser's open marker when the vocabulary has it as one token (Qwen2.5's <tool_call>), else
    None."""
    if parser.open is None:
        return None
    ids = tokenizer.encode(parser.open, add_bos=False, special=True)
    return ids[0] if len(ids) == 1 else None


def close_token(tokenizer, parser: type[ToolParser]) -> int | None:
    """The id of the parser's close marker when the vocabulary has it as one token (Qwen2.5's </tool_call>),
    else None."""
    if parser.open is None:
        return None
    ids = tokenizer.encode(parser.close, add_bos=False, special=True)
    return ids[0] if len(ids) == 1 else None


def parser_for_template(template: str | None, flag: str | None = None) -> str | None:
    """The parser's name: the --tool-call-parser flag ("none": no tool calling), else the format the chat template
    teaches (`<tool_call>`: hermes; `[TOOL_CALLS]`: mistral; `<|python_tag|>` or Llama 3's "parameters"
    wording: llama3), else hermes, with the fallback prompt teaching it."""
    if flag is not None:
        if flag != "none" and flag not in PARSERS:
            raise ValueError(f"unknown tool-call parser {flag!r} (known: {', '.join(PARSERS)}, none)")
        return None if flag == "none" else flag
    t = template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or '"parameters": dictionary' in t:
        return "llama3"
    return "hermes"


def template_takes_tools(template: str | None) -> bool:
    """Whether the chat template renders `tools` itself (else the fallback system prompt carries them)."""
    return template is not None and "tools" in template and "tool_call" in template


def tool_messages(template: str | None, messages: list[dict], tools: list[Tool] | None) -> tuple[list[dict], dict]:
    """The messages and render_chat keywords that show `tools` to the chat template: `tools` for a template that
    renders them itself, else the fallback system message (fallback_messages; also where the conversation holds
    calls or results to write as plain turns). The one rule of the server and of lumen.generate --tools."""
    if template_takes_tools(template):
        return messages, ({"tools": [t.openai() for t in tools]} if tools else {})
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return fallback_messages(messages, tools or []), {}
    return messages, {}


def assemble(deltas: list[ToolCallDelta]) -> list[dict]:
    """Deltas -> OpenAI's message.tool_calls (what a client that joins the stream's deltas gets)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d.index, {"id": d.id, "type": "function", "function": {"name": d.name,
                                                                                    "arguments": ""}})
        c["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def _json_string(body: str) -> str:
    """The text of a JSON string literal's body as a call head's pattern matched it (escapes decoded)."""
    return json.loads('"' + body + '"')
