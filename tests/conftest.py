"""Shared fixtures: the two real models (fetched on first use into LUMEN_HOME) and the golden data."""
import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
MODEL_NAMES = ("smollm2-135m", "gemma3-270m")


def golden(name: str) -> dict:
    """Golden llama.cpp data for a model name (see tests/data/README.md)."""
    return json.loads((DATA / f"{name}.llamacpp.json").read_text())


def corpus() -> dict:
    return json.loads((DATA / "corpus.json").read_text())


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from lumen.models import resolve
    return resolve("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from lumen.models import resolve
    return resolve("gemma3-270m", quiet=True)


@pytest.fixture(scope="session", params=MODEL_NAMES)
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def model_path(model_name) -> Path:
    from lumen.models import resolve
    return resolve(model_name, quiet=True)
