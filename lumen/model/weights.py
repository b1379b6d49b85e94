"""Model weights, as the named arrays the compiled forward pass takes (lumen.model.parts makes the forward pass's
Weights bundle of them; nothing here imports the engine).

- The token embedding is read straight from the GGUF mmap (zero-copy): its (n_vocab, row_bytes) rows; the
  lookup dequantizes only the rows of the tokens seen.
- Every other matrix is repacked once at load (lumen.kernels.matmul.prepare, its bit planes compiled here) into
  the layout of lumen.kernels.layout, all of them in a few flat buffers by dtype (`Packs`); a table row per matrix
  gives its family, sizes and offsets, so one compiled function can reach any matrix by its id. The table comes
  first (`plan`, from the tensors' shapes), then each matrix is packed a chunk of rows at a time into its slice
  (`pack_into`), on Numba's threads, the GGUF pages of a matrix dropped from this process once it is packed: a
  first load holds the output and one chunk's temporaries, never the GGUF, the packs and whole-model temporaries.
- Every norm/bias vector is (offset, length) into one float32 array.
- The packs of a GGUF file are cached on disk (lumen.model.packcache, $LUMEN_HOME/packs), packed straight into
  that file and mapped from it: a warm start maps them instead of repacking, and processes share the pages.
  LUMEN_PACK_CACHE=0 or load_weights(..., pack_cache=False) turns that off (the packs are then in memory).
The loader has already validated every offset, shape and type (lumen.format.gguf, lumen.model.config), and the
pack cache checks the packs against the tensors, so these tables are safe to hand to kernels.
"""
from __future__ import annotations

import math
import mmap
import sys
import threading
from dataclasses import dataclass

import numba
import numpy as np

from ..format.gguf import GGUFFile
from ..format.quants import ACT_FORMAT, QT, bits_per_weight, quantize_q4_0, row_bytes
from ..kernels.dequant import F16_TO_F32, dequantize
from ..kernels.layout import (BUFFERS, C_DOUT, C_FAM, C_FMT, C_G, C_NIN, C_Q, C_QT, C_S, C_T, DTYPES, F32, FAMILY,
                              FORMAT, GROUP_BYTES, N_COLS, NIB_BYTES, Q5, Q6, Q8, Packs, R, buffer_of, q_len, s_len)
from ..kernels.kinds import GELU, SILU, kinds
from ..kernels.matmul import Packed, _decode, _k_scale_min, _tiles, _u16, prepare
from ..format.quants import quant_info
from .config import Config

# per layer: the matrices and the vectors the forward pass reads, by GGUF tensor name (blk.N.<name>[.weight])
# the estimate packing announces, roughly: GGUF bytes packed per second and thread, and pack-file bytes written
# into the page cache per second (that, not the packing, dominated a first load on a 2-core VM)
PACK_RATE, WRITE_RATE = 400e6, 150e6
CHUNK_BYTES = 1 << 20     # GGUF bytes packed at a time (whole tiles of R rows; at least one tile)
MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
VECS = ("attn_norm", "ffn_norm", "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm", "attn_k_norm",
        "post_attention_norm", "post_ffw_norm")


class Requantized:
    """A GGUF matrix, raw (rows, row_bytes) of type qtype, read as Q4_0 rows: a slice of rows is dequantized and
    rounded to Q4_0 when it is taken (pack_into takes a chunk at a time, so no whole-matrix copy is made).
    `source` is the GGUF view (the loader drops its pages once the matrix is packed)."""
    def __init__(self, raw: np.ndarray, qtype):
        info = quant_info(qtype)
        self.source, self.source_type = raw, QT(int(qtype))
        self.n_in = raw.shape[1] // info.type_size * info.block_size
        self.shape = (raw.shape[0], row_bytes(QT.Q4_0, self.n_in))

    def __getitem__(self, rows: slice) -> np.ndarray:
        raw = np.ascontiguousarray(self.source[rows])
        x = dequantize(raw, self.source_type, np.empty((raw.shape[0], self.n_in), np.float32), parallel=False)
        return quantize_q4_0(x)


