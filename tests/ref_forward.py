"""A plain numpy (float64) forward pass of llama / qwen2 / gemma3, written from the architectures' definitions:
the test oracle for Lumen's compiled forward. Weights are dequantized with gguf-py; nothing from lumen's kernels
is used, only its Config (the metadata reading under test elsewhere).

Memory: a weight is dequantized when it is used and dropped after (nothing is cached), the token embedding only
for the ids fed. `hidden` returns the final normed states (N, E); `head` computes the logits of any rows of the
vocabulary from them, so a caller can work through a 262144-row head (Gemma 3: 1.3 GB as float64) in row blocks
and position chunks. `forward` is the two together, for small vocabularies.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from gguf.quants import dequantize

from lumen.model.config import ROPE_NEOX, Config


def f16(a):
    return a.astype(np.float16).astype(np.float64)


def q8_blocks(x, block, f16_scale):
    """Round-trip x through 8-bit blocks along the last axis (ggml's Q8_0/Q8_1: 32, f16 d; Q8_K: 256, f32 d)."""
    sh = x.shape
    b = x.reshape(-1, block)
    amax = np.abs(b).max(1, keepdims=True)
    d = amax / 127
    if f16_scale:
        d = f16(d)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    return (np.clip(np.round(b * inv), -127, 127) * d).reshape(sh)


# the activation format ggml's CPU backend quantizes to before a dot product with each weight type
ACT_FORMAT = {"Q4_0": (32, True), "Q5_0": (32, True), "Q8_0": (32, True), "Q4_1": (32, True), "Q5_1": (32, True),
              "Q4_K": (256, False), "Q5_K": (256, False), "Q6_K": (256, False)}


class RefModel:
    """llama_numerics=True rounds like llama.cpp's CPU path: activations through the 8-bit format of each weight
    type, K/V and q to f16 for attention, attention probabilities to f16 before the product with V."""

    def __init__(self, g, cfg: Config, llama_numerics: bool = False):
        self.cfg = cfg
        self.t = g.tensors
        self.llama = llama_numerics

    def act(self, x, name):
        """x rounded like llama.cpp would before a dot product with W's type (unchanged unless llama_numerics)."""
        if self.llama:
            fmt = ACT_FORMAT.get(self.t[name].qtype.name)
            if fmt is not None:
                return q8_blocks(x, *fmt)
            if self.t[name].qtype.name == "F16":
                return f16(x)
        return x

    def mat(self, x, name, rows=None):
        """x @ W[rows].T, x first rounded like llama.cpp would for W's type. rows: a slice of W's rows or None."""
        return self.act(x, name) @ self.w(name, rows).T

    def w(self, name: str, rows=None) -> np.ndarray:
        """numpy-order float64 array of a tensor, or of its rows (a slice or an index array) of a 2-D one.
        gguf-py dequantizes to float32, as ggml does; the float64 widening loses nothing."""
        t = self.t[name]
        data = t.data if rows is None else t.data[rows]        # (n_rows, row_bytes) uint8: whole quant blocks
        shape = t.shape if rows is None else (data.shape[0], t.shape[-1])
        # as one row: gguf-py loops in Python over groups of 16 rows, which is most of the time on a big tensor
        return dequantize(data.reshape(1, -1), t.qtype).reshape(shape).astype(np.float64)

    def has(self, name: str) -> bool:
        return name in self.t


def rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, base, n_rot, neox, freq_scale=1.0, factors=None):
    """x (N, heads, hd) rotated by positions pos (N,)."""
    half = n_rot // 2
    inv = base ** (-np.arange(half) * 2.0 / n_rot)
    if factors is not None:
        inv = inv / factors
    ang = pos[:, None] * inv[None, :] * freq_scale           # (N, half)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * c - b * s
        out[..., half:n_rot] = a * s + b * c
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * c - b * s
        out[..., 1:n_rot:2] = a * s + b * c
    return out


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def hidden(m: RefModel, ids) -> np.ndarray:
    """Final normed hidden states (N, E) for token ids at positions 0..N-1 (the input of the output head)."""
    c = m.cfg
    ids = np.asarray(ids)
    N = len(ids)
    pos = np.arange(N, dtype=np.float64)
    x = m.w("token_embd.weight", ids) * c.embd_scale        # (N, E)
    factors = m.w("rope_freqs.weight") if m.has("rope_freqs.weight") else None
    for il in range(c.n_layer):
        b = f"blk.{il}."
        h = rmsnorm(x, m.w(b + "attn_norm.weight"), c.rms_eps)
        q = m.mat(h, b + "attn_q.weight")
        k = m.mat(h, b + "attn_k.weight")
        v = m.mat(h, b + "attn_v.weight")
        if c.qkv_bias:
            q, k, v = q + m.w(b + "attn_q.bias"), k + m.w(b + "attn_k.bias"), v + m.w(b + "attn_v.bias")
        q = q.reshape(N, c.n_head, c.head_dim)
        k = k.reshape(N, c.n_head_kv, c.head_dim)
        v = v.reshape(N, c.n_head_kv, c.head_dim_v)
        if c.qk_norm:
            q = rmsnorm(q, m.w(b + "attn_q_norm.weight"), c.rms_eps)
            k = rmsnorm(k, m.w(b + "attn_k_norm.weight"), c.rms_eps)
        neox = c.rope_type == ROPE_NEOX
        base = c.rope_base_of(il)
        q = rope(q, pos, base, c.n_rot, neox, c.rope_freq_scale, factors)
        k = rope(k, pos, base, c.n_rot, neox, c.rope_freq_scale, factors)
        if m.llama:
            q, k, v = f16(q), f16(k), f16(v)
        window = c.window_of(il)
        i, j = np.arange(N)[:, None], np.arange(N)[None, :]
        mask = (j <= i) & ((window == 0) | (i - j < window))
        att = np.empty((N, c.n_head, c.head_dim_v))
        for hh in range(c.n_head):
            g = hh // c.n_gqa
            s = q[:, hh] @ k[:, g].T * c.attn_scale
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(1, keepdims=True))
            p = s / s.sum(1, keepdims=True)
            att[:, hh] = (f16(p) if m.llama else p) @ v[:, g]
        o = m.mat(att.reshape(N, -1), b + "attn_output.weight")
        if c.post_norms:
            o = rmsnorm(o, m.w(b + "post_attention_norm.weight"), c.rms_eps)
        x = x + o
        h = rmsnorm(x, m.w(b + "ffn_norm.weight"), c.rms_eps)
        gate = m.mat(h, b + "ffn_gate.weight")
        up = m.mat(h, b + "ffn_up.weight")
        act = gelu_tanh(gate) if c.act == "gelu" else gate / (1 + np.exp(-gate))
        f = m.mat(act * up, b + "ffn_down.weight")
        if c.post_norms:
            f = rmsnorm(f, m.w(b + "post_ffw_norm.weight"), c.rms_eps)
        x = x + f
    return rmsnorm(x, m.w("output_norm.weight"), c.rms_eps)


