"""Shared fixtures: the two real models (fetched on first use into the user's LUMEN_HOME) and a temporary
LUMEN_HOME for everything the tests make; Qwen2.5-Coder-0.5B too, for the few tests that take it (qwen05_file,
qwen05_path: fetched only when one of them runs, skipped with the reason when it cannot be).

`test_home` (session, autouse) first resolves the real models in the user's LUMEN_HOME, so they are fetched once
and kept there, and makes sure their packed-weight cache files exist there too (a user-visible asset that saves
a repack at every start: 0.64 s for SmolLM2, 2.5-2.7 s for Gemma, lumen/packcache.py). Then it points LUMEN_HOME at a temporary directory
for the whole session: packs of synthetic models, machine.json measurements and profile outputs land there and
are deleted with it. The temporary home links back to the user's real models (`models/<name>/<file>`, so a model
name resolves without a fetch, in this process and in subprocesses) and to their packs (`packs/<file>`, so
loading a real model reads its cache instead of repacking), and holds a copy of the user's machine.json if there
is one (so tests do not measure this machine again). A test that needs another home of its own gets the same
links from `new_home`.

Every module ends with a garbage collection: a model kept alive by a reference cycle would otherwise stay until
Python's collector happens to run, which large numpy buffers do not trigger.

The suite runs on 2 pytest-xdist workers, a test file to a worker (pyproject.toml's addopts: `-n 2 --dist
loadfile`); `-n 0` runs it in one process. A worker takes the next file when it finishes one, so the files that take
longest go first (`pytest_collection_modifyitems`), and the run does not end waiting on one of them. On an empty
Numba cache, two workers that reach the models at once would each compile the same kernels (1205 s of CPU against
937 s): so the controller compiles them once, in a subprocess started beside the workers (`pytest_sessionstart`),
and a test that runs the models first waits for it; the tests that do not (COMPILE_FREE) go first, meanwhile. The
0.5B is compiled the same way, after the two, only when the collected tests include one that runs it."""
import fcntl
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from goldens import MODEL_NAMES

_REAL: dict[str, Path] = {}          # model name -> its GGUF file in the user's LUMEN_HOME (set by test_home)
_PACKS: dict[str, Path | None] = {}  # model name -> its pack cache file in the user's LUMEN_HOME, if any
_USER: list[Path] = []               # the user's LUMEN_HOME


ENSURE_PACKS = """
import gc, sys
from lumen.model import packcache
from lumen.format.gguf import GGUFFile
for path in sys.argv[1:]:
    key = None
    if packcache.enabled():
        g = GGUFFile(path)
        key = packcache.cache_key(g)          # None: packing sources edited after import, the cache is not used
        pack = packcache.cache_path(g, key) if key else None
        del g
    if key and not pack.exists():
        from lumen.model.parts import open_gguf
        from lumen.model.weights import load_weights
        load_weights(*open_gguf(path))        # writes the cache file (or silently keeps the packs in memory)
        gc.collect()
    print(pack if key and pack.exists() else "")
"""


