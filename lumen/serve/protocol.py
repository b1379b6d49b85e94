"""What comes over the wire: the OpenAI request bodies as pydantic models, their translation to SamplingParams,
and the API's error (OpenAI's shape: {"error": {"message", "type", "param", "code"}}).

Bodies are validated strictly (no "0.5" for a number, no true for an integer), as the OpenAI API does. Fields
the API does not name are ignored, as vLLM ignores them. vLLM's extensions are accepted under vLLM's names
(top_k, min_p, repetition_penalty, stop_token_ids, min_tokens, ignore_eos, add_generation_prompt,
continue_final_message, return_token_ids, include_stop_str_in_output, add_special_tokens, documents) and
llama-server's under its own (repeat_penalty, repeat_last_n). A request holds at most MAX_STOP stop strings
(OpenAI takes four, vLLM any number): each costs the engine's one thread at every token.

vLLM's and llama-server's extensions that Lumen does not implement (UNSUPPORTED: prompt_logprobs, beam search,
logits processors, n_predict, mirostat, typical_p, XTC, DRY ...; CHAT_UNSUPPORTED: a request's own
chat_template) are refused with a 400 naming the field when set to anything but their default, rather than
ignored: a client asking for prompt_logprobs or beam search would otherwise get an answer that silently lacks
what it asked for. So are, on the chat endpoint, OpenAI's audio output
(modalities other than "text", audio) and web_search_options, best_of other than n, and vLLM's chat echo. Fields
whose absence changes no token (user, metadata, store, service_tier, prediction) are ignored.

Structured output (lumen.serve.structured): OpenAI's response_format, vLLM's structured_outputs and guided_*,
llama-server's json_schema and grammar, on both endpoints; `constraint_of` turns them into the request's one
Constraint, or an ApiError(400) naming the field with llguidance's message.
"""
from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

from ..engine.sampling.params import MAX_LOGPROBS, SamplingParams
from ..engine.sampling.sampler import SamplerError
from .structured import GUIDED, StructuredFieldError, constraint_from_body

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               431: "invalid_request_error", 429: "rate_limit_error",
               499: "client_closed_request",
               500: "server_error", 503: "service_unavailable"}
# what a union field holds, said once instead of one pydantic error per member of the union
EXPECTED = {"prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
            "stop": "a string or a list of strings", "content": "a string, null or a list of text parts"}
SEED_RANGE = 2 ** 63
# vLLM's and llama-server's extensions not implemented: field -> (the values that ask for nothing, what to send
# instead, whose extension it is)
UNSUPPORTED = {
    "prompt_logprobs": ((None,), "for the prompt's logprobs send echo: true with logprobs to /v1/completions",
                        "vLLM"),
    "use_beam_search": ((None, False), "only sampling is supported", "vLLM"),
    "skip_special_tokens": ((None, True), "special tokens are always left out of the text (logprobs show them)",
                            "vLLM"),
    "allowed_token_ids": ((None,), "send logit_bias, or a structured output such as guided_choice", "vLLM"),
    "bad_words": ((None, []), "send logit_bias with -100 for their tokens", "vLLM"),
    "truncate_prompt_tokens": ((None,), "send a prompt that fits max_model_len", "vLLM"),
    "logits_processors": ((None, []), "no custom logits processor runs here; send logit_bias or a structured output",
                          "vLLM"),
    "return_tokens_as_token_ids": ((None, False), "send return_token_ids: true for each choice's token ids", "vLLM"),
    "prompt_embeds": ((None,), "send the prompt as text or token ids", "vLLM"),
    "n_predict": ((None,), "send max_tokens (null: the rest of the context)", "llama-server"),
    "n_probs": ((None, 0), "send logprobs (and top_logprobs on /v1/chat/completions)", "llama-server"),
    "mirostat": ((None, 0), "send temperature, top_k, top_p or min_p", "llama-server"),
    "typical_p": ((None, 1, 1.0), "send temperature, top_k, top_p or min_p", "llama-server"),
    "top_n_sigma": ((None, -1, -1.0, 0, 0.0), "send temperature, top_k, top_p or min_p", "llama-server"),
    "xtc_probability": ((None, 0, 0.0), "send temperature, top_k, top_p or min_p", "llama-server"),
    "dynatemp_range": ((None, 0, 0.0), "send temperature", "llama-server"),
    "dry_multiplier": ((None, 0, 0.0), "send repetition_penalty, presence_penalty or frequency_penalty",
                       "llama-server"),
}
CHAT_UNSUPPORTED = {
    "chat_template": ((None,), "the server's template is used (python -m lumen.serve --chat-template FILE)", "vLLM"),
}
MAX_STOP = 128          # stop strings per request: the engine checks each at every token, on its one thread


