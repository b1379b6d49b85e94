"""The forward pass: every layer of llama, qwen2 and gemma3 in one compiled Numba function.

One call runs a chunk of N tokens (prefill: N > 1, decode: N = 1) through all layers, writes their K/V into the
cache and the logits of the last `n_out` rows. The architecture is a handful of flags (biases, q/k norms, post
norms, activation, RoPE layout); the weights are byte offsets into one buffer (the GGUF mmap, zero-copy), so the
whole layer loop is compiled and Python runs once per chunk, not once per op.

Every op writes `ticks()` into `times[op_slot]` when `prof` is set, so the profiler sees each op of each layer
inside the compiled code (lumen/profile.py turns the ticks into records).
"""
from __future__ import annotations

import os

import numpy as np
from numba import njit

from .kernels.activation import add_kernel, add_kernel_par, geglu_kernel, geglu_kernel_par, swiglu_kernel, \
    swiglu_kernel_par
from .kernels.attention import CHUNK, attention_kernel, attention_split_kernel, kv_store_kernel
from .kernels.dequant import dequant_row
from .kernels.matmul import F32, Q4, R, batched_kernel, matvec_kernel, prepare_x
from .kernels.norm import rmsnorm_heads_kernel, rmsnorm_kernel, rmsnorm_kernel_par
from .kernels.rope import rope_kernel, rope_kernel_par
from .kernels.scratch import per_thread
from .timer import ticks

# ---- op ids: the timer's vocabulary (profile reports group by these names) ----
OPS = ("embed", "attn_norm", "q", "k", "v", "qk_norm", "rope", "kv_store", "attention", "o", "post_attn_norm",
       "attn_residual", "ffn_norm", "gate", "up", "act", "down", "post_ffn_norm", "ffn_residual",
       "output_norm", "output")
(OP_EMBED, OP_ATTN_NORM, OP_Q, OP_K, OP_V, OP_QK_NORM, OP_ROPE, OP_KV_STORE, OP_ATTN, OP_O, OP_POST_ATTN_NORM,
 OP_ATTN_RESID, OP_FFN_NORM, OP_GATE, OP_UP, OP_ACT, OP_DOWN, OP_POST_FFN_NORM, OP_FFN_RESID, OP_OUT_NORM,
 OP_OUTPUT) = range(len(OPS))
LAYER_OPS = range(OP_ATTN_NORM, OP_FFN_RESID + 1)
N_LAYER_OPS = len(LAYER_OPS)

# ---- weights: layer matrices are rows of the packed table (lumen.weights.Packs); F32 vectors live in fvec ----
# packed-matrix table columns: family, tiles, groups of 32, scale halves, n_in, d_out, offsets into q/s/o,
# offset groups (0 when the type has no offset), activation format (lumen.quants.ACT_*)
(P_FAM, P_T, P_G, P_H, P_NIN, P_DOUT, P_Q, P_S, P_O, P_OG, P_FMT) = range(11)
N_PCOLS = 11
MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
(W_Q, W_K, W_V, W_O, W_GATE, W_UP, W_DOWN) = range(len(MATS))
VECS = ("attn_norm", "ffn_norm", "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm", "attn_k_norm",
        "post_attention_norm", "post_ffw_norm")
(V_ATTN_NORM, V_FFN_NORM, V_QB, V_KB, V_VB, V_QN, V_KN, V_POST_ATTN, V_POST_FFW) = range(len(VECS))
# flags (int64 array)
(F_QKV_BIAS, F_QK_NORM, F_POST_NORMS, F_GELU, F_NEOX, F_N_HEAD, F_N_HEAD_KV, F_HEAD_DIM, F_HEAD_DIM_V,
 F_N_LAYER, F_PAR_ROWS) = range(11)
# float params (float32 array)
(P_EPS, P_ATTN_SCALE, P_EMBD_SCALE) = range(3)


# A lone decode token spreads its attention chunks over the threads (split-K) once it has more than one chunk
# of keys; both kernels give the same bits (lumen.kernels.attention), so this choice is only about speed.
SPLIT_K_MIN_KEYS = CHUNK + 1


