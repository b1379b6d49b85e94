"""GGUF reader: memory-mapped, validated before anything touches the data.

    python -m lumen.gguf FILE      # metadata and a tensor table

Everything that can be wrong with a file raises `GGUFError` (or its subclass `UnsupportedError`) with a message
that says what and where: bad magic, an unsupported version, truncation, counts or lengths that do not fit in
the file, unknown value or tensor types, a tensor beyond the end of the file, overlapping or misaligned tensors,
duplicate names. Tensor data stays a zero-copy view of the mmap.

Layout (little-endian): magic "GGUF", u32 version (2 or 3), u64 n_tensors, u64 n_kv, then n_kv key/values,
then n_tensors tensor infos (name, u32 n_dims, u64 dims[n_dims] with dims[0] fastest, u32 type, u64 offset),
then padding to `general.alignment` (default 32) and the tensor data.
"""
from __future__ import annotations

import functools
import hashlib
import mmap
import os
import pickle
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import GGUFError, UnsupportedError
from .quants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
MAX_DIMS = 4
MAX_STRING = 1 << 30

# value type id -> (name, struct format or None for string/array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
T_STRING, T_ARRAY = 8, 9


@dataclass(frozen=True)
class Tensor:
    name: str
    qtype: GGMLQuantizationType
    dims: tuple[int, ...]  # ggml order: dims[0] is the fastest-varying (the row length)
    offset: int            # absolute byte offset in the file
    nbytes: int
    data: np.ndarray       # zero-copy uint8 view (rows, row_bytes) of the mmap

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order: reversed dims."""
        return tuple(reversed(self.dims))

    def as_f32(self) -> np.ndarray:
        """An F32 tensor as a float32 array of numpy shape (zero-copy)."""
        if self.qtype != GGMLQuantizationType.F32:
            raise GGUFError(f"tensor {self.name} is {self.qtype.name}, not F32")
        return self.data.reshape(-1).view(np.float32).reshape(self.shape)


class _Cursor:
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, buf, size: int, path: str, trace: list | None = None):
        self.buf, self.size, self.pos, self.path, self.trace = buf, size, 0, path, trace

    def need(self, n: int, what: str):
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"{self.path}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                            f"but the file is {self.size} bytes")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        if self.trace is not None:
            self.trace.append((self.pos, fmt, what))
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"length of {what}")
        if n > MAX_STRING:
            raise GGUFError(f"{self.path}: {what} claims a length of {n} bytes at offset {self.pos - 8}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e})") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == T_STRING:
            return self.string(what)
        if vtype == T_ARRAY:
            if depth > 0:
                raise GGUFError(f"{self.path}: {what}: nested arrays are not supported")
            etype = self.scalar("<I", f"element type of {what}")
            count = self.scalar("<Q", f"element count of {what}")
            if etype in _NP:
                itemsize = np.dtype(_NP[etype]).itemsize
                if count > (self.size - self.pos) // itemsize:
                    raise GGUFError(f"{self.path}: {what}: array of {count} elements does not fit in the file")
                arr = np.frombuffer(self.buf, dtype=np.dtype(_NP[etype]).newbyteorder("<"), count=count,
                                    offset=self.pos)
                self.pos += count * itemsize
                return arr.tolist()
            if etype == T_STRING:
                if count > (self.size - self.pos) // 8:
                    raise GGUFError(f"{self.path}: {what}: array of {count} strings does not fit in the file")
                if self.trace is not None:
                    return [self.string(f"{what}[{i}]") for i in range(count)]
                strings: list[str] = []
                while True:
                    self.pos = _strings(self.buf, self.pos, count, self.size, strings)
                    if len(strings) == count:
                        return strings
                    strings.append(self.string(f"{what}[{len(strings)}]"))  # raises, saying why
            if etype == T_ARRAY:
                raise GGUFError(f"{self.path}: {what}: nested arrays are not supported")
            raise GGUFError(f"{self.path}: {what}: unknown array element type {etype}")
        raise GGUFError(f"{self.path}: {what}: unknown value type {vtype}")


_U64 = struct.Struct("<Q")


def _strings(buf, pos: int, count: int, size: int, out: list[str]) -> int:
    """Append length-prefixed UTF-8 strings from pos in buf to out until it holds count -> the position after
    the last one appended. Stops early at a string out of bounds or not UTF-8: the checked path (_Cursor.string)
    then reads that one and says why. 3x faster than _Cursor.string per string (Gemma-3's vocabulary: 262144
    strings), and a bad string late in a list costs no second pass over the ones before it."""
    unpack = _U64.unpack_from
    append = out.append
    try:
        for _ in range(count - len(out)):
            (n,) = unpack(buf, pos)
            end = pos + 8 + n
            if n > MAX_STRING or end > size:
                break
            append(buf[pos + 8:end].decode("utf-8"))
            pos = end
    except (struct.error, UnicodeDecodeError):
        pass
    return pos


class Header(NamedTuple):
    """What parsing a file's header gives: version, metadata, tensor infos (name, dims, type id, offset) and the
    offset where the infos end."""
    version: int
    metadata: dict
    infos: list
    end: int


@functools.cache
def _reader_digest() -> bytes:
    """This module's source, once per process: a header parsed by other code is not this code's header."""
    return hashlib.sha256(Path(__file__).read_bytes()).digest()


class HeaderCache:
    """A file's parsed header, kept in `directory` so that the next open skips the parse (Qwen2.5's header holds
    two lists of 151,936 strings: opening the 1.5B took 0.25 s parsed, 0.10 s from here, on a 2-vCPU Xeon).

    The rule: a cached header is used only for the same bytes. The entry is found by the file's path and
    identity (size, inode, mtime, ctime) and this module's source, and holds the SHA-256 of the header bytes it
    was parsed from; those bytes are hashed again at every load (Qwen's 7 MB in 9 ms), so a file rewritten in
    place with the same stat is parsed again, not trusted. The tensor table is checked against the file on every
    open either way (GGUFFile._layout). An entry that cannot be read is a miss; it is written to a temporary file
    and renamed, so processes opening the same file at once see a whole entry or none. An entry starts with the
    real path of its file (MAGIC, its length, the path), so that writing one removes the entries of files that no
    longer exist (1-4 MB each), as the pack cache does for its packs."""

    VERSION = 2
    MAGIC = b"LUMENHDR"

    def __init__(self, directory: Path, g: GGUFFile):
        self.g = g
        st = g.stat
        self.source = os.path.realpath(g.path)
        where = hashlib.sha256(self.source.encode()).hexdigest()[:16]
        h = hashlib.sha256(f"{st.st_size} {st.st_ino} {st.st_mtime_ns} {st.st_ctime_ns}".encode())
        h.update(_reader_digest())
        self.prefix = f"{g.path.stem}-{where}-"          # one entry per file path: a new one replaces the old
        self.path = directory / f"{self.prefix}{h.hexdigest()[:16]}.header"

    def _digest(self, end: int) -> bytes:
        return hashlib.sha256(self.g._mmap[:end]).digest()

    def read(self) -> Header | None:
        try:
            with open(self.path, "rb") as f:
                if self._source(f) is None:
                    return None
                entry = pickle.load(f)
            version, digest, header = entry
            header = Header(*header)
            if version != self.VERSION or not 0 < header.end <= self.g.size or self._digest(header.end) != digest:
                return None
            return header
        except Exception:   # noqa: BLE001 - missing, partial or foreign entry: parse the file instead
            return None

    def write(self, header: Header) -> None:
        """Best effort: a cache that cannot be written only costs the next open a parse."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    where = self.source.encode("utf-8", "surrogateescape")
                    f.write(self.MAGIC + struct.pack("<I", len(where)) + where)
                    pickle.dump((self.VERSION, self._digest(header.end), tuple(header)), f, protocol=5)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
            self._evict()
        except OSError:
            pass

    @classmethod
    def _source(cls, f) -> str | None:
        """The real path an open entry names (f left at its pickle), or None: not an entry of this format."""
        pre = f.read(len(cls.MAGIC) + 4)
        if len(pre) != len(cls.MAGIC) + 4 or pre[:len(cls.MAGIC)] != cls.MAGIC:
            return None
        (n,) = struct.unpack("<I", pre[len(cls.MAGIC):])
        where = f.read(n) if n <= 1 << 16 else b""
        return where.decode("utf-8", "surrogateescape") if len(where) == n and n else None

    def _evict(self) -> None:
        """Delete this file's older entries, the entries of files that no longer exist or of another format (never
        a hit), and temporary files of writes interrupted over an hour ago."""
        old = time.time() - 3600
        for p in self.path.parent.glob("*.header"):
            if p == self.path:
                continue
            try:
                with open(p, "rb") as f:
                    source = self._source(f)
                if p.name.startswith(self.prefix) or source is None or not os.path.exists(source):
                    p.unlink(missing_ok=True)
            except OSError:
                pass
        for p in self.path.parent.glob("*.header*.tmp"):
            try:
                if p.stat().st_mtime < old:
                    p.unlink(missing_ok=True)
            except OSError:
                pass


def _qtype(type_id: int, name: str, path: str) -> GGMLQuantizationType:
    try:
        qt = GGMLQuantizationType(type_id)
    except ValueError:
        raise GGUFError(f"{path}: tensor {name} has an unknown type id {type_id}") from None
    if qt not in GGML_QUANT_SIZES:
        raise UnsupportedError(f"{path}: tensor {name} has type {qt.name}, which has no known block layout")
    return qt


class GGUFFile:
    """A parsed, validated GGUF file. `metadata` maps key -> str/int/float/bool/list; `tensors` maps name -> Tensor."""

    def __init__(self, path: str | Path, *, trace: list | None = None, cache: str | Path | None = None):
        """`trace`, if given, collects (offset, struct format, description) of every header field read (for tests).
        `cache`: a directory for the header cache (HeaderCache), or None to parse every time."""
        self.path = Path(path)
        self._trace = trace
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise GGUFError(f"cannot open {self.path}: {e.strerror}") from None
        with f:
            self.stat = os.fstat(f.fileno())  # of the file mapped, even if the path is replaced later
            size = self.stat.st_size
            if size < 24:
                raise GGUFError(f"{self.path}: not a GGUF file (only {size} bytes)")
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = size
        self.buf = np.frombuffer(self._mmap, dtype=np.uint8)  # (size,) zero-copy view of the whole file
        store = None if cache is None or trace is not None else HeaderCache(Path(cache), self)
        header = None if store is None else store.read()
        if header is None:
            header = self._parse_header()
            if store is not None:
                store.write(header)
        self.header_end = header.end         # end of the tensor infos: the bytes a Header is parsed from
        self.version, self.metadata = header.version, header.metadata
        self._layout(header.infos)

    def _parse_header(self) -> Header:
        """Magic, version, the metadata and the tensor infos, checked as they are read."""
        p = str(self.path)
        c = _Cursor(self._mmap, self.size, p, self._trace)
        magic = bytes(self._mmap[:4])
        if magic != MAGIC:
            raise GGUFError(f"{p}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        c.pos = 4
        version = c.scalar("<I", "version")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise GGUFError(f"{p}: unsupported GGUF version {version}{hint}; Lumen reads versions 2 and 3")
        n_tensors = c.scalar("<Q", "tensor count")
        n_kv = c.scalar("<Q", "metadata count")
        # every key/value takes at least 8+1+4+1 bytes and every tensor info 8+1+4+8+4+8 bytes
        if n_kv > (self.size - c.pos) // 14:
            raise GGUFError(f"{p}: metadata count {n_kv} cannot fit in a file of {self.size} bytes")
        if n_tensors > (self.size - c.pos) // 33:
            raise GGUFError(f"{p}: tensor count {n_tensors} cannot fit in a file of {self.size} bytes")

        meta: dict[str, Any] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            vtype = c.scalar("<I", f"type of metadata {key!r}")
            if key in meta:
                raise GGUFError(f"{p}: duplicate metadata key {key!r}")
            meta[key] = c.value(vtype, f"metadata {key!r}")

        infos = []
        for i in range(n_tensors):
            name = c.string(f"name of tensor #{i}")
            n_dims = c.scalar("<I", f"n_dims of tensor {name}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFError(f"{p}: tensor {name} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            dims = tuple(c.scalar("<Q", f"dims of tensor {name}") for _ in range(n_dims))
            type_id = c.scalar("<I", f"type of tensor {name}")
            offset = c.scalar("<Q", f"offset of tensor {name}")
            infos.append((name, dims, type_id, offset))
        return Header(version, meta, infos, c.pos)

    def _layout(self, infos: list) -> None:
        """The tensors of the header's infos, each checked against the file (type, shape, alignment, bounds,
        overlaps) and viewed in the mmap."""
        p = str(self.path)
        align = self.metadata.get("general.alignment", 32)
        if (not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1)
                or align > 1 << 16):
            raise GGUFError(f"{p}: general.alignment must be a power of two, got {align!r}")
        self.alignment = align
        data_start = -(-self.header_end // align) * align
        self.data_start = data_start

        tensors: dict[str, Tensor] = {}
        spans = []
        for name, dims, type_id, offset in infos:
            if name in tensors:
                raise GGUFError(f"{p}: duplicate tensor name {name!r}")
            qt = _qtype(type_id, name, p)
            if any(d <= 0 or d > 1 << 40 for d in dims):
                raise GGUFError(f"{p}: tensor {name} has an invalid shape {list(dims)}")
            block, type_size = GGML_QUANT_SIZES[qt]
            if dims[0] % block:
                raise GGUFError(f"{p}: tensor {name} ({qt.name}) has rows of {dims[0]} values, "
                                f"not a multiple of the block size {block}")
            row_bytes = dims[0] // block * type_size
            rows = 1
            for d in dims[1:]:
                rows *= d
            nbytes = row_bytes * rows
            if offset % align:
                raise GGUFError(f"{p}: tensor {name} data offset {offset} is not aligned to {align}")
            start = data_start + offset
            if start + nbytes > self.size:
                raise GGUFError(f"{p}: tensor {name} ({nbytes} bytes at file offset {start}) extends beyond "
                                f"the end of the file ({self.size} bytes): the file is truncated or corrupt")
            data = self.buf[start:start + nbytes].reshape(rows, row_bytes)
            tensors[name] = Tensor(name, qt, dims, start, nbytes, data)
            spans.append((start, start + nbytes, name))
        spans.sort()
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFError(f"{p}: tensors {n0} and {n1} overlap in the file")
        self.tensors = tensors

    def close(self):
        """Drop the views and the mmap. Arrays taken from this file must not be used afterwards."""
        self.buf = None
        self.tensors = {}
        try:
            self._mmap.close()
        except BufferError:
            pass  # still referenced by a view somebody kept; the GC frees it with them

    def __repr__(self):
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"
