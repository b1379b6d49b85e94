"""lumen.machine: the int8 dot kernel against numpy, the measured limits, their cache (kept per CPU identity,
re-measured when damaged), and the fallback without AVX512-VNNI (LUMEN_NO_VNNI=1 in a subprocess with its own
Numba cache)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

SMALL = dict(bw_bytes=1 << 22, reps=2, fma_rounds=2000, dot_rounds=200)


@pytest.mark.parametrize("bits", [256, 512])
def test_int8_dot_kernel_is_the_dot_it_counts(bits):
    """Per lane l: the sum over passes and vectors j of w[j, l, :] (u8) . x[4 (j % 8):][:4] (i8)."""
    from lumen.machine import DOT_BYTES, INT8_DOT, aligned
    rng = np.random.default_rng(0)
    w = aligned((DOT_BYTES,), np.uint8)
    w[:] = rng.integers(0, 256, DOT_BYTES)                    # (16 KB,) u8: the whole unsigned range
    x = rng.integers(-128, 128, 32).astype(np.int8)           # (32,) i8: the whole signed range
    out = np.zeros(32, np.int32)
    INT8_DOT[bits](out, w, x, 3)
    lanes = bits // 32
    wv = w.reshape(-1, lanes, 4).astype(np.int64)             # (vectors, lanes, 4 bytes)
    quad = x.reshape(8, 4).astype(np.int64)[np.arange(wv.shape[0]) % 8]   # (vectors, 4): the broadcast quad
    ref = 3 * np.einsum("jlb,jb->l", wv, quad)
    assert np.array_equal(out[:lanes], ref.astype(np.int32)) and not out[lanes:].any(), (out, ref)


def test_aligned_arrays_start_on_a_cache_line():
    from lumen.machine import aligned
    for shape, dtype in (((2, 16384), np.uint8), ((3, 5), np.int32), ((7,), np.float32)):
        for _ in range(4):
            a = aligned(shape, dtype)
            assert a.ctypes.data % 64 == 0 and a.shape == shape and a.dtype == dtype and not a.any()


def test_measure_small():
    from lumen.machine import int8_isa, measure
    d = measure(threads=2, **SMALL)
    for k in ("bw_1t_gbps", "bw_gbps", "fma_1t_gflops", "fma_gflops", "int8_dot_1t_gops", "int8_dot_gops"):
        assert math.isfinite(d[k]) and d[k] > 0, (k, d)
    assert d["threads"] == 2 and d["cpu"]
    widths = d["int8_dot_widths"]
    assert set(widths) == {"256", "512"} and all(v["1t_gops"] > 0 and v["gops"] > 0 for v in widths.values())
    best = max(widths, key=lambda b: widths[b]["1t_gops"])      # the roof is the faster width, named
    assert d["int8_dot_1t_gops"] == widths[best]["1t_gops"] and d["int8_dot_gops"] == widths[best]["gops"]
    assert d["int8_dot_isa"] == int8_isa(int(best))
    for k in ("l1d_bytes", "l2_bytes", "l3_bytes"):
        assert isinstance(d[k], int) and d[k] >= 0


def test_missing_old_or_foreign_cache_is_measured(tmp_path, monkeypatch, capsys):
    """limits() measures on a missing, older-version or foreign cache (here with small sizes), says so, and caches
    the int8 dot rate with the rest."""
    import lumen.machine as machine
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    real = machine.measure
    monkeypatch.setattr(machine, "measure", lambda: real(**SMALL))
    with pytest.raises(machine.LumenError, match="missing"):
        machine.limits(measure_if_missing=False)
    d = machine.limits()
    assert "is missing; measuring this machine" in capsys.readouterr().err
    cached = json.loads((tmp_path / "machine.json").read_text())
    assert cached == d and cached["version"] == machine.VERSION
    assert cached["int8_dot_gops"] > 0 and cached["int8_dot_1t_gops"] > 0 and cached["int8_dot_isa"]
    assert machine.limits() == d                                   # valid: read back, not measured
    # a cache written before the int8 dot was measured (version 1: an int16 dot) is measured again
    old = {k: v for k, v in d.items() if not k.startswith("int8_dot")}
    (tmp_path / "machine.json").write_text(json.dumps(dict(old, version=1, int_dot_gops=21.0)))
    assert machine.limits()["int8_dot_gops"] > 0
    assert "older version of these kernels" in capsys.readouterr().err
    (tmp_path / "machine.json").write_text(json.dumps(dict(d, cpu_key="another CPU", bw_gbps=1e-3)))
    assert machine.limits()["bw_gbps"] > 1e-3
    assert "another CPU" in capsys.readouterr().err
    other = "portable vector IR, 256-bit" if machine.simd.VNNI else "vpdpbusd, 512-bit (AVX512-VNNI)"
    (tmp_path / "machine.json").write_text(json.dumps(dict(d, int8_dot_isa=other, bw_gbps=1e-3)))
    assert machine.limits()["bw_gbps"] > 1e-3                      # the other int8 dot (LUMEN_NO_VNNI): measured
    assert "LUMEN_NO_VNNI" in capsys.readouterr().err
    (tmp_path / "machine.json").write_text("[1, 2]")                # JSON, but not the limits: unreadable
    assert machine.limits()["bw_gbps"] > 0
    assert "is unreadable" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["machine.json", "machine.lock"]   # no temporary left


def test_limits_follow_the_cpus_this_process_may_use(tmp_path, monkeypatch, capsys):
    """Under taskset -c 0 (here: usable_cpus() = 1) the all-thread figures are measured on 1 thread, and the
    machine's 2-thread figures are not read back as this process's, nor its 1-thread figures as the machine's."""
    import lumen.machine as machine
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    real = machine.measure
    monkeypatch.setattr(machine, "measure", lambda: real(**SMALL))
    two = real(threads=2, **SMALL)
    (tmp_path / "machine.json").write_text(json.dumps(dict(two, bw_gbps=1e-3)))
    monkeypatch.setattr(machine, "usable_cpus", lambda: 1, raising=False)
    one = machine.limits()
    assert one["threads"] == 1 and one["bw_gbps"] > 1e-3
    assert "was measured on 2 threads, and this process can compute on 1 CPUs" in capsys.readouterr().err
    assert machine.limits() == one                                 # valid here: read back
    monkeypatch.setattr(machine, "usable_cpus", lambda: 2)
    assert machine.limits()["threads"] == 2


