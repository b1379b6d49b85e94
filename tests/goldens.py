"""Paths and loaders of the golden data in tests/data (see tests/data/README.md).

A plain module rather than conftest.py: tests/benchmarks has a conftest.py too, and `from conftest import ...`
would pick whichever of the two pytest imported first."""
import json
from pathlib import Path

DATA = Path(__file__).parent / "data"
MODEL_NAMES = ("smollm2-135m", "gemma3-270m")


def golden(name: str) -> dict:
    """Golden llama.cpp data for a model name."""
    return json.loads((DATA / f"{name}.llamacpp.json").read_text())


def corpus() -> dict:
    return json.loads((DATA / "corpus.json").read_text())
