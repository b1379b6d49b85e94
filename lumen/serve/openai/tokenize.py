"""POST /tokenize and /detokenize, in vLLM's shapes (`prompt`, or `messages` with `tools`,
`add_generation_prompt` and `continue_final_message` as a chat request takes them; `prompt` back) and llama-server's
(`content`, `add_special`, `parse_special`, `with_pieces`; `content` back); vLLM's return_token_strs adds each
token's vocabulary string (token_strs). One of the three texts, two are a 400
(rather than one tokenized and the other ignored). parse_special false (either text
field) tokenizes special-token text ("<|im_start|>") as plain text; messages are always rendered with their markers
parsed, so it is a 400 with them. Both take at most max_model_len tokens, as a prompt does (400 beyond):
a text far past it is refused after tokenizing a prefix (lumen.serve.prompts), so neither stalls the server on a
text no request could use."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from .. import protocol as P
from ..tools import parse_tools
from .serving import Serving

router = APIRouter()


class ServingTokenize(Serving):

    async def tokenize(self, req: P.TokenizeRequest) -> dict:
        self.check_model(req.model)
        add = req.add_special_tokens if req.add_special_tokens is not None else req.add_special
        given = [f for f in ("prompt", "content", "messages") if getattr(req, f) is not None]
        if len(given) > 1:                             # (one would be tokenized, the other silently not)
            raise P.ApiError(400, f"give one of prompt, content or messages, not {' and '.join(given)}", given[1])
        if req.messages is not None:                   # rendered as a chat request renders them: its usage says
            if not req.parse_special:
                raise P.ApiError(400, "messages are rendered with the template's special tokens parsed: leave "
                                      "parse_special out (or true) with them", "parse_special")
            tools = await asyncio.to_thread(parse_tools, req.tools)      # the same prompt_tokens
            if req.tool_choice == "none":                                # (lumen.serve.openai.chat)
                tools = None
            ids = await asyncio.to_thread(self.prompter.chat, req.messages, req.add_generation_prompt, tools,
                                          req.continue_final_message, add is not False,
                                          template_kwargs=req.chat_template_kwargs)
            return self.answer(ids, req.with_pieces, "messages", req.return_token_strs)
        if req.prompt is not None:                                    # vLLM: special tokens added by default
            text, add, param = req.prompt, add is not False, "prompt"
        elif req.content is not None:                                   # llama-server: not by default
            text, add, param = req.content, bool(add), "content"
        else:
            raise P.ApiError(400, "give prompt, content or messages", "prompt")
        ids = await asyncio.to_thread(self.prompter.prompt, text, param, add_special=add is not False,
                                      special=req.parse_special)
        return self.answer(ids, req.with_pieces, param, req.return_token_strs)

    def answer(self, ids: list[int], with_pieces: bool, param: str, token_strs: bool = False) -> dict:
        if len(ids) > self.engine.max_model_len:
            raise P.ApiError(400, f"the text has {len(ids)} tokens; max_model_len is {self.engine.max_model_len}",
                             param)
        tokens = ids
        if with_pieces:
            tokens = []
            for i in ids:
                b = self.engine.tokenizer.token_bytes(i, special=True)
                try:
                    piece = b.decode("utf-8")
                except UnicodeDecodeError:
                    piece = list(b)
                tokens.append({"id": i, "piece": piece})
        out = {"tokens": tokens, "count": len(ids), "max_model_len": self.engine.max_model_len}
        if token_strs:                                 # vLLM's: the vocabulary's strings ("Ġworld", "<|im_start|>")
            out["token_strs"] = [self.engine.tokenizer.token_text(i) for i in ids]
        return out

    def detokenize(self, req: P.DetokenizeRequest) -> dict:
        self.check_model(req.model)
        if len(req.tokens) > self.engine.max_model_len:
            raise P.ApiError(400, f"{len(req.tokens)} tokens; max_model_len is {self.engine.max_model_len}", "tokens")
        V = self.vocab_end()
        bad = [t for t in req.tokens if not 0 <= t < V]
        if bad:
            raise P.ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{V - 1})", "tokens")
        text = self.engine.tokenizer.decode(req.tokens, special=True)
        return {"prompt": text, "content": text}


@router.post("/tokenize")
async def tokenize(request: Request):
    serving: ServingTokenize = request.app.state.tokenize
    return await serving.tokenize(P.parse(await request.body(), P.TokenizeRequest))


@router.post("/detokenize")
async def detokenize(request: Request):
    serving: ServingTokenize = request.app.state.tokenize
    return serving.detokenize(P.parse(await request.body(), P.DetokenizeRequest))