class ApiError(Exception):
    """An error answered to one request; the server goes on serving."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


class _Body(BaseModel):
    # a field no endpoint knows (a misspelt "max_token", another server's extension) is ignored, as by OpenAI's
    # and vLLM's servers, and named in the log (parse), as vLLM names it: a silent default is what the user got
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False       # vLLM's: with include_usage, each chunk's usage so far too

    @field_validator("include_usage", "continuous_usage_stats", mode="before")
    @classmethod
    def _null_is_default(cls, v):
        return False if v is None else v


class _Sampling(_Body):
    """The sampling fields both endpoints share."""
    unsupported: ClassVar[dict] = UNSUPPORTED
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False
    add_special_tokens: bool | None = None     # vLLM's: false, no BOS added to the prompt (null: the model's rule)
    include_stop_str_in_output: bool = False   # vLLM's: the stop string that matched ends the text (responses)
    speculative: str | None = None             # Lumen: "ngram", "draft" or "none" (default: the server's)
    num_speculative_tokens: int | None = None
    # structured output, read by lumen.serve.structured (constraint_of): values checked there
    response_format: Any = None                # OpenAI, vLLM, llama-server
    structured_outputs: Any = None             # vLLM
    guided_json: Any = None                    # vLLM's older names
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    json_schema: Any = None                    # llama-server
    grammar: Any = None

    @field_validator("n", "stream", "min_tokens", "ignore_eos", "return_token_ids", "include_stop_str_in_output",
                     mode="before")
    @classmethod
    def _null_is_default(cls, v, info: ValidationInfo):
        """OpenAI's spec lets a client send null for a parameter it leaves at its default."""
        return cls.model_fields[info.field_name].default if v is None else v

    @model_validator(mode="wrap")
    @classmethod
    def _refuse_unsupported(cls, data, handler):
        if isinstance(data, dict):
            for name, (off, instead, whose) in cls.unsupported.items():
                v = data.get(name)
                if not any(v is o or (type(v) is type(o) and v == o) for o in off):
                    raise ApiError(400, f"{name} (a {whose} extension) is not supported: {instead}", name)
        return handler(data)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats (only with include_usage, as vLLM reads it)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    max_tokens: int | None = 16                # OpenAI's and vLLM's default; null: the rest of the context (vLLM)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None                  # fill-in-the-middle (lumen.serve.openai.completions)
    best_of: int | None = None

    @field_validator("echo", mode="before")
    @classmethod
    def _null_echo(cls, v):
        return False if v is None else v


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_has_text(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs its text, a string")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")     # tool_calls, tool_call_id, ...: handed to the template
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None                                    # a participant's name (OpenAI: a string)

    @model_validator(mode="after")
    def _no_audio(self):
        if getattr(self, "audio", None) is not None:         # OpenAI's {"id"} of an earlier audio answer
            raise ValueError("an assistant's audio (an earlier audio answer, by id) is not supported: send its "
                             "transcript as the message's content")
        return self


