"""What goes back over the wire: engine outputs in OpenAI's shapes.

    text_completion / chat.completion            a whole response (choices, usage)
    text_completion / chat.completion.chunk      one SSE event per engine output that adds something
    logprobs   completions: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}; with echo the
               prompt's tokens first (the first one's logprob and top_logprobs null), from text_offset 0.
               text_offset: where the token begins in the choice's text, in characters of that text (a
               control token takes none unless the echoed prompt holds its text; a token that begins inside a
               character is at that character)
               chat:        {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
    usage      {prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details: {cached_tokens}}; a stream
               with stream_options.include_usage ends with a chunk of it and no choices, and with vLLM's
               continuous_usage_stats too each chunk carries its choice's {prompt_tokens, completion_tokens so far}

Choice i of prompt p has index p * n + i. completion_tokens counts every generated token, the end token
included (as vLLM counts them); logprobs cover the same tokens. With return_token_ids (vLLM's extension) each
choice also carries prompt_token_ids and token_ids (in a stream: the new token ids of each chunk).

With tools (lumen.serve.tools), a chat choice's text goes through its ToolParser: the content before a call
stays content, calls become message.tool_calls ({id, type: "function", function: {name, arguments}}, arguments
a JSON string) and the finish_reason "tool_calls" (when the model ended its turn; "length" stays "length", and a
stop string that cut a call's arguments leaves "stop").
A stream sends each call as OpenAI does: a tool_calls delta with its index, id, type and name (arguments ""), then
argument fragments, one tool_calls entry a chunk, and its content is null until some comes (a choice with neither
says "" at its end). The whole response is read by the same parser, so it is what a client joining the deltas gets,
content included.
"""
from __future__ import annotations

import json
import math

from ..engine.sequence import RequestOutput
from .tools import ToolCallDelta, ToolParser, assemble

DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0            # what vLLM reports for -inf (JSON has no infinity)


def sse(obj: dict) -> str:
    return f"data: {dumps(obj)}\n\n"


def dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _lp(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


def n_chars(b: bytes) -> int:
    """The characters UTF-8 bytes begin (every byte but a continuation byte, 0b10xxxxxx, begins one)."""
    return sum((x & 0xC0) != 0x80 for x in b)


def text_offset(chars: int, b: bytes) -> int:
    """The text_offset of a token whose text is the bytes b, after `chars` characters of text: the index of the
    character its first byte belongs to (one begun before it when b starts inside a character). A control token
    (no bytes in the text) sits where the next character will."""
    return max(0, chars - 1) if b and (b[0] & 0xC0) == 0x80 else chars


class Reply:
    """One HTTP request's answer, built from its engine outputs. kind: "completion" or "chat"."""

    def __init__(self, kind: str, response_id: str, model: str, created: int, prompter, *, n: int,
                 prompts: list[list[int]], logprobs: int | None, return_token_ids: bool = False,
                 echo: list[str] | None = None, tool_parser: type[ToolParser] | None = None,
                 named_tool: bool = False, include_stop: bool = False, continuous_usage: bool = False):
        self.kind, self.id, self.model, self.created = kind, response_id, model, created
        self.prompter = prompter
        self.n, self.prompts = n, prompts
        self.logprobs = logprobs                 # None: not asked; k: top-k alternatives per token
        self.return_token_ids = return_token_ids
        self.include_stop = include_stop         # vLLM's include_stop_str_in_output
        self.continuous_usage = continuous_usage  # vLLM's continuous_usage_stats: every chunk has its usage
        self.echo = echo                         # completions: the prompt text per prompt, put before the text
        self.echo_logprobs = echo is not None and logprobs is not None   # ... with its tokens' logprobs: a stream
                                                 # sends it with each choice's first chunk, not before
        self.sent_logprobs: dict[int, int] = {}  # choice index -> logprob entries already streamed
        self.offsets: dict[int, int] = {}        # choice index -> characters of text before its next token
                                                 # (completions' text_offset)
        self.started: set[int] = set()           # choices that sent a token chunk
        self.finals: dict[int, RequestOutput] = {}
        self.tool_parser = tool_parser           # chat with tools: the parser class of the model's call format
        self.named_tool = named_tool             # tool_choice named the function: its call finishes with "stop"
        self.parsers: dict[int, ToolParser] = {}  # choice index -> its stream's parser
        self.said: set[int] = set()              # choices whose stream sent content or a call (with tools)

    @property
    def object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion"

    # ---- whole responses
    def body(self) -> dict:
        choices = [self._final_choice(i, self.finals[i]) for i in sorted(self.finals)]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def _final_choice(self, index: int, out: RequestOutput) -> dict:
        text = out.text + self._stop_text(out)
        if self.echo is not None:
            text = self.echo[index // self.n] + text
        c: dict = {"index": index}
        if self.kind == "completion":
            c["text"] = text
        else:
            c["message"] = {"role": "assistant", "content": text}
        finish = out.finish_reason
        if self.tool_parser is not None:
            parser = self.tool_parser()
            content, deltas = parser.feed(text)
            rest, more = parser.finish()
            calls = assemble(deltas + more)
            c["message"] = {"role": "assistant", "content": (content + rest) or (None if calls else "")}
            if calls:
                c["message"]["tool_calls"] = calls
                if finish == "stop" and not parser.cut and not self.named_tool:
                    finish = "tool_calls"
        self.offsets.pop(index, None)
        c["logprobs"] = self._logprobs(index, out.token_ids, out.logprobs or [], out.prompt_logprobs)
        c["finish_reason"] = finish
        c["stop_reason"] = out.stop_reason
        if self.return_token_ids:
            c["prompt_token_ids"] = out.prompt_token_ids
            c["token_ids"] = out.token_ids
        return c

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(o.token_ids) for o in self.finals.values())
        cached = sum(self.finals[p * self.n].metrics.cached_tokens for p in range(len(self.prompts))
                     if p * self.n in self.finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- streams
    def _chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
        c = {"id": self.id, "object": self.object + ("" if self.kind == "completion" else ".chunk"),
             "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            c["usage"] = usage
        return c

    def opening(self, with_usage: bool) -> list[dict]:
        """Chunks sent before any token: the assistant role (chat) or the echoed prompt (completions)."""
        out = []
        for index in range(len(self.prompts) * self.n):
            delta = None
            if self.kind == "chat":                     # with tools, content stays null until there is some
                content = None if self.tool_parser is not None else ""
                delta = {"index": index, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                         "finish_reason": None}
            elif self.echo is not None and not self.echo_logprobs:
                delta = {"index": index, "text": self.echo[index // self.n], "logprobs": None,
                         "finish_reason": None}
            if delta is not None:
                if self.return_token_ids:
                    delta["prompt_token_ids"] = self.prompts[index // self.n]
                out.append(self._chunk([delta], self._usage_so_far(index, 0), with_usage))
        return out

    def chunks(self, index: int, out: RequestOutput, with_usage: bool) -> list[dict]:
        """The events for one engine output of choice `index` (none when it adds nothing to send): one, or with
        tools one per tool_calls entry (_one_call_each)."""
        if out.finished:
            self.finals[index] = out
        want_tokens = self.logprobs is not None or self.return_token_ids
        if not (out.delta_text or out.finished or (want_tokens and out.delta_token_ids)):
            return []
        delta_text = out.delta_text + self._stop_text(out)
        c: dict = {"index": index}
        echo_now = self.echo_logprobs and index not in self.started     # the echo and its logprobs, first
        if self.kind == "completion":
            c["text"] = self.echo[index // self.n] + delta_text if echo_now else delta_text
        elif self.tool_parser is not None:
            c["delta"] = self._tool_delta(index, out, delta_text)
            if not c["delta"] and not out.finished and not want_tokens:
                return []
        else:
            c["delta"] = {"content": delta_text} if delta_text or not out.finished else {}
        entries = out.logprobs or []
        start = self.sent_logprobs.get(index, 0)
        c["logprobs"] = self._logprobs(index, out.token_ids[start:len(entries)], entries[start:],
                                       out.prompt_logprobs if echo_now else None)
        self.sent_logprobs[index] = len(entries)
        c["finish_reason"] = out.finish_reason if out.finished else None
        parser = self.parsers.get(index)
        if (out.finished and out.finish_reason == "stop" and parser is not None and parser.made_calls
                and not parser.cut and not self.named_tool):
            c["finish_reason"] = "tool_calls"
        if out.finished:
            c["stop_reason"] = out.stop_reason
        if self.return_token_ids:
            c["token_ids"] = out.delta_token_ids
            if index not in self.started and self.kind == "completion" and (self.echo is None or echo_now):
                c["prompt_token_ids"] = out.prompt_token_ids
        self.started.add(index)
        usage = self._usage_so_far(index, len(out.token_ids))
        return [self._chunk([x], usage, with_usage) for x in self._one_call_each(c)]

    def _one_call_each(self, c: dict) -> list[dict]:
        """A streamed choice whose delta holds several tool_calls entries as one choice per entry, as OpenAI
        streams them (a client may read only a chunk's tool_calls[0]): the first keeps the content, logprobs and
        token ids, the last the finish_reason."""
        calls = c.get("delta", {}).get("tool_calls") or []
        if len(calls) < 2:
            return [c]
        first = {**c, "delta": {**c["delta"], "tool_calls": calls[:1]}, "finish_reason": None}
        first.pop("stop_reason", None)
        out = [first]
        for k, tc in enumerate(calls[1:], 1):
            x: dict = {"index": c["index"], "delta": {"tool_calls": [tc]}, "logprobs": None, "finish_reason": None}
            if k == len(calls) - 1:
                x["finish_reason"] = c["finish_reason"]
                if "stop_reason" in c:
                    x["stop_reason"] = c["stop_reason"]
            if "token_ids" in c:
                x["token_ids"] = []
            out.append(x)
        return out

    def _tool_delta(self, index: int, out: RequestOutput, delta_text: str) -> dict:
        """A stream's delta through the choice's tool parser: content and/or tool_calls (empty: nothing yet)."""
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = self.tool_parser()
        content, deltas = parser.feed(delta_text)
        if out.finished:
            rest, more = parser.finish()
            content, deltas = content + rest, deltas + more
        d: dict = {}
        if content:
            d["content"] = content
        if deltas:
            d["tool_calls"] = [x.openai() for x in _name_apart(deltas)]
        if d:
            self.said.add(index)
        elif out.finished and index not in self.said:
            d["content"] = ""                     # no call and no text: "", as the whole answer says
        return d

    def _stop_text(self, out: RequestOutput) -> str:
        """With include_stop_str_in_output, the stop string that ended the output (the engine's text ends before
        it): it goes at the end of the text, as vLLM puts it."""
        if self.include_stop and out.finished and out.finish_reason == "stop" and isinstance(out.stop_reason, str):
            return out.stop_reason
        return ""

    def _usage_so_far(self, index: int, generated: int) -> dict | None:
        """With continuous_usage_stats, a chunk's usage: its choice's prompt and the tokens it generated so far
        (as vLLM counts them); else None."""
        if not self.continuous_usage:
            return None
        prompt = len(self.prompts[index // self.n])
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    def usage_chunk(self) -> dict:
        return self._chunk([], self.usage(), True)

    # ---- logprobs
    def _logprobs(self, index: int, token_ids: list[int], entries: list, prompt: list | None = None) -> dict | None:
        """The logprobs of these generated tokens of choice `index` (entries: the engine's (log p, top)), after
        those of its prompt's tokens when `prompt` (the engine's prompt_logprobs) is given."""
        if self.logprobs is None:
            return None
        piece = self.prompter.piece
        if self.kind == "chat":
            content = []
            for tok, (lp, top) in zip(token_ids, entries):
                text, b = piece(tok)
                content.append({"token": text, "logprob": _lp(lp), "bytes": list(b),
                                "top_logprobs": [{"token": piece(t)[0], "logprob": _lp(x), "bytes": list(piece(t)[1])}
                                                 for t, x in top]})
            return {"content": content}
        tokens, lps, tops, offsets = [], [], [], []

        def add(tok: int, entry, chars: int, first: bool = False, echoed: str | None = None) -> int:
            text = piece(tok)[0]
            tokens.append(text)
            b = self.prompter.text_bytes(tok)
            if first and self.prompter.tok_strips_space and b[:1] == b" ":
                b = b[1:]                        # (as the tokenizer's decode drops it)
            if not b and text and echoed is not None and echoed.startswith(text, chars):
                b = text.encode()                # a control token the echoed prompt holds as text ("<|im_start|>")
            offsets.append(text_offset(chars, b))
            if entry is None:                    # the prompt's first token: nothing before it to predict it
                lps.append(None)
                tops.append(None)
            else:
                lp, top = entry
                lps.append(_lp(lp))
                d: dict = {}
                for t, x in top:                 # tokens of one text (bytes shown as U+FFFD): the likeliest's
                    d.setdefault(piece(t)[0], _lp(x))
                d[text] = _lp(lp)                # the token itself is always there (OpenAI's legacy format)
                tops.append(d)
            return chars + n_chars(b)
        if prompt is not None:
            chars, echoed = 0, self.echo[index // self.n] if self.echo is not None else None
            for i, (tok, entry) in enumerate(zip(self.prompts[index // self.n], prompt)):
                chars = add(tok, entry, chars, first=i == 0, echoed=echoed)
        chars = self.offsets.get(index, len(self.echo[index // self.n]) if self.echo is not None else 0)
        for tok, entry in zip(token_ids, entries):
            chars = add(tok, entry, chars)
        self.offsets[index] = chars
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _name_apart(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """A call's first delta (its id and name) with arguments "", its argument text in the next, as OpenAI and vLLM
    stream a call: a client that starts a call on its id and appends the arguments of the deltas without one
    loses no text."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if d.id is not None and d.arguments:
            out += [ToolCallDelta(d.index, d.id, d.name, ""), ToolCallDelta(d.index, arguments=d.arguments)]
        else:
            out.append(d)
    return out
