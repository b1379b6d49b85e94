"""Hosts that show more CPUs than a process may compute on: a CPU affinity narrower than os.cpu_count() (taskset,
a container's cpuset) or a cgroup CPU quota (`docker --cpus`). The thread count of a step never exceeds what the
process can use, and the process says so."""
import subprocess
import sys

from lumen.cpu import cpu_quota

V1 = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n"
V2 = "0::/system.slice/job.scope\n"


def test_cpu_quota_cgroup_v2(tmp_path):
    """The smallest quota on the path from the process's cgroup to the root, in CPUs; "max" is none."""
    leaf = tmp_path / "system.slice" / "job.scope"
    leaf.mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (leaf / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(V2, str(tmp_path)) is None
    (leaf / "cpu.max").write_text("150000 100000\n")
    assert cpu_quota(V2, str(tmp_path)) == 1.5
    (tmp_path / "system.slice" / "cpu.max").write_text("100000 100000\n")     # a parent's smaller quota binds
    assert cpu_quota(V2, str(tmp_path)) == 1.0


def test_cpu_quota_cgroup_v1(tmp_path):
    """cpu.cfs_quota_us / cpu.cfs_period_us of the cpu controller; -1 is none. A container sees its own cgroup
    at the mount's root, though /proc/self/cgroup names the host's path."""
    mount = tmp_path / "cpu,cpuacct"
    mount.mkdir()
    (mount / "cpu.cfs_quota_us").write_text("-1\n")
    (mount / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(V1, str(tmp_path)) is None
    (mount / "cpu.cfs_quota_us").write_text("50000\n")
    assert cpu_quota(V1, str(tmp_path)) == 0.5
    assert cpu_quota("", str(tmp_path)) is None                  # no cgroup named: no quota
    assert cpu_quota(V1, str(tmp_path / "missing")) is None


ONE_CPU = r"""
import logging, os
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})     # taskset -c <one CPU>, before Numba starts
logging.basicConfig(level=logging.WARNING, format="%(message)s")
import numba
from lumen.cpu import usable_cpus
from lumen.engine.threads import Governor
print("numba", numba.config.NUMBA_NUM_THREADS, "usable", usable_cpus())
for adaptive in (False, True):
    g = Governor(2, adaptive=adaptive)
    print("threads", g.threads(), numba.get_num_threads())
"""


def test_governor_never_runs_more_threads_than_usable_cpus():
    """NUMBA_NUM_THREADS=2 under a one-CPU affinity: Numba starts 2 threads, which on one CPU decoded SmolLM2 at
    16 tok/s against 64 for one thread (--fixed-threads). The Governor runs every step on 1, fixed or adaptive,
    and says so once."""
    env = {"NUMBA_NUM_THREADS": "2"}
    import os
    r = subprocess.run([sys.executable, "-c", ONE_CPU], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "numba 2 usable 1"
    assert lines[1:] == ["threads 1 1", "threads 1 1"], r.stdout
    assert r.stderr.count("2 threads asked, but this process can compute on 1 CPU (affinity 1 of") == 1, r.stderr