def head_name(m: RefModel) -> str:
    return "output.weight" if m.has("output.weight") else "token_embd.weight"


def head(m: RefModel, x, rows=None) -> np.ndarray:
    """Logits (N, n_rows) of the vocabulary rows `rows` (a slice; None = all) from hidden states x (N, E)."""
    z = m.mat(x, head_name(m), rows)
    cap = m.cfg.final_logit_softcap
    return cap * np.tanh(z / cap) if cap else z


def forward(m: RefModel, ids) -> np.ndarray:
    """Logits (N, V) for token ids at positions 0..N-1."""
    return head(m, hidden(m, ids))


class Fidelity(NamedTuple):
    """Per position p of N token ids (the prediction of token p+1; the last one predicts past the text)."""
    kl: np.ndarray         # (N,) KL(ref_p ‖ other_p), natural log, over the whole vocabulary
    top_ref: np.ndarray    # (N,) argmax of the reference's logits (the lowest id on a tie)
    top_other: np.ndarray  # (N,) argmax of the other's logits
    nll_ref: np.ndarray    # (N-1,) -log p_ref(ids[p+1]): the reference's own loss on the text


def compare(m: RefModel, ids, logits_of, n_others: int = 1, chunk_bytes: int = 1 << 26,
            block_bytes: int = 1 << 24) -> list[Fidelity]:
    """This float64 forward (ref) against other implementations on token ids, position by position.

    logits_of(a, b) returns a list of n_others arrays: each other's logits of positions a..b-1, (b - a, V)
    float32. It is called once per chunk of positions, in order (so a model can prefill chunk by chunk). The
    reference logits of a chunk are made one block of vocabulary rows at a time and folded into running sums, so
    memory stays at one chunk of each other's logits (about chunk_bytes each) plus a few float64 blocks (about
    block_bytes each), never (N, V) float64:
        KL = sum_v p_ref (z_ref - z_other) - lse(z_ref) + lse(z_other),
        sum_v p_ref (z_ref - z_other) = sum_v exp(z_ref - mx) (z_ref - z_other) / sum_v exp(z_ref - mx)."""
    ids = np.asarray(ids)
    x = hidden(m, ids)                                           # (N, E)
    N, E = x.shape
    V = m.cfg.n_vocab
    chunk = max(1, min(N, chunk_bytes // (4 * V)))
    block = max(256, min(block_bytes // (8 * chunk), block_bytes // (8 * E)))
    kl, top_o = np.empty((n_others, N)), np.empty((n_others, N), np.int64)
    top_ref, lse_ref = np.empty(N, np.int64), np.empty(N)
    for a in range(0, N, chunk):
        b = min(N, a + chunk)
        P = b - a
        others = logits_of(a, b)                                 # n_others x (P, V) float32
        if len(others) != n_others or any(o.shape != (P, V) for o in others):
            raise ValueError(f"logits_of({a}, {b}) gave {[o.shape for o in others]}, expected {n_others} x {(P, V)}")
        mx, s, arg = np.full(P, -np.inf), np.zeros(P), np.zeros(P, np.int64)  # max z_ref, sum exp(z_ref - mx)
        t = np.zeros((n_others, P))                              # sum exp(z_ref - mx) (z_ref - z_other)
        mo, so = np.full((n_others, P), -np.inf), np.zeros((n_others, P))  # max z_other, sum exp(z_other - mo)
        for r in range(0, V, block):
            z = head(m, x[a:b], slice(r, r + block))             # (P, B) float64
            bm = z.max(1)
            arg = np.where(bm > mx, r + z.argmax(1), arg)        # the first maximum, as argmax
            m2 = np.maximum(mx, bm)
            scale = np.exp(mx - m2)                              # 0 on the first block (mx = -inf)
            e = np.exp(z - m2[:, None])                          # (P, B)
            s = s * scale + e.sum(1)
            for i, o in enumerate(others):
                zo = o[:, r:r + block].astype(np.float64)        # (P, B)
                t[i] = t[i] * scale + (e * (z - zo)).sum(1)
                mo2 = np.maximum(mo[i], zo.max(1))
                so[i] = so[i] * np.exp(mo[i] - mo2) + np.exp(zo - mo2[:, None]).sum(1)
                mo[i] = mo2
            mx = m2
        lse_ref[a:b] = mx + np.log(s)
        top_ref[a:b] = arg
        for i, o in enumerate(others):
            kl[i, a:b] = t[i] / s - lse_ref[a:b] + mo[i] + np.log(so[i])
            top_o[i, a:b] = o.argmax(1)
        del others
    z_next = (x[:-1] * m.w(head_name(m), ids[1:])).sum(1)       # (N-1,) reference logit of the next token
    cap = m.cfg.final_logit_softcap
    if cap:
        z_next = cap * np.tanh(z_next / cap)
    nll = lse_ref[:-1] - z_next
    return [Fidelity(kl[i], top_ref, top_o[i], nll) for i in range(n_others)]
