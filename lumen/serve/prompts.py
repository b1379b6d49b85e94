"""Prompts as the engine takes them: token ids from a completion prompt, or from a conversation rendered with the
chat template (the GGUF's, or --chat-template's), tokenized as llama-server and vLLM tokenize:

- text is tokenized with the model's BOS default, and special-token text in it ("<|im_start|>") is parsed as
  those tokens (both servers do; lumen.generate does it only for --chat or --special);
- a rendered conversation that already starts with the BOS text gets no second BOS.
A text too long to fit max_model_len however it tokenizes is refused before tokenizing. The app tokenizes in a
worker thread, but the tokenizer holds the GIL while it encodes (the event loop stalls meanwhile), so a prompt of
more than PROBE_CHARS characters per context token is first tokenized by growing prefixes and refused at the first
that already holds more than max_model_len tokens: what a prompt far past the context costs is bounded by the
context, not by the request body.

Tools (lumen.serve.tools) go to a template that renders them itself (Qwen2.5's: it mentions `tools` and
`tool_call`) with the conversation's tool calls and tool messages as they are; any other template gets the
fallback: the tools and the call format in the system message, calls and results as plain text turns.
"""
from __future__ import annotations

from ..format.chat import (ChatTemplateError, ContinueFinalError, NO_CHAT_TEMPLATE_MESSAGE, check_template_kwargs,
                           compile_template, message_text, render_chat)
from .protocol import ApiError, ChatMessage
from .tools import Tool, check_messages, tool_messages

PROBE_CHARS = 8         # characters per context token past which a prompt is counted by its prefixes first
PROBE_SLACK = 64        # tokens a cut prefix may have beyond the whole text's (a split word or special token)