class ChatCompletionRequest(_Sampling):
    unsupported: ClassVar[dict] = UNSUPPORTED | CHAT_UNSUPPORTED
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None             # checked by lumen.serve.tools (parse_tools, parse_tool_choice)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None                      # OpenAI's deprecated function calling: refused (chat_params)
    function_call: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False       # vLLM: the answer goes on with the final message (a prefill)
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM: more template variables ({"enable_thinking": false})
    documents: list[Any] | None = None         # vLLM: the template's `documents` (RAG templates)
    # what the answer would lack if ignored: refused by chat_params unless at the value that asks for nothing
    modalities: list[str] | None = None        # OpenAI: ["text"] only
    audio: Any = None                          # OpenAI: audio output
    web_search_options: Any = None             # OpenAI: search models
    best_of: int | None = None                 # vLLM's chat takes it as the completions endpoint does
    echo: bool = False                         # vLLM's: the final message's text before the answer

    @field_validator("logprobs", "add_generation_prompt", "continue_final_message", "echo", mode="before")
    @classmethod
    def _null_flags(cls, v, info: ValidationInfo):
        return cls.model_fields[info.field_name].default if v is None else v


class TokenizeRequest(_Body):
    """vLLM's (`prompt` or `messages`, add_special_tokens default true) or llama-server's (`content`,
    add_special default false, parse_special default true, with_pieces default false; null is the default, as
    llama-server reads it, and another type a 400)."""
    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None             # with messages: rendered as a chat request renders them (not
    tool_choice: Any = None                    # shown with tool_choice "none")
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    add_generation_prompt: bool = True
    parse_special: bool = True                 # llama-server's: special-token text parsed as those tokens
    with_pieces: bool = False
    return_token_strs: bool = False            # vLLM's: each token's vocabulary string too ("token_strs")

    @field_validator("parse_special", "with_pieces", "return_token_strs", mode="before")
    @classmethod
    def _null_flags(cls, v, info: ValidationInfo):
        return cls.model_fields[info.field_name].default if v is None else v


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def parse(body: bytes, model: type[BaseModel]) -> Any:
    """A request body -> the model, or ApiError(400) saying what is wrong. A UTF-8 byte order mark before the JSON
    is skipped, as RFC 8259 allows and vLLM's and llama-server's parsers do (Windows tools write one)."""
    body = body.removeprefix(b"\xef\xbb\xbf")
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        lone = _lone_surrogate(body) if errors[0]["type"] == "json_invalid" else None
        if lone is not None:                          # (the parser says "unexpected end of hex escape")
            raise ApiError(400, f"invalid JSON: a lone UTF-16 surrogate {lone} (a \\uD800-\\uDBFF escape must be "
                                f"followed by a \\uDC00-\\uDFFF one, which stands after no other)") from None
        raise ApiError(400, *_describe(errors)) from None
    if req.model_extra:
        logging.getLogger("lumen.serve").warning("request fields ignored (this server does not know them): %s",
                                                 ", ".join(sorted(req.model_extra)[:20]))
    return req


ESCAPE = re.compile(r"\\(?:u([0-9A-Fa-f]{4})|.)", re.S)     # one JSON string escape: \uXXXX or \n, \\, ...


def _lone_surrogate(body: bytes) -> str | None:
    """Where the body's first \\uXXXX escape of a UTF-16 surrogate that is not half of a high-low pair is, as
    "\\ud800 at line 1 column 13" (1-based, in characters, of its backslash); None when there is none."""
    text = body.decode("utf-8", errors="replace")
    escapes = list(ESCAPE.finditer(text))
    units = [int(m.group(1), 16) if m.group(1) else 0 for m in escapes]      # (0: not a \uXXXX escape)
    paired = [False] * len(escapes)
    for i in range(len(escapes) - 1):
        if (0xD800 <= units[i] <= 0xDBFF and 0xDC00 <= units[i + 1] <= 0xDFFF and not paired[i]
                and escapes[i].end() == escapes[i + 1].start()):
            paired[i] = paired[i + 1] = True
    for m, unit, ok in zip(escapes, units, paired):
        if 0xD800 <= unit <= 0xDFFF and not ok:
            line = text.count("\n", 0, m.start()) + 1
            column = m.start() - text.rfind("\n", 0, m.start())
            return f"{m.group(0)} at line {line} column {column}"
    return None


