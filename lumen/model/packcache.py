"""The packed-weight cache: the repacked matrices (lumen.kernels.layout.Packs) of a GGUF file, kept on disk so a warm
start reads them instead of repacking. Measured with profiling/startup.py (medians, 2 cores at load 1.2):
SmolLM2-135M reads its 111 MB in 41 ms instead of 0.64 s of repacking, Gemma-3-270M its 294 MB in 108 ms instead
of 2.5-2.7 s, at half the peak RSS (710 MB vs 1.42 GB).

Where: `$LUMEN_HOME/packs/<gguf stem>-<source>-<key>.lpack` (default ~/.cache/lumen/packs), for registry models
and .gguf paths alike; <source> is a hash of the GGUF file's real path. Off with LUMEN_PACK_CACHE=0 or
`lumen.load(..., pack_cache=False)`; clear it by deleting the directory (running processes keep their mapping of a
deleted file; a file must never be changed in place, which is why every write goes to a new file). At most KEEP
files per GGUF file (per real path: files of one name in other folders are other models) are kept: when a new one
is written, the ones used longest ago are deleted (a hit sets its file's time), and so are the files of GGUF files
that no longer exist (the header names its GGUF file).

Key (sha256, 128 bits of it in the file name, all of it in the header): the format version, the GGUF file's identity
(size, inode, mtime, ctime, its first and last MiB, a page every 4 MiB, its tensor table), the packing code (the source
bytes of every lumen/kernels/*.py (matmul.py packs, with helpers it may take from its neighbours; layout.py holds the
table columns), model/weights.py, format/quants.py and this file), numpy's version, and how the matrices were packed
when not as stored (a draft model's requantized to Q4_0: its own file, beside the file of the same model as stored). A
change to any of them is another key, so a stale file is never read (an edit to any kernel costs one repack). If one of
those sources was modified after this process imported Lumen, the code running may not be the code on disk: the cache is
then not used at all (neither read nor written) in this process.

File: magic b"LUMENPK1", u64 header length, a JSON header {key, size, source (the GGUF file's real path), arrays:
{name: [dtype, shape, offset]}}, the table at a 64-byte aligned offset and each buffer on a 2 MiB boundary
(file_layout settles the offsets with the header's own length, whatever it is), the trailer b"LUMENEND". A miss is
packed straight into a temporary file in the same directory, a chunk of a matrix at a time
(lumen.model.weights.pack_into), fsync'ed, then os.replace'd: a reader sees a whole file or none, and the packs are
never in memory whole. The packing happens under the cache's file lock (fcntl.flock on .lock), so processes loading
a model at once pack it once and the others read that file. A read checks the magic, trailer, file size, key, each
array's dtype, shape and bounds, and every table row against the GGUF tensor it packs (family, activation format,
sizes, and that its slices lie inside the buffers as lumen.model.forward.mm takes them:
lumen.kernels.layout.check_table), because the compiled kernels do not check bounds. A file that is there but wrong
is named once on stderr (why it cannot be read) and rewritten.
The buffers are mapped from the file, copy-on-write (MAP_PRIVATE), also right after packing: the pages are the
page cache's, so the processes and replicas serving a model on one host share one copy. Writable, so their Numba
type is that of freshly allocated arrays (a read-only mapping would compile the forward pass again); nothing
writes them. Any OSError (unwritable directory, full disk) only means the packs stay in memory; nothing is raised.
Huge pages: a decode step streams every page of the packs, so the file is written in whole 2 MiB-aligned blocks
(`Blocks`; the packer's pieces, tens of KiB in two streams, left 4 KiB folios), which a filesystem with large folios
(ext4, xfs) caches as 2 MiB folios and a mapping maps as huge pages: fewer TLB misses, no prefetch stream cut every
4 KiB. The mapping asks for them (MADV_HUGEPAGE), so that a file read back from disk is cached so too.
"""
from __future__ import annotations

import glob
import hashlib
import json
import math
import mmap
import os
import struct
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from ..format.gguf import GGUFFile
from ..kernels.layout import BUFFERS, DTYPES, Packs, check_table
from ..paths import IMPORT_TIME_NS, lumen_home
from .store import file_lock

MAGIC, TRAILER = b"LUMENPK1", b"LUMENEND"
VERSION = 1
ALIGN = 64
KEEP = 2                  # cache files kept per GGUF file (real path)
EDGE = 1 << 20            # bytes hashed at each end of the GGUF file
SAMPLE_EVERY = 4 << 20    # and one 4 KiB page per this many bytes in between
SOURCES = ("kernels/*.py", "model/weights.py", "format/quants.py", "model/packcache.py")  # the packing code
MTIME_SLACK_NS = 2_000_000_000  # file mtimes come from a coarser clock than time.time_ns()
BLOCK = 2 << 20           # bytes of the file per write: one huge page (x86-64 and arm64 with 4 KiB pages)


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


