"""The UI's routes: two pages, their assets, and the two JSON endpoints the pages read.

    GET /                  the chat page (it talks to POST /v1/chat/completions, streamed)
    GET /dashboard         the live dashboard (it polls GET /dashboard/data about once a second)
    GET /ui/<asset>        the pages' scripts, styles and the vendored uPlot (a fixed list, read at startup)
    GET /ui/info           what the chat page needs: the model id, its max_model_len, structured output or not
    GET /dashboard/data    lumen.serve.ui.dashboard.Dashboard.data()

With --api-key, PAGES (the pages and their assets: no data) answer without the key; /ui/info, /dashboard/data
and the API the pages call need it. The pages ask for the key on a 401 and keep it in the tab's sessionStorage.
Every page and asset is sent with a Content-Security-Policy that allows scripts, styles and connections to this
origin only (no inline script), as a second line behind the pages' never treating model output as HTML.
"""
from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..protocol import error_body
from .dashboard import Dashboard
from .steps import StepTap

TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".txt": "text/plain; charset=utf-8"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


def _assets() -> dict[str, tuple[bytes, str]]:
    """Every file under static/ (but the pages): name relative to it -> (bytes, media type)."""
    out = {}
    root = resources.files(__package__) / "static"

    def walk(d, prefix: str):
        for f in d.iterdir():
            if f.is_dir():
                walk(f, f"{prefix}{f.name}/")
            else:
                ext = "." + f.name.rsplit(".", 1)[-1]
                if ext in TYPES or f.name.startswith("LICENSE"):
                    out[prefix + f.name] = (f.read_bytes(), TYPES.get(ext, TYPES[".txt"]))
    walk(root, "")
    return out


ASSETS = _assets()
PAGE_FILES = {"/": "chat.html", "/dashboard": "dashboard.html"}
PAGES = tuple(PAGE_FILES) + tuple(f"/ui/{name}" for name in ASSETS if not name.endswith(".html"))


def page_weight() -> dict[str, int]:
    """Bytes each page loads (the page, its scripts and styles): what the 300 KB budget counts."""
    import re
    out = {}
    for path, page in PAGE_FILES.items():
        html = ASSETS[page][0].decode()
        refs = re.findall(r'(?:src|href)="/ui/([^"]+)"', html)
        out[path] = len(ASSETS[page][0]) + sum(len(ASSETS[r][0]) for r in refs)
    return out


class UI:
    """What the UI's routes read at request time, kept on app.state.ui (add_ui)."""

    def __init__(self, board: Dashboard, info: dict):
        self.board, self.info = board, info


def add_ui(app, registry, tap: StepTap | None, *, model_id: str, max_model_len: int | None = None,
           speculative: str | None = None, structured_output: bool = False) -> None:
    """The UI's routes on app, over the server's Prometheus registry (lumen.serve.metrics.Metrics.registry) and
    the engine thread's StepTap (None: no step records). structured_output: the server honours response_format
    json_schema (the chat page then shows its JSON schema field).

    The routes are module functions that find the dashboard on app.state, as the API's routers do: FastAPI caches
    every endpoint callable it sees (fastapi.dependencies.models, 4096 entries, for the process's life), so a
    closure over the dashboard kept its registry, the metrics and so the engine alive after its server stopped."""
    app.state.ui = UI(Dashboard(registry, tap, model_id=model_id, speculative=speculative),
                      {"model": model_id, "max_model_len": max_model_len, "structured_output": structured_output})
    app.include_router(router)


def _send(name: str) -> Response:
    body, media = ASSETS[name]
    return Response(body, media_type=media, headers=HEADERS)


router = APIRouter()


@router.get("/")
async def chat_page():
    return _send(PAGE_FILES["/"])


@router.get("/dashboard")
async def dashboard_page():
    return _send(PAGE_FILES["/dashboard"])


@router.get("/ui/info")
async def ui_info(request: Request):
    return JSONResponse(request.app.state.ui.info, headers={"Cache-Control": "no-store"})


@router.get("/dashboard/data")
async def dashboard_data(request: Request):
    return JSONResponse(request.app.state.ui.board.data(), headers={"Cache-Control": "no-store"})


@router.get("/ui/{name:path}")
async def asset(name: str):
    if name not in ASSETS or name.endswith(".html"):
        return JSONResponse(error_body(404, f"no route GET /ui/{name}"), status_code=404)
    return _send(name)
