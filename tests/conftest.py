"""Shared fixtures: the two real models (fetched on first use into LUMEN_HOME) and the golden data."""
from pathlib import Path

import pytest

from goldens import MODEL_NAMES


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from lumen.model.store import resolve
    return resolve("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from lumen.model.store import resolve
    return resolve("gemma3-270m", quiet=True)


@pytest.fixture(scope="session", params=MODEL_NAMES)
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def model_path(model_name) -> Path:
    from lumen.model.store import resolve
    return resolve(model_name, quiet=True)
