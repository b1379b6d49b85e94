"""The packed weight layout, in one place: families, tile size, the table that locates every packed matrix in the
flat buffers, and the size arithmetic. lumen.kernels.matmul packs and reads this layout; the weights loader,
the pack cache and the profiler size and check it through the functions here, never with their own copies.

A matrix W (d_out, n_in) of a quantized type is packed into T = ceil(d_out / R) tiles of R rows, G = n_in / 32
groups of 32 columns, with the row index innermost (lanes = rows):
    family  types               q (values)                         s (scales)      o (offsets)
    Q4      Q4_0 Q4_1 Q4_K      (T, G, 4, R, 4) u8 nibble pairs     (T, G, H, R)    (T, OG, R)
    Q5      Q5_0 Q5_1 Q5_K      (T, G, 8, R, 4) u8                  f32, H = 1      f32, OG = G or 0
    I8      Q8_0 Q6_K           (T, G, 8, R, 4) u8                  H = 2 for Q6_K
    F32     F32 F16 BF16        (T, n_in, R) f32                    (T, 0, 1, R)    (T, 0, R)
All matrices of a model live in five flat buffers by dtype (`Packs`): q (Q4 nibbles), q8 (Q5 and I8 bytes, held
as int8), qf (F32 values), s, o. Row i of `Packs.table` (n_mats, N_COLS) i8 describes matrix i (columns below).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..format.quants import QT

R = 64                                           # rows per tile: the vector loop length
Q4, Q5, I8, F32 = 0, 1, 2, 3
FAMILY = {QT.Q4_0: Q4, QT.Q4_1: Q4, QT.Q4_K: Q4, QT.Q5_0: Q5, QT.Q5_1: Q5, QT.Q5_K: Q5,
          QT.Q8_0: I8, QT.Q6_K: I8, QT.F32: F32, QT.F16: F32, QT.BF16: F32}
K_RUNS = {Q4: 4, Q5: 8, I8: 8}                   # runs of R*4 bytes per group

# table columns: family, tiles, groups of 32, scale halves, n_in, d_out, offsets into q|q8|qf, s, o, offset
# groups (0: the type has no offsets), activation format (lumen.quants.ACT_*)
COLUMNS = ("fam", "T", "G", "H", "n_in", "d_out", "q", "s", "o", "OG", "fmt")
(C_FAM, C_T, C_G, C_H, C_NIN, C_DOUT, C_Q, C_S, C_O, C_OG, C_FMT) = range(len(COLUMNS))
N_COLS = len(COLUMNS)


class Packs(NamedTuple):
    """Every packed matrix of a model, concatenated by dtype; matrix i is described by table[i]."""
    table: np.ndarray  # (n_mats, N_COLS) i8
    q: np.ndarray      # (n,) u8: Q4 family nibbles
    q8: np.ndarray     # (n,) i8: Q5 and I8 family bytes (read as the u8 they are)
    qf: np.ndarray     # (n,) f32: F32 family values
    s: np.ndarray      # (n,) f32 scales
    o: np.ndarray      # (n,) f32 offsets

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.q8, self.qf, self.s, self.o))


BUFFERS = ("q", "q8", "qf", "s", "o")
DTYPES = {"table": np.int64, "q": np.uint8, "q8": np.int8, "qf": np.float32, "s": np.float32, "o": np.float32}


@njit(cache=True)
def q_len(fam, T, G, n_in):
    """Values of a packed matrix's q array (its elements in the family's buffer)."""
    if fam == F32:
        return T * n_in * R
    if fam == Q4:
        return T * G * 4 * R * 4
    return T * G * 8 * R * 4


@njit(cache=True)
def s_len(T, G, H):
    return T * G * H * R


@njit(cache=True)
def o_len(T, OG):
    return T * OG * R


def buffer_of(fam: int) -> str:
    """Which flat buffer holds a family's values."""
    return "q" if fam == Q4 else "qf" if fam == F32 else "q8"


def matrix_nbytes(row: np.ndarray) -> int:
    """Bytes of the packed matrix described by a table row: values, scales and offsets."""
    fam, T, G, H, n_in, OG = (int(row[c]) for c in (C_FAM, C_T, C_G, C_H, C_NIN, C_OG))
    item = 4 if fam == F32 else 1
    return q_len(fam, T, G, n_in) * item + 4 * s_len(T, G, H) + 4 * o_len(T, OG)


def check_table(table: np.ndarray, expected: np.ndarray, sizes: dict) -> str | None:
    """Why `table` cannot describe matrices whose (family, format, d_out, n_in, tiles) are `expected`
    (n_mats, 5), packed into buffers of `sizes` (name -> length), or None if it can: groups, halves and
    offset groups fit each matrix, and every slice the kernels take lies inside its buffer, the slices of each
    buffer adding up to its length. The kernels do not check bounds; this does, before any call."""
    if table.ndim != 2 or table.shape[1] != N_COLS or table.shape[0] != expected.shape[0]:
        return f"table shape {table.shape}, expected {(expected.shape[0], N_COLS)}"
    got = table[:, [C_FAM, C_FMT, C_DOUT, C_NIN, C_T]]
    if not np.array_equal(got, expected):
        i = int(np.argwhere((got != expected).any(axis=1))[0, 0])
        return f"table row {i} is {got[i].tolist()}, the tensor needs {expected[i].tolist()}"
    fam, T, G, H, n_in, OG = (table[:, c] for c in (C_FAM, C_T, C_G, C_H, C_NIN, C_OG))
    if not (np.all(G == np.where(fam == F32, 0, n_in // 32)) and np.all((H == 1) | (H == 2))
            and np.all((OG == 0) | (OG == G))):
        return "table groups/halves/offset groups do not fit the tensors"
    spans = {name: [] for name in BUFFERS}
    for row in table:
        f, t, g, h, n, og = (int(row[c]) for c in (C_FAM, C_T, C_G, C_H, C_NIN, C_OG))
        spans[buffer_of(f)].append((int(row[C_Q]), q_len(f, t, g, n)))
        spans["s"].append((int(row[C_S]), s_len(t, g, h)))
        spans["o"].append((int(row[C_O]), o_len(t, og)))
    for name, lst in spans.items():
        if any(off < 0 or off + n > sizes[name] for off, n in lst) or sum(n for _, n in lst) != sizes[name]:
            return f"table slices of {name} do not fit its {sizes[name]} values"
    return None
