"""An OpenAI-compatible HTTP server over the engine: `python -m lumen.serve --model M`.

    cli.py        the command line, uvicorn, and the graceful shutdown
    app.py        the app: the endpoints' routers and serving objects, the error shape; make_app, load_engine
    openai/       one module per endpoint: its APIRouter and its serving class (OpenAI JSON in, engine
                  requests out, tokens streamed back)
    gate.py       ASGI middleware: request id, API key, body bound, one log line per request, 500s
    protocol.py   request bodies (pydantic), their SamplingParams, OpenAI's error shape
    prompts.py    completion prompts and chat templates -> token ids
    responses.py  engine outputs -> OpenAI responses, stream chunks, logprobs, usage
    tools.py      tool calling: tools and tool_choice checked, their grammar, the parsers reading calls back
    worker.py     the engine's step loop in its own thread, bridged to asyncio
    metrics.py    /metrics (prometheus_client), vLLM's names with the lumen: prefix
    ray/          --replicas N: the same app as a Ray Serve application over N engine replicas
"""
