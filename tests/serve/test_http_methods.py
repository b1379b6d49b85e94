"""HTTP methods against the server's HTTP layer (the Gate and lumen.serve.app's error handlers on uvicorn, in this
process, over small routes: no model needed): HEAD is answered as GET without its body, as HTTP requires of a
server and as monitors send it; a wrong method is a 405 in OpenAI's error shape with the Allow header; an unknown
path a 404 in the same shape. The server is stopped by each test."""
import json
import socket
from contextlib import contextmanager

from fastapi import FastAPI

from lumen.serve.app import add_error_handlers
from lumen.serve.cli import uvicorn_config
from lumen.serve.gate import Gate
from servers import free_port, uvicorn_thread


def small_app():
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions():
        return {"object": "text_completion"}

    app.add_middleware(Gate, api_key=None, max_body_bytes=2 ** 20)
    return app


@contextmanager
def server():
    port = free_port()
    with uvicorn_thread(uvicorn_config(small_app(), host="127.0.0.1", port=port, shutdown_timeout=1,
                                       log_level="warning")):
        yield port


def ask(port: int, method: str, path: str) -> tuple[int, dict, bytes]:
    """Status, headers (lower-case names) and body of one request on a connection the server closes after it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    head, body = got.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def test_head_is_get_without_the_body():
    with server() as port:
        status, headers, body = ask(port, "GET", "/health")
        assert status == 200 and json.loads(body) == {"status": "ok"}
        status, head_headers, head_body = ask(port, "HEAD", "/health")
        assert status == 200 and head_body == b""
        assert head_headers["content-length"] == headers["content-length"]
        assert head_headers["content-type"] == "application/json"


def test_a_wrong_method_is_a_405_with_allow_and_an_unknown_path_a_404_in_openai_shape():
    with server() as port:
        for method, path, allow in [("GET", "/v1/completions", "POST"), ("OPTIONS", "/v1/completions", "POST"),
                                    ("DELETE", "/health", "GET")]:
            status, headers, body = ask(port, method, path)
            assert status == 405, (method, path, status)
            assert headers.get("allow") == allow, (method, path, headers)
            error = json.loads(body)["error"]
            assert error["code"] == 405 and error["type"] == "invalid_request_error" and path in error["message"]
        status, headers, body = ask(port, "GET", "/v1/embeddings")
        assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
