"""Validation helpers shared by the kernel wrappers: the raw kernels check nothing, the wrappers everything."""
from __future__ import annotations

import numpy as np


def check(ok: bool, msg: str) -> None:
    """Raise ValueError(msg) unless ok. Shared by the kernel wrappers in this package."""
    if not ok:
        raise ValueError(msg)


def as_f32(name: str, a, ndim: int) -> None:
    """Check that a is a C-contiguous float32 ndarray with ndim dimensions (what the raw kernels assume)."""
    check(isinstance(a, np.ndarray), f"{name} must be a numpy array, got {type(a).__name__}")
    check(a.dtype == np.float32, f"{name} must be float32, got {a.dtype}")
    check(a.ndim == ndim, f"{name} must have {ndim} dimensions, got shape {a.shape}")
    check(a.flags.c_contiguous, f"{name} must be C-contiguous")


def as_out(name: str, a, ndim: int) -> None:
    """as_f32, and writeable: the row functions (lumen.kernels.rows) write through the array's data pointer, so a
    read-only array would be written, not refused."""
    as_f32(name, a, ndim)
    check(a.flags.writeable, f"{name} must be writeable")