def _describe(errors: list[dict]) -> tuple[str, str | None]:
    own = [e for e in errors if e["type"] == "value_error"]       # a validator's own words (under a union too)
    if own:
        loc = [str(p) for p in own[0]["loc"] if "[" not in str(p)]     # (without the union member's tag)
        return f"{'.'.join(loc)}: {own[0]['ctx']['error']}", loc[0] if loc else None
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"malformed JSON: {first['ctx']['error']}", None
    if first["type"] == "model_type" and not first["loc"]:
        return "the request body must be a JSON object", None
    loc = [str(p) for p in first["loc"]]
    for i, p in enumerate(loc):
        if p in EXPECTED and i + 1 < len(loc):          # a union's member tag follows (/tokenize's prompt: a str)
            return f"{'.'.join(loc[:i + 1])} must be {EXPECTED[p]}", loc[0]
    return f"{'.'.join(loc)}: {first['msg']}", loc[0] if loc else None


def sampling_params(req: _Sampling, *, max_tokens: int | None, logprobs: int | None,
                    max_tokens_field: str = "max_tokens", least: int = 1, zero_note: str = "") -> SamplingParams:
    """The request's SamplingParams (one choice); ApiError(400) naming the field when a value is out of range
    (max_tokens_field: the one max_tokens came from; least: its smallest value; zero_note: said of a refused 0).
    OpenAI's defaults: temperature 1, top_p 1. top_k -1 (vLLM's "off") is 0 here."""
    if max_tokens is not None and max_tokens < least:
        raise ApiError(400, f"{max_tokens_field} must be at least {least}, got {max_tokens}" +
                       (zero_note if max_tokens == 0 else ""), max_tokens_field)
    if req.seed is not None and not -SEED_RANGE <= req.seed < SEED_RANGE:
        raise ApiError(400, f"seed must be a 64-bit integer, in [-2^63, 2^63), got {req.seed}", "seed")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
    if req.stream_options is not None and not req.stream:        # as OpenAI and vLLM answer it
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        raise ApiError(400, f"stop holds {len(req.stop)} strings; at most {MAX_STOP}", "stop")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise ApiError(400, f"{name} must be in [-2, 2], got {v}", name)
    repeat = req.repetition_penalty if req.repetition_penalty is not None else req.repeat_penalty
    kw = dict(max_tokens=max_tokens, temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0),
              top_k=0 if req.top_k == -1 else _or(req.top_k, 0), min_p=_or(req.min_p, 0.0),
              presence_penalty=_or(req.presence_penalty, 0.0), frequency_penalty=_or(req.frequency_penalty, 0.0),
              repeat_penalty=_or(repeat, 1.0), repeat_last_n=_or(req.repeat_last_n, 64),
              seed=None if req.seed is None else req.seed % SEED_RANGE,     # OpenAI's seeds may be negative
              stop=() if req.stop is None else req.stop, stop_token_ids=tuple(req.stop_token_ids or ()),
              min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
              logit_bias=dict(req.logit_bias or {}))
    try:
        return SamplingParams(**kw)
    except SamplerError as e:                    # the field the engine names; said as the client said it
        field, msg = e.param, str(e)
        if field == "repeat_penalty" and req.repetition_penalty is not None:
            field, msg = "repetition_penalty", msg.replace("repeat_penalty", "repetition_penalty", 1)
        raise ApiError(400, msg, field) from None


def speculation(params: list[SamplingParams], req: _Sampling, default: str | None) -> list[SamplingParams]:
    """The request's speculative decoding ("speculative": "ngram" | "draft" | "none"; absent: the server's
    --speculative) and its num_speculative_tokens."""
    kind = default if req.speculative is None else req.speculative
    if kind not in (None, "none", "ngram", "draft"):
        raise ApiError(400, f"speculative must be \"ngram\", \"draft\" or \"none\", got {kind!r}", "speculative")
    k = req.num_speculative_tokens
    if k is not None and not 1 <= k <= 16:
        raise ApiError(400, f"num_speculative_tokens must be in [1, 16], got {k}", "num_speculative_tokens")
    kind = None if kind == "none" else kind
    if kind is None and k is not None:
        raise ApiError(400, "num_speculative_tokens is used with speculative \"ngram\" or \"draft\""
                       + (" (this server has no --speculative default)" if default is None else ""),
                       "num_speculative_tokens")
    if kind is None and k is None:
        return params
    return [p.replace(speculative=kind, num_speculative_tokens=k) for p in params]


