"""The tests leave the user's LUMEN_HOME as it was (tests/conftest.py: a temporary LUMEN_HOME for the session),
while the real models and their packs are used from it, not copied or rebuilt."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_synthetic_model_leaves_the_user_home_alone(tmp_path, new_home):
    """tests/home_check.py in a pytest of its own, whose user home (HOME and LUMEN_HOME) is a fresh directory with
    the real models linked in: the real user home is written meanwhile by other processes (the other worker,
    the warm-up compile, anything the user runs), so a before/after comparison of it raced them. Numba's cache
    stays the user's (NUMBA_CACHE_DIR, inherited): it is shared on purpose, and warm."""
    user = new_home(tmp_path / "user")
    env = {k: v for k, v in os.environ.items() if k not in ("LUMEN_TESTS_WARM_LOCK", "PYTEST_XDIST_WORKER")}
    env.update(HOME=str(tmp_path / "home"), LUMEN_HOME=str(user))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--basetemp",
                        str(tmp_path / "inner"), str(TESTS / "home_check.py")], cwd=TESTS.parent, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr


def test_real_models_resolve_to_the_user_store(smollm2_path, gemma3_path, user_home, test_home):
    """A real model by name resolves, in the test home, to a link to the user's file; a load reads its pack
    through the link (the user's pack cache file) instead of repacking."""
    from lumen.model.store import resolve
    for name, path in (("smollm2-135m", smollm2_path), ("gemma3-270m", gemma3_path)):
        assert path.is_relative_to(user_home)
        mine = resolve(name, quiet=True)
        assert mine.is_relative_to(test_home) and mine.resolve() == path.resolve()
    packs = list((test_home / "packs").glob("SmolLM2-*.lpack"))
    if packs:  # none when LUMEN_PACK_CACHE=0
        assert all(p.is_symlink() and p.resolve().is_relative_to(user_home.resolve()) for p in packs)
