"""GET /v1/models and /v1/models/{id}: the one model this server serves."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request

from .. import protocol as P
from .serving import Serving

router = APIRouter()


class ServingModels(Serving):

    def __init__(self, worker, prompter, settings):
        super().__init__(worker, prompter, settings)
        self.created = int(time.time())

    def card(self) -> dict:
        return {"id": self.settings.model_id, "object": "model", "created": self.created, "owned_by": "lumen",
                "root": str(self.engine.parts.path), "max_model_len": self.engine.max_model_len}

    def listing(self) -> dict:
        return {"object": "list", "data": [self.card()]}

    def get(self, name: str) -> dict:
        if name != self.settings.model_id:
            raise P.ApiError(404, f"the model {name!r} does not exist", "model")
        return self.card()


@router.get("/v1/models")
async def models(request: Request):
    serving: ServingModels = request.app.state.models
    return serving.listing()


@router.get("/v1/models/{name:path}")
async def model(name: str, request: Request):
    serving: ServingModels = request.app.state.models
    return serving.get(name)
