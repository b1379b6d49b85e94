"""A first run compiles the forward pass in a child process while it loads the model (lumen.model.precompile): the
child compiles for the types every model passes, what it compiles is what the parent then runs (no second
compile, the same bits), and the child never outlives its parent. The forward pass calls the attention kernel and
mm3 through the entry table, at the types their entries are compiled for."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from numba import njit
from numba.core.errors import TypingError

import lumen
from lumen.kernels.attention import (attention_args, attention_kernel, attention_signature, lane_address,
                                     run_attention)
from lumen.kernels.entries import address
from lumen.kernels.kinds import ATTN, ATTN_LANE, MM3, N_ENTRIES
from lumen.model import precompile
from lumen.model.forward import forward, mm3, mm3_signature
from synth import write_model

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


def _sig(args):
    return precompile.signature(forward, args)


def test_forward_args_have_every_models_types(smollm2_path, gemma3_path, tmp_path):
    want = _sig(precompile.forward_args())
    models = [smollm2_path, gemma3_path]
    for arch, qt in (("llama", T.Q8_0), ("gemma3", T.Q5_0), ("qwen2", T.Q4_0)):
        models.append(tmp_path / f"{arch}.gguf")
        write_model(models[-1], arch, qtype=qt)
    for path in models:
        m = lumen.load(path, ctx=64, threads=1)
        r = m.runner
        for n, profiled in ((1, False), (3, True)):
            got = _sig(r.forward_args(n, 1, r.logits_rows(1), profiled))
            assert got == want, f"{path.name}: the forward pass's types changed; update forward_args"


# A first run on an empty compile cache: which functions this process compiled, what the cache holds after, the
# tokens, and the child started.
FIRST_RUN = r"""
import json, sys
from numba.core import event
compiled = []

class Listen(event.Listener):
    def on_start(self, ev):
        pass

    def on_end(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)

with event.install_listener("numba:compile", Listen()):
    import lumen
    from lumen.model import precompile
    m = lumen.load(sys.argv[1], ctx=64, threads=2)
    started, ready = precompile._started, precompile.ready()
    ids = [t.id for t in m.generate(sys.argv[2], max_tokens=6, temperature=0, ignore_eos=True)]
from lumen.kernels.attention import attention_kernel
from lumen.kernels.matmul import matmul_kernel, tile_one, tiles
from lumen.model.forward import forward, mm3
index = lambda d: len(d._cache._cache_file._load_index())
print(json.dumps({"compiled": compiled, "started": started, "ready": ready, "ids": ids, "mm3_sigs": index(mm3),
                  "attention_sigs": index(attention_kernel), "forward_sigs": index(forward),
                  "sigs": {d.__name__: index(d) for d in (tiles, tile_one, matmul_kernel)}}))
"""


@pytest.mark.slow
def test_a_first_run_runs_what_the_child_compiled(smollm2_path, tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "LUMEN_PRECOMPILE": "1"}
    r = subprocess.run([sys.executable, "-c", FIRST_RUN, str(smollm2_path), PROMPT], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["started"] and not got["ready"]               # (the CLI then waits for it under its status line)
    assert "forward" not in got["compiled"]                  # loaded from the cache the child filled
    assert "mm3" not in got["compiled"]                      # the child's too, loaded for the entry table
    assert "attention_kernel" in got["compiled"]             # compiled here, meanwhile
    assert got["forward_sigs"] == 1
    assert got["attention_sigs"] == 1 and got["mm3_sigs"] == 1   # each compiled once, for the entry table
    # by this process or by the child, whichever came to it first (the child takes the table's entries from
    # the end): the tile loop once for both of SmolLM2's matrix types, and each type's kernels
    assert got["sigs"] == {"tiles": 1, "tile_one": 2, "matmul_kernel": 1}
    assert got["compiled"].count("tile_one") <= 2 and got["compiled"].count("matmul_kernel") <= 1
    m = lumen.load(smollm2_path, ctx=64, threads=2)          # this session's cache: the same tokens
    assert got["ids"] == [t.id for t in m.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)]


# A parent that starts the child (its own attention compile on a thread), says the child's pid and waits to be killed.
PARENT = r"""
import sys, threading, time
from lumen.model import precompile
threading.Thread(target=precompile.start, daemon=True).start()
while precompile._child is None:
    time.sleep(0.01)
print(precompile._child.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):     # exited, not yet reaped by init
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="the child's parent-death signal is Linux's prctl")
def test_the_child_never_outlives_its_parent(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "LUMEN_PRECOMPILE": "1"}
    p = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        child = int(p.stdout.readline())
        assert not _gone(child, 0.5)                             # compiling
        p.send_signal(signal.SIGKILL)                            # no atexit: the parent-death signal stops it
        p.wait(30)
        assert _gone(child, 20)
    finally:
        p.kill()
        p.wait(30)
        p.stdout.close()


def test_nothing_starts_when_the_cache_has_it(smollm2_path):
    m = lumen.load(smollm2_path, ctx=64, threads=1)
    list(m.generate(PROMPT, max_tokens=1))                   # the forward pass compiled or loaded: cached
    assert precompile.cached(forward, _sig(precompile.forward_args()))
    assert precompile.start() is False
    assert precompile._child is None and precompile.wait() == 0.0
    assert precompile.ready()                                # (the CLI skips its throwaway token)


def test_the_forward_pass_calls_attention_and_mm3_through_the_entry_table(smollm2_path):
    # Not linked into the forward pass (which would optimize and generate their code again), so the table must
    # hold the very code compiled for them at the forward pass's types
    table = lumen.load(smollm2_path, ctx=64, threads=1).runner.w.kinds
    assert table.shape == (N_ENTRIES,)
    assert table[ATTN] == address(attention_kernel, attention_signature(), "attention") != 0
    assert table[ATTN_LANE] == lane_address() != 0              # the lane function the kernel's threads run
    assert table[MM3] == address(mm3, mm3_signature(), "mm3") != 0


def test_an_entry_called_at_other_types_is_a_compile_error():
    # The call is through a bare address: arguments of other types must fail to compile, never reach the code
    args = list(attention_args())
    args[1] = np.zeros((1, 1, 1))                            # float64 q

    @njit
    def go(table, a0, a1, a2, a3, a4, a5, a6, a7, a8):
        run_attention(table, a0, a1, a2, a3, a4, a5, a6, a7, a8)

    with pytest.raises(TypingError, match="attention entry is compiled for"):
        go(np.zeros(N_ENTRIES, np.int64), *args)
