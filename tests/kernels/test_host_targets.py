"""Kernels compiled for another CPU than this one (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES): what a host without
AVX512-VNNI, or without AVX-512, gets, checked on whatever CPU the tests run on.

Each case runs in a child process with its own Numba cache (the target is read when Numba starts, and a cache
compiled for one target must not mix with this process's)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_matmul import PORTABLE_SCRIPT, assert_bits_of_this_build


VNNI_OF = "import lumen.kernels.simd as simd; print(simd.VNNI, simd.MADD)"


def _env(tmp_path, cpu: str, features: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_FEATURES", "LUMEN_NO_VNNI")}
    env.update(NUMBA_CPU_NAME=cpu, NUMBA_CACHE_DIR=str(tmp_path / f"numba-{cpu}"), LUMEN_HOME=str(tmp_path / "home"))
    if features is not None:
        env["NUMBA_CPU_FEATURES"] = features
    return env


@pytest.mark.parametrize("cpu, features, vnni, madd", [
    ("haswell", "", False, 256),            # AVX2 only: vpmaddubsw on ymm
    ("skylake-avx512", "", False, 512),     # AVX-512 without VNNI: vpmaddubsw on zmm
    ("x86-64-v4", "", False, 512),
    ("x86-64-v2", "", False, 0),            # SSE4.2: the portable IR
    ("generic", None, False, 0),            # Numba's portable target (NUMBA_CPU_FEATURES defaults to "")
    ("cascadelake", "", True, 0),           # AVX-512 with VNNI
    ("znver4", "", True, 0),
    ("znver4", "-avx512vnni", False, 512),  # a CPU name with a feature taken away
])
def test_vnni_follows_the_compile_target(tmp_path, cpu, features, vnni, madd):
    """The tiles use vpdpbusd exactly when the CPU Numba compiles for has it, whatever this CPU has: LLVM aborted
    compiling a vpdpbusd for haswell on a VNNI host, and would encode one that a VNNI-less host cannot run; and
    without it, vpmaddubsw at the widest the target has (simd.MADD), else the portable IR."""
    r = subprocess.run([sys.executable, "-c", VNNI_OF], env=_env(tmp_path, cpu, features), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [str(vnni), str(madd)]


@pytest.mark.slow
def test_tiles_compiled_for_avx2_only(tmp_path):
    """Compiled for an AVX2-only CPU (haswell) the tile kernels run (no abort), use no AVX-512 register but AVX2's
    vpmaddubsw, and give the bits this CPU's build gives (within the float64 reference's bound too): the decode kernel, the NR-row
    passes and the passes over tiles unpacked first."""
    res = tmp_path / "haswell.npz"
    script = PORTABLE_SCRIPT + (
        "\nasm = ''.join(matmul_kernel.inspect_asm().values())"
        "\nprint('asm', asm.count('zmm'), asm.count('ymm'), asm.count('vpdpbusd'), asm.count('vpmaddubsw'))\n")
    r = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent), str(res)],
                       env=_env(tmp_path, "haswell", ""), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    zmm, ymm, dp, madd = (int(v) for v in r.stdout.split("asm", 1)[1].split())
    assert zmm == 0 and dp == 0 and ymm > 0 and madd > 0, (zmm, ymm, dp, madd)      # AVX2's int8 dot, not the IR's
    assert_bits_of_this_build(np.load(res), "haswell")


HALF_SCRIPT = r"""
import sys, numpy as np, numba
sys.path.insert(0, sys.argv[1])
from lumen.format.quants import ACT_FORMAT, QT, dequantize_ref
from lumen.kernels.kinds import kinds
from lumen.kernels.layout import R
from lumen.kernels.matmul import mat, matmul_kernel, new_acts, prepare, prepare_x, unpack_scratch
from lumen.kernels.scratch import per_thread
from lumen.kernels.work import counters
from test_matmul import check, make_weight
th, rng = numba.get_num_threads(), np.random.default_rng(7)
raw = make_weight(QT.Q8_0, 80, 512, rng)
p = prepare(raw, QT.Q8_0)
x = rng.standard_normal((1, 512)).astype(np.float32)
acts = new_acts(1, 512, ACT_FORMAT[QT.Q8_0])
prepare_x(acts, x, ACT_FORMAT[QT.Q8_0])
o = np.zeros((1, 80), np.float32)
m = mat(p)
matmul_kernel((o, o, o), (m, m, m), 1, acts, per_thread((th, R), np.float32), unpack_scratch(th, 512), counters(th),
              kinds(mats=(QT.Q8_0,), embd=(), acts=()))
check(o, x, dequantize_ref(raw, QT.Q8_0, (80, 512)).astype(np.float64), QT.Q8_0)
print("ok", o.tobytes().hex())
"""


def _has_half_conversions() -> bool:
    import ctypes
    try:
        lib = ctypes.CDLL("libgcc_s.so.1")
    except OSError:
        return False
    return hasattr(lib, "__extendhfsf2") and hasattr(lib, "__truncsfhf2")


@pytest.mark.slow
@pytest.mark.skipif(not _has_half_conversions(), reason="no libgcc_s with the half conversions (GCC 12 or later)")
def test_tiles_compiled_without_f16c(tmp_path):
    """Compiled for x86-64-v2 (SSE4.2: no F16C, no FMA; what NUMBA_CPU_NAME=generic also lacks) a Q8_0 tile runs
    in the portable IR, holds the float64 reference's bound and gives this build's bits: its f16 scales are library
    calls, which aborted the process ("LLVM ERROR: Symbol not found: __extendhfsf2") until lumen.kernels loaded
    them."""
    from lumen.format.quants import QT
    from lumen.kernels.matmul import matmul, prepare
    from test_matmul import make_weight
    r = subprocess.run([sys.executable, "-c", HALF_SCRIPT, str(Path(__file__).parent)],
                       env=_env(tmp_path, "x86-64-v2", ""), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.split()[0] == "ok", r.stderr[-3000:]
    rng = np.random.default_rng(7)                  # HALF_SCRIPT's weight and row, through this build's kernels
    raw = make_weight(QT.Q8_0, 80, 512, rng)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    o = np.zeros((1, 80), np.float32)
    matmul(o, x, prepare(raw, QT.Q8_0), QT.Q8_0)
    assert r.stdout.split()[1] == o.tobytes().hex()
