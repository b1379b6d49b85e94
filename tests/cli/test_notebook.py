"""The profiling notebook runs end to end on small token counts and is stored without outputs; every profiling
script runs with --quick and prints its VERDICT line."""
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "profile_smollm2.ipynb"
SCRIPTS = ("attention_share", "kernel_n_vs_1", "thread_scaling", "decode_vs_context", "bandwidth", "startup",
           "batch_decode_scaling", "chunked_prefill_itl", "prefix_cache", "cost_model_accuracy",
           "where_p99_itl_comes_from", "budget_sweep", "batch_step_ops", "spec_verify_cost", "gate_reference",
           "dispatch_cold_cache", "shared_machine", "per_n_roofline", "structured_output",
           "small_n_threads", "vnni_ports", "attention_rows", "ngram_replay", "compile_profile",
           "serving_schedulers", "decode_stream", "unpack_rows", "pack_pages")
SERVING = ROOT / "notebooks" / "serving.ipynb"
SERVING_SMALL = ('MODEL = "smollm2-135m"\nN_REQUESTS = 4\nRATE = 8.0\nDECODES = 2\nCHUNK = 16\nREPEATS = 1\n'
                 'GRID = "tiny"\n')
SMALL = 'MODEL = "smollm2-135m"\nPROMPT_TOKENS = 8\nGEN_TOKENS = 4\nATTN_LENGTHS = [4, 16]\nREPEATS = 1\n'


@pytest.mark.parametrize("path", [NOTEBOOK, SERVING], ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} has stored outputs; clear them before committing"
            assert cell.execution_count is None, f"cell {i} has an execution count; clear it before committing"


@pytest.mark.slow
def test_serving_notebook_runs_and_settles_its_question(smollm2_path):
    from nbclient import NotebookClient
    nb = nbformat.read(SERVING, as_version=4)
    params = [c for c in nb.cells if c.cell_type == "code" and "N_REQUESTS =" in c.source]
    assert len(params) == 1, "the serving notebook needs exactly one parameters cell"
    params[0].source = SERVING_SMALL
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "compute-bound past T*" in text and "TTFT p50" in text and "coverage min" in text
    assert "VERDICT: merging a 16-token chunk into 2 decodes" in text


@pytest.mark.slow
def test_notebook_runs_with_small_parameters(smollm2_path):
    from nbclient import NotebookClient
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if c.cell_type == "code" and "PROMPT_TOKENS =" in c.source]
    assert len(params) == 1, "the notebook needs exactly one parameters cell (PROMPT_TOKENS = ...)"
    params[0].source = SMALL
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "VERDICT: attention is" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "the roofline plot produced no image"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_profiling_script_quick(script, smollm2_path):
    env = dict(os.environ, MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, str(ROOT / "profiling" / f"{script}.py"), "--quick"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    verdicts = [line for line in r.stdout.splitlines() if line.startswith("VERDICT:")]
    assert len(verdicts) == 1, r.stdout[-2000:]


def test_budget_sweep_verdict_gives_no_ratio_to_a_zero_goodput(monkeypatch):
    """Where no fixed budget met the SLOs (a loaded machine), the verdict says the measured scheduler's goodput
    instead of dividing by zero (it printed 148345785.22x)."""
    monkeypatch.syspath_prepend(str(ROOT / "profiling"))
    from budget_sweep import summary
    zero = {4.0: {64: (0.0, 0.0), 512: (0.0, 0.0), "measured": (0.15, 0.2)}}
    line = summary(zero, [4.0], [64, 512])
    assert "goodput is 0.15 req/s where no fixed budget met both SLOs" in line, line
    assert line.endswith("; no fixed budget had any goodput"), line
    both = {2.0: {64: (1.0, 0.95), 512: (0.5, 0.5), "measured": (1.0, 0.95)},
            4.0: {64: (0.5, 0.5), 512: (0.0, 0.0), "measured": (1.0, 0.6)}}
    line = summary(both, [2.0, 4.0], [64, 512])
    assert line.startswith("at 4.0 req/s") and "2.00x the best fixed budget's (64)" in line, line
    assert line.endswith("at worst 1.00x over the 2 rates where a fixed budget had any goodput"), line
