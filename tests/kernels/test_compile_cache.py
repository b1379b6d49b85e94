"""Numba's compile cache stays whole when processes compile into it at once (lumen.paths.lock_compile_cache), and
its directory is keyed by the platform as well as the sources."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import lumen.kernels                      # locks Numba's cache (lumen.paths.lock_compile_cache)
    from numba.core import caching
    save_index = caching.IndexDataCacheFile._save_index

    def slow_save_index(self, overloads):     # widen the window between reading the index and writing it
        time.sleep(0.5)
        save_index(self, overloads)

    caching.IndexDataCacheFile._save_index = slow_save_index
    import racy
    start = float(sys.argv[2])
    time.sleep(max(0.0, start - time.time()))
    racy.f({"i": 1, "f": 1.5, "c": 1j, "b": True}[sys.argv[3]])
""")

RACY = textwrap.dedent("""
    from numba import njit

    @njit(cache=True)
    def f(x):
        return x + x
""")

CHECK = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import lumen.kernels
    import racy
    for x in (1, 1.5, 1j, True):
        assert racy.f(x) == x + x
    print(sum(racy.f.stats.cache_misses.values()), sum(racy.f.stats.cache_hits.values()))
""")


def test_processes_that_compile_at_once_keep_the_cache_index_whole(tmp_path):
    (tmp_path / "racy.py").write_text(RACY)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(tmp_path)])}
    start = time.time() + 8                         # every child imports first, then all compile at this time
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(start), kind], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for kind in "ifcb"]
    try:
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    r = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["0", "4"], f"cache misses, hits after 4 processes compiled at once: {r.stdout}"


def test_the_cache_directory_depends_on_the_platform(monkeypatch):
    from lumen import paths
    here = paths.compile_cache_dir()
    assert paths.compile_cache_dir() == here
    monkeypatch.setattr(paths, "_platform", lambda: b"another numba, another cpu")
    assert paths.compile_cache_dir() != here


# A child script's start: `names` collects the functions Numba compiles while a Names() listens.
NAMES = textwrap.dedent("""
    import sys, time
    from numba.core import event
    names = []

    class Names(event.Listener):
        def on_start(self, ev):
            pass

        def on_end(self, ev):
            names.append(ev.data["dispatcher"].py_func.__name__)
""")

# One of two processes that start at once on an empty cache and both need the kernels of one weight type; the
# first (argv[2] = 1) then makes the table of a model with a second type. Prints what each phase compiled.
ENTRIES = NAMES + textwrap.dedent("""
    from lumen.kernels.entries import entries
    from lumen.kernels.kinds import kinds
    time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
    with event.install_listener("numba:compile", Names()):
        entries(kinds(mats=(8,), embd=(8,), acts=(0,)))     # Q8_0 matrices and embedding, SiLU
    print(" ".join(names) or "-")
    names.clear()
    if sys.argv[2] == "1":
        with event.install_listener("numba:compile", Names()):
            entries(kinds(mats=(8, 3), embd=(8,), acts=(0,)))     # and Q4_1 matrices
        print(" ".join(names) or "-")
""")

KERNELS = ("tiles", "tile_one", "tile_rows_at", "tile_unpacked_at", "matmul_kernel")

# The precompiling child's part (lumen.model.precompile) for a model of the types in argv[1]: what it compiled, what
# a type's entries are, and how many kernels it loaded from the cache.
FROM_THE_END = NAMES + textwrap.dedent("""
    from lumen.kernels import attention, dequant, matmul, rows
    from lumen.kernels.entries import compile_from_the_end
    from lumen.kernels.kinds import kinds
    mats = tuple(int(t) for t in sys.argv[1].split(","))
    with event.install_listener("numba:compile", Names()):
        compile_from_the_end(kinds(mats=mats, embd=(8,), acts=(0,)))
    print(" ".join(sorted(n for n in names if n in sys.argv[2:])) or "-")     # (not the overloads' inner functions)
    print(" ".join(sorted(fn.__name__ for fn, ts in matmul.ENTRIES.values() if mats[-1] in ts)))
    kernels = [getattr(m, n) for m in (attention, dequant, matmul, rows) for n in dir(m)]
    print(sum(sum(k.stats.cache_hits.values()) for k in kernels if hasattr(k, "stats")))
