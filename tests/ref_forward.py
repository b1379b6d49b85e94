"""A plain numpy (float64) forward pass of llama / qwen2 / gemma3, written from the architectures' definitions:
the test oracle for Lumen's compiled forward. Weights are dequantized with gguf-py; nothing from lumen's kernels
is used, only its Config (the metadata reading under test elsewhere).
"""
from __future__ import annotations

import math

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
        self._cache = {}
        self.llama = llama_numerics

    def mat(self, x, name):
        """x @ W.T, x first rounded like llama.cpp would for W's type."""
        if self.llama:
            fmt = ACT_FORMAT.get(self.t[name].qtype.name)
            if fmt is not None:
                x = q8_blocks(x, *fmt)
            elif self.t[name].qtype.name == "F16":
                x = f16(x)
        return x @ self.w(name).T

    def w(self, name: str) -> np.ndarray:
        """numpy-order float64 array of a tensor."""
        if name not in self._cache:
            t = self.t[name]
            self._cache[name] = dequantize(t.data, t.qtype).reshape(t.shape).astype(np.float64)
        return self._cache[name]

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
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def forward(m: RefModel, ids) -> np.ndarray:
    """Logits (N, V) for token ids at positions 0..N-1."""
    c = m.cfg
    ids = np.asarray(ids)
    N = len(ids)
    pos = np.arange(N, dtype=np.float64)
    x = m.w("token_embd.weight")[ids] * c.embd_scale        # (N, E)
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
    x = rmsnorm(x, m.w("output_norm.weight"), c.rms_eps)
    return m.mat(x, "output.weight" if m.has("output.weight") else "token_embd.weight")