def _ensure_packs(paths: list[Path], home: Path | None = None) -> list[Path | None]:
    """The packed-weight cache files of the real models under LUMEN_HOME (the current one, or home), written there
    if missing (None where the cache is off or cannot be used). In a subprocess: Numba and a repack of Gemma (1.4
    GB peak RSS on a fresh machine) stay out of the test process."""
    env = {**os.environ, "LUMEN_HOME": str(home)} if home is not None else None
    r = subprocess.run([sys.executable, "-c", ENSURE_PACKS, *map(str, paths)], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0:
        raise RuntimeError(f"could not check the real models' packs:\n{r.stderr}")
    return [Path(line) if line else None for line in r.stdout.splitlines()]


def _link_real_models(home: Path) -> Path:
    """Link the real models and their packs into `home` (a LUMEN_HOME); nothing in it points to a writable copy
    of a user file: the model stamp is a copy, and a pack that must be rewritten replaces its link."""
    for name in _REAL:
        _link_real_model(home, name)
    return home


def _link_real_model(home: Path, name: str) -> None:
    from lumen.model.store import MODELS
    path = _REAL[name]
    assert MODELS[name].filename == path.name
    mine = home / "models" / name / path.name
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.symlink_to(path)                           # the stamp holds size and mtime: those of the link's target
    stamp = path.with_name(path.name + ".verified")
    shutil.copyfile(stamp, mine.with_name(stamp.name))
    if _PACKS[name] is not None:
        (home / "packs").mkdir(exist_ok=True)
        (home / "packs" / _PACKS[name].name).symlink_to(_PACKS[name])


@pytest.fixture(scope="session", autouse=True)
def test_home(tmp_path_factory) -> Path:
    """The temporary LUMEN_HOME of this session (see the module docstring)."""
    from lumen.model.store import lumen_home, resolve
    user = lumen_home()
    _USER[:] = [user]
    for name in MODEL_NAMES:
        _REAL[name] = resolve(name, quiet=True)
    _PACKS.update(zip(MODEL_NAMES, _ensure_packs([_REAL[name] for name in MODEL_NAMES]), strict=True))
    home = _link_real_models(tmp_path_factory.mktemp("lumen_home"))
    if (user / "machine.json").is_file():
        shutil.copyfile(user / "machine.json", home / "machine.json")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LUMEN_HOME", str(home))
        yield home


@pytest.fixture(scope="session")
def new_home(test_home):
    """new_home(dir) -> dir made a LUMEN_HOME with the real models and their packs linked in, as test_home."""
    return _link_real_models


@pytest.fixture(scope="session")
def user_home(test_home) -> Path:
    """The LUMEN_HOME the tests were started with (the user's): the tests must leave it as it was."""
    return _USER[0]


@pytest.fixture(scope="module", autouse=True)
def collect_after_module():
    yield
    gc.collect()


@pytest.fixture(scope="session")
def smollm2_path(test_home) -> Path:
    return _REAL["smollm2-135m"]


@pytest.fixture(scope="session")
def gemma3_path(test_home) -> Path:
    return _REAL["gemma3-270m"]


@pytest.fixture(scope="session")
def qwen05_file(test_home) -> Path:
    """Qwen2.5-Coder-0.5B (qwen2: QKV biases, GQA 7:1, the Qwen BPE, ChatML with tools), only for the tests that
    take it: fetched on first use into the user's LUMEN_HOME (491 MB, as test_home does for the other two) and
    linked into test_home with its pack. Those tests skip, with the reason, where it cannot be fetched."""
    if QWEN05 not in _REAL:
        from lumen.errors import FetchError
        from lumen.model.store import resolve
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LUMEN_HOME", str(_USER[0]))
            try:
                path = resolve(QWEN05, quiet=True)
            except FetchError as e:
                pytest.skip(f"{QWEN05} cannot be fetched: {e}")
        _PACKS[QWEN05], = _ensure_packs([path], home=_USER[0])
        _REAL[QWEN05] = path
        _link_real_model(test_home, QWEN05)
    return _REAL[QWEN05]


@pytest.fixture(scope="session")
def qwen05_path(qwen05_file) -> Path:
    """qwen05_file for a test that runs the model: under xdist, after its warm-up compile has ended
    (pytest_xdist_node_collection_finished)."""
    _wait_for(WARM_LOCK_QWEN)
    return qwen05_file


@pytest.fixture(scope="session", params=MODEL_NAMES)
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def model_path(model_name, test_home) -> Path:
    return _REAL[model_name]


# ---- the order of the files, and one warm-up compile beside the xdist workers (module docstring)

# Seconds per test file in a run of the whole suite (2 workers, empty Numba cache; 2-vCPU Intel Xeon, 2026-12-06,
# --durations=0). A file not listed counts as quick; a stale figure only makes the two workers finish less evenly.
FILE_SECONDS = {"test_serve_ray.py": 246, "test_determinism.py": 181, "test_notebook.py": 175,
                "test_speculative.py": 60, "test_host_targets.py": 96, "test_cli.py": 93, "test_engine.py": 90,
                "test_gguf_fuzz.py": 83, "test_fidelity.py": 74, "test_dashboard_page.py": 69,
                "test_serve_preemption.py": 62, "test_forward.py": 59, "test_serve_load.py": 58, "test_bench.py": 57,
                "test_chat_session.py": 50, "test_serve_pd.py": 45, "test_tools_server.py": 43, "test_threads.py": 42,
                "test_chat_page.py": 41, "test_tokenizer.py": 39, "test_compile_cache.py": 37,
                "test_pack_cache.py": 36, "test_profile_cli.py": 35, "test_ui.py": 32, "test_tools_realistic.py": 32,
                "test_matmul.py": 30, "test_precompile.py": 29, "test_workload_phases.py": 28,
                "test_bench_serve_sweep.py": 27, "test_http_slow_clients.py": 25}
# Tests that do not run the models' forward pass (parsing, tokenizers, grammars, small kernels; a whole file, or
# file::test): they do not wait for the warm-up. The fresh-compile test compiles into a cache of its own.
COMPILE_FREE = {"test_gguf_fuzz.py", "test_gguf.py", "test_tokenizer.py", "test_structured.py", "test_sampler.py",
                "test_chat_template.py", "test_scheduling.py", "test_help.py", "test_home.py", "test_store.py",
                "test_layers.py", "test_serve_handlers.py", "test_structured_fields.py", "test_kernels.py",
                "test_quants.py", "test_threads.py", "test_profiler.py",
                "test_determinism.py::test_fresh_compile_cache_load_and_threads_give_the_same_bits"}
WARM_UP = """
import fcntl, os, sys
import lumen
from lumen import Engine, SamplingParams
after, names = sys.argv[1], sys.argv[2:]
if after:                                           # start when that warm-up has ended
    fd = os.open(after, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.close(fd)
for name in names:                                  # fetched here on first use, as test_home would
    engine = Engine(lumen.load(name, ctx=256, threads=2), max_num_seqs=2, max_num_batched_tokens=64, kv_cache_mb=8)
    engine.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=3, temperature=0))
"""
QWEN05 = "qwen2.5-coder-0.5b"
WARM_LOCK = "LUMEN_TESTS_WARM_LOCK"     # the lock file's path, from the controller to its workers
WARM_LOCK_QWEN = "LUMEN_TESTS_WARM_LOCK_QWEN"  # the same for the 0.5B's warm-up, which runs only if tests need it
_warm_up: list[subprocess.Popen] = []   # the controller's warm-up processes
_qwen_fd: list[int] = []                # the controller's hold on the 0.5B's lock until it knows the tests
_waited: list[bool] = []                # a worker's: [True] once it waited for the first warm-up
_made_locks: list[str] = []             # the controller's: the variables naming the lock files it made


def _compile_free(item) -> bool:
    return item.path.name in COMPILE_FREE or f"{item.path.name}::{item.originalname}" in COMPILE_FREE


def pytest_collection_modifyitems(session, config, items):
    """Files whose first test is compile-free first (so the workers start on them while the warm-up compiles),
    longest first within each part; the order within a file stays."""
    first = {}
    for item in items:
        first.setdefault(item.path, _compile_free(item))
    items.sort(key=lambda item: (not first[item.path], -FILE_SECONDS.get(item.path.name, 0)))


def pytest_configure(config):
    """A run started in the background by a script or a non-interactive shell (`pytest &`, as CI jobs may be)
    starts with SIGINT ignored, and a command a test starts inherits an ignored signal: the tests that press
    Ctrl-C on a command then tested nothing (it ran to its end, status 0) unless an earlier test in that process had
    put a handler back. Ctrl-C is a KeyboardInterrupt again here, which stops what the fixtures started."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _bytecode() -> None:
    """Where Python may not write bytecode (PYTHONDONTWRITEBYTECODE, as some CI images set), every process a test
    starts compiled Lumen's modules from source: 0.1 s for the CLI's imports, 0.3 s with the server's, on a 2-vCPU
    Xeon, and the suite starts hundreds. So the controller compiles them (and the tests' helpers, which scripts
    import) once, into the __pycache__ folders Python would have written (ignored by git; a PYTHONPYCACHEPREFIX
    for the run would not do: it moves every package's bytecode, and numpy's and Numba's would compile again)."""
    if not sys.dont_write_bytecode:
        return
    from lumen.warmup import compile_bytecode
    compile_bytecode()                                  # only what is missing or stale; skips unwritable folders
    compile_bytecode(Path(__file__).parent)


@pytest.hookimpl(tryfirst=True)         # before xdist starts the workers, so that they inherit WARM_LOCK
def pytest_sessionstart(session):
    config = session.config
    if hasattr(config, "workerinput"):
        return
    _bytecode()
    if not getattr(config.option, "numprocesses", 0) or os.environ.get(WARM_LOCK):
        return
    # numpy's OpenBLAS takes a thread per CPU, and its idle threads spin: two workers' float64 references at once
    # (tests/ref_forward.py) took 58.9 s against 35.6 s with one BLAS thread each, on a 2-vCPU Xeon. Two workers
    # keep the CPUs busy between them; the tests check results, not speed.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    fd, path = tempfile.mkstemp(prefix="lumen-tests-warm-", suffix=".lock")
    fcntl.flock(fd, fcntl.LOCK_EX)      # held by the subprocess, which shares the open file, until it exits
    _warm_up.append(subprocess.Popen([sys.executable, "-c", WARM_UP, "", *MODEL_NAMES], pass_fds=(fd,),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    os.close(fd)
    os.environ[WARM_LOCK] = path
    fd, path = tempfile.mkstemp(prefix="lumen-tests-warm-qwen-", suffix=".lock")
    fcntl.flock(fd, fcntl.LOCK_EX)      # held here until the workers' collection says whether the 0.5B runs
    _qwen_fd.append(fd)
    os.environ[WARM_LOCK_QWEN] = path
    _made_locks.extend((WARM_LOCK, WARM_LOCK_QWEN))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The controller learns the tests from the first worker's collection: if any test that runs the 0.5B's
    forward is among them (its id says "qwen": its name or its parameter, and it is not compile-free), the 0.5B
    is compiled once beside the workers, after the first warm-up; otherwise its lock is released at once."""
    if not _qwen_fd:
        return
    fd = _qwen_fd.pop()

    def compile_free(nodeid):
        file, _, test = nodeid.partition("::")
        file = file.rsplit("/", 1)[-1]
        return file in COMPILE_FREE or f"{file}::{test.split('[')[0]}" in COMPILE_FREE

    needs = any("qwen" in i.lower() and not compile_free(i) for i in ids)
    if needs:
        _warm_up.append(subprocess.Popen([sys.executable, "-c", WARM_UP, os.environ[WARM_LOCK], QWEN05],
                                         pass_fds=(fd,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    os.close(fd)


def _wait_for(variable: str) -> None:
    """Block until the warm-up whose lock file the environment variable names has ended (a failed one too: the
    tests compile); no-op without one."""
    if not os.environ.get(variable):
        return
    fd = os.open(os.environ[variable], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)


def pytest_runtest_setup(item):
    if _waited or _compile_free(item) or not os.environ.get(WARM_LOCK):
        return
    _wait_for(WARM_LOCK)
    _waited.append(True)


def pytest_sessionfinish(session):
    for p in _warm_up:
        if p.poll() is None:
            p.kill()
        p.wait()
    for fd in _qwen_fd:
        os.close(fd)
    for variable in _made_locks:
        os.unlink(os.environ.pop(variable))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The benchmark gates (tests/benchmarks, LUMEN_BENCH=1 or LUMEN_BENCH_SMOKE=1) time kernels: they run in this
    one process, with no xdist worker beside them, and their summary reads this process's results. Before xdist's
    own hook, which turns addopts' `-n 2` into workers (set after it, the workers were already on)."""
    if "1" in (os.environ.get("LUMEN_BENCH"), os.environ.get("LUMEN_BENCH_SMOKE")):
        config.option.numprocesses = 0