def n_slots(n_layer: int) -> int:
    """embed, the layers' ops, output_norm, output, and the start tick in the last slot."""
    return 1 + n_layer * N_LAYER_OPS + 2 + 1


# LUMEN_TIMERS=0 compiles the timer calls out of the forward pass (to measure what they cost when off). Numba
# freezes this global at compile time, so lumen/__init__.py gives that build its own compile cache directory.
TIMERS = os.environ.get("LUMEN_TIMERS", "1") != "0"


@njit(cache=True, inline="always")
def _mark(times, prof, i):
    if TIMERS and prof:
        times[i] = ticks()


def matmul_scratch(max_rows: int, max_in: int, n_threads: int):
    """Scratch of `mm`: rounded activations (flat, reshaped per call) and per-thread accumulators."""
    G = max_in // 32
    return (np.zeros(max_rows * max_in, np.int8), np.zeros(max_rows * G, np.float32),
            np.zeros(max_rows * G * 2, np.float32), np.zeros(max_rows * max_in, np.float32),
            per_thread((n_threads, R), np.float32))


@njit(cache=True)
def mm(out, x, i, pk, Q, Q8, QF, S, O, scr):
    """out (N, d_out) = x (N, n_in) @ W_i.T for packed matrix i: the N=1 mat-vec kernel for decode, the batched
    kernel (each weight tile applied to all N rows while cached) for prefill; both give the same bits per row.
    Q holds the Q4 family's bytes, Q8 the Q5/I8 families' (stored as int8, read as the u8 they are)."""
    xq_f, xd_f, xs_f, xf_f, facc = scr
    fam, T, G, H = pk[i, P_FAM], pk[i, P_T], pk[i, P_G], pk[i, P_H]
    n_in, fmt = pk[i, P_NIN], pk[i, P_FMT]
    qo, so, oo, OG = pk[i, P_Q], pk[i, P_S], pk[i, P_O], pk[i, P_OG]
    z = 0
    if fam == F32:
        q = Q[0:0].reshape((z, z, z, z, z))
        qf = QF[qo:qo + T * n_in * R].reshape((T, n_in, R))
    elif fam == Q4:
        q = Q[qo:qo + T * G * 16 * R].reshape((T, G, 4, R, 4))
        qf = QF[0:0].reshape((z, z, z))
    else:
        q = Q8[qo:qo + T * G * 32 * R].view(np.uint8).reshape((T, G, 8, R, 4))
        qf = QF[0:0].reshape((z, z, z))
    s = S[so:so + T * G * H * R].reshape((T, G, H, R))
    o = O[oo:oo + T * OG * R].reshape((T, OG, R))
    N = x.shape[0]
    nch = min(T, facc.shape[0])
    xq = xq_f[:N * n_in].reshape((N, n_in))
    xd = xd_f[:N * G].reshape((N, G))
    xs = xs_f[:N * G * 2].reshape((N, G, 2))
    xf = xf_f[:N * n_in].reshape((N, n_in))
    if N == 1:
        matvec_kernel(out[0], fam, fmt, q, qf, s, o, x, xq, xd, xs, xf, facc[:nch])
    else:
        prepare_x(xq, xd, xs, xf, x, fmt)
        batched_kernel(out, fam, q, qf, s, o, xq, xd, xs, xf, facc[:nch])


@njit(cache=True)
def _vec(fvec, vt, layer, kind):
    off = vt[layer, kind, 0]
    return fvec[off:off + vt[layer, kind, 1]]


@njit(cache=True)
def _rmsnorm(out, x, w, eps, par):
    if par:
        rmsnorm_kernel_par(out, x, w, eps)
    else:
        rmsnorm_kernel(out, x, w, eps)


@njit(cache=True)
def _add(x, y, par):
    if par:
        add_kernel_par(x, y)
    else:
        add_kernel(x, y)


