"""The Gate: pure ASGI middleware in front of every route.

- X-Request-Id: honoured (or made) and echoed on the response; the handlers read it from the scope's state.
- The API key (--api-key): `Authorization: Bearer KEY` (or `X-Api-Key`) on every path but OPEN_PATHS, else 401.
- The body bound (--max-body-mb): past it, by Content-Length or counted as it arrives, 413; and a body that has
  not all arrived BODY_TIMEOUT_S after the headers, 408; one still arriving when the server starts draining,
  503 (so a slow upload does not hold the shutdown); a client gone before its body's end is not answered and its
  truncated body never reaches a handler. Those answers close the connection (a body sent past the bound is
  read and dropped for LINGER_S at most, so a client that sends all before it reads still gets the answer). The
  body is read here whole and handed on, so a handler's later receive() is the client's disconnect.
- HEAD is answered as GET without the body (HTTP's rule; Starlette does it for its routes, FastAPI not).
- One log line per request when its response ends: client, method, path, status, seconds, id, and the token
  counts a handler left in the state ("usage").
- A handler that raises answers 500 for that request alone (logged with its traceback); the server serves on.
  Unless the client is gone: an error raised by receive() (a proxy's cancelled task, a broken transport) or after
  it said the client disconnected is the client leaving, logged in one line, not a failure.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid

from . import protocol as P
from .responses import dumps

log = logging.getLogger("lumen.serve")
OPEN_PATHS = ("/health", "/metrics")          # answered without the API key
BODY_TIMEOUT_S = 60.0                         # 16 MB in it is 280 KB/s; a prompt is far smaller
LINGER_S = 2.0
POLL_S = 0.5                                  # how often a body read looks whether the server is draining
CLOSE = [(b"connection", b"close")]


class Gate:

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, open_paths: tuple = (),
                 body_timeout: float = BODY_TIMEOUT_S, draining=lambda: False):
        self.app, self.api_key, self.max_body, self.body_timeout = app, api_key, max_body_bytes, body_timeout
        self.draining = draining                     # () -> True once the server is shutting down
        self.open_paths = frozenset(OPEN_PATHS + tuple(open_paths))     # + the UI's pages (lumen.serve.ui.PAGES)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        t0 = time.perf_counter()
        status = [0]
        head = scope["method"] == "HEAD"

        async def send_(msg):
            if head and msg["type"] == "http.response.body":
                msg = dict(msg, body=b"")
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                msg = dict(msg, headers=[*msg.get("headers", []), (b"x-request-id", rid.encode("latin-1"))])
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                self._log(scope, status[0], rid, time.perf_counter() - t0, state.get("usage"))
                status[0] = -1                       # logged

        async def reply(code: int, message: str, extra: list | None = None):
            body = dumps(P.error_body(code, message)).encode()
            await send_({"type": "http.response.start", "status": code,
                         "headers": [(b"content-type", b"application/json"),
                                     (b"content-length", str(len(body)).encode()), *(extra or [])]})
            await send_({"type": "http.response.body", "body": body})

        if self.api_key is not None and scope["path"] not in self.open_paths and not self._authorized(headers):
            return await reply(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               [(b"www-authenticate", b"Bearer")])
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(headers, receive)
            if body == 413:
                return await reply(413, f"the request body is larger than {self.max_body} bytes", CLOSE)
            if body == 408:
                return await reply(408, f"the request body did not arrive within {self.body_timeout:g} s", CLOSE)
            if body == 503:
                return await reply(503, "the server is shutting down", [*CLOSE, (b"retry-after", b"1")])
            if body == 499:                          # nothing to answer, nobody to answer
                log.info("request %s: the client left before the end of its body", rid)
                return
            receive = _replay(body, receive)
        gone = [False]

        async def receive_():
            try:
                msg = await receive()
            except Exception:                        # noqa: BLE001 - the connection is gone (Ray: TaskCancelledError)
                gone[0] = True
                raise
            if msg.get("type") == "http.disconnect":
                gone[0] = True
            return msg

        try:
            await self.app(dict(scope, method="GET") if head else scope, receive_, send_)
        except Exception as e:                       # noqa: BLE001 - whatever a handler broke: 500, that request
            if gone[0]:
                log.info("request %s: the client left (%s)", rid, type(e).__name__)
                return
            log.exception("request %s failed", rid)
            if status[0] == 0:
                await reply(500, f"internal error: {type(e).__name__}: {e}")
            return
        if status[0] > 0:                            # a response begun and never ended: a stream the client left
            self._log(scope, 499, rid, time.perf_counter() - t0, state.get("usage"))

    def _authorized(self, headers: dict) -> bool:
        auth = headers.get("authorization", "")
        key = auth[7:] if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        return hmac.compare_digest(key.encode(), self.api_key.encode())

    async def _read_body(self, headers: dict, receive) -> bytes | int:
        """The whole body, or the status that refuses it: 413 past the bound (by Content-Length, before reading a
        byte: a client waiting for 100-continue sends none; or counted, then the rest is dropped for LINGER_S at
        most), 408 when it is not all in within body_timeout, 503 when the server starts draining meanwhile, 499
        when the client disconnects before its end."""
        try:
            if int(headers.get("content-length", 0)) > self.max_body:
                return 413
        except ValueError:
            pass
        chunks, size, pending = [], 0, None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        while True:
            if pending is None:
                pending = asyncio.ensure_future(receive())
            left = deadline - loop.time()
            done, _ = await asyncio.wait({pending}, timeout=min(left, POLL_S)) if left > 0 else ((), ())
            if not done:                         # receive() is cancelled only when the body is given up
                if left <= POLL_S or self.draining():
                    pending.cancel()
                    return 413 if size > self.max_body else 408 if left <= POLL_S else 503
                continue
            msg, pending = pending.result(), None
            if msg["type"] == "http.disconnect":
                return 499
            if size <= self.max_body:
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > self.max_body:         # drop what follows for a moment, then refuse
                    chunks, deadline = [], min(deadline, loop.time() + LINGER_S)
                else:
                    chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        return 413 if size > self.max_body else b"".join(chunks)

    @staticmethod
    def _log(scope, status: int, rid: str, seconds: float, usage: dict | None) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        extra = ""
        if usage:
            extra = (f" prompt={usage['prompt_tokens']} completion={usage['completion_tokens']} "
                     f"cached={usage['prompt_tokens_details']['cached_tokens']}")
        log.info('%s "%s %s" %d %.3fs id=%s%s', who, scope["method"], scope["path"], status, seconds, rid, extra)


def _replay(body: bytes, receive):
    """A receive that gives the buffered body once, then what the client sends next (its disconnect)."""
    sent = [False]

    async def receive_():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return receive_

