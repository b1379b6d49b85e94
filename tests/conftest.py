"""Shared fixtures: the two real models (fetched on first use into the user's LUMEN_HOME) and a temporary
LUMEN_HOME for everything the tests make.

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
Python's collector happens to run, which large numpy buffers do not trigger."""
import gc
import shutil
import subprocess
import sys
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
        from lumen.engine.llm import open_gguf
        from lumen.model.weights import load_weights
        load_weights(*open_gguf(path))        # writes the cache file (or silently keeps the packs in memory)
        gc.collect()
    print(pack if key and pack.exists() else "")
"""


def _ensure_packs(paths: list[Path]) -> list[Path | None]:
    """The packed-weight cache files of the real models under the current LUMEN_HOME, written there if missing
    (None where the cache is off or cannot be used). In a subprocess: Numba and a repack of Gemma (1.4 GB peak
    RSS on a fresh machine) stay out of the test process."""
    r = subprocess.run([sys.executable, "-c", ENSURE_PACKS, *map(str, paths)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"could not check the real models' packs:\n{r.stderr}")
    return [Path(line) if line else None for line in r.stdout.splitlines()]


def _link_real_models(home: Path) -> Path:
    """Link the real models and their packs into `home` (a LUMEN_HOME); nothing in it points to a writable copy
    of a user file: the model stamp is a copy, and a pack that must be rewritten replaces its link."""
    from lumen.model.store import MODELS
    for name, path in _REAL.items():
        assert MODELS[name].filename == path.name
        mine = home / "models" / name / path.name
        mine.parent.mkdir(parents=True, exist_ok=True)
        mine.symlink_to(path)                       # the stamp holds size and mtime: those of the link's target
        stamp = path.with_name(path.name + ".verified")
        shutil.copyfile(stamp, mine.with_name(stamp.name))
        if _PACKS[name] is not None:
            (home / "packs").mkdir(exist_ok=True)
            (home / "packs" / _PACKS[name].name).symlink_to(_PACKS[name])
    return home


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


@pytest.fixture(scope="session", params=MODEL_NAMES)
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def model_path(model_name, test_home) -> Path:
    return _REAL[model_name]
