"""RunState: every activation buffer and the KV cache of one sequence, allocated once.

Sized from the context length the user asks for (default 2048, not the model's training context) and the
prefill chunk size n_batch. Nothing on the per-token path allocates.
"""
from __future__ import annotations

import numpy as np

from .config import Config
from .forward import matmul_scratch, n_slots
from .kernels.attention import BLOCK, attention_scratch
from .kernels.rope import rope_cache

f32 = np.float32


class RunState:
    def __init__(self, cfg: Config, n_ctx: int, n_batch: int, n_threads: int, rope_freqs=None):
        E, H, KV, hd, hdv, F, L = (cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v, cfg.n_ff,
                                   cfg.n_layer)
        B = n_batch
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self.n_past = 0                              # positions 0 .. n_past-1 are in the cache
        self.x = np.zeros((B, E), f32)               # residual stream
        self.xn = np.zeros((B, E), f32)              # normed input / block output
        self.q = np.zeros((B, H * hd), f32)
        self.k = np.zeros((B, KV * hd), f32)
        self.v = np.zeros((B, KV * hdv), f32)
        self.att = np.zeros((B, H * hdv), f32)       # attention output, (B, H, hdv) flattened
        self.ffa = np.zeros((B, F), f32)             # FFN gate, then act(gate) * up
        self.ffb = np.zeros((B, F), f32)             # FFN up
        self.logits = np.zeros((1, cfg.n_vocab), f32)  # grown on demand when all positions' logits are asked
        nb = -(-n_ctx // BLOCK)
        self.k_pool = np.zeros((L, nb, KV, hd, BLOCK), np.uint16)    # f16 bits, keys transposed per block
        self.v_pool = np.zeros((L, nb, KV, BLOCK, hdv), np.uint16)
        self.block_table = np.arange(nb, dtype=np.int64)[None, :]    # (1, nb): one sequence, blocks in order
        self.seqs = np.zeros(B, np.int64)                            # every token belongs to sequence 0
        self.mmscratch = matmul_scratch(B, max(E, F, H * hdv), n_threads)
        self.att_scr = attention_scratch(H, hdv, n_ctx, n_threads)
        self.times = np.zeros(n_slots(L), np.int64)  # op timestamps of the last forward call
        # RoPE tables: 0 = global layers (rope_base), 1 = sliding-window layers (rope_base_local)
        cos = np.zeros((2, n_ctx, cfg.n_rot // 2), f32)
        sin = np.zeros((2, n_ctx, cfg.n_rot // 2), f32)
        for i, base in enumerate((cfg.rope_base, cfg.rope_base_local)):
            cos[i], sin[i] = rope_cache(base, cfg.n_rot, n_ctx, cfg.rope_freq_scale, rope_freqs)
        self.cos_tab, self.sin_tab = cos, sin
        self.rope_sel = np.array([1 if s else 0 for s in cfg.swa_layers], np.int64)  # (L,)
        self.windows = np.array([cfg.window_of(i) for i in range(L)], np.int64)     # (L,) 0 = full

    def logits_rows(self, n: int) -> np.ndarray:
        """A (n, V) logits buffer, grown (never shrunk) when a prefill asks for n rows."""
        if self.logits.shape[0] < n:
            self.logits = np.zeros((n, self.logits.shape[1]), f32)
        return self.logits

    @property
    def nbytes(self) -> int:
        arrays = [a for a in vars(self).values() if isinstance(a, np.ndarray)]
        arrays += [a for t in (self.mmscratch, self.att_scr) for a in t]
        return sum(a.nbytes for a in arrays)
