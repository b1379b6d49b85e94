"""POST /v1/completions: a prompt (text, token ids, or a list of either) continued, streamed or whole."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from .. import protocol as P
from .serving import Generation

router = APIRouter()


class ServingCompletion(Generation):
    kind, id_prefix, prompt_param = "completion", "cmpl", "prompt"

    async def create(self, req: P.CompletionRequest, request: Request):
        self.check_model(req.model)
        params = P.speculation(P.completion_params(req, self.settings.max_n), req, self.settings.speculative)
        params = P.constrained(params, await asyncio.to_thread(P.constraint_of, req))   # 400 if invalid
        prompts = await asyncio.to_thread(self.prompter.completion, req.prompt)
        echo = None
        if req.echo:                              # each prompt's text: as sent, or its token ids decoded
            sent = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
            echo = [p if isinstance(p, str) else self.engine.tokenizer.decode(ids) for p, ids in zip(sent, prompts)]
        return await self.respond(request, req, prompts, params, echo)


@router.post("/v1/completions")
async def completions(request: Request):
    serving: ServingCompletion = request.app.state.completion
    return await serving.create(P.parse(await request.body(), P.CompletionRequest), request)
