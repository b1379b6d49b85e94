"""POST /v1/chat/completions: messages rendered with the model's chat template, answered streamed or whole."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from .. import protocol as P
from .serving import Generation

router = APIRouter()


class ServingChat(Generation):
    kind, id_prefix, prompt_param = "chat", "chatcmpl", "messages"

    async def create(self, req: P.ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        params = P.speculation(P.chat_params(req, self.settings.max_n), req, self.settings.speculative)
        params = P.constrained(params, await asyncio.to_thread(P.constraint_of, req))   # 400 if invalid
        prompts = [await asyncio.to_thread(self.prompter.chat, req.messages, req.add_generation_prompt)]
        return await self.respond(request, req, prompts, params)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    serving: ServingChat = request.app.state.chat
    return await serving.create(P.parse(await request.body(), P.ChatCompletionRequest), request)
