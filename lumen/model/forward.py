"""The forward pass: every layer of llama, qwen2 and gemma3 over one ragged batch, in one compiled function.

One call runs T tokens that belong to S sequences. Every matmul runs over all T rows at once (each weight tile is
read once per step); attention runs per token over its own sequence's blocks of the paged KV cache; logits are
computed only for the rows that will be sampled. A single sequence (lumen.Model) is the S = 1 case.

    forward(arch, w, kv, batch, scr, logits, prof)

takes named bundles (NamedTuples, which Numba compiles as structs):
    Arch     the architecture: sizes, switches, RoPE tables, per-layer windows (from the Config)
    Weights  the token embedding (rows of the GGUF mmap), the packed matrices (lumen.kernels.layout.Packs)
             and the norm/bias vectors, named after the GGUF tensors; the addresses of the kernels of the
             model's weight types (lumen.kernels.entries), so nothing here depends on the model
    KV       the paged f16 K/V pools of every layer (lumen.kernels.attention)
    Batch    this step's tokens, their positions, sequences and cache slots, the block tables, the rows to sample
    Scratch  activation buffers and kernel scratch, allocated once for the largest step
Every op writes `ticks()` into scr.times when prof is set, so the profiler sees each op of each layer inside
the compiled code (lumen.profile turns the ticks into records).
"""
from __future__ import annotations

import os
from enum import IntEnum
from typing import NamedTuple

import numpy as np
from numba import njit
from numba.extending import overload

from ..kernels.attention import AttnScratch, Paged, kv_store_kernel, run_attention
from ..kernels.dequant import dequant_row
from ..kernels.entries import address, entries
from ..kernels.jit import compiled_only
from ..kernels.kinds import ACT, ADD, GELU, MM3, N_ENTRIES, QUANT, RMSNORM, ROPE, SILU, call, require_abi
from ..kernels.layout import C_FAM, C_FMT, C_G, C_NIN, C_Q, C_QT, C_S, C_T, F32, R, Packs, q_len, s_len
from ..kernels.matmul import Acts, Mat, act_rows, prepare_x_at, run_matmul
from ..kernels.policy import parallel_rows, split_attention
from ..kernels.rope import rope_flags
from ..kernels.rows import run_rows
from ..timer import ticks

# ---- op ids: the timer's vocabulary (profile reports group by these names) ----
OPS = ("embed", "attn_norm", "qkv", "qk_norm", "rope", "kv_store", "attention", "o", "post_attn_norm",
       "attn_residual", "ffn_norm", "gate_up", "act", "down", "post_ffn_norm", "ffn_residual", "output_norm",
       "output")
Op = IntEnum("Op", OPS, start=0)       # Op.qkv == OPS.index("qkv"): a slot's name and its index cannot drift
LAYER_OPS = range(Op.attn_norm, Op.ffn_residual + 1)
N_LAYER_OPS = len(LAYER_OPS)
MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")      # per layer
VECS = ("attn_norm", "ffn_norm", "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm", "attn_k_norm",
        "post_attention_norm", "post_ffw_norm")                                               # per layer


def n_slots(n_layer: int) -> int:
    """Timer slots: embed, the layers' ops, output_norm, output, and the start tick in the last slot. Op o of
    layer il writes slot o + il * N_LAYER_OPS (embed: slot 0); output_norm and output follow the last layer's."""
    return 1 + n_layer * N_LAYER_OPS + 2 + 1


# LUMEN_TIMERS=0 compiles the timer calls out (to measure what they cost when off). Numba freezes this global at
# compile time, so lumen/__init__.py gives that build its own compile cache directory.
TIMERS = os.environ.get("LUMEN_TIMERS", "1") != "0"


class Arch(NamedTuple):
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    qkv_bias: bool
    qk_norm: bool
    post_norms: bool       # gemma3: post_attention_norm, post_ffw_norm
    gelu: bool             # else silu
    neox: bool             # RoPE pairs (i, i + n_rot/2), else (2i, 2i+1)
    eps: np.float32
    attn_scale: np.float32
    embd_scale: np.float32
    softcap: np.float32    # final logit soft-capping, 0 = none
    windows: np.ndarray    # (L,) i8 sliding window per layer, 0 = full attention
    rope_sel: np.ndarray   # (L,) i8 which RoPE table a layer uses
    rope_cos: np.ndarray   # (n_tables, max_pos, n_rot/2) f32
    rope_sin: np.ndarray


