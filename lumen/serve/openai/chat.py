"""POST /v1/chat/completions: messages rendered with the model's chat template, answered streamed or whole.

With `tools` (lumen.serve.tools): the tools are checked (400 naming the field), rendered with the conversation,
and unless tool_choice is "none" the output is constrained by the tools' grammar (a call for "required" and a
named function; free text or calls for "auto") and read back by the model's tool-call parser; with "none" the
prompt leaves the tools out (else a model shown them writes a call as text; vLLM's
--exclude-tools-when-tool-choice-none). A JSON
response_format with tools (as OpenAI's Agents SDK sends its output type on every turn) constrains the text answer
only: "auto" gives calls or JSON that follows it, "required" and a named function a call, "none" the JSON.

continue_final_message (vLLM's; with add_generation_prompt false): the prompt ends inside the final message, so
the answer goes on with it (an assistant prefill). chat_template_kwargs (vLLM's): more variables for the template,
such as Qwen3's {"enable_thinking": false}; one that would replace the template's own (messages, tools,
add_generation_prompt, bos_token, ...) is a 400. vLLM's documents are the template's `documents` variable, and its
add_special_tokens false leaves out the BOS the template does not write.
"""
from __future__ import annotations

import asyncio
import functools

from fastapi import APIRouter, Request

from .. import protocol as P
from ..tools import (PARSERS, call_grammar, parse_tool_choice, parse_tools, parser_for_template, shown_tools,
                     tool_answer)
from .serving import Generation

router = APIRouter()


class ServingChat(Generation):
    kind, id_prefix, prompt_param = "chat", "chatcmpl", "messages"

    async def create(self, req: P.ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        params = P.speculation(P.chat_params(req, self.settings.max_n), req, self.settings.speculative)
        constraint = await asyncio.to_thread(P.constraint_of, req)      # 400 if invalid
        tools = await asyncio.to_thread(parse_tools, req.tools)
        choice = parse_tool_choice(req.tool_choice, tools)
        prompts = [await self.prompt_ids(req, shown_tools(tools, choice))]   # (a 400 for the conversation costs
                                                                            # no grammar)
        parser = None
        if choice != "none":
            name = parser_for_template(self.prompter.template, self.settings.tool_call_parser)
            if name is None:
                raise P.ApiError(400, "this server does not parse tool calls (--tool-call-parser none); send "
                                      "tool_choice \"none\" or no tools", "tool_choice")
            try:                            # "auto" with response_format: calls, or an answer that follows it
                answer = tool_answer(constraint, choice)
            except ValueError as e:
                raise P.ApiError(400, f"{P.constraint_field(req)} {e}", P.constraint_field(req)) from None
            cls = PARSERS[name]             # (required, a named function: a call, whatever response_format says)
            constraint = await asyncio.to_thread(call_grammar, cls, self.engine.tokenizer, tools, choice,
                                                 req.parallel_tool_calls is not False, answer)
            parser = functools.partial(cls, names=[t.name for t in tools], calls_only=choice != "auto")
            await self.compile_grammar(constraint, "tools")
        params = P.constrained(params, constraint)
        return await self.respond(request, req, prompts, params, tool_parser=parser,
                                  named_tool=choice not in ("none", "auto", "required"))

    async def prompt_ids(self, req: P.ChatCompletionRequest, tools) -> list[int]:
        """The conversation's prompt ids (with continue_final_message: ending inside the final message)."""
        kwargs = req.chat_template_kwargs
        if req.documents is not None:                  # vLLM's: the template's `documents`
            kwargs = {"documents": req.documents, **(kwargs or {})}
        return await asyncio.to_thread(self.prompter.chat, req.messages, req.add_generation_prompt, tools,
                                       req.continue_final_message, req.add_special_tokens is not False,
                                       template_kwargs=kwargs)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    serving: ServingChat = request.app.state.chat
    return await serving.create(P.parse(await request.body(), P.ChatCompletionRequest), request)
