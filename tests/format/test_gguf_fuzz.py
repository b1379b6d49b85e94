"""Fuzz the loader with mutated copies of the real GGUF files.

Every case must either load or raise GGUFError (UnsupportedError is a subclass) with a message; nothing else, no
crash, no hang. A case that does not change the file must load; one that cuts the tensor data must not.
Mutations: truncation at random points, random byte flips in the header/metadata/tensor-info region, and huge or
random values written over the header's integer fields (counts, lengths, n_dims, dims, types, offsets), whose
positions come from the loader's own field trace. A copy of the file is mutated in place and restored after each
case, so a case costs a parse, not a copy of the whole file.

LUMEN_FUZZ_CASES sets the number of cases per model (default 350 for SmolLM2, half that for Gemma, whose 262k-entry
vocabulary makes each full parse slower).
"""
import os
import shutil
import signal
import struct
from contextlib import contextmanager

import numpy as np
import pytest

from lumen.errors import GGUFError
from lumen.format.gguf import GGUFFile
from lumen.model.parts import build_tokenizer, open_gguf

CASES = int(os.environ.get("LUMEN_FUZZ_CASES", "350"))
TIMEOUT_S = 30


@contextmanager
def deadline(seconds):
    def boom(signum, frame):
        raise TimeoutError(f"loader hung for more than {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def load_everything(path):
    """What lumen.load does before any forward pass: parse, validate, build config and tokenizer (the header cache
    off: every case is a parse, and a mutated copy is a new file to it anyway)."""
    g, cfg = open_gguf(path, cache=False)
    try:
        build_tokenizer(g.metadata)
    finally:
        g.close()


def mutations(rng, size, header_end, fields):
    """Yield (description, kind, payload) cases."""
    int_fields = [f for f in fields if f[1] in ("<Q", "<I")]
    structural = [f for f in int_fields if "]" not in f[2]]  # not an element of an array (the token strings)
    while True:
        kind = rng.choice(["truncate", "flip", "flip_info", "huge", "random_int"], p=[0.2, 0.3, 0.15, 0.2, 0.15])
        if kind == "truncate":
            cut = int(rng.integers(0, header_end + 64)) if rng.random() < 0.6 else int(rng.integers(0, size))
            yield f"truncate at {cut}", "truncate", cut
        elif kind in ("flip", "flip_info"):
            lo = fields[-1][0] - 64 * 1024 if kind == "flip_info" else 0  # tensor infos sit at the end of the header
            lo = max(0, lo)
            n = int(rng.integers(1, 9))
            pos = rng.integers(lo, header_end, n)
            vals = rng.integers(0, 256, n)
            yield f"flip {n} bytes at {pos.tolist()}", "bytes", list(zip(pos.tolist(), vals.tolist()))
        else:
            pool = structural if rng.random() < 0.7 else int_fields
            pos, fmt, what = pool[int(rng.integers(len(pool)))]
            if kind == "huge":
                v = int(rng.choice([2 ** 63 - 1, 2 ** 64 - 1, 2 ** 32 - 1, 2 ** 40, 2 ** 31]))
            else:
                v = int(rng.integers(0, 2 ** 16))
            v &= (1 << (8 * struct.calcsize(fmt))) - 1
            yield f"set {what} to {v}", "bytes", list(enumerate(struct.pack(fmt, v), start=pos))


MIN_REJECTED = 0.5   # of the cases that changed the file, at least this share must be rejected


@pytest.mark.slow
@pytest.mark.parametrize("name,share", [("smollm2-135m", 1.0), ("gemma3-270m", 0.5)])
def test_fuzz_loader(tmp_path, name, share):
    """Each case changes the file (or is counted as unchanged, and then must load), and ends in one of two ways:
    it loads, or it raises a GGUFError with a message. A file cut short of its last tensor's data is always
    rejected. Enough of the changed cases are rejected, and some load (mutations inside the vocabulary's strings
    make another valid file), so the mutations neither all miss the checks nor all hit trivially."""
    from lumen.model.store import resolve
    src = resolve(name, quiet=True)
    trace = []
    g = GGUFFile(src, trace=trace)
    header_end, size = g.data_start, g.size
    data_end = max(t.offset + t.nbytes for t in g.tensors.values())  # Tensor.offset is a file offset
    g.close()
    # keep the positions of fields of the header proper and tensor infos, and a sample of the token strings
    fields = sorted(set(trace), key=lambda f: f[0])
    work = tmp_path / "fuzz.gguf"
    shutil.copyfile(src, work)
    original = open(src, "rb").read(header_end)
    rng = np.random.default_rng(1234 + len(name))
    n_cases = max(1, int(CASES * share))
    outcomes = {"loaded": 0, "rejected": 0, "unchanged": 0, "truncated": 0}
    gen = mutations(rng, size, header_end, fields)
    for _ in range(n_cases):
        what, kind, payload = next(gen)
        if kind == "truncate":
            changed = payload < size
        else:
            changed = any(original[pos] != val for pos, val in payload)
        with open(work, "r+b") as f:
            if kind == "truncate":
                f.truncate(payload)
            else:
                for pos, val in payload:
                    f.seek(pos)
                    f.write(bytes([val]))
        try:
            with deadline(TIMEOUT_S):
                load_everything(work)
            loaded = True
        except GGUFError as e:
            assert str(e).strip(), f"{name}: case '{what}' raised a GGUFError without a message"
            loaded = False
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{name}: case '{what}' raised {type(e).__name__}: {e}")
        if not changed:
            assert loaded, f"{name}: case '{what}' left the file as it was, yet it did not load"
            outcomes["unchanged"] += 1
        else:
            outcomes["loaded" if loaded else "rejected"] += 1
        if kind == "truncate" and payload < data_end:
            assert not loaded, f"{name}: case '{what}' cut the tensor data (it ends at {data_end}) and still loaded"
            outcomes["truncated"] += 1
        # restore
        with open(work, "r+b") as f, open(src, "rb") as s:
            if kind == "truncate":
                s.seek(payload)
                f.seek(payload)
                shutil.copyfileobj(s, f, 1 << 22)
            else:
                f.seek(0)
                f.write(original)
    print(f"\n{name}: {n_cases} fuzz cases: {outcomes}")
    changed = outcomes["loaded"] + outcomes["rejected"]
    assert changed >= 0.9 * n_cases, f"most cases must change the file: {outcomes}"
    assert outcomes["rejected"] >= MIN_REJECTED * changed, f"too few mutations were caught: {outcomes}"
    if n_cases >= 100:  # 2 of SmolLM2's 350 default cases load, 13 of Gemma's 175
        assert outcomes["loaded"] >= 1, f"no mutation made a file that still loads: {outcomes}"
    assert outcomes["truncated"] >= 0.1 * n_cases, f"too few truncations: {outcomes}"
