"""The packed-weight cache: the repacked matrices (lumen.kernels.layout.Packs) of a GGUF file, kept on disk so a warm
start reads them instead of repacking. Measured with profiling/startup.py (medians, 2 cores at load 1.2):
SmolLM2-135M reads its 111 MB in 41 ms instead of 0.64 s of repacking, Gemma-3-270M its 294 MB in 108 ms instead
of 2.5-2.7 s, at half the peak RSS (710 MB vs 1.42 GB).

Where: `$LUMEN_HOME/packs/<gguf stem>-<key>.lpack` (default ~/.cache/lumen/packs), for registry models and
.gguf paths alike. Off with LUMEN_PACK_CACHE=0 or `lumen.load(..., pack_cache=False)`; clear it by deleting
the directory. At most KEEP files per GGUF stem are kept (the oldest are deleted when a new one is written).

Key (sha256, 128 bits of it in the file name, all of it in the header): the format version, the GGUF file's
identity (size, inode, mtime, ctime, its first and last MiB, a page every 4 MiB, its tensor table), the packing
code (the source bytes of every lumen/kernels/*.py (matmul.py packs, with helpers it may take from its
neighbours; layout.py holds the table columns), model/weights.py, format/quants.py and this file) and numpy's
version. A change to any of them is another key, so a stale file is never read (an edit to any kernel costs one
repack). If one of those sources was modified after this process imported Lumen, the code running may not be the
code on disk: the cache is then not used at all (neither read nor written) in this process.

File: magic b"LUMENPK1", u64 header length, a JSON header {key, size, arrays: {name: [dtype, shape, offset]}},
the arrays at 64-byte aligned offsets, the trailer b"LUMENEND". Written to a temporary file in the same
directory, fsync'ed, then os.replace'd: a reader sees a whole file or none. A miss is packed and written under
the cache's file lock (fcntl.flock on .lock), so processes loading a model at once pack it once and the others
read that file. A read checks the magic, trailer, file size, key, each array's dtype, shape and bounds, and every
table row against the GGUF tensor it packs (family, activation format, sizes, and that its slices lie inside the buffers
as lumen.model.forward.mm takes them: lumen.kernels.layout.check_table), because the compiled kernels do not
check bounds. Anything wrong -> the file is ignored and rewritten.
The arrays are read into ordinary memory, not mapped: decode over a copy-on-write mapping of the file measured
5% slower (SmolLM2 12.0 vs 11.45 ms of CPU per step, Gemma 25.7 vs 24.4; one process, interleaved, medians),
and a read-only mapping is another Numba type (the forward pass would compile again).
Any OSError (unwritable directory, full disk) only means the packs stay in memory; nothing is raised.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from ..format.gguf import GGUFFile
from ..kernels.layout import DTYPES, Packs, check_table
from ..paths import IMPORT_TIME_NS, lumen_home
from .store import file_lock

MAGIC, TRAILER = b"LUMENPK1", b"LUMENEND"
VERSION = 1
ALIGN = 64
KEEP = 2                  # cache files kept per GGUF stem
EDGE = 1 << 20            # bytes hashed at each end of the GGUF file
SAMPLE_EVERY = 4 << 20    # and one 4 KiB page per this many bytes in between
SOURCES = ("kernels/*.py", "model/weights.py", "format/quants.py", "model/packcache.py")  # the packing code
MTIME_SLACK_NS = 2_000_000_000  # file mtimes come from a coarser clock than time.time_ns()


def enabled() -> bool:
    """False when LUMEN_PACK_CACHE=0 (or off/false/no)."""
    return os.environ.get("LUMEN_PACK_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    return lumen_home() / "packs"


def code_hash() -> str | None:
    """sha256 of the packing code's sources; None if one changed after Lumen was imported (the running code may
    differ from the file)."""
    root = Path(__file__).resolve().parent.parent          # lumen/
    h = hashlib.sha256()
    for p in (p for pattern in SOURCES for p in sorted(root.glob(pattern))):
        rel = p.relative_to(root).as_posix()
        try:
            st = p.stat()
            data = p.read_bytes()
        except OSError:
            return None
        if st.st_mtime_ns > IMPORT_TIME_NS - MTIME_SLACK_NS:
            return None
        h.update(rel.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def gguf_identity(g: GGUFFile) -> str:
    """sha256 of the file's size, inode, mtime and ctime, its first and last MiB, a 4 KiB page every 4 MiB and its
    tensor table (3-6 ms for either model; a sha256 of the whole file takes 80 ms for SmolLM2, 190 for Gemma)."""
    st = g.stat
    h = hashlib.sha256()
    h.update(f"{g.size} {st.st_ino} {st.st_mtime_ns} {st.st_ctime_ns}\n".encode())
    h.update(g.buf[:EDGE])
    h.update(g.buf[max(0, g.size - EDGE):])
    for a in range(EDGE, g.size - EDGE, SAMPLE_EVERY):
        h.update(g.buf[a:a + 4096])
    for name, t in g.tensors.items():
        h.update(f"{name} {int(t.qtype)} {t.dims} {t.offset}\n".encode())
    return h.hexdigest()


def cache_key(g: GGUFFile) -> str | None:
    """The key of g's packs under the current code, or None when the code cannot be trusted to match its sources."""
    code = code_hash()
    if code is None:
        return None
    h = hashlib.sha256(f"lumen-packs v{VERSION} numpy {np.__version__} {sys.byteorder}\n".encode())
    h.update(gguf_identity(g).encode() + b"\n" + code.encode())
    return h.hexdigest()


