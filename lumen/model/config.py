"""One frozen Config per model, built from the GGUF metadata in one place, and the tensor contract it implies.

Derived sizes (head_dim, GQA group, the sliding-window layer pattern, per-layer RoPE bases) are computed here and
nowhere else. `check_tensors` validates every tensor the architecture needs (presence, shape, type) before any
kernel sees one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import GGUFError, UnsupportedError

ARCHITECTURES = ("llama", "qwen2", "gemma3")
ROPE_NORM, ROPE_NEOX = 0, 2  # llama.cpp's rope modes: llama rotates pairs (2i, 2i+1), NeoX pairs (i, i+n/2)


@dataclass(frozen=True)
class Config:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int        # key/query head size
    head_dim_v: int      # value head size
    n_vocab: int
    ctx_train: int
    rms_eps: float
    rope_type: int       # ROPE_NORM or ROPE_NEOX
    n_rot: int
    rope_base: float     # global layers
    rope_base_local: float  # sliding-window layers (gemma3), else == rope_base
    rope_freq_scale: float  # 1 / linear scaling factor
    sliding_window: int  # 0 = none
    swa_layers: tuple[bool, ...]  # per layer: uses the sliding window
    attn_scale: float    # multiplies q.k
    embd_scale: float    # multiplies the token embedding (gemma: sqrt(n_embd))
    act: str             # "silu" or "gelu"
    qkv_bias: bool
    qk_norm: bool
    post_norms: bool     # gemma3: post_attention_norm, post_ffw_norm
    final_logit_softcap: float  # 0 = none
    name: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def v_dim(self) -> int:
        return self.n_head_kv * self.head_dim_v

    def rope_base_of(self, layer: int) -> float:
        return self.rope_base_local if self.swa_layers[layer] else self.rope_base

    def window_of(self, layer: int) -> int:
        return self.sliding_window if self.swa_layers[layer] else 0


def _get(meta: Mapping[str, Any], key: str, kind, default=None, required=True):
    if key not in meta:
        if required and default is None:
            raise GGUFError(f"missing metadata key {key!r}")
        return default
    v = meta[key]
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise GGUFError(f"metadata {key!r} should be an integer, got {v!r}")
    elif kind is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise GGUFError(f"metadata {key!r} should be a finite number, got {v!r}")
        v = float(v)
    return v


def _positive(name: str, v: int, upper: int = 1 << 24) -> int:
    if not 0 < v <= upper:
        raise GGUFError(f"metadata {name} = {v} is out of range (1..{upper})")
    return v


def config_from_metadata(meta: Mapping[str, Any]) -> Config:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError("missing metadata key 'general.architecture'")
    if arch not in ARCHITECTURES:
        raise UnsupportedError(f"architecture {arch!r} is not supported; Lumen runs {', '.join(ARCHITECTURES)}")
    a = arch + "."
    n_layer = _positive("block_count", _get(meta, a + "block_count", int), 1024)
    n_embd = _positive("embedding_length", _get(meta, a + "embedding_length", int))
    n_ff = _get(meta, a + "feed_forward_length", int)
    if isinstance(n_ff, list):
        raise UnsupportedError("per-layer feed_forward_length is not supported")
    _positive("feed_forward_length", n_ff)
    n_head = _get(meta, a + "attention.head_count", int)
    n_head_kv = _get(meta, a + "attention.head_count_kv", int, default=n_head)
    _positive("attention.head_count", n_head, 4096)
    _positive("attention.head_count_kv", n_head_kv, 4096)
    if n_head % n_head_kv:
        raise GGUFError(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    if arch != "gemma3" and n_embd % n_head:
        raise GGUFError(f"embedding_length {n_embd} is not a multiple of head_count {n_head}")
    head_dim = _positive("attention.key_length", _get(meta, a + "attention.key_length", int, default=n_embd // n_head))
    head_dim_v = _positive("attention.value_length",
                           _get(meta, a + "attention.value_length", int, default=head_dim))
    n_rot = _get(meta, a + "rope.dimension_count", int, default=head_dim)
    if not (0 < n_rot <= head_dim and n_rot % 2 == 0):
        raise GGUFError(f"rope.dimension_count {n_rot} must be even and at most the head size {head_dim}")
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if isinstance(tokens, list) else _get(meta, a + "vocab_size", int)
    _positive("vocab size", n_vocab, 1 << 22)
    ctx_train = _positive("context_length", _get(meta, a + "context_length", int, default=2048), 1 << 24)
    rms_eps = _get(meta, a + "attention.layer_norm_rms_epsilon", float)
    if not 0 < rms_eps < 1:
        raise GGUFError(f"layer_norm_rms_epsilon {rms_eps} is out of range")
    rope_base = _get(meta, a + "rope.freq_base", float, default=10000.0)
    if rope_base <= 0:                                   # (else the first forward pass fails, in the kernel's words)
        raise GGUFError(f"rope.freq_base {rope_base} must be positive")
    scaling = meta.get(a + "rope.scaling.type", "none")
    factor = _get(meta, a + "rope.scaling.factor", float, default=1.0)
    if scaling not in ("none", "linear") and factor != 1.0:
        raise UnsupportedError(f"rope scaling {scaling!r} is not supported (only linear)")
    if factor <= 0:
        raise GGUFError(f"rope.scaling.factor {factor} must be positive")

    common = dict(arch=arch, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                  head_dim=head_dim, head_dim_v=head_dim_v, n_vocab=n_vocab, ctx_train=ctx_train, rms_eps=rms_eps,
                  n_rot=n_rot, rope_base=rope_base, rope_freq_scale=1.0 / factor, final_logit_softcap=0.0,
                  name=str(meta.get("general.name", "")))
    if arch in ("llama", "qwen2"):
        return Config(**common, rope_type=ROPE_NORM if arch == "llama" else ROPE_NEOX, rope_base_local=rope_base,
                      sliding_window=0, swa_layers=(False,) * n_layer, attn_scale=1.0 / math.sqrt(head_dim),
                      embd_scale=1.0, act="silu", qkv_bias=arch == "qwen2", qk_norm=False, post_norms=False)
    # gemma3 (llama.cpp: llm_build_gemma3_iswa): 5 sliding-window layers then 1 global, local RoPE base 10k
    window = _get(meta, a + "attention.sliding_window", int, default=0)
    if window < 0:
        raise GGUFError(f"sliding_window {window} is negative")
    pattern = meta.get(a + "attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise GGUFError(f"sliding_window_pattern has {len(pattern)} entries for {n_layer} layers")
        swa = tuple(bool(x) for x in pattern)
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        swa = tuple(window > 0 and (il % pattern) < pattern - 1 for il in range(n_layer))
    else:
        raise GGUFError(f"sliding_window_pattern {pattern!r} is invalid")
    softcap = _get(meta, a + "final_logit_softcapping", float, default=0.0, required=False)
    return Config(**{**common, "final_logit_softcap": softcap}, rope_type=ROPE_NEOX, rope_base_local=10000.0,
                  sliding_window=window, swa_layers=swa, attn_scale=1.0 / math.sqrt(head_dim),
                  embd_scale=math.sqrt(n_embd), act="gelu", qkv_bias=False, qk_norm=True, post_norms=True)


def expected_tensors(cfg: Config) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (ggml dims, required) for every tensor the forward pass reads."""
    E, V = cfg.n_embd, cfg.n_vocab
    t: dict[str, tuple[tuple[int, ...], bool]] = {
        "token_embd.weight": ((E, V), True),
        "output_norm.weight": ((E,), True),
        "output.weight": ((E, V), False),  # absent: tied to token_embd
    }
    if cfg.arch == "llama":
        t["rope_freqs.weight"] = ((cfg.n_rot // 2,), False)
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = ((E,), True)
        t[b + "attn_q.weight"] = ((E, cfg.q_dim), True)
        t[b + "attn_k.weight"] = ((E, cfg.kv_dim), True)
        t[b + "attn_v.weight"] = ((E, cfg.v_dim), True)
        t[b + "attn_output.weight"] = ((cfg.n_head * cfg.head_dim_v, E), True)
        t[b + "ffn_norm.weight"] = ((E,), True)
        t[b + "ffn_gate.weight"] = ((E, cfg.n_ff), True)
        t[b + "ffn_up.weight"] = ((E, cfg.n_ff), True)
        t[b + "ffn_down.weight"] = ((cfg.n_ff, E), True)
        if cfg.qkv_bias:
            t[b + "attn_q.bias"] = ((cfg.q_dim,), True)
            t[b + "attn_k.bias"] = ((cfg.kv_dim,), True)
            t[b + "attn_v.bias"] = ((cfg.v_dim,), True)
        if cfg.qk_norm:
            t[b + "attn_q_norm.weight"] = ((cfg.head_dim,), True)
            t[b + "attn_k_norm.weight"] = ((cfg.head_dim,), True)
        if cfg.post_norms:
            t[b + "post_attention_norm.weight"] = ((E,), True)
            t[b + "post_ffw_norm.weight"] = ((E,), True)
    return t


def check_tensors(cfg: Config, tensors: Mapping[str, Any], supported_types) -> None:
    """Raise GGUFError/UnsupportedError unless every needed tensor is present with the right shape and a usable type.

    `tensors` maps name -> object with `.dims` and `.qtype`. Norms and biases must be F32 (as llama.cpp writes
    them); matrices may be any supported type.
    """
    from ..format.quants import QT as T
    for name, (dims, required) in expected_tensors(cfg).items():
        t = tensors.get(name)
        if t is None:
            if required:
                raise GGUFError(f"missing tensor {name!r} needed by the {cfg.arch} architecture")
            continue
        if tuple(t.dims) != dims:
            raise GGUFError(f"tensor {name!r} has shape {list(t.dims)}, expected {list(dims)} "
                            f"from the {cfg.arch} metadata")
        if len(dims) == 1:
            if t.qtype != T.F32:
                raise UnsupportedError(f"tensor {name!r} is {t.qtype.name}; 1-D tensors must be F32")
        elif t.qtype not in supported_types:
            raise UnsupportedError(f"tensor {name!r} uses quant type {t.qtype.name}, which Lumen does not support "
                                   f"(supported: {', '.join(sorted(q.name for q in supported_types))})")