def cache_key(g: GGUFFile, variant: str = "") -> str | None:
    """The key of g's packs under the current code, or None when the code cannot be trusted to match its sources.
    variant: how they were packed, if not as stored ("requant Q4_0")."""
    code = code_hash()
    if code is None:
        return None
    h = hashlib.sha256(f"lumen-packs v{VERSION} numpy {np.__version__} {sys.byteorder}\n".encode())
    h.update(gguf_identity(g).encode() + b"\n" + code.encode())
    if variant:
        h.update(b"\n" + variant.encode())
    return h.hexdigest()


def source_path(g: GGUFFile) -> str:
    """The GGUF file's real path (symbolic links resolved): what a cache file's versions are counted by."""
    return os.path.realpath(g.path)


def cache_path(g: GGUFFile, key: str) -> Path:
    source = hashlib.sha256(source_path(g).encode("utf-8", "surrogateescape")).hexdigest()[:12]
    return cache_dir() / f"{Path(g.path).stem}-{source}-{key[:32]}.lpack"


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


class Unreadable(Exception):
    """Why a cache file cannot be used (said once, then the file is rebuilt)."""


def read(path: Path, key: str, expected: np.ndarray) -> Packs | None:
    """The packs stored at path, or None if the file is missing, stale or damaged (open() says why)."""
    try:
        return open_packs(path, key, expected)
    except (FileNotFoundError, Unreadable):
        return None