class _WeightFields(NamedTuple):
    token_embd: np.ndarray       # (n_vocab, row_bytes) u8: rows of the GGUF mmap, dequantized on lookup
    token_embd_type: int         # its GGML type
    lut: np.ndarray              # (65536,) f32: f16 bits -> value
    packs: object                # lumen.kernels.layout.Packs: every matrix below is a row of packs.table
    attn_q: np.ndarray           # (L,) i8 matrix ids
    attn_k: np.ndarray
    attn_v: np.ndarray
    attn_output: np.ndarray
    ffn_gate: np.ndarray
    ffn_up: np.ndarray
    ffn_down: np.ndarray
    output: int                  # the output head's matrix id (token_embd's when tied)
    kinds: np.ndarray            # (N_ENTRIES,) i8 the entry table of the model's kinds (lumen.kernels.kinds)
    fvec: np.ndarray             # (n,) f32: every norm and bias vector; each below is (offset, length) into it
    attn_norm: np.ndarray        # (L, 2) i8
    ffn_norm: np.ndarray
    attn_q_bias: np.ndarray      # length 0 when absent
    attn_k_bias: np.ndarray
    attn_v_bias: np.ndarray
    attn_q_norm: np.ndarray
    attn_k_norm: np.ndarray
    post_attention_norm: np.ndarray
    post_ffw_norm: np.ndarray
    output_norm: np.ndarray      # (2,) i8


class Weights(_WeightFields):
    """The Weights bundle. A kinds value given for `kinds` (lumen.kernels.kinds.kinds: the types the model uses)
    becomes its entry table here (lumen.kernels.entries: those types' kernels compiled or loaded now), so
    the forward pass is one compiled function for every model, and its type-specific kernels are compiled once
    per type on a machine."""
    __slots__ = ()

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls, *args, **kwargs)
        table = entries(self.kinds)
        if table.shape[0] == N_ENTRIES and table[MM3] == 0:
            table[MM3] = address(mm3, mm3_signature(), "mm3")
        return self._replace(kinds=table)


class KV(NamedTuple):
    k: np.ndarray                # (L, n_blocks, n_kv, head_dim, BLOCK) u16 f16 bits
    v: np.ndarray                # (L, n_blocks, n_kv, BLOCK, head_dim_v) u16


class Batch(NamedTuple):
    tokens: np.ndarray           # (T,) i8
    positions: np.ndarray        # (T,) i8 position of each token in its sequence
    seqs: np.ndarray             # (T,) i8 each token's row of block_tables
    slots: np.ndarray            # (T,) i8 where its K/V go: block * BLOCK + offset
    block_tables: np.ndarray     # (rows, max_blocks) i8
    out_rows: np.ndarray         # (n_out,) i8 the rows whose logits are computed, in order


class MMScratch(NamedTuple):
    xq: np.ndarray               # (rows * max_in,) i8 activations rounded to 8 bits (reshaped per call)
    xd: np.ndarray               # (rows * max_in / 32,) f32 their scales
    xs: np.ndarray               # (rows * max_in / 32,) f32 their scaled sums
    xf: np.ndarray               # (rows * max_in,) f32 activations rounded for the float families; for the
                                 # 8-bit formats its head holds their integer half sums (rows, G, 2) i32
    facc: np.ndarray             # (lanes, FACC) f32 per-thread accumulators (lumen.kernels.matmul)
    wbuf: np.ndarray             # (lanes, max_in / 32 * UNPACKED_GROUP) u8 per-thread unpacked tile (matmul_kernel)
    work: np.ndarray             # (8,) i8 the work counter of the matmul regions (lumen.kernels.work), own line


class Scratch(NamedTuple):
    x: np.ndarray                # (rows, E) residual stream
    xn: np.ndarray               # (rows, E) normed input / block output
    q: np.ndarray                # (rows, H * hd)
    k: np.ndarray                # (rows, KV * hd)
    v: np.ndarray                # (rows, KV * hdv)
    att: np.ndarray              # (rows, H * hdv) attention output
    ffa: np.ndarray              # (rows, F) FFN gate, then act(gate) * up
    ffb: np.ndarray              # (rows, F) FFN up
    mm: MMScratch
    attn: AttnScratch            # lumen.kernels.attention
    times: np.ndarray            # (n_slots,) i8 op timestamps of the last call


@njit(cache=True, inline="always")
def _mark(times, prof, i):
    if TIMERS and prof:
        times[i] = ticks()


