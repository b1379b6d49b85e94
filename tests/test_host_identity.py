"""What keys Lumen's per-machine caches and records when the code is compiled for another CPU than this one
(NUMBA_CPU_NAME, NUMBA_CPU_FEATURES): the compile cache directory, the CPU key of the benchmark baselines, the
machine limits' key and the step-cost table's key each tell such a build from this CPU's own, and stay as they
were when no other target is named."""
import pytest

from lumen import paths
from lumen.cpu import cpu_info, cpu_key, read_cpuinfo

ZEN5 = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 26
model		: 2
model name	: AMD EPYC
stepping	: 1
flags		: fpu avx avx2 fma avx512f avx512bw avx512_vnni avx_vnni

"""

TARGETS = [(None, None), ("haswell", ""), ("haswell", None), ("skylake-avx512", ""), ("generic", None),
           (None, "-avx512vnni")]


def _target(monkeypatch, name, features):
    for var, value in (("NUMBA_CPU_NAME", name), ("NUMBA_CPU_FEATURES", features)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)


def test_compile_cache_dir_per_target(monkeypatch, tmp_path):
    """Code compiled for haswell and code compiled for this CPU never share a cache directory (nor the step costs
    keyed by its name); without a target the directory is the one it always was."""
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    dirs = {}
    for name, features in TARGETS:
        _target(monkeypatch, name, features)
        dirs[name, features] = paths.compile_cache_dir()
    assert len(set(dirs.values())) == len(TARGETS), dirs
    _target(monkeypatch, None, None)
    assert paths.compile_cache_dir() == dirs[None, None]


def test_cpu_key_names_another_target(monkeypatch):
    """The CPU key (benchmark baselines, machine limits) of a build for another CPU names that CPU: its figures
    are that code's, not this CPU's own code's."""
    info = read_cpuinfo(ZEN5)
    keys = {}
    for name, features in TARGETS:
        _target(monkeypatch, name, features)
        keys[name, features] = cpu_key(cpu_info(info))
    assert len(set(keys.values())) == len(TARGETS), keys
    assert keys[None, None] == "AMD EPYC | family 26 model 2 | 2 CPUs | avx2 avx512_vnni avx512bw avx512f avx_vnni fma" \
        .replace("2 CPUs", f"{cpu_info(info)['cpus']} CPUs")
    assert keys["haswell", ""].endswith(" | compiled for haswell, features ''")
    assert keys["haswell", None].endswith(" | compiled for haswell, features of this CPU")
    assert keys["generic", None] == keys[None, None] + " | compiled for generic, features ''"  # Numba's default
    _target(monkeypatch, None, None)
    assert not cpu_info(info).get("target")


@pytest.mark.parametrize("name, features", TARGETS[1:3])
def test_machine_and_cost_keys_per_target(monkeypatch, tmp_path, name, features):
    """The machine limits (machine.json) and the measured step costs of a build for another CPU are not this
    CPU's: their keys differ."""
    from lumen.engine.costs.steps import CostKey, cache_key
    from lumen.machine import machine_key
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    key = CostKey(model, 2, 256, 8, 1024)
    _target(monkeypatch, None, None)
    own = machine_key(), cache_key(key)
    _target(monkeypatch, name, features)
    other = machine_key(), cache_key(key)
    assert own[0] != other[0] and own[1] != other[1]
