"""Compiling once per machine: `lumen.warmup` compiles what a model needs, a second warm-up compiles nothing, and a
model whose weight types the cache has seen compiles nothing whatever its architecture and sizes."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from synth import write_model

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(?P<model>\S+): ready in [\d.]+ s; compiled (?P<n>\d+) functions? .*loaded (?P<hits>\d+) from",
                  re.M)


def warmup(*models, env=None) -> dict[str, int]:
    """Run `python -m lumen.warmup --model ...` in a fresh process; {model: functions it compiled}."""
    argv = [sys.executable, "-m", "lumen.warmup"] + [a for m in models for a in ("--model", str(m))]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=ROOT,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    found = {m["model"]: int(m["n"]) for m in LINE.finditer(r.stdout)}
    assert len(found) == len(models), r.stdout
    return found


@pytest.mark.slow
def test_models_of_known_types_compile_nothing(smollm2_path, tmp_path):
    # SmolLM2: Q4_1 and Q8_0 matrices, a Q8_0 embedding, SiLU; Gemma-3 adds GELU (and Q5_0, Q4_K, Q6_K). The
    # synthetic models use kinds they have: a llama and a gemma3 (other sizes, norms, RoPE, attention windows),
    # all in Q8_0.
    llama, gemma = tmp_path / "llama-q8.gguf", tmp_path / "gemma3-q8.gguf"
    write_model(llama, "llama", qtype=T.Q8_0)
    write_model(gemma, "gemma3", qtype=T.Q8_0)
    warmup("smollm2-135m", "gemma3-270m")                      # compiles into the session's cache, if need be
    assert warmup(llama, gemma) == {str(llama): 0, str(gemma): 0}
    assert warmup("smollm2-135m", llama) == {"smollm2-135m": 0, str(llama): 0}    # a second warm-up


def test_warmup_compiles_bytecode_python_would_not_write(tmp_path, monkeypatch):
    """compile_bytecode writes the bytecode that is missing or stale, even where Python writes none itself, and
    nothing else; Python then loads it."""
    from lumen.warmup import compile_bytecode
    pkg = tmp_path / "pkg_bc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("X = 1\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert compile_bytecode(pkg) == 3
    assert compile_bytecode(pkg) == 0
    (pkg / "sub" / "mod.py").write_text("X = 22\n")
    assert compile_bytecode(pkg) == 1
    r = subprocess.run([sys.executable, "-v", "-c", "import pkg_bc.sub.mod as m; print(m.X, m.__cached__)"],
                       capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                       timeout=60)
    x, cached = r.stdout.split()
    assert x == "22" and f"code object from '{cached}'" in r.stderr, r.stderr[-2000:]     # loaded, not compiled
    assert compile_bytecode(tmp_path / "nowhere") == 0


def test_warmup_refuses_a_missing_model_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lumen.warmup", "--model", str(tmp_path / "nope.gguf")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 1
    assert r.stderr == f"error: no such model file: {tmp_path / 'nope.gguf'}\n", r.stderr     # named once
    r = subprocess.run([sys.executable, "-m", "lumen.warmup", "--model", "nosuch"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 1 and r.stderr.startswith("error: unknown model 'nosuch'"), r.stderr
    for model in (["--model", "nosuch"], []):        # a wrong flag value is a usage error (2), said first
        r = subprocess.run([sys.executable, "-m", "lumen.warmup", *model, "--threads", "0"], capture_output=True,
                           text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith(
            "python -m lumen.warmup: error: --threads must be between 1 and"), r.stderr


def test_warmup_checks_every_name_before_it_warms_any(tmp_path):
    """Several models: a wrong name among the later ones is refused before the first one compiles."""
    r = subprocess.run([sys.executable, "-m", "lumen.warmup", "--model", "smollm2-135m", "--model", "nosuch"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert r.stderr.startswith("error: unknown model 'nosuch'") and len(r.stderr.splitlines()) == 1, r.stderr


def test_warmup_says_it_is_compiling_only_when_it_compiles(monkeypatch, capsys):
    """A first run compiles for a minute or more: the warm-up says so at once, as the other commands do, and a
    warm cache (nothing compiles) says nothing but its result."""
    import lumen.warmup as warmup_mod
    from lumen.generate import COMPILING
    from numba import njit

    compiles = [True]

    def fake_warm(model, threads=None, draft=False):
        if compiles[0]:
            njit(lambda x: x + 1)(1)                   # a compile, as a first warm-up's
        return warmup_mod.Warmed(model, 0.1, int(compiles[0]), 0.0, 0)

    monkeypatch.setattr(warmup_mod, "warm", fake_warm)
    assert warmup_mod.main(["-m", "smollm2-135m"]) == 0
    out, err = capsys.readouterr()
    assert COMPILING in err and "compiled 1 function (" in out, err
    compiles[0] = False
    assert warmup_mod.main(["-m", "smollm2-135m"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "compiled 0 functions" in out, err


def test_ctrl_c_stops_the_warmup_in_one_line(monkeypatch, capsys):
    import lumen.warmup as warmup_mod

    def interrupted(model, threads=None, draft=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(warmup_mod, "warm", interrupted)
    assert warmup_mod.main(["-m", "smollm2-135m"]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "interrupted", err


def test_a_background_warmup_dies_with_its_parent(smollm2_path, tmp_path):
    """lumen.warmup.in_background (the Ray path's warm-up while Ray starts): its child warms the model up, is
    ended by stop(), and dies with its parent when the parent is killed outright (no process outlives it)."""
    import psutil
    code = ("import sys, time; from lumen import warmup\n"
            f"c = warmup.in_background([{str(smollm2_path)!r}], 1)\n"
            "print(c.pid, flush=True); time.sleep(600)")
    env = {**os.environ, "LUMEN_HOME": str(tmp_path / "home"), "NUMBA_CACHE_DIR": str(tmp_path / "nc")}
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.is_running() and child.ppid() == parent.pid
    finally:
        parent.kill()
        parent.wait()
    gone, alive = psutil.wait_procs([child], timeout=10)     # (a warm-up of an empty cache takes longer)
    assert not alive, "the warm-up outlived its parent"


def test_stop_ends_a_background_warmup():
    from lumen import warmup
    warmup.stop(None)                                          # nothing started: nothing to do
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    warmup.stop(child)
    assert child.poll() is not None


def test_a_draft_model_is_warmed_as_speculation_loads_it(smollm2_path, monkeypatch, capsys):
    """`lumen.warmup --draft-model M` (and the Ray path's background warm-up, for --draft-model) loads M requantized
    as a draft is (SpeculativeConfig.draft_quant), so its packs and kernels are the ones the replicas need."""
    import lumen.model.parts as parts_mod
    import lumen.warmup as warmup_mod
    from lumen.format.quants import QT
    seen, real = [], parts_mod.load_parts

    def spy(model, **kw):
        seen.append(kw.get("requant"))
        return real(model, **kw)
    monkeypatch.setattr(parts_mod, "load_parts", spy)
    assert warmup_mod.main(["--draft-model", str(smollm2_path), "-t", "2"]) == 0
    out, _ = capsys.readouterr()
    assert seen == [QT.Q4_0] and out.startswith(f"{smollm2_path}: ready in "), out
