"""The benchmark gates' choice of baseline (tests/benchmarks/conftest.py): one entry per CPU, keyed so that two
CPUs a hypervisor shows under one model name do not share one, and no gating against another CPU's entry."""
import importlib.util
from pathlib import Path

import pytest

from lumen.cpu import read_cpuinfo

GATES = Path(__file__).parents[1] / "benchmarks" / "conftest.py"


@pytest.fixture(scope="module")
def gates():
    spec = importlib.util.spec_from_file_location("lumen_bench_gates", GATES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FLAGS = "fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16"


def cpuinfo(family: int, model: int, name: str = "AMD EPYC", flags: str = FLAGS) -> str:
    block = (f"processor\t: {{}}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
             f"model name\t: {name}\nstepping\t: 1\nflags\t\t: {flags}\n\n")
    return block.format(0) + block.format(1)


def test_zen4_and_zen5_guests_of_one_name_get_different_keys(gates):
    zen4 = gates.cpu_info(read_cpuinfo(cpuinfo(25, 17)))
    zen5 = gates.cpu_info(read_cpuinfo(cpuinfo(26, 2)))
    assert zen4["model"] == zen5["model"] == "AMD EPYC" and zen4["isa"] == zen5["isa"]
    assert gates.cpu_key(zen4) != gates.cpu_key(zen5)
    assert "family 25 model 17" in gates.cpu_key(zen4) and "family 26 model 2" in gates.cpu_key(zen5)


def test_arm_and_unknown_cpus_have_keys(gates):
    arm = read_cpuinfo("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n")
    assert "implementer 0x41 part 0xd0c" in gates.cpu_key(gates.cpu_info(arm))
    assert "identity unknown" in gates.cpu_key(gates.cpu_info({}))


def test_a_zen5_run_never_gates_against_the_zen4_entry(gates, monkeypatch):
    monkeypatch.delenv("LUMEN_BENCH_CPU", raising=False)
    zen4 = gates.cpu_info(read_cpuinfo(cpuinfo(25, 17)))
    zen5 = gates.cpu_info(read_cpuinfo(cpuinfo(26, 2)))
    entry = {"cases": {"c": {"norm": 1.0}}, "meta": {"written": "2026-12-03"}}
    baselines = {"cpus": {gates.cpu_key(zen4): entry}}
    assert gates.Gate(zen4, baselines).baseline is entry
    g = gates.Gate(zen5, baselines)
    assert g.baseline is None and g.cases == {}
    why = g.missing_reason()
    assert gates.cpu_key(zen5) in why and "not comparable" in why and "LUMEN_BENCH_WRITE=1" in why


def test_an_entry_keyed_without_the_family_is_read_but_not_gated_against(gates, monkeypatch):
    monkeypatch.delenv("LUMEN_BENCH_CPU", raising=False)
    zen5 = gates.cpu_info(read_cpuinfo(cpuinfo(26, 2)))
    old_key = gates.legacy_key(gates.cpu_key(zen5))        # "AMD EPYC | 2 CPUs | flags", as keys were
    assert old_key.count(" | ") == 2 and gates.legacy_key(old_key) == old_key
    entry = {"cases": {"c": {"norm": 1.0}}, "meta": {}}
    g = gates.Gate(zen5, {"cpus": {old_key: entry}})
    assert g.baseline is None
    why = g.missing_reason()
    assert old_key in why and "LUMEN_BENCH_CPU=" in why and "another CPU of that name" in why
    monkeypatch.setenv("LUMEN_BENCH_CPU", old_key)             # on purpose: gated, and the output says so
    g = gates.Gate(zen5, {"cpus": {old_key: entry}})
    assert g.baseline is entry and "LUMEN_BENCH_CPU" in g.describe()


def test_the_committed_baselines_name_their_cpus_family_and_model(gates):
    cpus = gates.load_baselines()["cpus"]
    assert cpus
    for key, entry in cpus.items():
        assert key.count(" | ") == 3, key
        assert key.split(" | ")[1].startswith(("family ", "implementer ")), key
        assert gates.cpu_key(entry["meta"]["cpu"]) == key