def open_packs(path: Path, key: str, expected: np.ndarray) -> Packs:
    """The packs stored at path, its buffers mapped copy-on-write (MAP_PRIVATE) from the file: the pages are the
    page cache's, shared by every process that maps the file, and nothing is copied. The mapping is writable, so
    the arrays have the Numba type of freshly allocated ones (a read-only array would compile the forward pass
    again); nothing writes to them (a write would only make a private copy of the page). The table is copied (it
    is checked, and small). FileNotFoundError if there is no file; Unreadable(why) if it cannot be used."""
    try:
        f = open(path, "rb", buffering=0)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(path) from None
    except OSError as e:
        raise Unreadable(f"{type(e).__name__}: {e.strerror or e}") from None
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < 16 + len(TRAILER):
                raise Unreadable(f"{size} bytes: too short")
            pre, tail = bytearray(16), bytearray(len(TRAILER))
            _read_at(f, 0, pre)
            _read_at(f, size - len(TRAILER), tail)
            (hlen,) = struct.unpack("<Q", pre[8:])
            if pre[:8] != MAGIC:
                raise Unreadable("not a pack file (bad magic)")
            if tail != TRAILER:
                raise Unreadable("no end marker (an incomplete write?)")
            if hlen > size - 16 - len(TRAILER):
                raise Unreadable(f"header length {hlen} beyond the file's {size} bytes")
            raw = bytearray(hlen)
            _read_at(f, 16, raw)
            head = json.loads(raw)
            if not isinstance(head, dict):
                raise Unreadable(f"a header that is not a JSON object ({type(head).__name__})")
            if head.get("key") != key:
                raise Unreadable("another key in its header")
            if head.get("size") != size:
                raise Unreadable(f"{size} bytes, its header says {head.get('size')}")
            if set(head.get("arrays", ())) != set(DTYPES):
                raise Unreadable(f"arrays {sorted(head.get('arrays', ()))}, expected {sorted(DTYPES)}")
            layout = {}
            for name, dt in DTYPES.items():
                dtype, shape, off = head["arrays"][name]
                shape = tuple(int(n) for n in shape)
                nbytes = math.prod(shape) * np.dtype(dt).itemsize
                if (np.dtype(dtype) != np.dtype(dt) or len(shape) != (2 if name == "table" else 1)
                        or any(n < 0 for n in shape) or off % ALIGN or off < 16 + hlen
                        or off + nbytes > size - len(TRAILER)):
                    raise Unreadable(f"array {name} {dtype} {list(shape)} at {off} does not fit the file")
                layout[name] = shape, off
            table = np.empty(layout["table"][0], np.int64)
            _read_at(f, layout["table"][1], table)
            sizes = {name: shape[0] for name, (shape, off) in layout.items() if name != "table"}
            why = check_table(table, expected, sizes)
            if why is not None:
                raise Unreadable(why)
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            _advise_huge(mm)
        arrays = {"table": table}
        for name, (shape, off) in layout.items():
            if name != "table":
                arrays[name] = np.frombuffer(mm, DTYPES[name], count=shape[0], offset=off)
        return Packs(**arrays)
    except (OSError, ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise Unreadable(f"{type(e).__name__}: {e}") from None  # json.JSONDecodeError is a ValueError


# ---------------------------------------------------------------- write

def file_layout(key: str, table: np.ndarray, sizes: dict, source: str = "") -> tuple[bytes, dict, int]:
    """(header, {array name: byte offset}, file size) of a file holding `table` and buffers of `sizes`.
    The header's length moves the data offsets and the offsets are in the header: iterate until the offsets the
    header states are those its own length gives (its length only grows with the offsets, so this settles in a
    few rounds), so that read() finds every array where it was written, whatever the header's length."""
    shapes = {"table": list(table.shape), **{name: [int(sizes[name])] for name in BUFFERS}}
    start = 0
    for _ in range(16):
        layout, off = {}, start
        for name, dt in DTYPES.items():
            if name in BUFFERS:                       # each buffer from a huge page of its own
                off = -(-off // BLOCK) * BLOCK
            layout[name] = [np.dtype(dt).str, shapes[name], off]
            off = -(-(off + math.prod(shapes[name]) * np.dtype(dt).itemsize) // ALIGN) * ALIGN
        head = json.dumps({"key": key, "size": off + len(TRAILER), "source": source, "arrays": layout}).encode()
        first = -(-(16 + len(head)) // ALIGN) * ALIGN
        if first == start:
            return head, {name: v[2] for name, v in layout.items()}, off + len(TRAILER)
        start = first
    raise AssertionError("the pack file header did not settle")


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _advise_huge(mm: mmap.mmap) -> None:
    """Ask for huge pages on the mapping (taken where the page cache holds 2 MiB folios, and the folios a fault
    reads from disk are then 2 MiB); a kernel or platform without them keeps base pages."""
    if hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mm, "madvise"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


class Blocks:
    """Writes into a new, zero-filled file of `size` bytes, gathered into whole BLOCK-aligned blocks: a block is
    written with one pwrite once all its bytes inside `regions` (the (start, end) byte ranges that will be written;
    the rest stays zero) have come, so the page cache can hold the file in folios of a block. Each byte is written
    at most once (a piece for a block already written is written as it comes); close() writes what is left.
    Thread-safe (pack_into puts from several threads)."""

    def __init__(self, fd: int, size: int, regions: list[tuple[int, int]]):
        self.fd, self.size, self.regions = fd, size, regions
        self.open: dict[int, list] = {}           # block index -> [its bytes, bytes still to come]
        self.done: set[int] = set()
        self.lock = threading.Lock()

    def write(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > self.size:
            raise ValueError(f"{len(view)} bytes at {offset} do not fit a file of {self.size}")
        with self.lock:
            while len(view):
                b = offset // BLOCK
                start, end = b * BLOCK, min(b * BLOCK + BLOCK, self.size)
                n = min(len(view), end - offset)
                if b in self.done:
                    _pwrite(self.fd, view[:n], offset)
                else:
                    block = self.open.get(b)
                    if block is None:
                        due = sum(max(0, min(end, e) - max(start, s)) for s, e in self.regions)
                        block = self.open[b] = [bytearray(end - start), due]
                    block[0][offset - start:offset - start + n] = view[:n]
                    block[1] -= n
                    if block[1] <= 0:
                        self._flush(b)
                view, offset = view[n:], offset + n

    def _flush(self, b: int) -> None:
        _pwrite(self.fd, self.open.pop(b)[0], b * BLOCK)
        self.done.add(b)

    def close(self) -> None:
        with self.lock:
            for b in sorted(self.open):
                self._flush(b)


def write(path: Path, key: str, table: np.ndarray, sizes: dict, fill, source: str = "") -> str | None:
    """Store the packs of the GGUF file `source` atomically at path, packed straight into the file: fill(put)
    packs every matrix through put(buffer name, offset in values, flat array), which writes the piece at its place
    in the file, so neither the file nor the packs are ever in memory whole. Returns None, or why it could not
    (then no file is left)."""
    head, offsets, size = file_layout(key, table, sizes, source)
    assert 16 + len(head) <= min(offsets.values())
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb"):
            os.ftruncate(fd, size)                           # the padding stays zero
            dtypes = {name: np.dtype(DTYPES[name]) for name in BUFFERS}
            out = Blocks(fd, size, [(0, 16 + len(head)), (offsets["table"], offsets["table"] + table.size * 8),
                                    *((offsets[n], offsets[n] + sizes[n] * dtypes[n].itemsize) for n in BUFFERS),
                                    (size - len(TRAILER), size)])
            out.write(MAGIC + struct.pack("<Q", len(head)) + head, 0)
            out.write(np.ascontiguousarray(table, np.int64), offsets["table"])

            def put(name, off, a):
                assert a.dtype == dtypes[name] and 0 <= off and off + a.size <= sizes[name]
                out.write(np.ascontiguousarray(a), offsets[name] + off * a.itemsize)
            fill(put)
            out.write(TRAILER, size - len(TRAILER))
            out.close()
            os.fsync(fd)
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


def _source_of(path: Path) -> str | None:
    """The GGUF path a cache file's header names, or None (unreadable, or written before headers named it)."""
    try:
        with open(path, "rb") as f:
            pre = f.read(16)
            if len(pre) != 16 or pre[:8] != MAGIC:
                return None
            (hlen,) = struct.unpack("<Q", pre[8:])
            head = json.loads(f.read(min(hlen, 1 << 20)))
        source = head.get("source") if isinstance(head, dict) else None
        return source if isinstance(source, str) and source else None
    except (OSError, ValueError):
        return None


def _evict(keep: Path) -> None:
    """Delete all but the KEEP most recently used cache files of keep's GGUF file (the same stem and source hash;
    keep itself stays), the cache files of GGUF files that no longer exist, and temporary files of interrupted
    writes older than an hour."""
    group = keep.name[:keep.name.rindex("-")]
    try:
        mine = [p for p in keep.parent.glob(f"{glob.escape(group)}-*.lpack")
                if p.name[:p.name.rindex("-")] == group and p != keep]
        mine.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for p in mine[KEEP - 1:]:
            p.unlink(missing_ok=True)
        for p in keep.parent.glob("*.lpack"):
            source = _source_of(p)
            if p != keep and source is not None and not os.path.exists(source):
                p.unlink(missing_ok=True)
        old = time.time() - 3600
        for p in keep.parent.glob(".*.lpack.*.tmp"):
            if p.stat().st_mtime < old:
                p.unlink(missing_ok=True)
    except OSError:
        pass


# ---------------------------------------------------------------- entry

def load_or_pack(g: GGUFFile, table: np.ndarray, sizes: dict, fill, pack, expected: np.ndarray,
                 say=None, variant: str = "") -> tuple[Packs, str]:
    """(packs, where they came from): the cached packs of g if valid, else packed into the cache file by
    fill(put) and mapped from it, or packed in memory by pack(why the cache is not used) otherwise. The second
    item is "cache", "packed, cached", or "packed" plus why nothing was cached. say(line), if given, is told
    once that a cache file exists but cannot be read (it is then rebuilt). variant: cache_key's.

    A miss packs and writes under an exclusive lock on `.lock` in the cache directory (one file for the cache, so
    none accumulate), so processes loading the same model at once pack it once: the others wait, then read the
    file it wrote. If the lock cannot be taken (an unwritable directory), it packs without it; write() then says
    why nothing was cached."""
    key = cache_key(g, variant)
    if key is None:
        return pack("the packing sources changed after import"), \
            "packed (packing sources changed after import: cache not used)"
    path = cache_path(g, key)
    told = []

    def attempt() -> tuple[Packs | None, Unreadable | None]:
        try:
            return open_packs(path, key, expected), None
        except FileNotFoundError:
            return None, None
        except Unreadable as e:
            if say is not None and not told:
                say(f"the packed-weight cache file {path.name} cannot be read ({e}); packing again")
                told.append(e)
            return None, e

    packs, _ = attempt()
    if packs is not None:
        try:
            os.utime(path)  # its time is its last use: what eviction keeps
        except OSError:
            pass
        return packs, "cache"
    with ExitStack() as held:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            held.enter_context(file_lock(path.parent / ".lock"))
        except OSError:
            pass
        packs, _ = attempt()  # written by the process we waited for
        if packs is not None:
            return packs, "cache"
        why = write(path, key, table, sizes, fill, source_path(g))
        if why is None:
            packs, err = attempt()
            if packs is not None:
                return packs, "packed, cached"
            why = f"the file written cannot be read: {err or 'it is gone'}"
    return pack("the pack cache cannot be written"), f"packed (cache not written: {why})"
