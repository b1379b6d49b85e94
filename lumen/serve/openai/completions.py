"""POST /v1/completions: a prompt (text, token ids, or a list of either) continued, streamed or whole.

With OpenAI's `suffix`, the completion fills the middle between the prompt and the suffix (fill-in-the-middle, as
code editors ask a coder model): each prompt becomes llama-server's infill prompt (its format_infill, in the
prefix-suffix-middle order Qwen2.5-Coder and StarCoder are trained on):

    [BOS if the vocabulary adds one] FIM_PRE prompt FIM_SUF suffix FIM_MID

with the model's fill-in-the-middle tokens (GGUF tokenizer.ggml.fim_{pre,suf,mid}_token_id, else found by their
texts: `<|fim_prefix|>` ..., `<fim_prefix>` ...). Prompt and suffix texts are tokenized as plain text, their
special-token texts not parsed (as llama-server's infill does), so a `<|fim_middle|>` typed in the code is text. A
model without those tokens answers 400. With echo the prompt alone is echoed, as OpenAI does; echo with logprobs
(which would score the suffix and the FIM tokens as the prompt's) is refused.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from .. import protocol as P
from ..prompts import Prompter
from .serving import Generation

router = APIRouter()


class ServingCompletion(Generation):
    kind, id_prefix, prompt_param = "completion", "cmpl", "prompt"

    async def create(self, req: P.CompletionRequest, request: Request):
        self.check_model(req.model)
        fim = None if req.suffix is None else fim_ids(self.engine.tokenizer)    # 400 without FIM tokens
        if fim is not None and req.echo and req.logprobs is not None:
            raise P.ApiError(400, "echo with logprobs scores the prompt's tokens, which with suffix would include "
                                  "the suffix's: send them without suffix", "suffix")
        params = P.speculation(P.completion_params(req, self.settings.max_n), req, self.settings.speculative)
        params = P.constrained(params, await asyncio.to_thread(P.constraint_of, req))   # 400 if invalid
        if fim is None:
            sent = prompts = await asyncio.to_thread(self.prompter.completion, req.prompt,
                                                     req.add_special_tokens is not False)
        else:
            sent, prompts = await asyncio.to_thread(infill_prompts, self.prompter, req.prompt, req.suffix, fim)
        echo = None
        if req.echo:                              # each prompt's text: as sent, or its token ids decoded
            texts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
            echo = [p if isinstance(p, str) else self.engine.tokenizer.decode(ids) for p, ids in zip(texts, sent)]
        return await self.respond(request, req, prompts, params, echo)


def fim_ids(tok) -> tuple[int, int, int]:
    """The vocabulary's fill-in-the-middle (prefix, suffix, middle) token ids; ApiError(400) if it lacks one."""
    ids = (getattr(tok, "fim_pre_id", None), getattr(tok, "fim_suf_id", None), getattr(tok, "fim_mid_id", None))
    if None in ids:
        missing = ", ".join(n for n, i in zip(("prefix", "suffix", "middle"), ids) if i is None)
        raise P.ApiError(400, "suffix asks for fill-in-the-middle, but this model's vocabulary has no "
                              f"fill-in-the-middle tokens ({missing}); send the prompt without suffix", "suffix")
    return ids


def infill_prompts(prompter: Prompter, prompt, suffix: str, fim: tuple[int, int, int]):
    """(the prompts' own token ids, their infill prompts): each prompt (text or token ids) between the FIM prefix
    and suffix tokens, then the suffix's tokens and the FIM middle token; ApiError(400) for a missing prompt or one
    that cannot fit max_model_len."""
    if prompt is None:
        raise P.ApiError(400, "prompt is required", "prompt")
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise P.ApiError(400, "prompt is empty", "prompt")
    pre, suf, mid = fim
    tok = prompter.tok
    bos = [tok.bos_id] if tok.add_bos_default and tok.bos_id is not None else []
    tail = [suf, *prompter.prompt(suffix, "suffix", add_special=False, special=False), mid]
    own, out = [], []
    for p in prompt:
        ids = prompter.prompt(p, add_special=False, special=False) if isinstance(p, str) else list(p)
        ids_all = [*bos, pre, *ids, *tail]
        if len(ids_all) >= prompter.max_model_len:
            raise P.ApiError(400, f"the prompt and suffix make {len(ids_all)} tokens; max_model_len is "
                                  f"{prompter.max_model_len}, which must also leave room for at least one generated "
                                  "token", "prompt")
        own.append(ids)
        out.append(ids_all)
    return own, out


@router.post("/v1/completions")
async def completions(request: Request):
    serving: ServingCompletion = request.app.state.completion
    return await serving.create(P.parse(await request.body(), P.CompletionRequest), request)
