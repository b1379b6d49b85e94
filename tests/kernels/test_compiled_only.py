"""Functions compiled without their Python wrapper (lumen.kernels.jit): compiled callers and the entry table reach
them, fresh or from the cache, and a call from Python is a TypeError, not a jump to a wrapper that is not there."""
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import lumen
from lumen.kernels.jit import CompiledOnly

ROOT = Path(lumen.__file__).resolve().parent.parent


def _compiled_only() -> dict:
    found = {}
    for pkg in ("lumen.kernels", "lumen.model"):
        for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__, pkg + "."):
            for v in vars(importlib.import_module(m.name)).values():
                if isinstance(v, CompiledOnly):
                    found[f"{v.py_func.__module__}.{v.py_func.__qualname__}"] = v
    return found


COMPILED_ONLY = _compiled_only()


def test_the_forward_pass_helpers_and_entries_are_compiled_only():
    assert {"lumen.model.forward.mm3", "lumen.model.forward._mat", "lumen.kernels.matmul.tiles",
            "lumen.kernels.matmul.tile_rows_at", "lumen.kernels.rows.rows_par", "lumen.kernels.norm.rmsnorm_row",
            "lumen.kernels.attention.attention_lane", "lumen.kernels.dequant.row_q4_k"} <= set(COMPILED_ONLY)


@pytest.mark.parametrize("name", sorted(COMPILED_ONLY))
def test_a_call_from_python_is_a_type_error(name):
    with pytest.raises(TypeError, match="called from compiled code only"):
        COMPILED_ONLY[name]()


MODULE = '''
from numba import njit
from lumen.kernels.jit import compiled_only

@compiled_only
def inner(x):
    return x + 1

@compiled_only(c_wrapper=True)
def entry(a):
    a[0] = inner(a[0]) * 2

@njit(cache=True)
def caller(x):
    return inner(x) * 3
'''

SCRIPT = '''
import sys
sys.path[:0] = sys.argv[1:3]
import numpy as np
from numba import njit, typeof
from lumen.kernels.kinds import address, call
import helpers
a = np.array([4.0])
addr = address(helpers.entry, (typeof(a),))

@njit
def through(addr, a):
    call(addr, (a,))

through(addr, a)
print(helpers.caller(2), a[0], helpers.caller.stats.cache_hits.get((typeof(2),), 0) > 0)
for f in (helpers.inner, helpers.entry):
    try:
        f(1)
    except TypeError:
        print("TypeError")
'''


def test_compiled_callers_and_the_table_reach_them_fresh_and_cached(tmp_path):
    (tmp_path / "helpers.py").write_text(MODULE)
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache"), "LUMEN_HOME": str(tmp_path / "home")}
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(ROOT)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, **env})
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(r.stdout.split())
    assert outs[0] == ["9", "10.0", "False", "TypeError", "TypeError"]
    assert outs[1] == ["9", "10.0", "True", "TypeError", "TypeError"]        # the second from the cache
