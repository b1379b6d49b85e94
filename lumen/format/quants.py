"""GGUF quant types Lumen supports: one table entry per type, and the numpy reference used as test oracle.

A quantized 2D weight is stored row by row; each row is n_cols // block_size blocks of type_size bytes.
The fast kernels live in lumen/kernels (dequant.py, matmul.py); this module is the slow, obvious side.
"""
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import GGUFError, UnsupportedError


@dataclass(frozen=True)
class QuantInfo:
    name: str
    block_size: int    # values per block
    type_size: int     # bytes per block


# Layouts are in ggml-common.h; gguf-py's quants.py has the numpy dequantizers we test against.
QUANTS: dict[QT, QuantInfo] = {
    QT.F32: QuantInfo("F32", 1, 4),
    QT.F16: QuantInfo("F16", 1, 2),
    QT.BF16: QuantInfo("BF16", 1, 2),
    QT.Q8_0: QuantInfo("Q8_0", 32, 34),     # f16 d, 32 x int8                         v = d*q
    QT.Q4_0: QuantInfo("Q4_0", 32, 18),     # f16 d, 16 bytes of nibbles                v = d*(q-8)
    QT.Q4_1: QuantInfo("Q4_1", 32, 20),     # f16 d, f16 m, 16 bytes of nibbles         v = d*q + m
    QT.Q5_0: QuantInfo("Q5_0", 32, 22),     # f16 d, u32 fifth bits, 16 bytes nibbles   v = d*(q-16)
    QT.Q5_1: QuantInfo("Q5_1", 32, 24),     # f16 d, f16 m, u32 fifth bits, nibbles     v = d*q + m
    QT.Q4_K: QuantInfo("Q4_K", 256, 144),   # f16 d, f16 dmin, 12 B 6-bit sc/m, 128 B nibbles
    QT.Q5_K: QuantInfo("Q5_K", 256, 176),   # as Q4_K + 32 B of fifth bits before the nibbles
    QT.Q6_K: QuantInfo("Q6_K", 256, 210),   # 128 B low nibbles, 64 B high 2 bits, 16 x int8 sc, f16 d
}

SUPPORTED: frozenset[QT] = frozenset(QUANTS)


def quant_info(qtype) -> QuantInfo:
    """The table entry for qtype (a GGMLQuantizationType or its int id); UnsupportedError if Lumen lacks it."""
    try:
        return QUANTS[QT(int(qtype))]
    except (ValueError, KeyError):
        name = getattr(qtype, "name", None) or str(qtype)
        raise UnsupportedError(
            f"quant type {name} is not supported (supported: {', '.join(sorted(q.name for q in QUANTS.values()))})"
        ) from None


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one row of n_cols values of qtype. GGUFError if n_cols is not a whole number of blocks."""
    info = quant_info(qtype)
    if n_cols <= 0 or n_cols % info.block_size:
        raise GGUFError(f"{info.name} row of {n_cols} values is not a positive multiple of the block size "
                        f"{info.block_size}")
    return n_cols // info.block_size * info.type_size


def dequantize_ref(raw: np.ndarray, qtype, shape) -> np.ndarray:
    """Slow numpy reference (gguf-py): raw bytes of a tensor -> float32 array of `shape` (rows, ..., n_cols)."""
    shape = tuple(int(s) for s in shape)
    nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes(qtype, shape[-1])
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if raw.size != nbytes:
        raise GGUFError(f"{quant_info(qtype).name} tensor of shape {shape} needs {nbytes} bytes, got {raw.size}")
    import gguf.quants
    with np.errstate(invalid="ignore", over="ignore"):   # NaN/inf scales are data here, not errors
        out = gguf.quants.dequantize(raw.reshape(-1, row_bytes(qtype, shape[-1])), QT(int(qtype)))
    return np.asarray(out, dtype=np.float32).reshape(shape)


# ---- activation formats: what llama.cpp's CPU backend rounds activations to before a dot product with a weight
# type (its vec_dot_type): Q8_0-style blocks of 32 with an f16 scale for the 32-blocks types, Q8_K (blocks of 256,
# f32 scale) for the K types, f16 for F16 weights, bf16 for BF16 weights, nothing for F32.
ACT_Q8, ACT_Q8K, ACT_F32, ACT_F16, ACT_BF16 = 0, 1, 2, 3, 4
ACT_FORMAT: dict[QT, int] = {QT.Q8_0: ACT_Q8, QT.Q4_0: ACT_Q8, QT.Q4_1: ACT_Q8, QT.Q5_0: ACT_Q8, QT.Q5_1: ACT_Q8,
                             QT.Q4_K: ACT_Q8K, QT.Q5_K: ACT_Q8K, QT.Q6_K: ACT_Q8K,
                             QT.F32: ACT_F32, QT.F16: ACT_F16, QT.BF16: ACT_BF16}


def round_activations_ref(x: np.ndarray, qtype) -> np.ndarray:
    """numpy reference: x (N, n) f32 -> the f32 values the matmul actually multiplies for weight type qtype."""
    fmt = ACT_FORMAT[QT(int(qtype))]
    x = np.asarray(x, np.float32)
    if fmt == ACT_F32:
        return x.copy()
    if fmt == ACT_F16:
        return x.astype(np.float16).astype(np.float32)
    if fmt == ACT_BF16:
        u = x.view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000            # round to nearest even on the top 16 bits
        return u.astype(np.uint32).view(np.float32)
    n = x.shape[-1]
    if fmt == ACT_Q8:                                             # ggml quantize_row_q8_0 / q8_1
        b = x.reshape(-1, 32)
        amax = np.abs(b).max(axis=1, keepdims=True)
        d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.rint(b * inv)
        return (q * d).astype(np.float32).reshape(x.shape)
    b = x.reshape(-1, 256)                                       # ggml quantize_row_q8_K
    i = np.abs(b).argmax(axis=1)
    mx = b[np.arange(b.shape[0]), i][:, None]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        d = np.where(mx != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint(b * iscale), 127)
    return (q * d).astype(np.float32).reshape(x.shape)