def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n choices: choice i samples with seed + i (as vLLM), so a seeded request with n > 1 is reproducible and
    its choices differ."""
    if params.seed is None:
        return [params] * n
    return [params.replace(seed=(params.seed + i) % SEED_RANGE) for i in range(n)]


def check_n(n: int, limit: int) -> None:
    if not 1 <= n <= limit:
        raise ApiError(400, f"n must be between 1 and {limit}, got {n}", "n")


def _or(v, default):
    return default if v is None else v


def completion_params(req: CompletionRequest, n_limit: int) -> list[SamplingParams]:
    """One SamplingParams per choice of a completion request; ApiError(400) for what is not supported. With echo,
    logprobs cover the prompt's tokens too (the engine's prompt_logprobs, as OpenAI's legacy completions and
    vLLM give them), and max_tokens may be 0: the prompt echoed and scored, nothing generated."""
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, "best_of is not supported (only best_of == n)", "best_of")
    check_n(req.n, n_limit)
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, least=0 if req.echo else 1,
                             zero_note=" (0 only with echo)")
    if req.echo and req.logprobs is not None:
        params = params.replace(prompt_logprobs=req.logprobs)
    return per_choice(params, req.n)


def chat_params(req: ChatCompletionRequest, n_limit: int) -> list[SamplingParams]:
    """One SamplingParams per choice of a chat request; ApiError(400) for what is not supported, such as
    OpenAI's deprecated functions and function_call (tools and tool_choice say the same), and what an answer would
    silently lack: audio output (modalities, audio), web search, best_of beyond n, vLLM's echo."""
    if req.functions is not None:
        raise ApiError(400, "functions (OpenAI's deprecated function calling) is not supported: send tools, "
                            "[{\"type\": \"function\", \"function\": <each function>}]", "functions")
    if req.function_call is not None:
        raise ApiError(400, "function_call (OpenAI's deprecated function calling) is not supported: send "
                            "tool_choice, \"none\", \"auto\" or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", "function_call")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise ApiError(400, f"modalities other than \"text\" are not supported (this server answers text), got "
                            f"{req.modalities}", "modalities")
    if req.audio is not None:
        raise ApiError(400, "audio output is not supported: this server answers text; leave audio out", "audio")
    if req.web_search_options is not None:
        raise ApiError(400, "web_search_options is not supported: this server does not search the web",
                       "web_search_options")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, "best_of is not supported (only best_of == n)", "best_of")
    if req.echo:
        raise ApiError(400, "echo (vLLM's chat extension) is not supported: to go on with a final assistant "
                            "message send continue_final_message: true and add_generation_prompt: false", "echo")
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs")
    check_n(req.n, n_limit)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return per_choice(sampling_params(req, max_tokens=getattr(req, field), logprobs=logprobs,
                                      max_tokens_field=field), req.n)


STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED, "guided_whitespace_pattern", "json_schema",
                     "grammar")


def constraint_of(req: _Sampling):
    """The request's structured-output Constraint (None: none asked); ApiError(400) naming the field for a
    malformed or conflicting one or one llguidance rejects (its message). Validating a large grammar takes
    milliseconds: call it off the event loop."""
    try:
        return constraint_from_body({f: getattr(req, f) for f in STRUCTURED_FIELDS})
    except StructuredFieldError as e:
        raise ApiError(400, str(e), e.param) from None


def constraint_field(req: _Sampling) -> str | None:
    """The structured-output field the request set (for a grammar that fails to compile)."""
    for f in STRUCTURED_FIELDS:
        v = getattr(req, f)
        if v is None or f == "guided_whitespace_pattern" or (f == "response_format" and isinstance(v, dict)
                                                              and v.get("type", "text") == "text"):
            continue
        return f
    return None


def constrained(params: list[SamplingParams], constraint) -> list[SamplingParams]:
    return params if constraint is None else [p.replace(constraint=constraint) for p in params]