@njit(cache=True)
def _round_f16(a):
    """Round every value of a (any shape, C-contiguous f32) to float16 precision in place: llama.cpp keeps K and V
    in an f16 cache and converts q to f16 for q.k. Ties to even on the 13 dropped mantissa bits; exact for the
    f16 normal range, which is where attention values live."""
    u = a.reshape(-1).view(np.uint32)
    for i in range(u.shape[0]):
        b = u[i]
        u[i] = (b + np.uint32(0x0FFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)


@njit(cache=True)
def _add_bias(x, b):
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += b[i]


@njit(cache=True)
def forward_kernel(buf, mt, gt, pk, Q, Q8, QF, S, O, fvec, vt, flags, params, lut, tokens, positions, pos0,
                   n_out, x, xn, q, k, v, att, ffa, ffb, logits, scr,
                   k_pool, v_pool, slots, seqs, block_tables, windows, rope_sel, cos_tab, sin_tab,
                   att_scr, times, prof):
    """Run tokens (N,) at positions (N,) == pos0 + arange(N) through every layer.

    buf (nbytes,) u8          the GGUF mmap, read for the token embedding rows: gt[0] = its (byte offset,
                              qtype, rows, cols, row_bytes); gt[1] = output_norm (fvec offset, length);
                              gt[2, 0] = the output matrix's index in the packed table
    mt (L, 7)                 each layer matrix's index in the packed table pk (n_mats, 12)
    Q, Q8, QF, S, O           the packed buffers (lumen.weights.Packs); scr: matmul_scratch
    fvec (n,) f32, vt (L, 9, 2) the F32 vectors (norms, biases) and their (offset, length)
    x, xn (N, E)              residual stream and normed input      q (N, H*hd)  k (N, KV*hd)  v (N, KV*hdv)
    att (N, H*hdv)            attention output                      ffa, ffb (N, F) FFN gate/up
    logits (n_out, V)         logits of the last n_out rows
    k_pool (L, n_blocks, KV, hd, 16), v_pool (L, n_blocks, KV, 16, hdv) u16: the paged f16 KV cache
    slots (N,) where each token's K/V go; seqs (N,) its row of block_tables (S, max_blocks)
    att_scr                   attention scratch (lumen.kernels.attention.attention_scratch)
    windows (L,) 0 = full attention
    rope_sel (L,) which cos/sin table a layer uses; cos_tab, sin_tab (n_tables, ctx, n_rot/2)
    times (n_slots,) i8       ticks after each op when prof
    """
    N = tokens.shape[0]
    E = x.shape[1]
    L = flags[F_N_LAYER]
    H = flags[F_N_HEAD]
    KVH = flags[F_N_HEAD_KV]
    hd = flags[F_HEAD_DIM]
    hdv = flags[F_HEAD_DIM_V]
    neox = flags[F_NEOX] != 0
    par = N >= flags[F_PAR_ROWS]
    eps = params[P_EPS]
    base = 1

    if TIMERS and prof:
        times[times.shape[0] - 1] = ticks()  # start
    # embedding lookup (dequantize the token rows), gemma scales it by sqrt(E)
    e_off, e_qt, e_rows, e_rb = gt[0, 0], gt[0, 1], gt[0, 2], gt[0, 4]
    emb = buf[e_off:e_off + e_rows * e_rb].reshape((e_rows, e_rb))
    for t in range(N):
        dequant_row(x[t], emb[tokens[t]], lut, e_qt)
    if params[P_EMBD_SCALE] != 1.0:
        x *= params[P_EMBD_SCALE]
    _mark(times, prof, 0)

    for il in range(L):
        b = base + il * N_LAYER_OPS
        # attention block
        _rmsnorm(xn, x, _vec(fvec, vt, il, V_ATTN_NORM), eps, par)
        _mark(times, prof, b + 0)
        mm(q, xn, mt[il, W_Q], pk, Q, Q8, QF, S, O, scr)
        _mark(times, prof, b + 1)
        mm(k, xn, mt[il, W_K], pk, Q, Q8, QF, S, O, scr)
        _mark(times, prof, b + 2)
        mm(v, xn, mt[il, W_V], pk, Q, Q8, QF, S, O, scr)
        if flags[F_QKV_BIAS]:
            _add_bias(q, _vec(fvec, vt, il, V_QB))
            _add_bias(k, _vec(fvec, vt, il, V_KB))
            _add_bias(v, _vec(fvec, vt, il, V_VB))
        _mark(times, prof, b + 3)
        q3 = q.reshape((N, H, hd))
        k3 = k.reshape((N, KVH, hd))
        if flags[F_QK_NORM]:
            rmsnorm_heads_kernel(q3, q3, _vec(fvec, vt, il, V_QN), eps)
            rmsnorm_heads_kernel(k3, k3, _vec(fvec, vt, il, V_KN), eps)
        _mark(times, prof, b + 4)
        tsel = rope_sel[il]
        if par:
            rope_kernel_par(q3, positions, cos_tab[tsel], sin_tab[tsel], neox)
            rope_kernel_par(k3, positions, cos_tab[tsel], sin_tab[tsel], neox)
        else:
            rope_kernel(q3, positions, cos_tab[tsel], sin_tab[tsel], neox)
            rope_kernel(k3, positions, cos_tab[tsel], sin_tab[tsel], neox)
        _round_f16(q3)
        _round_f16(k3)
        _round_f16(v)
        _mark(times, prof, b + 5)
        kv_store_kernel(k_pool[il], v_pool[il], k3, v.reshape((N, KVH, hdv)), slots)
        _mark(times, prof, b + 6)
        a3 = att.reshape((N, H, hdv))
        o_a, st_a, ro_a, rm_a, po_a, pm_a = att_scr
        if N == 1 and positions[0] + 1 > SPLIT_K_MIN_KEYS:
            attention_split_kernel(a3, q3, k_pool[il], v_pool[il], positions[0], seqs[0], block_tables,
                                   windows[il], params[P_ATTN_SCALE], o_a, st_a, ro_a, rm_a, po_a, pm_a)
        else:
            attention_kernel(a3, q3, k_pool[il], v_pool[il], positions, seqs, block_tables, windows[il],
                             params[P_ATTN_SCALE], o_a, st_a, ro_a, rm_a)
        _mark(times, prof, b + 7)
        mm(xn, att, mt[il, W_O], pk, Q, Q8, QF, S, O, scr)
        _mark(times, prof, b + 8)
        if flags[F_POST_NORMS]:
            _rmsnorm(xn, xn, _vec(fvec, vt, il, V_POST_ATTN), eps, par)
        _mark(times, prof, b + 9)
        _add(x, xn, par)
        _mark(times, prof, b + 10)
        # feed-forward block
        _rmsnorm(xn, x, _vec(fvec, vt, il, V_FFN_NORM), eps, par)
        _mark(times, prof, b + 11)
        mm(ffa, xn, mt[il, W_GATE], pk, Q, Q8, QF, S, O, scr)
        _mark(times, prof, b + 12)
        mm(ffb, xn, mt[il, W_UP], pk, Q, Q8, QF, S, O, scr)
        _mark(times, prof, b + 13)
        if flags[F_GELU]:
            if par:
                geglu_kernel_par(ffa, ffa, ffb)
            else:
                geglu_kernel(ffa, ffa, ffb)
        else:
            if par:
                swiglu_kernel_par(ffa, ffa, ffb)
            else:
                swiglu_kernel(ffa, ffa, ffb)
        _mark(times, prof, b + 14)
        mm(xn, ffa, mt[il, W_DOWN], pk, Q, Q8, QF, S, O, scr)
        _mark(times, prof, b + 15)
        if flags[F_POST_NORMS]:
            _rmsnorm(xn, xn, _vec(fvec, vt, il, V_POST_FFW), eps, par)
        _mark(times, prof, b + 16)
        _add(x, xn, par)
        _mark(times, prof, b + 17)

    # output: final norm and the vocabulary projection, only for the last n_out rows
    end = base + L * N_LAYER_OPS
    xo = xn[N - n_out:]
    _rmsnorm(xo, x[N - n_out:], fvec[gt[1, 0]:gt[1, 0] + E], eps, n_out >= flags[F_PAR_ROWS])
    _mark(times, prof, end)
    mm(logits[:n_out], xo, gt[2, 0], pk, Q, Q8, QF, S, O, scr)
    _mark(times, prof, end + 1)