class Prompter:
    def __init__(self, tokenizer, chat_template: str | None, max_model_len: int):
        """chat_template: the template text (None: the model has none, chat requests are refused)."""
        self.tok = tokenizer
        self.max_model_len = max_model_len
        # a text longer than this many characters makes more than max_model_len tokens: refused untokenized
        longest = max(len(tokenizer.token_bytes(i, special=True)) for i in range(tokenizer.n_vocab))
        self.max_chars = max_model_len * max(1, longest)
        self.max_model_len = max_model_len
        self.template = chat_template
        if chat_template is not None:
            compile_template(chat_template)             # a bad --chat-template fails at startup
        self.bos_text = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        self.eos_text = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        self._pieces: dict[int, tuple[str, bytes]] = {}
        self._text_bytes: dict[int, bytes] = {}
        # the tokenizer's decode drops one leading space of the first piece (SentencePiece's add_space_prefix)
        self.tok_strips_space = bool(getattr(tokenizer, "add_space_prefix", False))

    def encode(self, text: str, *, add_special: bool = True, param: str = "prompt", special: bool = True,
               shielded: bool = False) -> list[int]:
        if len(text) > self.max_chars:
            raise ApiError(400, f"the text ({len(text)} characters) is longer than {self.max_model_len} tokens "
                                "(max_model_len) can be", param)
        return self._encode(text, add_special and self.tok.default_bos(text, special), param, special, shielded)

    def _encode(self, text: str, add_bos: bool, param: str, special: bool = True, shielded: bool = False
                ) -> list[int]:
        """The tokenizer's ids for a request's text (special: its special-token texts parsed; shielded: a rendered
        conversation whose messages were shielded, Tokenizer.shield); whatever ValueError it raises on that text
        (it is the client's) is ApiError(400), not a server error."""
        try:
            return self.tok.encode(text, add_bos=add_bos, special=special, shielded=shielded)
        except ValueError as e:
            raise ApiError(400, f"the {param} cannot be tokenized: {e}", param) from None

    def prompt(self, text: str, param: str = "prompt", *, add_special: bool = True, special: bool = True,
               shielded: bool = False) -> list[int]:
        """A generation prompt's token ids; ApiError(400) for a text that cannot fit max_model_len, found by
        tokenizing prefixes of 8, 32, 128 ... times max_model_len characters when it is that long. add_special:
        the BOS by the model's default (False: none); special: its special-token texts parsed (False: text);
        shielded: a conversation rendered by `render` (its messages' control-token texts stay text)."""
        size = PROBE_CHARS * self.max_model_len
        while size < len(text):
            n = len(self._encode(text[:size], False, param, special, shielded))
            if n > self.max_model_len + PROBE_SLACK:
                raise ApiError(400, f"the first {size} characters of {param} are more than {n - PROBE_SLACK} "
                                    f"tokens; max_model_len is {self.max_model_len}", param)
            size *= 4
        return self.encode(text, add_special=add_special, param=param, special=special, shielded=shielded)

    def completion(self, prompt, add_special: bool = True) -> list[list[int]]:
        """A completion request's `prompt` (a string, token ids, or a list of either) -> one id list per prompt
        (add_special: a text's BOS by the model's rule; False: none, as vLLM's add_special_tokens false).
        Token ids are checked by the engine (range, length), in Python loops on the event loop: a list too long
        for the context is refused here first, by its length alone."""
        if prompt is None:
            raise ApiError(400, "prompt is required", "prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise ApiError(400, "prompt is empty", "prompt")
        out = []
        for p in prompts:
            if not isinstance(p, str) and len(p) >= self.max_model_len:
                raise ApiError(400, f"the prompt has {len(p)} tokens; max_model_len is {self.max_model_len}, which "
                                    "must also leave room for at least one generated token", "prompt")
            ids = self.prompt(p, add_special=add_special) if isinstance(p, str) else list(p)
            if not ids:
                raise ApiError(400, "prompt is empty (no tokens)", "prompt")
            out.append(ids)
        return out

    def render(self, messages: list[ChatMessage] | None, add_generation_prompt: bool = True,
               tools: list[Tool] | None = None, continue_final_message: bool = False,
               template_kwargs: dict | None = None) -> str:
        """The conversation as prompt text, through the chat template (sandboxed), with the request's tools;
        continue_final_message: ending inside the final message (render_chat's, 400 naming that field when the
        final message cannot be continued); template_kwargs: the request's chat_template_kwargs (400 naming it
        for one that would replace the template's own variables)."""
        try:
            check_template_kwargs(template_kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "chat_template_kwargs") from None
        if self.template is None:
            raise ApiError(400, NO_CHAT_TEMPLATE_MESSAGE + " Or start the server with --chat-template FILE.",
                           "messages")
        if not messages:
            raise ApiError(400, "messages must be a non-empty list", "messages")
        plain = [_plain(m) for m in messages]
        check_messages([{**p, "content": None} if m.content is None else p for p, m in zip(plain, messages)])
        plain = self.tok.shield_messages(plain)         # a message's "<|im_start|>" is text: it opens no turn
        plain, kw = tool_messages(self.template, plain, tools)
        try:
            return render_chat(self.template, plain, bos_token=self.bos_text, eos_token=self.eos_text,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, template_kwargs=template_kwargs, **kw)
        except ContinueFinalError as e:
            raise ApiError(400, str(e), "continue_final_message") from None
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None

    def chat(self, messages: list[ChatMessage] | None, add_generation_prompt: bool = True,
             tools: list[Tool] | None = None, continue_final_message: bool = False, add_special: bool = True,
             template_kwargs: dict | None = None) -> list[int]:
        """A conversation's prompt ids; with continue_final_message (vLLM's, add_generation_prompt false) they end
        inside the final message, so that the answer goes on with it (an assistant prefill). add_special: the
        model's BOS rule (False: no BOS beyond what the template writes). template_kwargs: the request's
        chat_template_kwargs, more variables for the template."""
        if not continue_final_message:
            text = self.render(messages, add_generation_prompt, tools, template_kwargs=template_kwargs)
            return self.prompt(text, "messages", add_special=add_special, shielded=True)
        if add_generation_prompt:                                            # (as vLLM answers it)
            raise ApiError(400, "continue_final_message goes on with the final message, so no new turn may follow "
                                "it: send add_generation_prompt: false with it", "continue_final_message")
        return self.prompt(self.render(messages, False, tools, True, template_kwargs), "messages",
                           add_special=add_special, shielded=True)

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and bytes as logprobs show it (control tokens as their text)."""
        p = self._pieces.get(token_id)
        if p is None:
            b = self.tok.token_bytes(token_id, special=True)
            p = self._pieces[token_id] = (b.decode("utf-8", errors="replace"), b)
        return p

    def text_bytes(self, token_id: int) -> bytes:
        """A token's bytes as they are in generated or decoded text (control tokens: none)."""
        b = self._text_bytes.get(token_id)
        if b is None:
            b = self._text_bytes[token_id] = self.tok.token_bytes(token_id, special=False)
        return b


def _plain(m: ChatMessage) -> dict:
    """A message as the template sees it: content parts joined into one string (content_text)."""
    d = m.model_dump(exclude_none=True)
    d["content"] = content_text(m)
    return d


def content_text(m: ChatMessage) -> str:
    """A message's content as one string: its text parts joined by "\n" as llama.cpp and vLLM join them
    (lumen.format.chat.message_text, as the offline chat does), and an assistant's refusal parts as its text
    (OpenAI's assistant content holds text and refusal parts; vLLM renders a refusal as text); any other part is
    ApiError(400)."""
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for part in m.content:
        if part.type == "refusal" and m.role == "assistant":
            refusal = getattr(part, "refusal", None)
            if not isinstance(refusal, str):
                raise ApiError(400, "a refusal part needs its refusal, a string", "messages")
            texts.append(refusal)
        elif part.type == "text" and part.text is not None:
            texts.append(part.text)
        else:
            raise ApiError(400, f"only text content parts (and an assistant's refusal parts) are supported, got "
                                f"type {part.type!r}", "messages")
    return message_text([{"type": "text", "text": t} for t in texts])
