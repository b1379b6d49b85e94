"""The server's web pages: a chat at `/` and a live dashboard at `/dashboard` (`python -m lumen.serve --no-ui`
turns both off). Self-contained: the routes (router.py), what the dashboard shows (dashboard.py), the engine
steps it records while a page looks (steps.py), and the pages with their vendored chart library (static/; no
network is needed to load them).

    tap = StepTap(); worker.tap = tap                  # the engine thread runs tap.step(engine)
    add_ui(app, metrics.registry, tap, model_id="smollm2-135m")    # the routes, the dashboard on app.state.ui
    Gate(..., open_paths=PAGES)                         # the pages load without the API key; their data does not
"""
from .router import PAGES, add_ui, page_weight
from .steps import StepTap

__all__ = ["PAGES", "StepTap", "add_ui", "page_weight"]
