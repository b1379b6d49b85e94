"""The Gate (lumen/serve/gate.py) alone, over plain ASGI apps: a handler's failure is a 500 logged with its
traceback, but an error out of receive() (the client gone: behind Ray a cancelled task, TaskCancelledError) or
after receive() said the client disconnected is one info line, and no 500 is sent to nobody."""
import asyncio
import logging

from lumen.serve.gate import Gate

SCOPE = {"type": "http", "method": "GET", "path": "/v1/x", "headers": [], "client": ("127.0.0.1", 1)}


class Cancelled(Exception):
    """Stands for ray.exceptions.TaskCancelledError (the Gate must not import Ray)."""


def run(app, receive):
    sent = []

    async def send(msg):
        sent.append(msg)

    asyncio.run(Gate(app, api_key=None, max_body_bytes=1024)(dict(SCOPE), receive, send))
    return sent


async def started_then(app_error, scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await receive()
    raise app_error


def test_an_error_out_of_receive_is_the_client_leaving(caplog):
    async def receive():
        raise Cancelled("the proxy cancelled the task")

    async def app(scope, receive, send):
        await started_then(RuntimeError("never reached"), scope, receive, send)

    with caplog.at_level(logging.INFO, logger="lumen.serve"):
        sent = run(app, receive)
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failed, [r.getMessage() for r in failed]
    assert any("the client left (Cancelled)" in r.getMessage() for r in caplog.records)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]   # no 500 after it


def test_an_error_after_a_disconnect_is_the_client_leaving(caplog):
    async def receive():
        return {"type": "http.disconnect"}

    async def app(scope, receive, send):
        await started_then(asyncio.InvalidStateError("writing to a closed stream"), scope, receive, send)

    with caplog.at_level(logging.INFO, logger="lumen.serve"):
        run(app, receive)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_handler_that_fails_is_still_a_logged_500(caplog):
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def app(scope, receive, send):
        raise ValueError("a bug")

    with caplog.at_level(logging.INFO, logger="lumen.serve"):
        sent = run(app, receive)
    assert any(r.levelno == logging.ERROR and "failed" in r.getMessage() for r in caplog.records)
    assert sent[0]["status"] == 500 and b"a bug" in sent[1]["body"]


def test_a_stream_the_client_left_is_logged_once_as_499(caplog):
    """A streamed answer whose client disconnected ends without its last body message (Starlette stops sending),
    so it was never logged; a finished one is logged once, with its status."""
    async def receive():
        return {"type": "http.disconnect"}

    async def left(scope, receive, send):                  # as a StreamingResponse whose client left
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})

    async def finished(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    for app, status in ((left, 499), (finished, 200)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lumen.serve"):
            run(app, receive)
        lines = [r.getMessage() for r in caplog.records if '"GET /v1/x"' in r.getMessage()]
        assert len(lines) == 1 and f'"GET /v1/x" {status} ' in lines[0], lines
