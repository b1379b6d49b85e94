"""The tests leave the user's LUMEN_HOME as it was (tests/conftest.py: a temporary LUMEN_HOME for the session),
while the real models and their packs are used from it, not copied or rebuilt."""
import os

import lumen
from lumen.model import packcache
from synth import write_model


def files(home) -> dict:
    """path -> (size, mtime) of every file under home (links not followed: the models' store is big)."""
    out = {}
    for root, _, names in os.walk(home):
        for n in names:
            st = os.lstat(os.path.join(root, n))
            out[os.path.join(root, n)] = (st.st_size, st.st_mtime_ns)
    return out


def test_synthetic_model_leaves_the_user_home_alone(tmp_path, user_home, test_home):
    before = files(user_home)
    path = tmp_path / "tiny.gguf"
    write_model(path, "llama")
    m = lumen.load(path, ctx=32)
    m.logits([5, 6, 7])
    if packcache.enabled() and packcache.code_hash() is not None:  # off, or lumen's sources edited meanwhile
        assert m.weights.packs_from == "packed, cached"
        assert list((test_home / "packs").glob("tiny-*.lpack")), "the synthetic model's pack goes to the test home"
    assert os.environ["LUMEN_HOME"] == str(test_home) != str(user_home)
    assert files(user_home) == before


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