def cache_path(g: GGUFFile, key: str) -> Path:
    return cache_dir() / f"{g.path.stem}-{key[:32]}.lpack"


# ---------------------------------------------------------------- read

def _read_at(f, offset: int, out) -> None:
    """Fill the writable buffer `out` from f at offset; ValueError if the file ends first."""
    view = memoryview(out).cast("B")
    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError("the file ends early")
        got += n


def read(path: Path, key: str, expected: np.ndarray) -> Packs | None:
    """The packs stored at path (read into fresh arrays), or None if the file is missing, stale or damaged."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size < 16 + len(TRAILER):
                return None
            pre, tail = bytearray(16), bytearray(len(TRAILER))
            _read_at(f, 0, pre)
            _read_at(f, size - len(TRAILER), tail)
            (hlen,) = struct.unpack("<Q", pre[8:])
            if pre[:8] != MAGIC or tail != TRAILER or hlen > size - 16 - len(TRAILER):
                return None
            raw = bytearray(hlen)
            _read_at(f, 16, raw)
            head = json.loads(raw)
            if head.get("key") != key or head.get("size") != size or set(head.get("arrays", ())) != set(DTYPES):
                return None
            layout = {}
            for name, dt in DTYPES.items():
                dtype, shape, off = head["arrays"][name]
                shape = tuple(int(n) for n in shape)
                nbytes = math.prod(shape) * np.dtype(dt).itemsize
                if (np.dtype(dtype) != np.dtype(dt) or len(shape) != (2 if name == "table" else 1)
                        or any(n < 0 for n in shape) or off % ALIGN or off < 16 + hlen
                        or off + nbytes > size - len(TRAILER)):
                    return None
                layout[name] = shape, off
            table = np.empty(layout["table"][0], np.int64)
            _read_at(f, layout["table"][1], table)
            sizes = {name: shape[0] for name, (shape, off) in layout.items() if name != "table"}
            if check_table(table, expected, sizes) is not None:
                return None
            arrays = {"table": table}
            for name, (shape, off) in layout.items():
                if name != "table":
                    arrays[name] = np.empty(shape, DTYPES[name])
                    _read_at(f, off, arrays[name])
        return Packs(**arrays)
    except (OSError, ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError):
        return None  # unreadable, or a damaged header (json.JSONDecodeError is a ValueError)


# ---------------------------------------------------------------- write

def write(path: Path, key: str, packs: Packs) -> str | None:
    """Store packs at path atomically; returns None, or why it could not (the cache is then just skipped)."""
    arrays = {name: np.ascontiguousarray(getattr(packs, name)) for name in DTYPES}
    layout, off = {}, 0
    head = b""
    for _ in range(2):  # the header's length moves the data offsets: settle it
        off = -(-(16 + len(head)) // ALIGN) * ALIGN
        layout = {}
        for name, a in arrays.items():
            layout[name] = [a.dtype.str, list(a.shape), off]
            off = -(-(off + a.nbytes) // ALIGN) * ALIGN
        head = json.dumps({"key": key, "size": off + len(TRAILER), "arrays": layout}).encode()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(head)) + head)
            for name, a in arrays.items():
                f.write(b"\0" * (layout[name][2] - f.tell()))
                f.write(memoryview(a.reshape(-1)).cast("B"))
            f.write(b"\0" * (off - f.tell()) + TRAILER)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    _evict(path)
    return None


def _evict(keep: Path) -> None:
    """Delete all but the KEEP newest cache files of keep's stem (keep itself stays), and temporary files of
    interrupted writes older than an hour."""
    stem = keep.name[:keep.name.rindex("-")]
    try:
        mine = [p for p in keep.parent.glob(f"{stem}-*.lpack") if p.name[:p.name.rindex("-")] == stem and p != keep]
        mine.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for p in mine[KEEP - 1:]:
            p.unlink(missing_ok=True)
        old = time.time() - 3600
        for p in keep.parent.glob(".*.lpack.*.tmp"):
            if p.stat().st_mtime < old:
                p.unlink(missing_ok=True)
    except OSError:
        pass


# ---------------------------------------------------------------- entry

def load_or_pack(g: GGUFFile, mats: list, pack, expected: np.ndarray) -> tuple[Packs, str]:
    """(packs, where they came from): the cached packs of g if valid, else pack(mats), stored for next time.
    The second item is "cache", "packed, cached", or "packed" plus why nothing was cached.

    A miss packs and writes under an exclusive lock on `.lock` in the cache directory (one file for the cache, so
    none accumulate), so processes loading the same model at once pack it once: the others wait, then read the
    file it wrote. If the lock cannot be taken (an unwritable directory), it packs without it; write() then says
    why nothing was cached."""
    key = cache_key(g)
    if key is None:
        return pack(mats), "packed (packing sources changed after import: cache not used)"
    path = cache_path(g, key)
    packs = read(path, key, expected)
    if packs is not None:
        return packs, "cache"
    with ExitStack() as held:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            held.enter_context(file_lock(path.parent / ".lock"))
        except OSError:
            pass
        packs = read(path, key, expected)  # written by the process we waited for
        if packs is not None:
            return packs, "cache"
        packs = pack(mats)
        why = write(path, key, packs)
    return packs, "packed, cached" if why is None else f"packed (cache not written: {why})"