@compiled_only
def _mat(i, packs):
    """Packed matrix i as the kernels take it (a lumen.kernels.matmul.Mat), and its activation format."""
    pk = packs.table
    qt, fam, T, G, n_in = pk[i, C_QT], pk[i, C_FAM], pk[i, C_T], pk[i, C_G], pk[i, C_NIN]
    qo, so = pk[i, C_Q], pk[i, C_S]
    z = 0
    sb = s_len(qt, T, G)
    s = packs.s[so:so + sb].reshape((T, sb // T))
    if fam == F32:
        return Mat(qt, packs.q[0:0].reshape((z, z)), packs.qf[qo:qo + q_len(fam, T, G, n_in)].reshape((T, n_in, R)),
                   s), pk[i, C_FMT]
    qb = q_len(fam, T, G, n_in)
    return Mat(qt, packs.q[qo:qo + qb].reshape((T, qb // T)), packs.qf[0:0].reshape((z, z, R)), s), pk[i, C_FMT]


@compiled_only(c_wrapper=True)
def mm3(o0, o1, o2, x, i0, i1, i2, n, packs, kinds, scr):
    """o_m (N, d_out_m) = x (N, n_in) @ W_{i_m}.T for the first n (1..3) of the packed matrices i0, i1, i2 of
    packs: the activations rounded once (prepare_x_at), then one parallel region over the tiles of all n (one
    activation row per pass for decode, NR rows per pass otherwise; both give the same bits per row). Matrices
    whose activation formats differ, or of the F32 family, run one region each (matmul_kernel, through the entry
    table). The forward pass calls it through the table too (`run_mm3`), so it does not link (and compile again)
    the matmul kernels' tree."""
    m0, f0 = _mat(i0, packs)
    m1, f1 = _mat(i1, packs)
    m2, f2 = _mat(i2, packs)
    outs, ms, fmts = (o0, o1, o2), (m0, m1, m2), (f0, f1, f2)
    fused = n == 1 or (m0.qf.shape[0] == 0 and m1.qf.shape[0] == 0 and f1 == f0
                       and (n == 2 or (m2.qf.shape[0] == 0 and f2 == f0)))
    N, n_in = x.shape
    G = n_in // 32
    if act_rows(N) * n_in <= scr.xq.shape[0]:     # 3 rows padded for one NR-row pass (matmul.tiles)
        N = act_rows(N)
    acts = Acts(scr.xq[:N * n_in].reshape((N, n_in)), scr.xd[:N * G].reshape((N, G)),
                scr.xs[:N * G].reshape((N, G)),
                scr.xf[:N * G * 2].view(np.int32).reshape((N, G, 2)),   # xf is free for the 8-bit formats
                scr.xf[:N * n_in].reshape((N, n_in)))
    for r in range(1 if fused else n):
        if fused:
            o, ws, k = outs, ms, n
        else:
            o, ws, k = (outs[r], outs[r], outs[r]), (ms[r], ms[r], ms[r]), np.int64(1)
        prepare_x_at(acts, x, fmts[r], kinds[QUANT])
        run_matmul(o, ws, k, acts, scr.facc, scr.wbuf, scr.work, kinds)


def _z(dtype, ndim: int) -> np.ndarray:
    return np.zeros((1,) * ndim, dtype)


def packs_args() -> Packs:
    """A Packs of the types every model's has (of no use but its types)."""
    return Packs(_z(np.int64, 2), _z(np.uint8, 1), _z(np.float32, 1), _z(np.uint8, 1))


def mm_scratch_args() -> MMScratch:
    """An MMScratch of the types the runner makes (of no use but its types)."""
    f32 = np.float32
    return MMScratch(_z(np.int8, 1), _z(f32, 1), _z(f32, 1), _z(f32, 1), _z(f32, 2), _z(np.uint8, 2),
                     _z(np.int64, 1))


def mm3_signature() -> tuple:
    """The types the forward pass gives mm3, for which its entry in the table is compiled."""
    i64 = np.int64
    args = (*(_z(np.float32, 2) for _ in range(4)), i64(0), i64(0), i64(0), i64(0), packs_args(), _z(i64, 1),
            mm_scratch_args())
    return tuple(mm3.typeof_pyval(a) for a in args)


def run_mm3(o0, o1, o2, x, i0, i1, i2, n, packs, kinds, scr):
    """mm3(...) called through the entry table kinds. Compiled code only."""
    raise NotImplementedError("run_mm3 runs in compiled code only")


@overload(run_mm3, inline="always")
def _run_mm3(o0, o1, o2, x, i0, i1, i2, n, packs, kinds, scr):
    require_abi("the mm3 entry", (o0, o1, o2, x, i0, i1, i2, n, packs, kinds, scr), mm3_signature())

    def impl(o0, o1, o2, x, i0, i1, i2, n, packs, kinds, scr):
        call(kinds[MM3], (o0, o1, o2, x, i0, i1, i2, n, packs, kinds, scr))
    return impl


@njit(cache=True, inline="always")
def mm(out, x, i, packs, kinds, scr):
    """out (N, d_out) = x (N, n_in) @ W_i.T for packed matrix i (mm3 of one matrix)."""
    run_mm3(out, out, out, x, i, i, i, np.int64(1), packs, kinds, scr)   # (n not a literal: one signature)


@compiled_only
def _vec(fvec, span, layer):
    """The f32 vector at span[layer] = (offset, length) in fvec (the Weights' fvec). It takes the array, not the
    Weights bundle: each pass of a bundle holding n arrays is n reference count increments and decrements in the
    forward pass's unoptimized code, which LLVM then spends time removing."""
    off = span[layer, 0]
    return fvec[off:off + span[layer, 1]]


@compiled_only
def _round_f16(a):
    """Round every value of a (any shape, C-contiguous f32) to float16 precision in place: llama.cpp keeps K and V
    in an f16 cache and converts q to f16 for q.k. Ties to even on the 13 dropped mantissa bits; exact for the
    f16 normal range, which is where attention values live."""
    u = a.reshape(-1).view(np.uint32)
    for i in range(u.shape[0]):
        b = u[i]
        u[i] = (b + np.uint32(0x0FFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)


@compiled_only
def _add_bias(x, b):
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += b[i]


@njit(cache=True, nogil=True, no_cfunc_wrapper=True)
def forward(arch, w, kv, batch, scr, logits, prof):
    """Run the batch's T tokens through every layer: their K/V go into the cache at batch.slots, and logits
    (n_out, V) receive the logits of rows batch.out_rows. Bundles: see the module docstring."""
    N = batch.tokens.shape[0]
    E = scr.x.shape[1]
    H, KVH, hd, hdv = arch.n_head, arch.n_head_kv, arch.head_dim, arch.head_dim_v
    par = parallel_rows(N)
    eps = arch.eps
    x, xn = scr.x[:N], scr.xn[:N]
    q, k, v, att = scr.q[:N], scr.k[:N], scr.v[:N], scr.att[:N]
    ffa, ffb = scr.ffa[:N], scr.ffb[:N]
    times = scr.times
    q3 = q.reshape((N, H, hd))
    k3 = k.reshape((N, KVH, hd))
    v3 = v.reshape((N, KVH, hdv))
    a3 = att.reshape((N, H, hdv))
    split = split_attention(N, batch.positions[0] + 1)
    # the row-wise ops (lumen.kernels.rows) pass arrays of the same types to every row function, unused ones too,
    # so that the row loop and its region compile once (a global array would be read-only: another signature)
    pos, nov, f0, z = batch.positions, w.fvec[:0], np.float32(0), np.int64(0)
    rf = rope_flags(hd, arch.neox)
    qh, kh = q.reshape((N * H, hd)), k.reshape((N * KVH, hd))     # rows of one head (qk_norm)
    act = ACT + (GELU if arch.gelu else SILU)

    if TIMERS and prof:
        times[times.shape[0] - 1] = ticks()  # start
    # embedding lookup (dequantize the token rows); gemma scales it by sqrt(E)
    for t in range(N):
        dequant_row(w.kinds, x[t], w.token_embd[batch.tokens[t]], w.lut, w.token_embd_type)
    if arch.embd_scale != 1.0:
        for t in range(N):
            for j in range(E):
                x[t, j] *= arch.embd_scale
    _mark(times, prof, Op.embed)

    for il in range(arch.n_layer):
        lb = il * N_LAYER_OPS                    # op o of this layer: timer slot lb + o
        # attention block
        run_rows(w.kinds[RMSNORM], par, N, xn, x, x, _vec(w.fvec, w.attn_norm, il), pos, eps, z)
        _mark(times, prof, lb + Op.attn_norm)
        run_mm3(q, k, v, xn, w.attn_q[il], w.attn_k[il], w.attn_v[il], np.int64(3), w.packs, w.kinds, scr.mm)
        if arch.qkv_bias:
            _add_bias(q, _vec(w.fvec, w.attn_q_bias, il))
            _add_bias(k, _vec(w.fvec, w.attn_k_bias, il))
            _add_bias(v, _vec(w.fvec, w.attn_v_bias, il))
        _mark(times, prof, lb + Op.qkv)
        if arch.qk_norm:
            run_rows(w.kinds[RMSNORM], par, N * H, qh, qh, qh, _vec(w.fvec, w.attn_q_norm, il), pos, eps, z)
            run_rows(w.kinds[RMSNORM], par, N * KVH, kh, kh, kh, _vec(w.fvec, w.attn_k_norm, il), pos, eps, z)
        _mark(times, prof, lb + Op.qk_norm)
        cos, sin = arch.rope_cos[arch.rope_sel[il]], arch.rope_sin[arch.rope_sel[il]]
        run_rows(w.kinds[ROPE], par, N, q, cos, sin, nov, pos, f0, rf)
        run_rows(w.kinds[ROPE], par, N, k, cos, sin, nov, pos, f0, rf)
        _round_f16(q)           # (2-d, as v: one signature)
        _round_f16(k)
        _round_f16(v)
        _mark(times, prof, lb + Op.rope)
        kv_store_kernel(kv.k[il], kv.v[il], k3, v3, batch.slots)
        _mark(times, prof, lb + Op.kv_store)
        cache = Paged(kv.k[il], kv.v[il], batch.block_tables)
        run_attention(w.kinds, a3, q3, cache, batch.positions, batch.seqs, arch.windows[il], arch.attn_scale,
                      scr.attn, split)
        _mark(times, prof, lb + Op.attention)
        mm(xn, att, w.attn_output[il], w.packs, w.kinds, scr.mm)
        _mark(times, prof, lb + Op.o)
        if arch.post_norms:
            run_rows(w.kinds[RMSNORM], par, N, xn, xn, xn, _vec(w.fvec, w.post_attention_norm, il), pos, eps, z)
        _mark(times, prof, lb + Op.post_attn_norm)
        run_rows(w.kinds[ADD], par, N, x, xn, xn, nov, pos, f0, z)
        _mark(times, prof, lb + Op.attn_residual)
        # feed-forward block
        run_rows(w.kinds[RMSNORM], par, N, xn, x, x, _vec(w.fvec, w.ffn_norm, il), pos, eps, z)
        _mark(times, prof, lb + Op.ffn_norm)
        run_mm3(ffa, ffb, ffb, xn, w.ffn_gate[il], w.ffn_up[il], w.ffn_up[il], np.int64(2), w.packs, w.kinds,
                scr.mm)
        _mark(times, prof, lb + Op.gate_up)
        run_rows(w.kinds[act], par, N, ffa, ffa, ffb, nov, pos, f0, z)     # ffa = act(gate) * up
        _mark(times, prof, lb + Op.act)
        mm(xn, ffa, w.ffn_down[il], w.packs, w.kinds, scr.mm)
        _mark(times, prof, lb + Op.down)
        if arch.post_norms:
            run_rows(w.kinds[RMSNORM], par, N, xn, xn, xn, _vec(w.fvec, w.post_ffw_norm, il), pos, eps, z)
        _mark(times, prof, lb + Op.post_ffn_norm)
        run_rows(w.kinds[ADD], par, N, x, xn, xn, nov, pos, f0, z)
        _mark(times, prof, lb + Op.ffn_residual)

    # output: final norm and the vocabulary projection, only for the rows to sample
    lb = (arch.n_layer - 1) * N_LAYER_OPS        # the slots after the last layer's
    n_out = batch.out_rows.shape[0]
    xo = scr.xn[:n_out]
    for i in range(n_out):
        for j in range(E):
            xo[i, j] = x[batch.out_rows[i], j]
    on = w.output_norm
    run_rows(w.kinds[RMSNORM], parallel_rows(n_out), n_out, xo, xo, xo, w.fvec[on[0]:on[0] + on[1]], pos, eps,
             z)
    _mark(times, prof, lb + Op.output_norm)
    out = logits[:n_out]
    mm(out, xo, w.output, w.packs, w.kinds, scr.mm)
    if arch.softcap > 0:
        c = arch.softcap
        for i in range(n_out):
            for j in range(out.shape[1]):
                out[i, j] = c * np.tanh(out[i, j] / c)
    _mark(times, prof, lb + Op.output)
