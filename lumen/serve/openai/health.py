"""GET /health (503 while the server drains) and /metrics (Prometheus text, lumen/serve/metrics.py). Both are
answered without the API key (lumen.serve.gate.OPEN_PATHS)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..metrics import CONTENT_TYPE

router = APIRouter()


class ServingHealth:
    """The worker's state and the metrics' text; `metrics` is anything with render() -> bytes (lumen.serve.metrics
    .Metrics, or lumen.serve.ray.metrics.ReplicaMetrics)."""

    def __init__(self, worker, metrics):
        self.worker, self.metrics = worker, metrics

    def health(self) -> Response | dict:
        if self.worker.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    def render_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/health")
async def health(request: Request):
    serving: ServingHealth = request.app.state.health
    return serving.health()


@router.get("/metrics")
async def metrics(request: Request):
    serving: ServingHealth = request.app.state.health
    return serving.render_metrics()
