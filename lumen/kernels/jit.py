"""njit for functions that Python never calls: without the wrappers nobody uses.

Numba gives every compiled function two wrappers besides its code: a CPython one (unboxing each argument, boxing
the result: large for the forward pass's bundles of arrays) and a C one (what an address in the entry table points
at, lumen.kernels.kinds.address). Both are lowered, optimised and compiled to machine code with the function (in the
forward pass's module they were a third of the instructions), on every first run. A function only compiled code
calls needs neither (`compiled_only`); one called only through its address needs the C wrapper alone
(`compiled_only(c_wrapper=True)`); one that Python calls and nothing takes the address of, the CPython one alone
(`njit(..., no_cfunc_wrapper=True)`).

Called from Python, a function without its CPython wrapper would jump to code that is not there (a segfault): the
dispatcher these return raises TypeError instead. Compiled callers do not go through that call.
"""
from __future__ import annotations

from numba import njit
from numba.core.registry import CPUDispatcher


class CompiledOnly(CPUDispatcher):
    """A dispatcher whose function has no CPython wrapper: a call from Python is an error, not a crash."""

    def __call__(self, *args, **kwargs):
        raise TypeError(f"{self.py_func.__module__}.{self.py_func.__qualname__} is called from compiled code only "
                        "(it has no Python wrapper)")


def compiled_only(fn=None, *, c_wrapper: bool = False, **options):
    """@njit(cache=True, **options) without the CPython wrapper, and without the C one unless c_wrapper (an entry
    of the entry table, called through its address)."""
    def wrap(f):
        d = njit(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=not c_wrapper, **options)(f)
        if type(d) is CPUDispatcher:               # (not under NUMBA_DISABLE_JIT: the Python function itself)
            d.__class__ = CompiledOnly
        return d
    return wrap if fn is None else wrap(fn)
