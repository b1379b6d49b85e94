"""GGUF quant types Lumen supports: one table entry per type, and the numpy reference used as test oracle.

A quantized 2D weight is stored row by row; each row is n_cols // block_size blocks of type_size bytes.
The fast kernels live in lumen/kernels (dequant.py, matmul.py); this module is the slow, obvious side.
"""
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from ..errors import GGUFError, UnsupportedError


class GGMLQuantizationType(IntEnum):
    """ggml's tensor type ids (enum ggml_type, named as gguf-py names them; ids ggml retired are absent). Written
    out here rather than imported from gguf-py, whose import (it loads yaml) cost 40 ms of every start; a test
    holds this table equal to gguf-py's."""
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


QT = GGMLQuantizationType
# (values per block, bytes per block) of every type, as gguf-py's table of the same name
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    QT.F32: (1, 4), QT.F16: (1, 2), QT.Q4_0: (32, 18), QT.Q4_1: (32, 20), QT.Q5_0: (32, 22), QT.Q5_1: (32, 24),
    QT.Q8_0: (32, 34), QT.Q8_1: (32, 40), QT.Q2_K: (256, 84), QT.Q3_K: (256, 110), QT.Q4_K: (256, 144),
    QT.Q5_K: (256, 176), QT.Q6_K: (256, 210), QT.Q8_K: (256, 292), QT.IQ2_XXS: (256, 66), QT.IQ2_XS: (256, 74),
    QT.IQ3_XXS: (256, 98), QT.IQ1_S: (256, 50), QT.IQ4_NL: (32, 18), QT.IQ3_S: (256, 110), QT.IQ2_S: (256, 82),
    QT.IQ4_XS: (256, 136), QT.I8: (1, 1), QT.I16: (1, 2), QT.I32: (1, 4), QT.I64: (1, 8), QT.F64: (1, 8),
    QT.IQ1_M: (256, 56), QT.BF16: (1, 2), QT.TQ1_0: (256, 54), QT.TQ2_0: (256, 66), QT.MXFP4: (32, 17),
    QT.NVFP4: (64, 36), QT.Q1_0: (128, 18),
}


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
    import gguf
    import gguf.quants
    with np.errstate(invalid="ignore", over="ignore"):   # NaN/inf scales are data here, not errors
        rows = raw.reshape(-1, row_bytes(qtype, shape[-1]))
        out = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(int(qtype)))
    return np.asarray(out, dtype=np.float32).reshape(shape)



def bits_per_weight(qtype) -> float:
    info = quant_info(qtype)
    return info.type_size * 8 / info.block_size


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """x (rows, n) f32, n a multiple of 32 -> Q4_0 bytes (rows, n / 32 * 18), as ggml's quantize_row_q4_0_ref
    rounds, bit for bit: per block of 32 the value of largest magnitude (the first of equals) over -8 is the scale
    d (f16), each value min(15, trunc(x / d + 8.5)), two to a byte (the block's first half in the low nibbles)."""
    x = np.asarray(x, np.float32)
    rows, n = x.shape
    if n % 32:
        raise ValueError(f"Q4_0 rows are whole blocks of 32 values, got {n}")
    b = x.reshape(rows, n // 32, 32)
    big = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)[..., 0]
    d = big / np.float32(-8)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    with np.errstate(invalid="ignore"):
        q = np.minimum(15, (b * inv[..., None] + np.float32(8.5)).astype(np.int8)).astype(np.uint8)
    out = np.empty((rows, n // 32, 18), np.uint8)
    out[..., :2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(rows, -1)

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
