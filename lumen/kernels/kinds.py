"""Which kernels a forward pass needs, as a compile-time value: the weight types of its matrices, the type of its
token embedding, its gated activation.

Numba compiles every branch of a function whatever the data. The forward pass used to dispatch on runtime type
ids, so it compiled the tile kernels of all 8 quantized types (at 2 row counts), the row dequantizers of all 11
types and both activations, for every model; each compiled function is optimised again inside every caller that
links it (numba.core.codegen: a library's final module holds its callees), so a cold start paid for them several
times over. The kinds travel in the Weights bundle, and their Numba type carries the sets, so the dispatchers
(lumen.kernels.matmul.run_rows, lumen.kernels.dequant.dequant_row) build, with `switch`, code for what the model
has and nothing else.

The forward pass does not take a model's kinds value itself but the table lumen.kernels.entries makes of it: the
addresses of the type-specific kernels (the tile kernels of each matrix type, lumen.kernels.matmul.ENTRIES, the row
dequantizer for the embedding type, the gated activation's row function), each compiled (or loaded from Numba's
cache) for its one kind on its own, and called through `call`. The forward pass's code then holds none of them: it
is one compiled function for every model, compiled once per machine, and so is the tile loop that calls the passes
(lumen.kernels.matmul.tiles, given the table); a model of new weight types compiles those types' kernels only, and a
model of known types nothing. (With the kinds compiled into it, each new set of types compiled the whole forward
pass again, every kernel it links included; with the tile loop compiled per type, each type paid for the loop.)

The value is a zero-length array whose structured dtype names the kinds (fields m<type>, e<type>, a<act>): Numba's
dispatcher types arrays in its C fast path, so the bundle costs nothing per call (a Python object of a custom type
sent it down the slow path: 37 us per call instead of 1, measured on a small NamedTuple, 320-410 us per decode
step on the real bundles).
"""
from __future__ import annotations

import functools
import zlib
from contextlib import contextmanager

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload

from ..format.quants import QT
from ..paths import compile_turn

QUANTIZED = tuple(sorted(int(q) for q in (QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K,
                                          QT.Q8_0)))
FLOATS = tuple(sorted(int(q) for q in (QT.F32, QT.F16, QT.BF16)))
SILU, GELU = 0, 1
ACTS = (SILU, GELU)


def kinds(mats=QUANTIZED + FLOATS, embd=QUANTIZED + FLOATS, acts=ACTS) -> np.ndarray:
    """mats: the GGML types of the packed matrices; embd: the types the embedding lookup dequantizes; acts: the
    gated activations (SILU, GELU). The defaults hold everything (one compiled variant for any model: the kernels'
    public entry points use it)."""
    names = ([f"m{int(q)}" for q in sorted({int(q) for q in mats})]
             + [f"e{int(q)}" for q in sorted({int(q) for q in embd})]
             + [f"a{int(a)}" for a in sorted({int(a) for a in acts})])
    return np.zeros(0, dtype=np.dtype([(n, np.uint8) for n in names]))


def sets(kinds_type) -> tuple[tuple, tuple, tuple]:
    """(mats, embd, acts) of a kinds value's Numba type (at compile time, in an overload)."""
    names = list(kinds_type.dtype.fields)
    pick = lambda p: tuple(sorted(int(n[1:]) for n in names if n[0] == p))  # noqa: E731
    return pick("m"), pick("e"), pick("a")


ALL = kinds()


