"""The packed weight layout, in one place: families, tile size, the table that locates every packed matrix in the
flat buffers, and the size arithmetic. lumen.kernels.matmul packs and reads this layout; the weights loader,
the pack cache and the profiler size and check it through the functions here, never with their own copies.

A matrix W (d_out, n_in) is packed into T = ceil(d_out / R) tiles of R rows (the last one padded with zero rows),
G = n_in / 32 groups of 32 columns. The packs hold no more bytes than the GGUF tensor (scales stay f16 and are
converted in registers; 5- and 6-bit values stay nibbles plus bit planes), so a decode step reads what the GGUF
holds. Per tile, the weights of group g are GROUP_BYTES[family] bytes with the row index before the 4 columns of
an int32 lane ("lanes = rows"):
    family  types              group bytes (u8)
    Q4      Q4_0 Q4_1 Q4_K     nib (4, R, 4): byte [k, r, b] = low 4 bits of column 4k+b | of column 16+4k+b << 4
    Q5      Q5_0 Q5_1 Q5_K     nib, then (R,) u32 fifth bits: byte b bit k of row r's word = bit 4 of column 4k+b
    Q6      Q6_K               nib, then (2, R) u32 bits 4-5: word j, byte b, bits 2m..2m+1 = column 4(4j+m)+b
    Q8      Q8_0               (8, R, 4): byte [k, r, b] = column 4k+b + 128
    F32     F32 F16 BF16       f32 values (n_in, R) per tile, in the qf buffer
The unsigned value u of a column is (nibble | plane bits << 4); the kernel computes sum (u - z) x with the type's
zero point z (Q4_0 8, Q5_0 16, Q6_K 32, Q8_0 128; 0 for the types with an offset m, Q4_1 Q5_1 Q4_K Q5_K, whose
weight is d u + m). Per tile, the scales of every group, then of every 256-block (K types),
in one byte record (the s buffer), the row index innermost:
    scales  types              per group                    per 256 columns
    D       Q4_0 Q5_0 Q8_0     f16 d (R,)                   -
    DM      Q4_1 Q5_1          f16 d (R,), f16 m (R,)       -
    K       Q4_K Q5_K          u8 sc (R,), u8 min (R,)      f16 d (R,), f16 dmin (R,)
    K6      Q6_K               i8 sc0 (R,), i8 sc1 (R,)     f16 d (R,)
All matrices of a model live in three flat buffers (`Packs`): q (u8 weights of every quantized family), qf (F32
values) and s (u8 scale records). Row i of `Packs.table` (n_mats, N_COLS) i8 describes matrix i (columns below).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..format.quants import QT

R = 64                                           # rows per tile: 4 vectors of 16 int32 lanes
Q4, Q5, Q6, Q8, F32 = 0, 1, 2, 3, 4              # weight families
SC_D, SC_DM, SC_K, SC_K6, SC_NONE = 0, 1, 2, 3, 4  # scale formats
# qtype -> (family, scale format, zero point)
FORMAT = {QT.Q4_0: (Q4, SC_D, 8), QT.Q4_1: (Q4, SC_DM, 0), QT.Q4_K: (Q4, SC_K, 0),
          QT.Q5_0: (Q5, SC_D, 16), QT.Q5_1: (Q5, SC_DM, 0), QT.Q5_K: (Q5, SC_K, 0),
          QT.Q6_K: (Q6, SC_K6, 32), QT.Q8_0: (Q8, SC_D, 128),
          QT.F32: (F32, SC_NONE, 0), QT.F16: (F32, SC_NONE, 0), QT.BF16: (F32, SC_NONE, 0)}
FAMILY = {qt: f[0] for qt, f in FORMAT.items()}
NIB_BYTES = 4 * R * 4                            # the nibbles of one group of a tile
GROUP_BYTES = (NIB_BYTES, NIB_BYTES + 4 * R, NIB_BYTES + 8 * R, 8 * R * 4, 0)   # by family

# table columns: GGML type, family, tiles, groups of 32, n_in, d_out, offset into q (or qf), offset into s,
# activation format (lumen.format.quants.ACT_*)
COLUMNS = ("qt", "fam", "T", "G", "n_in", "d_out", "q", "s", "fmt")
(C_QT, C_FAM, C_T, C_G, C_NIN, C_DOUT, C_Q, C_S, C_FMT) = range(len(COLUMNS))
N_COLS = len(COLUMNS)


class Packs(NamedTuple):
    """Every packed matrix of a model, concatenated by dtype; matrix i is described by table[i]."""
    table: np.ndarray  # (n_mats, N_COLS) i8
    q: np.ndarray      # (n,) u8: the weights of the quantized families
    qf: np.ndarray     # (n,) f32: F32 family values
    s: np.ndarray      # (n,) u8: scale records

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.qf, self.s))


BUFFERS = ("q", "qf", "s")
DTYPES = {"table": np.int64, "q": np.uint8, "qf": np.float32, "s": np.uint8}


@njit(cache=True, inline="always", no_cfunc_wrapper=True)
def q_len(fam, T, G, n_in):
    """Elements of a packed matrix's weights in its buffer (bytes of q, or f32 values of qf)."""
    if fam == F32:
        return T * n_in * R
    return T * G * (NIB_BYTES + 4 * R if fam == Q5 else NIB_BYTES + 8 * R if fam == Q6 else
                    8 * R * 4 if fam == Q8 else NIB_BYTES)


