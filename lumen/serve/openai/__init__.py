"""The OpenAI-compatible endpoints, one module each: its router (a FastAPI APIRouter: the HTTP shape) and its
serving class (what the endpoint does; importable and testable without the app). The bodies are in
lumen/serve/protocol.py. lumen/serve/app.py puts one serving object per endpoint on `app.state` and includes the
routers; a route finds its object there.

    serving.py       Serving: what every endpoint shares (the served model, the worker, the prompter);
                     Generation: submitting to the worker and the one loop that answers, streamed or whole
    completions.py   POST /v1/completions                 ServingCompletion
    chat.py          POST /v1/chat/completions            ServingChat
    tokenize.py      POST /tokenize, /detokenize          ServingTokenize
    models.py        GET  /v1/models, /v1/models/{id}     ServingModels
    health.py        GET  /health, /metrics               ServingHealth
"""