@functools.lru_cache(maxsize=None)
def switch(cases: tuple, n_args: int):
    """The one way the kernels dispatch on a type: cases ((key, fn), ...) -> a compiled
    f(key, a0, ..., a<n_args - 1>) that calls fn(a0, ...) of the first case whose key == key, the last case taking
    every other key (the loader checked it). Built at compile time, inside an overload, from the kinds' cases
    only, so nothing else is compiled. The if-chain is generated source, inlined into its caller at Numba IR
    level, so the caller's reference counting is the same as if it called the kernel itself. (A chain of compiled
    functions taking *args compiled to the same vector code but put 26 atomic reference count increments into
    lumen.kernels.matmul.tiles_1, the decode loop, against 0 with this; counted in its LLVM IR.)"""
    args = ", ".join(f"a{i}" for i in range(n_args))
    lines = [f"def switch_(key, {args}):"]
    if len(cases) == 1:
        lines.append(f"    f0({args})")
    else:
        for j, (key, _) in enumerate(cases):
            head = "if" if j == 0 else "elif" if j < len(cases) - 1 else "else"
            lines.append(f"    {head}{f' key == {int(key)}' if head != 'else' else ''}:\n        f{j}({args})")
    ns = {f"f{j}": fn for j, (_, fn) in enumerate(cases)}
    exec("\n".join(lines), ns)
    return njit(inline="always")(ns["switch_"])


# ---------------------------------------------------------------- the entry table of a model's kinds
# (made by lumen.kernels.entries, which compiles the kernels; here what the kernels that call them need)

N_TYPES = 32                      # GGML type ids below this (lumen.format.quants.QT)
TILES, ROWS = 0, N_TYPES          # table[TILES + t]: lumen.kernels.matmul.tiles for a type t; table[ROWS + t]: the
                                  # embedding row dequantizer (lumen.kernels.dequant.dequant_row_entry) for type t
ACT = 2 * N_TYPES                 # table[ACT + a]: the row function of gated activation a (lumen.kernels.activation)
ATTN = ACT + len(ACTS)            # table[ATTN]: lumen.kernels.attention.attention_kernel at the forward pass's types
ATTN_LANE = ATTN + 1              # table[ATTN_LANE]: lumen.kernels.attention.attention_lane (attention_kernel runs it)
RMSNORM, ADD, ROPE = ATTN_LANE + 1, ATTN_LANE + 2, ATTN_LANE + 3    # table[...]: those row functions
                                  # (lumen.kernels.norm.rmsnorm_row, activation.add_row, rope.rope_row)
QUANT = ROPE + 1                  # table[QUANT]: lumen.kernels.matmul.quantize_row (the activations' rounding)
MM3 = QUANT + 1                   # table[MM3]: lumen.model.forward.mm3 (filled by the model layer)
ONE = MM3 + 1                     # table[ONE + t], [PASS + t], [PASS_U + t]: the tile kernels' entries for matrix
PASS = ONE + N_TYPES              # type t (lumen.kernels.matmul.ENTRIES), which `tiles` given the table calls (the
PASS_U = PASS + N_TYPES           # last for the types lumen.kernels.policy.UNPACKED names)
MATMUL = PASS_U + N_TYPES         # table[MATMUL]: lumen.kernels.matmul.matmul_kernel (mm3 calls it there)
N_ENTRIES = MATMUL + 1


def cached(dispatcher, sig: tuple) -> bool:
    """Whether Numba's compile cache holds dispatcher's code for sig (read from its index: nothing is loaded)."""
    cache = getattr(dispatcher, "_cache", None)
    if not getattr(cache, "_enabled", False):
        return False
    key = cache._index_key(sig, dispatcher.targetctx.codegen())
    return key in cache._cache_file._load_index()


_new_only = False


@contextmanager
def new_only():
    """In this block `address` returns 0, loading nothing, for code the compile cache already holds: for a process
    that compiles for others (the precompiling child, lumen.model.precompile), which loaded each entry the loading
    process had made (20-50 ms an entry) while that process waited for it to exit."""
    global _new_only
    _new_only = True
    try:
        yield
    finally:
        _new_only = False