@njit(cache=True, inline="always")
def s_tile(sc, G):
    """Bytes of one tile's scale record."""
    if sc == SC_D:
        return G * 2 * R
    if sc == SC_DM:
        return G * 4 * R
    if sc == SC_K:
        return G * 2 * R + (G // 8) * 4 * R
    if sc == SC_K6:
        return G * 2 * R + (G // 8) * 2 * R
    return 0


# qt -> (family, scale format), as an array the compiled code indexes (types outside FORMAT: F32, SC_NONE)
_BY_QT = np.array([FORMAT[QT(q)][:2] if any(int(t) == q for t in FORMAT) else (F32, SC_NONE)
                   for q in range(max(int(t) for t in FORMAT) + 1)], np.int64)


@njit(cache=True, inline="always")
def family(qt):
    """The weight family (Q4 .. F32) of GGML type qt."""
    return _BY_QT[qt, 0] if 0 <= qt < _BY_QT.shape[0] else F32


@njit(cache=True, inline="always")
def scale_format(qt):
    """The scale format (SC_*) of GGML type qt."""
    return _BY_QT[qt, 1] if 0 <= qt < _BY_QT.shape[0] else SC_NONE


@njit(cache=True, inline="always", no_cfunc_wrapper=True)
def s_len(qt, T, G):
    """Bytes of a packed matrix's scale records."""
    return T * s_tile(scale_format(qt), G)


def buffer_of(fam: int) -> str:
    """Which flat buffer holds a family's values."""
    return "qf" if fam == F32 else "q"


def matrix_nbytes(row: np.ndarray) -> int:
    """Bytes of the packed matrix described by a table row: weights and scales (what one pass over it reads)."""
    qt, fam, T, G, n_in = (int(row[c]) for c in (C_QT, C_FAM, C_T, C_G, C_NIN))
    return q_len(fam, T, G, n_in) * (4 if fam == F32 else 1) + s_len(qt, T, G)


def check_table(table: np.ndarray, expected: np.ndarray, sizes: dict) -> str | None:
    """Why `table` cannot describe matrices whose (type, activation format, d_out, n_in, tiles) are `expected`
    (n_mats, 5), packed into buffers of `sizes` (name -> length), or None if it can: family and groups fit each
    matrix, and every slice the kernels take lies inside its buffer, the slices of each buffer adding up to its
    length. The kernels do not check bounds; this does, before any call."""
    if table.ndim != 2 or table.shape[1] != N_COLS or table.shape[0] != expected.shape[0]:
        return f"table shape {table.shape}, expected {(expected.shape[0], N_COLS)}"
    got = table[:, [C_QT, C_FMT, C_DOUT, C_NIN, C_T]]
    if not np.array_equal(got, expected):
        i = int(np.argwhere((got != expected).any(axis=1))[0, 0])
        return f"table row {i} is {got[i].tolist()}, the tensor needs {expected[i].tolist()}"
    fam_ok = [int(row[C_FAM]) == FAMILY[QT(int(row[C_QT]))] for row in table]
    if not all(fam_ok) or not np.all(table[:, C_G] == np.where(table[:, C_FAM] == F32, 0, table[:, C_NIN] // 32)):
        return "table families/groups do not fit the tensors"
    spans = {name: [] for name in BUFFERS}
    for row in table:
        qt, f, t, g, n = (int(row[c]) for c in (C_QT, C_FAM, C_T, C_G, C_NIN))
        spans[buffer_of(f)].append((int(row[C_Q]), q_len(f, t, g, n)))
        spans["s"].append((int(row[C_S]), s_len(qt, t, g)))
    for name, lst in spans.items():
        if any(off < 0 or off + n > sizes[name] for off, n in lst) or sum(n for _, n in lst) != sizes[name]:
            return f"table slices of {name} do not fit its {sizes[name]} values"
    return None
