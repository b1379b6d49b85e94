"""A first run compiles the forward pass on the other core while this process loads the model.

On a machine whose compile cache lacks it, the forward pass is most of a first run: about 18 s of SmolLM2's 24 s
on a 2-vCPU EPYC, all of it on one core (Numba compiles serially) while the other waits. Its types are the same
for every model (the model's numbers and its weight types' kernels are runtime values: lumen.kernels.entries), so
it can be compiled before the model is even read, from arguments of no size with the same types (`forward_args`).
`start()` (lumen.model.parts, before the weights load) then, when the cache lacks it:
- starts a child process (`main` here), which compiles mm3 (the matmul's rounding of the activations and its call
  of the matmul kernel) and then the forward pass into the cache on the other core;
- compiles the attention kernel here meanwhile (about 5 s), the entry table's largest (the forward pass calls it
  and mm3 through the table: lumen.kernels.entries), so the two halves take about the same time;
then this process loads and packs the weights and compiles their type's kernels as before, and makes the entry
table, which loads mm3 once the child has compiled it. The child, its forward pass compiled, goes on to the entry
table from its end (this process's kinds, from the file's header), one compile turn per entry, so that a model
whose packing makes this half the longer (the 1.5B's) has the two meet in the middle. The runner's first forward
pass calls `wait()`: the child is done by then or soon after, and the forward pass loads from the cache. Processes
that start at once take turns (lumen.paths.compile_turn) for each of these: the later ones load what the first
compiled. If the child fails, the forward pass compiles here as it did before; the bits are the same either way
(compiled code does not depend on which process compiled it). LUMEN_PRECOMPILE=0 turns it off.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time

import numpy as np
from numba import typeof

from ..kernels.attention import attention_args, attention_kernel, attention_signature, lane_address
from ..kernels.kinds import address, cached, sets
from ..paths import compile_turn
from .forward import KV, Arch, Batch, Scratch, Weights, _z, forward, mm3, mm3_signature, mm_scratch_args, packs_args

_child: subprocess.Popen | None = None
_started = False                 # whether this process started a child (tests read it)


def forward_args() -> tuple:
    """Arguments of the types every model passes `forward` (lumen.engine.runner.Runner.forward), of no use but
    their types (tests/model/test_precompile.py checks them against every model's)."""
    f32, i64 = np.float32, np.int64
    embd = _z(np.uint8, 2)
    embd.setflags(write=False)                         # the GGUF's mapped bytes
    arch = Arch(1, 1, 1, 1, 1, False, False, False, False, False, f32(0), f32(0), f32(0), f32(0), _z(i64, 1),
                _z(i64, 1), _z(f32, 3), _z(f32, 3))
    w = Weights(embd, 0, _z(f32, 1), packs_args(),
                *(_z(i64, 1) for _ in range(7)), 0, _z(i64, 1), _z(f32, 1), *(_z(i64, 2) for _ in range(9)),
                _z(i64, 1))
    kv = KV(_z(np.uint16, 5), _z(np.uint16, 5))
    batch = Batch(_z(i64, 1), _z(i64, 1), _z(i64, 1), _z(i64, 1), _z(i64, 2), _z(i64, 1))
    scr = Scratch(*(_z(f32, 2) for _ in range(8)), mm_scratch_args(), attention_args()[7], _z(i64, 1))
    return arch, w, kv, batch, scr, _z(f32, 2), False


def signature(dispatcher, args: tuple) -> tuple:
    return tuple(dispatcher.typeof_pyval(a) for a in args)


def start(k: np.ndarray | None = None) -> bool:
    """Start compiling the forward pass in a child process when the compile cache lacks it, and compile the
    attention kernel here meanwhile (module doc); k: the model's kinds value (lumen.kernels.kinds), whose entries
    the child then compiles from the end of the table while this process makes it from the start. Returns whether
    a child was started. Once per process."""
    global _child, _started
    if _child is not None or os.environ.get("LUMEN_PRECOMPILE", "1") == "0" or not cached_ok():
        return False
    if _compiled() is not False:                 # (None: Numba's cache internals moved: compile here, as before)
        return False
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        argv = [str(os.getpid())] + ([] if k is None else [",".join(map(str, ts)) for ts in sets(typeof(k))])
        code = (f"import sys; r = {root!r}; r in sys.path or sys.path.insert(0, r)\n"    # this lumen, wherever
                f"from lumen.model.precompile import main; main({argv!r})")              # it was imported from
        _child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    except OSError:
        return False
    _started = True
    atexit.register(_stop)
    lane_address()                               # (replicas starting at once: the first compiles, the rest load)
    address(attention_kernel, attention_signature(), "attention")
    return True


def cached_ok() -> bool:
    """Whether this process uses Numba's compile cache at all (forward is cached=True; off, nothing is shared)."""
    return getattr(getattr(forward, "_cache", None), "_enabled", False)     # (NUMBA_DISABLE_JIT: no cache)


def _compiled() -> bool | None:
    """Whether the forward pass is loaded here or in the compile cache (its index read, nothing loaded); None when
    Numba's cache internals moved and that cannot be told."""
    try:
        return bool(forward.overloads) or cached(forward, signature(forward, forward_args()))
    except Exception:                            # noqa: BLE001 - private Numba API
        return None


def ready() -> bool:
    """Whether the forward pass's first call compiles nothing: no child is compiling it, and it is compiled."""
    return _child is None and bool(_compiled())


def wait() -> float:
    """Wait for the child started by start() (if any) to finish compiling; returns the seconds waited."""
    global _child
    if _child is None:
        return 0.0
    t0 = time.perf_counter()
    try:
        _child.wait()
    finally:
        _child = None
    return time.perf_counter() - t0


def _stop() -> None:
    """At exit: a child still compiling for a process that never ran a forward pass is stopped."""
    global _child
    if _child is not None and _child.poll() is None:
        _child.terminate()
        try:
            _child.wait(5)
        except subprocess.TimeoutExpired:
            _child.kill()
    _child = None


def _die_with_parent(parent: int) -> None:
    """In the child: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG), and out now if it already has."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        sys.exit(1)


def main(argv: list[str]) -> None:
    """The child (argv: the parent's pid, then the kinds' matrix, embedding and activation ids, comma-separated):
    compile the forward pass into the cache, unless another process's child just did, then the kinds' entries from
    the end (lumen.kernels.entries.compile_from_the_end)."""
    if argv and argv[0].isdigit():
        _die_with_parent(int(argv[0]))
    if not cached(mm3, mm3_signature()):          # the entry the parent's table takes next (lumen.model.forward)
        with compile_turn("mm3"):
            mm3.compile(mm3_signature())
    with compile_turn("precompile"):
        sig = signature(forward, forward_args())
        if not cached(forward, sig):
            forward.compile(sig)
    if len(argv) == 4:
        from ..kernels.entries import compile_from_the_end
        from ..kernels.kinds import kinds
        mats, embd, acts = ([int(v) for v in a.split(",") if v] for a in argv[1:])
        compile_from_the_end(kinds(mats=mats, embd=embd, acts=acts))


if __name__ == "__main__":
    main(sys.argv[1:])