def cpuinfo(family: int, model: int, stepping: int = 1) -> str:
    """/proc/cpuinfo of a 2-CPU "AMD EPYC" KVM guest (Zen 4: family 25; Zen 5: family 26), one block per CPU."""
    block = (f"processor\t: {{}}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
             f"model name\t: AMD EPYC\nstepping\t: {stepping}\nflags\t\t: fpu avx2 fma avx512f avx512bw "
             f"avx512_vnni\n")
    return "\n".join(block.format(i) for i in range(2))


def test_machine_key_tells_cpus_of_one_name_apart():
    from lumen.cpu import read_cpuinfo
    from lumen.machine import machine_key
    zen4, zen5 = machine_key(read_cpuinfo(cpuinfo(25, 17))), machine_key(read_cpuinfo(cpuinfo(26, 2)))
    assert zen4 != zen5 and zen4.startswith("AMD EPYC | family 25 model 17 |") and "family 26 model 2" in zen5
    assert zen4.endswith("| vendor AuthenticAMD stepping 1") and "avx512_vnni" in zen4
    assert machine_key(read_cpuinfo(cpuinfo(25, 17, 2))) != zen4            # another stepping
    assert machine_key(read_cpuinfo(cpuinfo(25, 17))) == zen4               # the same CPU: the same key
    arm = machine_key(read_cpuinfo("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n"
                                   "CPU part\t: 0xd0c\n"))
    assert "implementer 0x41 part 0xd0c" in arm
    assert "identity unknown" in machine_key({})                           # no /proc/cpuinfo: still a key


def test_cache_is_kept_per_cpu_identity(tmp_path, monkeypatch, capsys):
    """Two "AMD EPYC" guests with 2 CPUs that differ only in family and model do not share a cache: each is
    measured on the other's; the same identity reads it back; a cache from before the key (no cpu_key) is
    measured again."""
    import lumen.machine as machine
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    real, runs = machine.measure, []
    monkeypatch.setattr(machine, "measure", lambda: runs.append(1) or real(**SMALL))
    cpu = {}
    monkeypatch.setattr(machine, "read_cpuinfo", lambda: cpu["info"])
    from lumen.cpu import read_cpuinfo
    zen4, zen5 = read_cpuinfo(cpuinfo(25, 17)), read_cpuinfo(cpuinfo(26, 2))
    cpu["info"] = zen4
    d4 = machine.limits()
    assert len(runs) == 1 and "family 25 model 17" in d4["cpu_key"] and d4["cpu"] == machine.cpu_model()
    assert machine.limits() == d4 and len(runs) == 1                        # the same CPU: read back
    cpu["info"] = zen5
    d5 = machine.limits()
    assert len(runs) == 2 and "family 26 model 2" in d5["cpu_key"]         # the other: measured, not shared
    assert "was measured on another CPU (AMD EPYC | family 25 model 17" in capsys.readouterr().err
    assert machine.limits() == d5 and len(runs) == 2
    old = {k: v for k, v in d5.items() if k != "cpu_key"}                   # as written before the key
    (tmp_path / "machine.json").write_text(json.dumps(old))
    with pytest.raises(machine.LumenError, match="does not name the CPU's family and model"):
        machine.limits(measure_if_missing=False)
    assert machine.limits()["cpu_key"] == d5["cpu_key"] and len(runs) == 3