""")


def test_processes_that_start_at_once_compile_a_types_kernels_once(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(ROOT)}
    start = time.time() + 8
    procs = [subprocess.Popen([sys.executable, "-c", ENTRIES, str(start), str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
            outs.append(out.splitlines()[-2:] if p is procs[1] else out.splitlines()[-1:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    both = [n for lines in (outs[0], outs[1][:1]) for n in lines[0].split() if n in KERNELS]
    # each kernel once, by one process or the other (a compile turn per kernel: they may share the work)
    assert sorted(both) == sorted(("tiles", "tile_one", "tile_rows_at", "matmul_kernel")), outs
    # a second matrix type compiles its own entries only: the tile loop is one function for every type
    assert sorted(n for n in outs[1][1].split() if n in KERNELS) == sorted(KERNELS[1:4]), outs
    # the precompiling child loads none of what the loader made, and compiles a new type's entries
    for mats, fresh in (("8,3", False), ("8,3,2", True)):
        p = subprocess.run([sys.executable, "-c", FROM_THE_END, mats, *KERNELS], env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        compiled, its_entries, loaded = p.stdout.splitlines()[-3:]
        assert (compiled, loaded) == ((its_entries if fresh else "-"), "0"), p.stdout



RECORDS = textwrap.dedent("""
    from numba import njit

    @njit(cache=True)
    def last(a, out):
        out[0] = a[0].last                    # at the offset of its record type, compiled into each signature
""")

COMPILE_ONE = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import lumen.kernels
    import records
    n, out = int(sys.argv[2]), np.zeros(1, np.int64)
    records.last(np.arange(1, n + 1, dtype=np.uint8).view([(f"f{i}", np.uint8) for i in range(n - 1)]
                                                           + [("last", np.uint8)]), out)
    assert out[0] == n
""")

LOAD_ALL = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    from numba import njit
    import lumen.kernels
    from lumen.kernels.entries import address
    from lumen.kernels.kinds import call
    import records

    @njit
    def through(addr, a, out):
        call(addr, (a, out))

    def record(n):                              # bytes 1..n: its last field holds n
        return np.arange(1, n + 1, dtype=np.uint8).view([(f"f{i}", np.uint8) for i in range(n - 1)] + [("last", "u1")])

    arrays, out = [record(n) for n in (1, 2, 3)], np.zeros(1, np.int64)
    for a in arrays:                            # load every signature from the cache first
        records.last(a, out)
    got = []
    for a in arrays:                            # then call each through its address, as the forward pass does
        sig = (records.last.typeof_pyval(a), records.last.typeof_pyval(out))
        through(address(records.last, sig), a, out)
        got.append(int(out[0]))
    print(*got, sum(records.last.stats.cache_hits.values()))
""")


def test_signatures_cached_by_different_processes_keep_their_own_code(tmp_path):
    """Numba names a compiled signature by a per-process count and its record types by another, so processes that
    each compiled one record signature first saved their code under one symbol, and a process that loaded them
    all found the first one's at every signature's address (lumen.paths.unique_symbols)."""
    (tmp_path / "records.py").write_text(RECORDS)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(tmp_path)])}
    for n in (1, 2, 3):                              # one signature per fresh process, each compiled first there
        r = subprocess.run([sys.executable, "-c", COMPILE_ONE, str(tmp_path), str(n)], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-c", LOAD_ALL, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1", "2", "3", "3"], f"last fields of 1..3-field records, cache hits: {r.stdout}"
