"""The HTTP layer: OpenAI JSON in, engine requests out, tokens streamed back. It only translates: sampling,
stopping and detokenizing happen in the engine, so the server answers what `Model.generate` would.

    POST /v1/completions, /v1/chat/completions     streamed (SSE, ending with `data: [DONE]`) or not
    POST /tokenize, /detokenize                    vLLM's and llama-server's shapes
    GET  /v1/models, /v1/models/{id}, /health, /metrics
    GET  /, /dashboard (+ /dashboard/data, /ui/*)   the chat page and the live dashboard (lumen.serve.ui)

Each endpoint is a router and a serving object (lumen/serve/openai/); build_app puts the objects on `app.state`
and includes the routers. Every request passes the Gate first (lumen.serve.gate: request id, API key, body
bound, log line, 500s); an ApiError raised anywhere is answered in OpenAI's error shape.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.config import EngineConfig, cli_words
from ..errors import LumenError
from . import protocol as P
from .gate import Gate
from .metrics import Metrics
from .openai import chat, completions, health, models, tokenize
from .openai.serving import Settings
from .prompts import Prompter
from .ui import PAGES, StepTap, add_ui
from .worker import EngineWorker, Worker

__all__ = ["Settings", "build_app", "make_app", "load_engine", "add_error_handlers"]
log = logging.getLogger("lumen.serve")
ROUTERS = (completions.router, chat.router, tokenize.router, models.router, health.router)


def build_app(worker: Worker, prompter: Prompter, metrics: Metrics, settings: Settings) -> FastAPI:
    """The app over a worker (an EngineWorker, or lumen.serve.ray's RemoteWorker); its lifespan starts and stops
    the worker."""

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="Lumen", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    state = app.state
    state.completion = completions.ServingCompletion(worker, prompter, settings)
    state.chat = chat.ServingChat(worker, prompter, settings)
    state.tokenize = tokenize.ServingTokenize(worker, prompter, settings)
    state.models = models.ServingModels(worker, prompter, settings)
    state.health = health.ServingHealth(worker, metrics)
    for router in ROUTERS:
        app.include_router(router)
    if settings.ui:                               # GET /, /dashboard, /dashboard/data, /ui/* (lumen.serve.ui)
        worker.tap = StepTap() if getattr(worker, "steps_here", True) else None    # Ray: the steps are elsewhere
        add_ui(app, metrics.registry, worker.tap, model_id=settings.model_id, max_model_len=prompter.max_model_len,
               speculative=settings.speculative, structured_output=True)
    app.add_middleware(Gate, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       open_paths=PAGES if settings.ui else (), draining=lambda: worker.draining)
    if settings.allowed_origins:      # outside the Gate: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """ApiError -> its status and OpenAI's error body (Retry-After on 429 and 503); Starlette's own errors (no
    route, wrong method: with its Allow header) in the same shape."""

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, e: P.ApiError):
        retry = {"Retry-After": "1"} if e.status in (429, 503) else None      # the openai client honours it
        return JSONResponse(e.body(), status_code=e.status, headers=retry)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(P.error_body(e.status_code, msg), status_code=e.status_code, headers=e.headers)


def make_app(engine, *, model_name: str, chat_template: str | None = None, api_key: str | None = None,
             max_queue: int = 256, max_n: int = 64, max_body_bytes: int = 16 * 2 ** 20,
             speculative: str | None = None, profile_path: str | None = None, ui: bool = True,
             tool_call_parser: str | None = None, allowed_origins: tuple[str, ...] = ("*",)):
    """The FastAPI app over an engine, and its worker (started by the app's lifespan). ui: the chat page and the
    dashboard (lumen.serve.ui). tool_call_parser: lumen.serve.tools' parser name or "none" (None: from the
    template)."""
    from ..format.chat import chat_template_from_metadata
    template = chat_template if chat_template is not None else chat_template_from_metadata(engine.parts.gguf.metadata)
    prompter = Prompter(engine.tokenizer, template, engine.max_model_len)
    metrics = Metrics(engine, model_name)
    worker = EngineWorker(engine, max_queue=max_queue, metrics=metrics, profile_path=profile_path)
    settings = Settings(model_id=model_name, api_key=api_key, max_body_bytes=max_body_bytes, max_n=max_n,
                        speculative=speculative, ui=ui, tool_call_parser=tool_call_parser,
                        allowed_origins=tuple(allowed_origins))
    return build_app(worker, prompter, metrics, settings), worker


def load_engine(model: str, config: EngineConfig):
    """The engine, warmed up: every kernel a request runs is compiled (or loaded) before this returns, so a
    server reports healthy only when it answers at full speed. Processes starting at once on one machine (Ray
    replicas) take turns to compile (lumen.paths.compiling): the later ones load what the first compiled. A served
    context never exceeds the model's trained one nor what the KV pool holds (config.fit_model_len)."""
    from ..engine.engine import Engine
    from ..engine.sampling.params import SamplingParams
    from ..engine.structured.bitmask import warm_up
    from ..kernels.work import release_threads
    from ..paths import compiling
    with compiling():
        engine = Engine(model, replace(config, fit_model_len=True))
        try:
            config.check_unchunked(engine.max_model_len)        # (the served length is known from here)
        except ValueError as e:
            raise LumenError(cli_words(str(e))) from None
        engine.generate([[0]], SamplingParams(max_tokens=1, temperature=0))
        engine.costs.clear()       # that step timed loading the kernels: it must not pace the first requests
        warm_up()
    release_threads()              # the engine thread steps from now on: only its OpenMP pool may exist
    return engine
