"""Tiny synthetic GGUF models written with the `gguf` writer, for tests of loading, errors and architectures.

`write_model(path, arch)` writes a random model with a small byte-level GPT-2 vocabulary. Keyword overrides
change metadata, drop or reshape tensors, or change the quant type, so each error path can be produced on purpose.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf.quants import quantize


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable unicode mapping, one token per byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]


def vocab():
    toks = _byte_tokens()
    toks += [a + b for a, b in (m.split(" ") for m in MERGES)]
    toks += SPECIALS
    types = [1] * (len(toks) - len(SPECIALS)) + [3] * len(SPECIALS)
    return toks, types


DIMS = dict(n_embd=64, n_ff=96, n_head=4, n_head_kv=2, n_layer=2, head_dim=16)


def model_tensors(arch: str, n_vocab: int, rng: np.random.Generator, d=DIMS) -> dict[str, np.ndarray]:
    """name -> float32 array in numpy order (out, in) for matrices."""
    E, F, H, KV, L = d["n_embd"], d["n_ff"], d["n_head"], d["n_head_kv"], d["n_layer"]
    hd = d["head_dim"] if arch == "gemma3" else E // H
    w = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    t = {"token_embd.weight": w(n_vocab, E), "output_norm.weight": norm(E)}
    if arch != "gemma3":
        t["output.weight"] = w(n_vocab, E)
    for i in range(L):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = norm(E)
        t[b + "attn_q.weight"] = w(H * hd, E)
        t[b + "attn_k.weight"] = w(KV * hd, E)
        t[b + "attn_v.weight"] = w(KV * hd, E)
        t[b + "attn_output.weight"] = w(E, H * hd)
        t[b + "ffn_norm.weight"] = norm(E)
        t[b + "ffn_gate.weight"] = w(F, E)
        t[b + "ffn_up.weight"] = w(F, E)
        t[b + "ffn_down.weight"] = w(E, F)
        if arch == "qwen2":
            for n, size in (("q", H * hd), ("k", KV * hd), ("v", KV * hd)):
                t[b + f"attn_{n}.bias"] = (0.1 * rng.standard_normal(size)).astype(np.float32)
        if arch == "gemma3":
            t[b + "attn_q_norm.weight"] = norm(hd)
            t[b + "attn_k_norm.weight"] = norm(hd)
            t[b + "post_attention_norm.weight"] = norm(E)
            t[b + "post_ffw_norm.weight"] = norm(E)
    return t


def write_model(path, arch: str = "llama", *, qtype: T = T.Q8_0, seed: int = 0, drop: tuple[str, ...] = (),
                reshape: dict[str, tuple[int, ...]] | None = None, meta: dict | None = None,
                arch_name: str | None = None, tensor_types: dict[str, T] | None = None, d=DIMS,
                pre: str = "smollm") -> dict:
    """Write a tiny model; return the float32 tensors as written (after quantization round trip)."""
    rng = np.random.default_rng(seed)
    toks, types = vocab()
    tensors = model_tensors(arch, len(toks), rng, d)
    w = GGUFWriter(str(path), arch_name or arch)
    E, H = d["n_embd"], d["n_head"]
    w.add_block_count(d["n_layer"])
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_feed_forward_length(d["n_ff"])
    w.add_head_count(H)
    w.add_head_count_kv(d["n_head_kv"])
    w.add_layer_norm_rms_eps(1e-5 if arch != "gemma3" else 1e-6)
    w.add_rope_freq_base(10000.0 if arch != "gemma3" else 1e6)
    if arch == "gemma3":
        w.add_key_length(d["head_dim"])
        w.add_value_length(d["head_dim"])
        w.add_sliding_window(4)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(len(toks) - 3)
    w.add_eos_token_id(len(toks) - 3)
    w.add_add_bos_token(False)
    for k, v in (meta or {}).items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_string(k, v)
    written = {}
    for name, arr in tensors.items():
        if name in drop:
            continue
        if reshape and name in reshape:
            arr = np.resize(arr, reshape[name]).astype(np.float32)
        qt = (tensor_types or {}).get(name, qtype if arr.ndim == 2 else T.F32)
        if qt == T.F32:
            w.add_tensor(name, arr)
            written[name] = arr
        else:
            from gguf.quants import dequantize
            try:
                q = quantize(arr, qt)
                written[name] = dequantize(q, qt).reshape(arr.shape)
            except NotImplementedError:  # a type gguf-py cannot quantize: random bytes of the right size
                block, size = GGML_QUANT_SIZES[qt]
                q = rng.integers(0, 256, (arr.shape[0], arr.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