def address(dispatcher, sig: tuple, turn: str = "entries") -> int:
    """The address of the C wrapper of dispatcher compiled for sig (compiled now, or loaded from Numba's cache):
    what `call` calls. The dispatcher keeps the code alive for the life of the process. Processes that start at
    once take turns (lumen.paths.compile_turn) for each function and signature: the later ones load what the first
    compiled, and different ones compile at once. (0 for cached code inside `new_only`.)"""
    if tuple(sig) not in dispatcher.overloads:
        key = zlib.crc32(str(tuple(sig)).encode())
        with compile_turn(f"{turn}-{dispatcher.py_func.__name__}-{key:08x}"):
            if _new_only and cached(dispatcher, sig):
                return 0
            dispatcher.compile(sig)
    cres = dispatcher.overloads[tuple(sig)]
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name)


def is_table(kinds_type) -> bool:
    """Whether a kinds argument's Numba type is an entry table (else a kinds value, compiled in)."""
    return isinstance(kinds_type, types.Array) and kinds_type.dtype == types.int64


def _call_codegen(borrow: bool):
    def codegen(context, builder, sig, llargs):
        fn_addr, tup = llargs
        tys = sig.args[1].types
        fnty = ir.FunctionType(context.get_value_type(types.none), [context.get_value_type(t) for t in tys])
        fn = builder.inttoptr(fn_addr, fnty.as_pointer())
        vals = []
        for i, t in enumerate(tys):
            v = builder.extract_value(tup, i)
            if borrow and isinstance(t, types.Array):       # field 0 of Numba's array struct: its meminfo
                v = builder.insert_value(v, ir.Constant(v.type.elements[0], None), 0)
            vals.append(v)
        builder.call(fn, vals)
        return context.get_dummy_value()
    return codegen


@intrinsic
def call(typingctx, addr, args):
    """call(addr, (a0, a1, ...)): call the compiled function whose C wrapper is at addr
    (`address`) with the arguments of the tuple, which must be of the types it was compiled
    for (up to the dtype of an array's elements: its struct is the same); returns nothing. The callee is not
    linked into the caller's code."""
    if not (isinstance(addr, types.Integer) and isinstance(args, types.BaseTuple)):
        return None
    return types.none(addr, args), _call_codegen(False)


@intrinsic
def call_borrowed(typingctx, addr, args):
    """call, with the arrays of the tuple (its top level) passed without their meminfo (null): the callee's
    reference count updates on them are then no-ops, not atomic adds on counts that every thread of a parallel
    region shares (the caller holds the arrays for the call). For a callee that keeps no reference."""
    if not (isinstance(addr, types.Integer) and isinstance(args, types.BaseTuple)):
        return None
    return types.none(addr, args), _call_codegen(True)


def same_abi(got: tuple, want: tuple) -> bool:
    """Whether arguments of Numba types got can be passed to code compiled for want: the same types, except that an
    array may be read-only on one side and writable on the other (the struct and the code are the same)."""
    def norm(t):
        if isinstance(t, types.Array):
            return ("array", str(t.dtype), t.ndim, t.layout, t.aligned)
        if isinstance(t, types.BaseNamedTuple):
            return ("named", t.instance_class, tuple(norm(x) for x in t.types))
        if isinstance(t, types.BaseTuple):
            return ("tuple", tuple(norm(x) for x in t.types))
        return str(t)
    return len(got) == len(want) and all(norm(a) == norm(b) for a, b in zip(got, want))


def require_abi(what: str, got: tuple, want: tuple) -> None:
    """In an overload, at compile time: a TypingError unless arguments of the Numba types got can be passed to
    `what`, compiled for want (same_abi). Code called through its address checks nothing itself: a call at other
    types must fail to compile, never reach the code."""
    if not same_abi(got, want):
        raise TypingError(f"{what} is compiled for {want}, not for {got}")


def abi_guard(what: str, want: tuple):
    """A function of one tuple, the arguments of a call to `what` (compiled for want) through its address: nothing
    at run time; at compile time, require_abi. The call sites start with it."""
    def guard(args):
        """Nothing at run time (lumen.kernels.kinds.abi_guard)."""

    @overload(guard, inline="always")
    def _guard(args):
        require_abi(what, tuple(args.types), want)
        return lambda args: None
    return guard