def packed_type(qtype, n_in: int, to) -> QT:
    """The type a matrix stored as qtype, rows of n_in values, is packed as: `to` (None, or QT.Q4_0) where qtype
    takes more bits per weight and the rows are whole Q4_0 blocks, else its own."""
    if to is not None and QT(int(to)) != QT.Q4_0:
        raise ValueError(f"matrices can be requantized to Q4_0 only, not {QT(int(to)).name}")
    if to is None or bits_per_weight(qtype) <= bits_per_weight(QT.Q4_0) or n_in % 32:
        return QT(int(qtype))
    return QT.Q4_0


def requantized(raw: np.ndarray, qtype, to) -> tuple:
    """(raw, qtype) as the packer takes a matrix: as stored, or as Requantized Q4_0 rows (packed_type)."""
    info = quant_info(qtype)
    if packed_type(qtype, raw.shape[1] // info.type_size * info.block_size, to) == QT(int(qtype)):
        return raw, qtype
    return Requantized(raw, qtype), QT.Q4_0


def expected_rows(mats: list) -> np.ndarray:
    """(n_mats, 5) i8: GGML type, activation format, d_out, n_in, tiles of each [(raw (rows, row_bytes), qtype)],
    from the GGUF tensors alone (what lumen.kernels.layout.check_table checks a table against)."""
    out = np.zeros((len(mats), 5), np.int64)
    for i, (raw, qtype) in enumerate(mats):
        qt = QT(int(qtype))
        info = quant_info(qt)
        d_out = raw.shape[0]
        out[i] = int(qt), ACT_FORMAT[qt], d_out, raw.shape[1] // info.type_size * info.block_size, -(-d_out // R)
    return out


@numba.njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def _planes_into(u, fam, G, out):
    """lumen.kernels.matmul._planes as one pass: u (T*R, G*32) u8 unsigned values -> out (T, G * GROUP_BYTES[fam])
    u8, the layout of lumen.kernels.layout (the nibbles of columns 4k+b and 16+4k+b, then Q5's fifth bits (byte b
    bit k: column 4k+b) or Q6's top two bits (word j, byte b, bits 2m: column 16j+4m+b); Q8 the bytes as they
    are), without the numpy version's whole-chunk u32 temporaries. nogil: threads pack chunks at once."""
    gb = out.shape[1] // G if G else 0
    for t in range(out.shape[0]):
        o = out[t]
        for g in range(G):
            base = g * gb
            for r in range(R):
                row = u[t * R + r, g * 32:g * 32 + 32]
                if fam == Q8:
                    for k in range(8):
                        for b in range(4):
                            o[base + (k * R + r) * 4 + b] = row[4 * k + b]
                    continue
                for k in range(4):
                    for b in range(4):
                        o[base + (k * R + r) * 4 + b] = (row[4 * k + b] & 15) | ((row[16 + 4 * k + b] & 15) << 4)
                p = base + NIB_BYTES
                if fam == Q5:
                    for b in range(4):
                        v = 0
                        for k in range(8):
                            v |= (row[4 * k + b] >> 4) << k
                        o[p + r * 4 + b] = v
                elif fam == Q6:
                    for j in range(2):
                        for b in range(4):
                            v = 0
                            for m in range(4):
                                v |= (row[16 * j + 4 * m + b] >> 4) << (2 * m)
                            o[p + (j * R + r) * 4 + b] = v


# lumen.kernels.matmul._decode's unsigned values for one type each, written into u[:rows] in one pass (no
# temporaries): raw (rows, row_bytes) u8 -> u (>= rows, n_in) u8. One function per type, so a first load compiles
# only its model's types (as one function of the type id, all four: 1.4 s of a first run on a 2-vCPU EPYC Zen 5).

@numba.njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def _decode_q8_0(raw, u):
    """Q8_0: 34-byte blocks, f16 d then 32 int8 (+128)."""
    for r in range(raw.shape[0]):
        src, dst = raw[r], u[r]
        for blk in range(src.shape[0] // 34):
            for i in range(32):
                dst[32 * blk + i] = src[34 * blk + 2 + i] ^ 0x80


@numba.njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def _decode_q5_0(raw, u):
    """Q5_0: f16 d, u32 fifth bits, 16 bytes of nibbles."""
    for r in range(raw.shape[0]):
        src, dst = raw[r], u[r]
        for blk in range(src.shape[0] // 22):
            o = 22 * blk
            qh = (np.uint32(src[o + 2]) | (np.uint32(src[o + 3]) << 8) | (np.uint32(src[o + 4]) << 16)
                  | (np.uint32(src[o + 5]) << 24))
            for i in range(16):
                nib = src[o + 6 + i]
                dst[32 * blk + i] = (nib & 15) | (((qh >> i) & 1) << 4)
                dst[32 * blk + 16 + i] = (nib >> 4) | (((qh >> (16 + i)) & 1) << 4)


@numba.njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def _decode_q4_k(raw, u):
    """Q4_K: 144-byte blocks of 256, nibbles from byte 16."""
    for r in range(raw.shape[0]):
        src, dst = raw[r], u[r]
        for blk in range(src.shape[0] // 144):
            for j in range(4):
                for i in range(32):
                    q = src[144 * blk + 16 + 32 * j + i]
                    dst[256 * blk + 64 * j + i] = q & 15
                    dst[256 * blk + 64 * j + 32 + i] = q >> 4


@numba.njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def _decode_q6_k(raw, u):
    """Q6_K: 210-byte blocks, ql (2, 64), qh (2, 32)."""
    for r in range(raw.shape[0]):
        src, dst = raw[r], u[r]
        for blk in range(src.shape[0] // 210):
            o, d = 210 * blk, 256 * blk
            for h in range(2):
                for i in range(32):
                    a, b, q = src[o + 64 * h + i], src[o + 64 * h + 32 + i], src[o + 128 + 32 * h + i]
                    dst[d + 128 * h + i] = (a & 15) | ((q & 3) << 4)
                    dst[d + 128 * h + 32 + i] = (b & 15) | (((q >> 2) & 3) << 4)
                    dst[d + 128 * h + 64 + i] = (a >> 4) | (((q >> 4) & 3) << 4)
                    dst[d + 128 * h + 96 + i] = (b >> 4) | (((q >> 6) & 3) << 4)


FAST_DECODE = {QT.Q8_0: _decode_q8_0, QT.Q5_0: _decode_q5_0, QT.Q4_K: _decode_q4_k,    # the others: numpy's
               QT.Q6_K: _decode_q6_k}                                                   # _decode


def _scales(raw: np.ndarray, qt: QT, n_in: int):
    """_decode's scale fields alone (per group, per 256-block or None), for the types of FAST_DECODE."""
    rows, G = raw.shape[0], n_in // 32
    if qt in (QT.Q8_0, QT.Q5_0):
        return _u16(raw.reshape(rows, G, quant_info(qt).type_size)[..., 0:2])[..., None], None
    blk = raw.reshape(rows, n_in // 256, quant_info(qt).type_size)
    if qt == QT.Q4_K:
        sc, mn = _k_scale_min(blk[..., 4:16])
        return (np.stack([sc, mn], axis=-1).reshape(rows, G, 2),
                np.stack([_u16(blk[..., 0:2]), _u16(blk[..., 2:4])], axis=-1))
    return blk[..., 192:208].reshape(rows, G, 2), _u16(blk[..., 208:210])[..., None]      # Q6_K


_scratch = threading.local()


def _buffer(name: str, shape: tuple) -> np.ndarray:
    """A u8 array of shape, reused by this thread across calls (packing a model allocates no new pages per
    chunk: fresh pages cost a fault and zeroing each, half of a first load's time in the kernel)."""
    n = math.prod(shape)
    buf = getattr(_scratch, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, CHUNK_BYTES * 2), np.uint8)
        setattr(_scratch, name, buf)
    return buf[:n].reshape(shape)


def prepare_fast(raw: np.ndarray, qtype, *, scratch: bool = False) -> Packed:
    """lumen.kernels.matmul.prepare(raw, qtype), the same bytes (tests/test_pack_cache.py compares them for every
    type), its slowest steps compiled: the bit planes (_planes_into, 2/3 of prepare's time in numpy) and, for the
    types of FAST_DECODE, the unpacking of the values (_decode_q8_0 ...). scratch: q is a buffer of this thread, valid
    until its next call (the packer copies it out at once)."""
    qt = QT(int(qtype))
    fam = FORMAT.get(qt, (F32,))[0]
    if fam == F32 or not isinstance(raw, np.ndarray) or raw.ndim != 2 or raw.dtype != np.uint8:
        return prepare(raw, qtype)
    info = quant_info(qt)
    raw = np.ascontiguousarray(raw)
    d_out, n_in = raw.shape[0], raw.shape[1] // info.type_size * info.block_size
    if raw.shape[1] % info.type_size or not raw.shape[1] or n_in % 32:
        return prepare(raw, qtype)                                   # its error
    T, G = -(-d_out // R), n_in // 32
    pad = _buffer("pad", (T * R, n_in)) if scratch else np.empty((T * R, n_in), np.uint8)
    pad[d_out:] = 0
    if qt in FAST_DECODE:
        FAST_DECODE[qt](raw, pad)
        per_g, per_b = _scales(raw, qt, n_in)
    else:
        u, per_g, per_b = _decode(raw, qt, n_in)
        pad[:d_out] = u
    s = _tiles(per_g, T).reshape(T, -1).view(np.uint8)
    if per_b is not None:
        s = np.concatenate([s, _tiles(per_b, T).reshape(T, -1).view(np.uint8)], axis=1)
    q = _buffer("q", (T, G * GROUP_BYTES[fam])) if scratch else np.empty((T, G * GROUP_BYTES[fam]), np.uint8)
    _planes_into(pad, fam, G, q)
    return Packed(int(qtype), d_out, n_in, fam, q, np.ascontiguousarray(s))


def plan(mats: list) -> tuple[np.ndarray, dict]:
    """(table, sizes): the table of mats' packs (lumen.kernels.layout) and the length of each flat buffer, from
    the tensors' types and shapes alone, so the buffers can be allocated (or the cache file laid out) before any
    matrix is packed. Matrices take their slices of each buffer in order."""
    table = np.zeros((len(mats), N_COLS), np.int64)
    size = dict.fromkeys(BUFFERS, 0)
    for i, (raw, qtype) in enumerate(mats):
        qt = QT(int(qtype))
        info = quant_info(qt)
        d_out, n_in = raw.shape[0], raw.shape[1] // info.type_size * info.block_size
        fam = FAMILY[qt]
        T, G = -(-d_out // R), (0 if fam == F32 else n_in // 32)
        buf = buffer_of(fam)
        table[i, [C_QT, C_FAM, C_T, C_G, C_NIN, C_DOUT, C_Q, C_S, C_FMT]] = (
            int(qt), fam, T, G, n_in, d_out, size[buf], size["s"], ACT_FORMAT[qt])
        size[buf] += q_len(fam, T, G, n_in)
        size["s"] += s_len(int(qt), T, G)
    return table, size


def pack_into(mats: list, table: np.ndarray, put, *, release=None, threads: int = 1) -> None:
    """Pack every matrix into its slices as `table` (from plan) places them: put(buffer name, offset in values,
    flat array) stores a piece. One chunk of CHUNK_BYTES of GGUF rows at a time (whole tiles: a tile's packed
    bytes depend on its rows alone, so the pieces are the bytes of a whole-matrix repack), so the temporaries are
    those of a chunk, never of a matrix or of the model; `threads` chunks at once (numpy releases the GIL).
    release(raw), if given, is called once a matrix is done (the loader drops its GGUF pages there)."""
    def one(i, t0, t1):
        raw, qtype = mats[i]
        row = table[i]
        fam, G, n_in = int(row[C_FAM]), int(row[C_G]), int(row[C_NIN])
        p = prepare_fast(raw[t0 * R:t1 * R], qtype, scratch=True)
        q, s = p.q.reshape(-1), p.s.reshape(-1)
        assert q.size == q_len(fam, t1 - t0, G, n_in) and s.size == s_len(int(row[C_QT]), t1 - t0, G)
        put(buffer_of(fam), int(row[C_Q]) + t0 * (q.size // (t1 - t0)), q)
        if s.size:
            put("s", int(row[C_S]) + t0 * (s.size // (t1 - t0)), s)

    def chunks(i):
        raw = mats[i][0]
        T = int(table[i, C_T])
        step = max(1, CHUNK_BYTES // max(1, R * raw.shape[1]))
        return [(i, t0, min(T, t0 + step)) for t0 in range(0, T, step)]

    if threads <= 1:
        try:
            for i in range(len(mats)):
                for c in chunks(i):
                    one(*c)
                if release is not None:
                    release(mats[i][0])
        finally:
            _scratch.__dict__.clear()
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(threads) as pool:
        for i in range(len(mats)):
            for f in [pool.submit(one, *c) for c in chunks(i)]:
                f.result()
            if release is not None:
                release(mats[i][0])


def pack_all(mats: list, *, threads: int = 1, release=None) -> Packs:
    """[(raw (rows, row_bytes) u8, qtype)] -> Packs, in order, in memory (pack_into's arguments)."""
    table, size = plan(mats)
    flat = {name: np.empty(size[name], DTYPES[name]) for name in BUFFERS}

    def put(name, off, a):
        flat[name][off:off + a.size] = a
    pack_into(mats, table, put, threads=threads, release=release)
    return Packs(table=table, **flat)


@dataclass
class LoadedWeights:
    arrays: dict                 # the fields of lumen.model.forward.Weights, by name: what the forward pass takes
    rope_freqs: np.ndarray | None  # (n_rot/2,) f32 llama3 frequency factors, or None
    tied_output: bool
    decode_bytes: int            # weight bytes one decode step reads: every packed matrix (incl. the head), vector
    packs_from: str = "packed"   # "cache", "packed, cached", or "packed" (+ why the cache was not used)

    @property
    def packs(self) -> Packs:
        return self.arrays["packs"]


def _page_dropper(g: GGUFFile):
    """release(raw): unmap the pages of raw, a view of g's read-only mapping, from this process (madvise
    MADV_DONTNEED: they stay in the page cache, and a later read maps them again), so that a pass over every
    matrix does not leave the whole GGUF file in this process's RSS. None where that cannot be done."""
    mm = getattr(g, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or g.buf is None:
        return None
    base = g.buf.ctypes.data

    def release(raw: np.ndarray) -> None:
        start = raw.ctypes.data - base
        if not 0 <= start <= start + raw.nbytes <= g.size:
            return
        a = start - start % mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, a, start + raw.nbytes - a)
        except (OSError, ValueError):
            pass
    return release


def header_kinds(g: GGUFFile, cfg: Config, requant=None) -> np.ndarray:
    """The kinds value (lumen.kernels.kinds) of g's weights, from its header: the types of the packed matrices (the
    tensors' own, or requantized as load_weights(requant=) does), of the token embedding, and the gated
    activation."""
    emb = g.tensors["token_embd.weight"]
    tensors = [g.tensors[f"blk.{il}.{name}.weight"] for il in range(cfg.n_layer) for name in MATS]
    tensors.append(g.tensors.get("output.weight", emb))
    mats = {int(packed_type(t.qtype, t.dims[0], requant)) for t in tensors}
    return kinds(mats=mats, embd=(int(emb.qtype),), acts=(GELU if cfg.act == "gelu" else SILU,))


def load_weights(g: GGUFFile, cfg: Config, *, pack_cache: bool | None = None,
                 quiet: bool = False, requant=None) -> LoadedWeights:
    """The weights of g. pack_cache: use the on-disk pack cache (None: unless LUMEN_PACK_CACHE=0). Packing
    (a first load, or the cache off) says so in one line on stderr, with roughly how long it takes, unless quiet;
    so does a cache file that cannot be read. requant: None, or QT.Q4_0 to pack every matrix stored in more bits
    per weight as Q4_0 (a draft model's: fewer bytes a drafted token; cached apart from the packs as stored)."""
    L = cfg.n_layer
    spans = {name: np.zeros((L, 2), np.int64) for name in VECS}
    pieces, n = [], 0

    def add_vec(name: str) -> tuple[int, int]:
        nonlocal n
        arr = g.tensors[name].as_f32().reshape(-1)
        pieces.append(arr)
        n += arr.size
        return n - arr.size, arr.size

    mats = []
    ids = {name: np.zeros(L, np.int64) for name in MATS}
    for il in range(L):
        for name in MATS:
            t = g.tensors[f"blk.{il}.{name}.weight"]
            ids[name][il] = len(mats)
            mats.append(requantized(t.data, t.qtype, requant))
        for name in VECS:
            full = f"blk.{il}.{name}" + ("" if name.endswith(".bias") else ".weight")
            if full in g.tensors:
                spans[name][il] = add_vec(full)
    output_norm = np.array(add_vec("output_norm.weight"), np.int64)
    emb = g.tensors["token_embd.weight"]
    tied = "output.weight" not in g.tensors
    out = emb if tied else g.tensors["output.weight"]
    output = len(mats)
    mats.append(requantized(out.data, out.qtype, requant))
    from . import packcache
    table, sizes = plan(mats)
    threads, drop = numba.get_num_threads(), _page_dropper(g)
    release = None if drop is None else lambda raw: drop(getattr(raw, "source", raw))
    cache = packcache.enabled() if pack_cache is None else pack_cache
    told = []

    def say(line: str) -> None:
        if not quiet:
            print(f"lumen: {line}", file=sys.stderr, flush=True)

    def announce(why: str, writes: bool) -> None:
        if not told:
            told.append(True)
            nbytes = sum(getattr(raw, "source", raw).nbytes for raw, _ in mats)
            secs = max(1, round(nbytes / PACK_RATE / threads + (nbytes / WRITE_RATE if writes else 0)))
            how = "" if requant is None else f" as {QT(int(requant)).name}"
            say(f"packing the weights of {g.path.name}{how} for this CPU ({why}, ~{secs} s)")

    def pack(why: str = "the pack cache is off"):
        announce(why, False)
        return pack_all(mats, threads=threads, release=release)

    def fill(put):
        announce("first load only", True)
        pack_into(mats, table, put, threads=threads, release=release)

    if cache:
        variant = "" if requant is None else f"requant {QT(int(requant)).name}"
        packs, packs_from = packcache.load_or_pack(g, table, sizes, fill, pack, expected_rows(mats), say=say,
                                                   variant=variant)
    else:
        packs, packs_from = pack(), "packed (cache off)"
    fvec = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    rope = g.tensors.get("rope_freqs.weight")
    kset = header_kinds(g, cfg, requant)                                            # what forward compiles for
    arrays = dict(token_embd=emb.data, token_embd_type=int(emb.qtype), lut=F16_TO_F32, packs=packs, kinds=kset,
                     attn_q=ids["attn_q"], attn_k=ids["attn_k"], attn_v=ids["attn_v"],
                     attn_output=ids["attn_output"], ffn_gate=ids["ffn_gate"], ffn_up=ids["ffn_up"],
                     ffn_down=ids["ffn_down"], output=output, fvec=fvec,
                     attn_norm=spans["attn_norm"], ffn_norm=spans["ffn_norm"], attn_q_bias=spans["attn_q.bias"],
                     attn_k_bias=spans["attn_k.bias"], attn_v_bias=spans["attn_v.bias"],
                     attn_q_norm=spans["attn_q_norm"], attn_k_norm=spans["attn_k_norm"],
                     post_attention_norm=spans["post_attention_norm"], post_ffw_norm=spans["post_ffw_norm"],
                     output_norm=output_norm)
    return LoadedWeights(arrays=arrays, rope_freqs=None if rope is None else np.ascontiguousarray(rope.as_f32()),
                         tied_output=tied, decode_bytes=packs.nbytes + fvec.nbytes, packs_from=packs_from)
