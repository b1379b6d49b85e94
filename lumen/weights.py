"""Model weights, as arrays the compiled forward pass can take.

- The token embedding is read straight from the GGUF mmap (zero-copy): `gt` holds its (byte offset, qtype,
  rows, cols, row_bytes); the lookup dequantizes only the rows of the tokens seen.
- Every other matrix is repacked once at load (lumen.kernels.matmul.prepare: tiles of 64 rows, rows innermost)
  and the packed arrays of all matrices are concatenated into a few flat buffers by dtype (`Packs`); a table
  row per matrix gives its family, sizes and offsets, so one compiled function can reach any matrix.
- Every norm/bias vector is (offset, length) into one float32 array.
- The packs of a GGUF file are cached on disk (lumen.packcache, $LUMEN_HOME/packs): a warm start reads them
  instead of repacking. LUMEN_PACK_CACHE=0 or load_weights(..., pack_cache=False) turns that off.
The loader has already validated every offset, shape and type (lumen.gguf, lumen.config), so these tables are
safe to hand to kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import Config
from .forward import MATS, N_PCOLS, P_DOUT, P_FAM, P_FMT, P_G, P_H, P_NIN, P_O, P_OG, P_Q, P_S, P_T, VECS
from .gguf import GGUFFile
from .kernels.matmul import F32, Q4, prepare
from .quants import ACT_FORMAT, QT


@dataclass
class Packs:
    """All repacked matrices, concatenated by dtype. Matrix i is described by table[i] (see P_* columns)."""
    table: np.ndarray  # (n_mats, N_PCOLS) i8
    q: np.ndarray      # (n,) u8: Q4 family nibbles
    q8: np.ndarray     # (n,) i8: Q5 and I8 family values
    qf: np.ndarray     # (n,) f32: F32 family values
    s: np.ndarray      # (n,) f32 scales
    o: np.ndarray      # (n,) f32 offsets

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.q8, self.qf, self.s, self.o))


def pack_all(mats: list) -> Packs:
    """[(raw (rows, row_bytes) u8, qtype)] -> Packs, in order."""
    table = np.zeros((len(mats), N_PCOLS), np.int64)
    parts = {k: [] for k in ("q", "q8", "qf", "s", "o")}
    size = dict.fromkeys(parts, 0)

    def put(kind, arr):
        flat = np.ascontiguousarray(arr).reshape(-1)
        parts[kind].append(flat)
        size[kind] += flat.size
        return size[kind] - flat.size

    for i, (raw, qtype) in enumerate(mats):
        p = prepare(raw, qtype)
        T = p.s.shape[0]
        G = p.n_in // 32 if p.family != F32 else 0
        row = table[i]
        row[[P_FAM, P_T, P_G, P_H, P_NIN, P_DOUT]] = p.family, T, G, p.s.shape[2], p.n_in, p.d_out
        row[P_Q] = put("q" if p.family == Q4 else "qf" if p.family == F32 else "q8", p.q)
        row[P_FMT] = ACT_FORMAT[QT(int(qtype))]
        row[P_S] = put("s", p.s)
        row[P_O], row[P_OG] = put("o", p.o), p.o.shape[1]
    dt = dict(q=np.uint8, q8=np.int8, qf=np.float32, s=np.float32, o=np.float32)
    flat = {k: (np.concatenate(v) if v else np.zeros(0, dt[k])).astype(dt[k], copy=False) for k, v in parts.items()}
    return Packs(table=table, **flat)


@dataclass
class Weights:
    buf: np.ndarray    # (file bytes,) u8: the GGUF mmap
    mt: np.ndarray     # (L, len(MATS)) i8: index of each layer matrix in packs.table
    gt: np.ndarray     # (3, 5) i8: token_embd (byte offset, qtype, rows, cols, row_bytes) in buf,
                       #            output_norm (fvec offset, length), output (index in packs.table)
    packs: Packs
    fvec: np.ndarray   # (n,) f32: every 1-D F32 tensor, concatenated
    vt: np.ndarray     # (L, len(VECS), 2) i8: offset into fvec, length (0 = absent)
    rope_freqs: np.ndarray | None  # (n_rot/2,) f32 llama3 frequency factors, or None
    tied_output: bool
    decode_bytes: int  # weight bytes one decode step reads: every packed matrix (incl. the head) and vector
    packs_from: str = "packed"  # "cache", "packed, cached", or "packed" (+ why the cache was not used)


def load_weights(g: GGUFFile, cfg: Config, *, pack_cache: bool | None = None) -> Weights:
    """The weights of g. pack_cache: use the on-disk pack cache (None: unless LUMEN_PACK_CACHE=0)."""
    L = cfg.n_layer
    vt = np.zeros((L, len(VECS), 2), np.int64)
    pieces, n = [], 0

    def add_vec(name: str) -> tuple[int, int]:
        nonlocal n
        arr = g.tensors[name].as_f32().reshape(-1)
        pieces.append(arr)
        n += arr.size
        return n - arr.size, arr.size

    mats = []
    mt = np.zeros((L, len(MATS)), np.int64)
    for il in range(L):
        for k, name in enumerate(MATS):
            t = g.tensors[f"blk.{il}.{name}.weight"]
            mt[il, k] = len(mats)
            mats.append((t.data, t.qtype))
        for k, name in enumerate(VECS):
            full = f"blk.{il}.{name}" + ("" if name.endswith(".bias") else ".weight")
            if full in g.tensors:
                vt[il, k] = add_vec(full)
    gt = np.zeros((3, 5), np.int64)
    emb = g.tensors["token_embd.weight"]
    gt[0] = [emb.offset, int(emb.qtype), emb.data.shape[0], emb.dims[0], emb.data.shape[1]]
    gt[1, :2] = add_vec("output_norm.weight")
    tied = "output.weight" not in g.tensors
    out = emb if tied else g.tensors["output.weight"]
    gt[2, 0] = len(mats)
    mats.append((out.data, out.qtype))
    from . import packcache
    if packcache.enabled() if pack_cache is None else pack_cache:
        packs, packs_from = packcache.load_or_pack(g, mats, pack_all)
    else:
        packs, packs_from = pack_all(mats), "packed (cache off)"
    fvec = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    rope = g.tensors.get("rope_freqs.weight")
    return Weights(buf=g.buf, mt=mt, gt=gt, packs=packs, fvec=fvec, vt=vt,
                   rope_freqs=None if rope is None else np.ascontiguousarray(rope.as_f32()),
                   tied_output=tied, decode_bytes=packs.nbytes + fvec.nbytes, packs_from=packs_from)
