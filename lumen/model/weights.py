"""Model weights, as the named arrays the compiled forward pass takes (lumen.model.parts makes the forward pass's
Weights bundle of them; nothing here imports the engine).

- The token embedding is read straight from the GGUF mmap (zero-copy): its (n_vocab, row_bytes) rows; the
  lookup dequantizes only the rows of the tokens seen.
- Every other matrix is repacked once at load (lumen.kernels.matmul.prepare) into the layout of
  lumen.kernels.layout, and all of them are concatenated into a few flat buffers by dtype (`Packs`); a table row
  per matrix gives its family, sizes and offsets, so one compiled function can reach any matrix by its id.
- Every norm/bias vector is (offset, length) into one float32 array.
- The packs of a GGUF file are cached on disk (lumen.model.packcache, $LUMEN_HOME/packs): a warm start reads
  them instead of repacking. LUMEN_PACK_CACHE=0 or load_weights(..., pack_cache=False) turns that off.
The loader has already validated every offset, shape and type (lumen.format.gguf, lumen.model.config), and the
pack cache checks the packs against the tensors, so these tables are safe to hand to kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..format.gguf import GGUFFile
from ..format.quants import ACT_FORMAT, QT
from ..kernels.dequant import F16_TO_F32
from ..kernels.layout import (C_DOUT, C_FAM, C_FMT, C_G, C_NIN, C_Q, C_QT, C_S, C_T, DTYPES, F32, N_COLS, Packs, R,
                              buffer_of)
from ..kernels.kinds import GELU, SILU, kinds
from ..kernels.matmul import prepare
from ..format.quants import quant_info
from .config import Config

# per layer: the matrices and the vectors the forward pass reads, by GGUF tensor name (blk.N.<name>[.weight])
MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
VECS = ("attn_norm", "ffn_norm", "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm", "attn_k_norm",
        "post_attention_norm", "post_ffw_norm")


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


def pack_all(mats: list) -> Packs:
    """[(raw (rows, row_bytes) u8, qtype)] -> Packs, in order."""
    table = np.zeros((len(mats), N_COLS), np.int64)
    parts = {k: [] for k in ("q", "qf", "s")}
    size = dict.fromkeys(parts, 0)

    def put(kind, arr):
        flat = np.ascontiguousarray(arr).reshape(-1)
        parts[kind].append(flat)
        size[kind] += flat.size
        return size[kind] - flat.size

    for i, (raw, qtype) in enumerate(mats):
        p = prepare(raw, qtype)
        row = table[i]
        row[[C_QT, C_FAM, C_T, C_G, C_NIN, C_DOUT]] = (int(qtype), p.family, p.s.shape[0],
                                                       p.n_in // 32 if p.family != F32 else 0, p.n_in, p.d_out)
        row[C_Q] = put(buffer_of(p.family), p.q)
        row[C_FMT] = ACT_FORMAT[QT(int(qtype))]
        row[C_S] = put("s", p.s)
    flat = {k: (np.concatenate(v) if v else np.zeros(0, DTYPES[k])).astype(DTYPES[k], copy=False)
            for k, v in parts.items()}
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


def load_weights(g: GGUFFile, cfg: Config, *, pack_cache: bool | None = None) -> LoadedWeights:
    """The weights of g. pack_cache: use the on-disk pack cache (None: unless LUMEN_PACK_CACHE=0)."""
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
            mats.append((t.data, t.qtype))
        for name in VECS:
            full = f"blk.{il}.{name}" + ("" if name.endswith(".bias") else ".weight")
            if full in g.tensors:
                spans[name][il] = add_vec(full)
    output_norm = np.array(add_vec("output_norm.weight"), np.int64)
    emb = g.tensors["token_embd.weight"]
    tied = "output.weight" not in g.tensors
    out = emb if tied else g.tensors["output.weight"]
    output = len(mats)
    mats.append((out.data, out.qtype))
    from . import packcache
    if packcache.enabled() if pack_cache is None else pack_cache:
        packs, packs_from = packcache.load_or_pack(g, mats, pack_all, expected_rows(mats))
    else:
        packs, packs_from = pack_all(mats), "packed (cache off)"
    fvec = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    rope = g.tensors.get("rope_freqs.weight")
    kset = kinds(mats=packs.table[:, C_QT].tolist(), embd=(int(emb.qtype),),       # what forward compiles for
                  acts=(GELU if cfg.act == "gelu" else SILU,))
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