@pytest.mark.parametrize("text", [
    '{"bw_gbps": 4',                                              # cut short
    "\x00\xff\xfe garbage",                                        # not text
    "null",
    "FIELD:bw_gbps=fast", "FIELD:threads=0", "FIELD:int8_dot_widths=[1]", "FIELD:int8_dot_widths={\"256\": 1}",
    "FIELD:fma_gflops=NaN", "DROP:measured_at",
])
def test_damaged_cache_is_measured_again(tmp_path, monkeypatch, capsys, text):
    """A damaged machine.json (cut short, not text, a field of the wrong type or missing) is measured again and
    rewritten, never trusted and never a crash."""
    import lumen.machine as machine
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    real, runs = machine.measure, []
    monkeypatch.setattr(machine, "measure", lambda: runs.append(1) or real(**SMALL))
    good = machine.limits()
    path = tmp_path / "machine.json"
    if text.startswith("FIELD:"):
        name, value = text[6:].split("=", 1)
        text = json.dumps(dict(good, **{name: json.loads(value) if value[0] in "[{0N" else value}))
    elif text.startswith("DROP:"):
        text = json.dumps({k: v for k, v in good.items() if k != text[5:]})
    path.write_bytes(text.encode("latin-1"))
    capsys.readouterr()
    d = machine.limits()
    assert len(runs) == 2 and "is unreadable; measuring" in capsys.readouterr().err
    assert json.loads(path.read_text()) == d and d["bw_gbps"] > 0


def test_processes_measure_one_at_a_time(tmp_path, monkeypatch, capsys):
    """Two callers that find no cache at once: one measures, the other waits for it and reads its result (an
    flock per open file, so two threads contend as two processes would); nothing is left beside the cache."""
    import threading
    import time
    import lumen.machine as machine
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path))
    real, runs, busy = machine.measure, [], []

    def slow():
        busy.append(1)
        assert len(busy) == 1, "two measurements at once"
        runs.append(1)
        time.sleep(0.3)
        d = real(**SMALL)
        busy.pop()
        return d

    monkeypatch.setattr(machine, "measure", slow)
    got = []
    ts = [threading.Thread(target=lambda: got.append(machine.limits())) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(runs) == 1 and len(got) == 2 and got[0] == got[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["machine.json", "machine.lock"]
    machine.limits(remeasure=True)                                      # --remeasure: measured whatever the cache
    assert len(runs) == 2


NO_VNNI = """
import re, sys, numpy as np
import lumen.kernels.simd as simd
from lumen.machine import INT8_DOT, measure
d = measure(bw_bytes=1 << 22, reps=2, fma_rounds=2000, dot_rounds=200, threads=1)
asm = {b: k.inspect_asm(k.signatures[0]) for b, k in INT8_DOT.items()}
regs = {b: sorted({m[-3:] for m in re.findall(r"vpdpbusd\\s+%([xyz]mm)", a)}) for b, a in asm.items()}
print(simd.VNNI, all("vpdpbusd" in a for a in asm.values()), regs[256], regs[512], d["int8_dot_1t_gops"],
      d["int8_dot_isa"], sep="|")
"""


@pytest.mark.slow
@pytest.mark.parametrize("no_vnni", ["0", "1"])
def test_the_kernel_is_the_tiles_instruction(tmp_path, no_vnni):
    """With AVX512-VNNI the int8 dot compiles to vpdpbusd; without it (LUMEN_NO_VNNI=1 here) it compiles to the
    portable IR the tile kernels then run, is still measured, and says so."""
    import lumen.kernels.simd as simd
    env = dict(os.environ, LUMEN_NO_VNNI=no_vnni, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    r = subprocess.run([sys.executable, "-c", NO_VNNI], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    vnni, has_dp, regs256, regs512, rate, isa = r.stdout.strip().split("|")
    assert vnni == str(simd.VNNI and no_vnni == "0")
    assert has_dp == vnni                         # vpdpbusd in the machine code exactly when VNNI is on
    if vnni == "True":                            # on ymm and zmm registers: the two widths
        assert (regs256, regs512) == ("['ymm']", "['zmm']"), r.stdout
    assert float(rate) > 0
    assert ("vpdpbusd" in isa) == (vnni == "True") and ("no AVX512-VNNI" in isa) == (vnni == "False")
