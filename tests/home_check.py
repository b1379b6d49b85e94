"""Run by tests/cli/test_home.py in a pytest of its own (not collected by the suite: the name does not start with
test_), whose user home is a fresh temporary directory that no other process writes."""
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
    assert before, "the user home holds the linked models"
    path = tmp_path / "tiny.gguf"
    write_model(path, "llama")
    m = lumen.load(path, ctx=32)
    m.logits([5, 6, 7])
    if packcache.enabled() and packcache.code_hash() is not None:  # off, or lumen's sources edited meanwhile
        assert m.weights.packs_from == "packed, cached"
        assert list((test_home / "packs").glob("tiny-*.lpack")), "the synthetic model's pack goes to the test home"
    assert os.environ["LUMEN_HOME"] == str(test_home) != str(user_home)
    assert files(user_home) == before
