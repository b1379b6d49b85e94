"""This CPU's identity, for the caches and records that are only valid on the CPU that measured them (the machine
limits of lumen.machine, the benchmark gates' baselines).

    cpu_key(cpu_info())   # 'AMD EPYC | family 26 model 2 | 2 CPUs | avx2 avx512bw avx512_vnni avx512f avx_vnni fma'

A hypervisor may show a generic model name ("AMD EPYC" for both a Zen 4 guest, family 25, and a Zen 5 one, family
26), so the name alone does not tell two CPUs apart: the key holds the identity numbers of /proc/cpuinfo too.
Bottom floor: imports nothing of Lumen (no Numba), so any layer and the test machinery can use it.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

ISA = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")  # flags that decide speed


def read_cpuinfo(text: str | None = None) -> dict:
    """The first processor's fields of /proc/cpuinfo (or of `text`), {name: value}; {} where there is none."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break               # the end of the first processor's block
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's, else what the platform module gives."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_info(cpuinfo: dict | None = None) -> dict:
    """The CPU: model name (cpu_model()), its identity numbers, the vector ISA flags that decide kernel speed, CPU
    count. The identity is x86's "family F model M" (what tells a Zen 4 guest, family 25, from a Zen 5 one, family
    26, when both show "AMD EPYC"), or ARM's "implementer I part P"; "" where /proc/cpuinfo gives neither."""
    info = read_cpuinfo() if cpuinfo is None else cpuinfo
    flags = set((info.get("flags") or info.get("Features") or "").split())
    if "cpu family" in info and "model" in info:
        ident = f"family {info['cpu family']} model {info['model']}"
    elif "CPU implementer" in info and "CPU part" in info:
        ident = f"implementer {info['CPU implementer']} part {info['CPU part']}"
    else:
        ident = ""
    return {"model": info.get("model name") or cpu_model(), "id": ident,
            "isa": sorted(f for f in flags if f in ISA), "cpus": os.cpu_count(), "target": compile_target()}


def compile_target() -> str:
    """The CPU Numba is told to compile for instead of this one, "" when it is not: NUMBA_CPU_NAME (the features
    are this CPU's unless NUMBA_CPU_FEATURES is set; Numba's own rule). What runs, and how fast, is the target's
    code: a figure measured for haswell code on a Zen 5 is not a Zen 5 figure."""
    name, features = os.environ.get("NUMBA_CPU_NAME"), os.environ.get("NUMBA_CPU_FEATURES")
    if name is None and features is None:
        return ""
    if features is None and str(name).lower() == "generic":
        features = ""                                   # (Numba's default for generic)
    return f"{name or 'this CPU'}, features {'of this CPU' if features is None else repr(features)}"


def cpu_key(cpu: dict) -> str:
    """The key of a CPU: "model name | identity | N CPUs | ISA flags". A hypervisor may show a generic model name
    ("AMD EPYC" for both a Zen 4 and a Zen 5 guest), so the family and model numbers are part of the key, and so
    are the ISA flags (a guest may not be granted all of its CPU's), and the CPU Numba compiles for when it is
    told another one (compile_target: code built for haswell runs at haswell code's speed on any host)."""
    isa = " ".join(cpu["isa"]) or "no AVX2"
    key = f"{cpu['model']} | {cpu.get('id') or 'identity unknown'} | {cpu['cpus']} CPUs | {isa}"
    return key + (f" | compiled for {cpu['target']}" if cpu.get("target") else "")


def cpu_quota(cgroup: str | None = None, root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs' worth of time a cgroup quota lets this process use (`docker --cpus=1.5`: 1.5), the smallest on
    the path from its cgroup up to the root; None when there is none or it cannot be read. cgroup: the text of
    /proc/self/cgroup (read when None); root: where the cgroup file systems are mounted.
    cgroup v2: <root>/<path>/cpu.max is "quota period" or "max period"; v1: cpu.cfs_quota_us (-1: none) and
    cpu.cfs_period_us in the cpu controller's mount (<root>/cpu or <root>/cpu,cpuacct)."""
    if cgroup is None:
        try:
            cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    base = Path(root)
    dirs = []                                           # (directory of the cgroup, v2?) deepest first
    for line in cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = Path(path.strip().lstrip("/"))
        if hid == "0" and controllers == "":
            mounts = [(base, True), (base / "unified", True)]
        elif "cpu" in controllers.split(","):
            mounts = [(base / name, False) for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")]
        else:
            continue
        for mount, v2 in mounts:
            for d in (mount / rel, *(mount / rel).parents):
                if mount in (d, *d.parents):
                    dirs.append((d, v2))
    best = None
    for d, v2 in dirs:
        try:
            if v2:
                quota, period = (d / "cpu.max").read_text().split()[:2]
                if quota == "max":
                    continue
            else:
                quota, period = (d / "cpu.cfs_quota_us").read_text(), (d / "cpu.cfs_period_us").read_text()
            q = int(quota) / int(period)
        except (OSError, ValueError, ZeroDivisionError):
            continue
        if q > 0:
            best = q if best is None else min(best, q)
    return best


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (sched_getaffinity: taskset, a container's cpuset), or every CPU where the
    OS cannot say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process can compute on at once: its allowed_cpus, fewer under a cgroup CPU quota
    (cpu_quota, rounded up). os.cpu_count() counts the machine's, which a process may not use: more threads than
    this wait on each other at every barrier."""
    n = len(allowed_cpus())
    q = cpu_quota()
    if q is not None:
        import math
        n = min(n, max(1, math.ceil(q - 1e-9)))
    return max(1, n)
