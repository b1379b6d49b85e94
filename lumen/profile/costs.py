"""The work of each timer slot of one forward call: (layer, op, bytes, flops), from shapes and types.

Matmuls: packed weight bytes read + activations in and out, 2 N d_out n_in flops. Attention: the K and V rows read
from the f16 cache for every (token, kv head), 2 (hd + hd_v) flops per (query head, key). Elementwise ops: their
activations in and out. The head: only the rows sampled.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..model.forward import LAYER_OPS, OPS
from ..kernels.layout import C_DOUT, C_NIN, matrix_nbytes

# per runner, per (N, n_out): the costs that do not depend on positions. Weak keys: an id() key could be reused
# by a later runner and hand it another model's costs.
_STATIC: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
MAT_OF = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
          "down": ("ffn_down",)}       # the matmul ops (q, k, v and gate, up run fused) and their matrices


def keys_read(positions: np.ndarray, window: int) -> int:
    """Keys the tokens at these positions attend to in a layer with this window (0: full)."""
    n = positions + 1
    return int(np.minimum(n, window).sum() if window else n.sum())


def forward_costs(runner, batch) -> list[tuple[int, str, int, int]]:
    c, w = runner.cfg, runner.w
    N, n_out = batch.tokens.shape[0], batch.out_rows.shape[0]
    per = _STATIC.setdefault(runner, {})
    static = per.get((N, n_out))
    if static is None:
        table = w.packs.table
        mat = lambda i: (matrix_nbytes(table[i]), int(table[i, C_DOUT]), int(table[i, C_NIN]))  # noqa: E731
        E, F = c.n_embd, c.n_ff
        qd, kd, vd = c.q_dim, c.kv_dim, c.v_dim
        act = 4 * N
        elem = {"attn_norm": (2 * act * E, 4 * N * E), "qk_norm": (2 * act * (qd + kd) if c.qk_norm else 0,
                                                                     4 * N * (qd + kd) if c.qk_norm else 0),
                "rope": (2 * act * (qd + kd), 3 * N * (qd + kd)), "kv_store": (act * (kd + vd) + 2 * N * (kd + vd), 0),
                "post_attn_norm": (2 * act * E if c.post_norms else 0, 4 * N * E if c.post_norms else 0),
                "attn_residual": (3 * act * E, N * E), "ffn_norm": (2 * act * E, 4 * N * E),
                "act": (3 * act * F, 8 * N * F), "post_ffn_norm": (2 * act * E if c.post_norms else 0,
                                                                   4 * N * E if c.post_norms else 0),
                "ffn_residual": (3 * act * E, N * E)}
        layers = []
        for il in range(c.n_layer):
            row = []
            for op_id in LAYER_OPS:
                op = OPS[op_id]
                if op in MAT_OF:
                    ms = [mat(int(getattr(w, m)[il])) for m in MAT_OF[op]]
                    n_in = ms[0][2]
                    row.append([il, op, sum(b + act * d_out for b, d_out, _ in ms) + act * n_in,
                                sum(2 * N * d_out * n_in for _, d_out, _ in ms)])
                elif op == "attention":
                    row.append([il, op, 0, 0])          # filled per call from the positions
                else:
                    row.append([il, op, *elem[op]])
            layers.append(row)
        emb_rb = int(w.token_embd.shape[1])
        head_b, head_out, head_in = mat(int(w.output))
        static = ([[-1, "embed", N * emb_rb + act * E, N * E]], layers,
                  [[-1, "output_norm", 2 * 4 * n_out * E, 4 * n_out * E],
                   [-1, "output", head_b + 4 * n_out * (head_in + head_out), 2 * n_out * head_out * head_in]])
        per[(N, n_out)] = static
    first, layers, last = static
    out = [tuple(first[0])]
    att_slot = LAYER_OPS.index(OPS.index("attention"))
    keys = {}
    for il, row in enumerate(layers):
        win = c.window_of(il)
        if win not in keys:
            keys[win] = keys_read(batch.positions, win)
        kv_bytes = keys[win] * c.n_head_kv * (c.head_dim + c.head_dim_v) * 2    # f16 cache
        row[att_slot][2] = kv_bytes + 4 * N * (c.q_dim + c.n_head * c.head_dim_v)
        row[att_slot][3] = 2 * keys[win] * c.n_head * (c.head_dim + c.head_dim_v)
        out.extend(tuple(r) for r in row)
    out.extend(tuple(r) for r in last)
    return out
