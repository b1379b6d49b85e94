"""The packed-weight cache (lumen.model.packcache): a hit reads arrays identical to a fresh repack, so the logits are
identical; any change of the key (packing code, GGUF file) repacks; a damaged cache file is detected and rebuilt;
an unwritable cache directory or LUMEN_PACK_CACHE=0 falls back to packing in memory. Tiny synthetic models
(tests/synth.py) in a temporary LUMEN_HOME; the K-quant one is quantized from float weights by quantize_k below
(gguf-py cannot quantize K types), so its logits are finite and the comparisons say something."""
import json
import mmap
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import lumen
import synth
from gguf.quants import dequantize
from lumen.model import packcache
from lumen.kernels.layout import C_Q as P_Q, C_S as P_S
from lumen.model.parts import open_gguf
from lumen.model import weights
from lumen.model.weights import load_weights
from synth import write_model

ARRAYS = ("table", "q", "qf", "s")
# one matrix type of every packing family (Q4, Q5, Q8, F32) in each layer
MIXED = {f"blk.{i}.{name}.weight": qt for i in range(2) for name, qt in (
    ("attn_q", T.Q4_0), ("attn_k", T.Q5_1), ("attn_v", T.Q8_0), ("attn_output", T.F16), ("ffn_gate", T.Q4_1),
    ("ffn_up", T.Q5_0), ("ffn_down", T.BF16))}
# the K types need rows of 256
K_DIMS = dict(n_embd=256, n_ff=256, n_head=4, n_head_kv=2, n_layer=1, head_dim=64)
K_TYPES = {"blk.0.attn_q.weight": T.Q4_K, "blk.0.attn_k.weight": T.Q5_K, "blk.0.attn_v.weight": T.Q6_K,
           "blk.0.ffn_down.weight": T.Q6_K, "output.weight": T.Q6_K}
IDS = [5, 100, 7, 42, 9]


def quantize_k(x: np.ndarray, qt: T) -> np.ndarray:
    """A plain K-quant quantizer (not llama.cpp's search for the best scales): rows (n, 256 k) float32 -> blocks
    (n, k * block bytes) uint8, in gguf-py's layout (its dequantize is the check). Q4_K/Q5_K: 8 sub-blocks of 32,
    each x = d*sc*q - dmin*m with q in 0..15 / 0..31 and 6-bit sc, m under f16 d, dmin. Q6_K: 16 sub-blocks of
    16, x = d*sc*(q - 32) with q in 0..63 and int8 sc under an f16 d."""
    safe = lambda a: np.where(a > 0, a, 1)  # noqa: E731 - an all-zero sub-block has scale 0 and q 0
    if qt == T.Q6_K:
        b = x.reshape(-1, 16, 16)                                                # (blocks, sub-blocks, 16)
        scale = np.abs(b).max(-1) / 31
        d = (scale.max(-1) / 127).astype(np.float16)
        sc = np.clip(np.round(scale / safe(d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
        step = d.astype(np.float32)[:, None, None] * sc[..., None]
        q = (np.clip(np.round(b / safe(step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 2, 2, 64)
        low, high = q & 15, q >> 4                               # value 128 h + 64 nib + c -> ql byte 64 h + c
        ql = low[:, :, :, 0] | low[:, :, :, 1] << 4                              # (blocks, 2, 2, 64) -> 128 bytes
        qh = high.reshape(-1, 2, 4, 32)
        qh = qh[:, :, 0] | qh[:, :, 1] << 2 | qh[:, :, 2] << 4 | qh[:, :, 3] << 6     # (blocks, 2, 32)
        parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)]
    else:
        qmax = 15 if qt == T.Q4_K else 31
        b = x.reshape(-1, 8, 32)                                                 # (blocks, sub-blocks, 32)
        lo, hi = np.minimum(b.min(-1), 0), b.max(-1)
        scale, mins = (hi - lo) / qmax, -lo
        d, dmin = (scale.max(-1) / 63).astype(np.float16), (mins.max(-1) / 63).astype(np.float16)
        df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
        sc = np.clip(np.round(scale / safe(df)), 0, 63).astype(np.uint8)
        m = np.clip(np.round(mins / safe(dmf)), 0, 63).astype(np.uint8)
        step, offset = (df * sc)[..., None], (dmf * m)[..., None]
        q = np.clip(np.round((b + offset) / safe(step)), 0, qmax).astype(np.uint8)
        scales = np.concatenate([sc[:, :4] | sc[:, 4:] >> 4 << 6, m[:, :4] | m[:, 4:] >> 4 << 6,
                                 (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)   # 12 bytes of 6-bit values
        low = q & 15
        qs = (low[:, 0::2] | low[:, 1::2] << 4).reshape(-1, 128)   # sub-blocks 2j, 2j+1: low, high nibbles of 32 B
        parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales]
        if qt == T.Q5_K:
            high = (q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]       # bit i: sub-block i
            parts.append(np.bitwise_or.reduce(high, axis=1))                      # (blocks, 32)
        parts.append(qs)
    return np.concatenate(parts, axis=1).reshape(x.shape[0], -1)


def write_k_model(path: Path, monkeypatch) -> dict:
    """The K_TYPES model, its K matrices quantized with quantize_k (synth.write_model falls back to random bytes,
    whose f16 scales include NaN and inf, for the types gguf-py cannot quantize)."""
    real = synth.quantize
    with monkeypatch.context() as m:
        m.setattr(synth, "quantize", lambda a, qt: quantize_k(a, qt) if qt in (T.Q4_K, T.Q5_K, T.Q6_K) else real(a, qt))
        return write_model(path, "llama", tensor_types=K_TYPES, d=K_DIMS)


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_quantize_k_round_trips(qt):
    """gguf-py's dequantize of quantize_k's blocks gives the floats back, to within the quantization step."""
    x = (np.random.default_rng(3).standard_normal((8, 512)) * 0.2).astype(np.float32)
    x[0, :256] = 0.0                                                           # an all-zero block
    y = dequantize(quantize_k(x, qt), qt).reshape(x.shape)
    levels = {T.Q4_K: 15, T.Q5_K: 31, T.Q6_K: 63}[qt]
    step = (x.max(axis=1, keepdims=True) - x.min(axis=1, keepdims=True)) / levels
    assert np.isfinite(y).all()
    assert np.all(np.abs(y - x) <= step), np.abs(y - x).max()
    assert np.array_equal(y[0, :256], x[0, :256])


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh LUMEN_HOME with the cache on. The packing sources count as older than the import even if someone
    edits them while the tests run (that guard has its own test)."""
    h = tmp_path / "home"
    monkeypatch.setenv("LUMEN_HOME", str(h))
    monkeypatch.delenv("LUMEN_PACK_CACHE", raising=False)
    monkeypatch.setattr(packcache, "IMPORT_TIME_NS", time.time_ns() + 10**12)
    return h


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "tiny.gguf"
    write_model(path, "llama", tensor_types=MIXED)
    return path


def packs_of(path, cache):
    g, cfg = open_gguf(path)
    return load_weights(g, cfg, pack_cache=cache)


def assert_same_packs(a, b):
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name
        assert x.flags.c_contiguous and x.flags.writeable and x.flags.aligned, name  # same Numba type as fresh


def cache_files(home) -> list[Path]:
    return sorted((home / "packs").glob("*.lpack"))


@pytest.mark.parametrize("kind", ["mixed", "k-quants"])
def test_hit_is_identical_to_a_repack(home, tmp_path, monkeypatch, kind):
    path = tmp_path / f"{kind}.gguf"
    if kind == "mixed":
        write_model(path, "llama", tensor_types=MIXED)
    else:
        write_k_model(path, monkeypatch)
    first = packs_of(path, True)
    assert first.packs_from == "packed, cached"
    assert len(cache_files(home)) == 1 and cache_files(home)[0].name.startswith(f"{kind}-")
    hit = packs_of(path, True)
    assert hit.packs_from == "cache"
    fresh = packs_of(path, False)
    assert fresh.packs_from == "packed (cache off)"
    assert_same_packs(hit.packs, fresh.packs)
    assert hit.decode_bytes == fresh.decode_bytes
    m_hit, m_fresh = lumen.load(path, ctx=32), lumen.load(path, ctx=32, pack_cache=False)
    assert m_hit.weights.packs_from == "cache"
    logits = m_hit.logits(IDS)
    assert np.isfinite(logits).all() and logits.std() > 0
    np.testing.assert_array_equal(logits, m_fresh.logits(IDS))            # bit for bit
    out_hit = [t.id for t in m_hit.generate(IDS, max_tokens=6)]
    assert out_hit == [t.id for t in m_fresh.generate(IDS, max_tokens=6)]


def test_changed_code_rebuilds(home, model_file, monkeypatch):
    assert packs_of(model_file, True).packs_from == "packed, cached"
    real = packcache.code_hash()
    monkeypatch.setattr(packcache, "code_hash", lambda: "a layout change")
    w = packs_of(model_file, True)
    assert w.packs_from == "packed, cached"
    assert len(cache_files(home)) == 2
    assert packs_of(model_file, True).packs_from == "cache"
    monkeypatch.setattr(packcache, "code_hash", lambda: real)
    assert packs_of(model_file, True).packs_from == "cache"          # the first file is still there (KEEP = 2)
    monkeypatch.setattr(packcache, "code_hash", lambda: "a third layout")
    assert packs_of(model_file, True).packs_from == "packed, cached"
    assert len(cache_files(home)) == packcache.KEEP                   # the oldest was evicted


def test_eviction_keeps_the_file_used_last(home, model_file, monkeypatch):
    """Eviction drops the file read longest ago, not the one written longest ago: a version of Lumen used every
    day keeps its packs when others are tried (a read does not change a file's time, so a hit sets it)."""
    def load_with(layout: str) -> str:
        time.sleep(0.05)                 # file times come from the kernel's coarse clock (ticks of up to 10 ms):
        monkeypatch.setattr(packcache, "code_hash", lambda: layout)    # two uses in one tick would tie
        return packs_of(model_file, True).packs_from

    assert load_with("daily") == "packed, cached"
    (daily,) = cache_files(home)
    os.utime(daily, (1, 1))                                   # written long ago
    assert load_with("tried once") == "packed, cached"
    assert load_with("daily") == "cache"                      # and used today
    assert load_with("a third") == "packed, cached"           # evicts "tried once", the one used longest ago
    assert load_with("daily") == "cache"


def test_eviction_of_a_file_name_with_glob_characters(home, tmp_path, monkeypatch):
    """Old cache files of "model[v2].gguf" are evicted like any other's (its stem is not a glob pattern)."""
    path = tmp_path / "model[v2].gguf"
    write_model(path, "llama", tensor_types=MIXED)
    for layout in ("one layout", "another", "a third"):
        monkeypatch.setattr(packcache, "code_hash", lambda layout=layout: layout)
        assert packs_of(path, True).packs_from == "packed, cached"
    assert len(cache_files(home)) == packcache.KEEP


def test_files_of_one_name_in_other_folders_keep_their_own_packs(home, tmp_path):
    """model.gguf in three folders (three models): each reads its own packs, never another's, and none evicts
    another's (eviction counts the versions of one file, not of one file name)."""
    paths = []
    for i, folder in enumerate("abc"):
        (tmp_path / folder).mkdir()
        paths.append(tmp_path / folder / "model.gguf")
        write_model(paths[-1], "llama", tensor_types=MIXED, seed=i)
    for p in paths:
        assert packs_of(p, True).packs_from == "packed, cached"
    assert len(cache_files(home)) == 3
    for p in paths:
        w = packs_of(p, True)
        assert w.packs_from == "cache", p
        assert_same_packs(w.packs, packs_of(p, False).packs)


def test_packs_of_a_deleted_gguf_are_evicted(home, tmp_path, model_file):
    """A GGUF file that is gone (a temporary copy, a deleted download) leaves no pack file behind for ever: the
    next pack written deletes it."""
    gone = tmp_path / "gone.gguf"
    write_model(gone, "llama", tensor_types=MIXED, seed=3)
    assert packs_of(gone, True).packs_from == "packed, cached"
    gone.unlink()
    assert packs_of(model_file, True).packs_from == "packed, cached"
    assert [p.name.split("-")[0] for p in cache_files(home)] == ["tiny"]


def test_changed_gguf_rebuilds(home, model_file):
    """Another file of the same size and name (another seed): another key, and its own weights."""
    size = model_file.stat().st_size
    assert packs_of(model_file, True).packs_from == "packed, cached"
    write_model(model_file, "llama", tensor_types=MIXED, seed=7)
    assert model_file.stat().st_size == size
    w = packs_of(model_file, True)
    assert w.packs_from == "packed, cached"
    assert_same_packs(w.packs, packs_of(model_file, False).packs)
    assert packs_of(model_file, True).packs_from == "cache"


def test_sources_edited_after_import_skip_the_cache(home, model_file, monkeypatch):
    """A packing source newer than the import: the code running may not be the code on disk, so no cache."""
    monkeypatch.setattr(packcache, "IMPORT_TIME_NS", 0)
    w = packs_of(model_file, True)
    assert w.packs_from.startswith("packed (packing sources changed")
    assert not (home / "packs").exists()


def _header(path: Path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[8:16])
    return json.loads(raw[16:16 + n])


def _patch(path: Path, offset: int, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _edit_header(path: Path, edit):
    """Apply edit to the JSON header, written back in the same number of bytes."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[8:16])
    head = json.loads(raw[16:16 + n])
    edit(head)
    text = json.dumps(head).encode()
    assert len(text) <= n
    raw[16:16 + n] = text.ljust(n)
    path.write_bytes(bytes(raw))


def _table_cell(path: Path, row: int, col: int) -> int:
    dtype, shape, off = _header(path)["arrays"]["table"]
    return off + 8 * (row * shape[1] + col)


CORRUPTIONS = {
    "empty": lambda p: p.write_bytes(b""),
    "truncated to 10 bytes": lambda p: os.truncate(p, 10),
    "truncated to half": lambda p: os.truncate(p, p.stat().st_size // 2),
    "last byte missing": lambda p: os.truncate(p, p.stat().st_size - 1),
    "garbage header": lambda p: _patch(p, 16, b"\xff" * 32),
    "bad magic": lambda p: _patch(p, 0, b"NOTLUMEN"),
    "huge header length": lambda p: _patch(p, 8, struct.pack("<Q", 1 << 62)),
    "bad trailer": lambda p: _patch(p, p.stat().st_size - 8, b"\0" * 8),
    "table offset out of bounds": lambda p: _patch(p, _table_cell(p, 0, P_Q), struct.pack("<q", 1 << 40)),
    "table offset negative": lambda p: _patch(p, _table_cell(p, 3, P_S), struct.pack("<q", -64)),
    "table offset overflows": lambda p: _patch(p, _table_cell(p, 1, P_Q), struct.pack("<q", (1 << 63) - 8)),
    "table rows swapped": lambda p: _patch(p, _table_cell(p, 0, 0), Path(p).read_bytes()[
        _table_cell(p, 1, 0):_table_cell(p, 2, 0)]),
    "array missing from header": lambda p: p.write_bytes(p.read_bytes().replace(b'"qf"', b'"qx"', 1)),
    "array shorter in header": lambda p: _edit_header(p, lambda h: h["arrays"]["s"][1].__setitem__(0, 64)),
    "array dtype in header": lambda p: _edit_header(p, lambda h: h["arrays"]["qf"].__setitem__(0, "<f8")),
    "another key in header": lambda p: _edit_header(p, lambda h: h.__setitem__("key", "0" * 64)),
    "header not an object": lambda p: _patch(p, 16, b"[1]".ljust(len(json.dumps(_header(p)).encode()))),
    "array entry not a list": lambda p: _edit_header(p, lambda h: h["arrays"].__setitem__("q", 7)),
    "unknown dtype in header": lambda p: _edit_header(p, lambda h: h["arrays"]["qf"].__setitem__(0, "<z9")),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_damaged_cache_file_is_rebuilt(home, model_file, how):
    assert packs_of(model_file, True).packs_from == "packed, cached"
    (path,) = cache_files(home)
    CORRUPTIONS[how](path)
    m = lumen.load(model_file, ctx=32)
    assert m.weights.packs_from == "packed, cached"
    assert_same_packs(m.weights.packs, packs_of(model_file, False).packs)
    m.logits(IDS)
    assert packs_of(model_file, True).packs_from == "cache"


def test_interrupted_write_leaves_no_cache_file(home, model_file, monkeypatch):
    def fail(fd):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(packcache.os, "fsync", fail)
        w = packs_of(model_file, True)
    assert w.packs_from.startswith("packed (cache not written: OSError") and "No space left" in w.packs_from
    assert [p.name for p in (home / "packs").iterdir()] == [".lock"]  # neither the file nor its temporary
    assert packs_of(model_file, True).packs_from == "packed, cached"
    assert packs_of(model_file, True).packs_from == "cache"


def test_unwritable_cache_dir_packs_in_memory(home, model_file, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where LUMEN_HOME should be a directory")
    monkeypatch.setenv("LUMEN_HOME", str(blocker))
    m = lumen.load(model_file, ctx=32)
    assert m.weights.packs_from.startswith("packed (cache not written")
    assert_same_packs(m.weights.packs, packs_of(model_file, False).packs)
    env = dict(os.environ, LUMEN_HOME=str(blocker))
    r = subprocess.run([sys.executable, "-m", "lumen.generate", "--model", str(model_file), "-p", "the", "-n", "3"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and len(lines) == 2, r.stderr          # the packing line, the summary
    assert lines[0].startswith("lumen: packing the weights of tiny.gguf for this CPU (the pack cache cannot be "
                               "written, ~"), lines


def test_disabled_by_env_and_parameter(home, model_file, monkeypatch):
    monkeypatch.setenv("LUMEN_PACK_CACHE", "0")
    assert lumen.load(model_file, ctx=32).weights.packs_from == "packed (cache off)"
    assert not (home / "packs").exists()
    monkeypatch.delenv("LUMEN_PACK_CACHE")
    assert lumen.load(model_file, ctx=32, pack_cache=False).weights.packs_from == "packed (cache off)"
    assert not (home / "packs").exists()
    assert lumen.load(model_file, ctx=32).weights.packs_from == "packed, cached"


# One of the concurrent processes: its cache write made slow (as a big model's is), so without the lock all of them
# would miss and pack; they load the model at the agreed start time.
CONCURRENT = r"""
import sys, time
import lumen, lumen.model.packcache as pc
real = pc.write
def slow_write(*args):
    time.sleep(0.5)
    return real(*args)
pc.write = slow_write
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
print(lumen.load(sys.argv[1], ctx=32).weights.packs_from)
"""


@pytest.mark.slow
def test_concurrent_writers(home, model_file):
    """Processes loading the same model at once: one packs and writes, the others wait for it and read its file;
    the file left is whole."""
    env = dict(os.environ, LUMEN_HOME=str(home))
    start = time.time() + 5.0  # after every process has imported Lumen
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(model_file), str(start)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert sorted(out.strip() for out, _ in outs) == ["cache", "cache", "packed, cached"], outs
    assert len(cache_files(home)) == 1
    assert not list((home / "packs").glob(".*.tmp"))
    w = packs_of(model_file, True)
    assert w.packs_from == "cache"
    assert_same_packs(w.packs, packs_of(model_file, False).packs)


# ---------------------------------------------------------------- the file's header, at every length

def test_layout_settles_for_every_header_length():
    """file_layout states offsets that leave room for the header, whatever its length: with the header crossing a
    64-byte boundary (its length 240 -> 241 moved the data by 64 bytes) the old two-pass layout stated offsets of
    the shorter header, and the reader found the arrays under the header's end."""
    table, sizes = np.zeros((3, 9), np.int64), {"q": 1000, "qf": 10, "s": 99}
    lengths = set()
    for n in range(0, 400):
        head, offsets, size = packcache.file_layout("k" * n, table, sizes)
        lengths.add(len(head))
        assert json.loads(head)["arrays"]["table"][2] == offsets["table"] >= 16 + len(head)
        assert offsets["table"] == -(-(16 + len(head)) // packcache.ALIGN) * packcache.ALIGN
        assert json.loads(head)["size"] == size
        starts = sorted(offsets[name] for name in packcache.BUFFERS)   # each buffer on a huge page of its own
        assert all(o % packcache.BLOCK == 0 for o in starts) and starts[0] > offsets["table"], offsets
        assert size >= offsets["s"] + 99 + len(packcache.TRAILER)
    assert set(range(200, 301)) <= lengths


def test_every_header_length_reads_back(home, model_file):
    """A file written with each header length over 200-300 bytes (and beyond) reads back, the arrays intact."""
    g, cfg = open_gguf(model_file)
    ref = load_weights(g, cfg, pack_cache=False, quiet=True)
    mats = _mats(g, cfg)
    table, sizes = weights.plan(mats)
    expected = weights.expected_rows(mats)
    path = home / "packs" / "header-0.lpack"
    lengths = set()
    for n in range(0, 460, 3):
        key = "k" * n
        assert packcache.write(path, key, table, sizes, lambda put: weights.pack_into(mats, table, put)) is None
        lengths.add(len(json.dumps(_header(path)).encode()))
        assert_same_packs(packcache.open_packs(path, key, expected), ref.packs)
    assert min(lengths) < 200 and max(lengths) > 300


def _mats(g, cfg):
    """The matrices of g in the loader's order (as load_weights lists them)."""
    mats = [(g.tensors[f"blk.{il}.{name}.weight"].data, g.tensors[f"blk.{il}.{name}.weight"].qtype)
            for il in range(cfg.n_layer) for name in weights.MATS]
    out = g.tensors.get("output.weight") or g.tensors["token_embd.weight"]
    return mats + [(out.data, out.qtype)]


# ---------------------------------------------------------------- what a load says

def test_packing_says_so_once_and_a_hit_says_nothing(home, model_file, capfd):
    """A first load says it packs (one plain line on stderr, captured here: not a terminal), a hit nothing, and
    quiet=True nothing at all; the cache off says so."""
    assert packs_of(model_file, True).packs_from == "packed, cached"
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("lumen: packing the weights of tiny.gguf for this CPU "
                                               "(first load only, ~") and err[0].endswith(" s)"), err
    assert packs_of(model_file, True).packs_from == "cache"
    assert capfd.readouterr().err == ""
    g, cfg = open_gguf(model_file)
    assert load_weights(g, cfg, pack_cache=False, quiet=True).packs_from == "packed (cache off)"
    assert capfd.readouterr().err == ""
    assert packs_of(model_file, False).packs_from == "packed (cache off)"
    assert "(the pack cache is off, ~" in capfd.readouterr().err


@pytest.mark.parametrize("how", ["bad trailer", "garbage header", "truncated to half", "table rows swapped"])
def test_unreadable_cache_file_says_so_once(home, model_file, capfd, how):
    """A cache file that exists but cannot be read is named once, with why, then rebuilt (no silent repack)."""
    packs_of(model_file, True)
    (path,) = cache_files(home)
    CORRUPTIONS[how](path)
    capfd.readouterr()
    assert packs_of(model_file, True).packs_from == "packed, cached"
    err = capfd.readouterr().err.splitlines()
    said = [line for line in err if "cannot be read" in line]
    assert len(said) == 1 and path.name in said[0] and said[0].endswith("; packing again"), err
    assert len(err) == 2 and "packing the weights" in err[1], err
    assert packs_of(model_file, True).packs_from == "cache"
    assert capfd.readouterr().err == ""
    CORRUPTIONS[how](path)
    g, cfg = open_gguf(model_file)
    assert load_weights(g, cfg, quiet=True).packs_from == "packed, cached"
    assert capfd.readouterr().err == ""


# ---------------------------------------------------------------- memory: mapped, shared, streamed

def _mapped_from(a: np.ndarray):
    """The mmap.mmap at the end of a's base chain, or None."""
    while a is not None and not isinstance(a, mmap.mmap):
        a = getattr(a, "base", None) if isinstance(a, np.ndarray) else getattr(a, "obj", None)
    return a


def _maps_of(path: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(path))]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
def test_cached_packs_are_a_private_mapping_of_the_file(home, model_file):
    """The buffers of a fresh pack (cache on) and of a hit are pages of the cache file (MAP_PRIVATE: shared by
    every process mapping it until written, which nothing does), not anonymous copies; and of the Numba type of
    in-memory packs (writable, C-contiguous, aligned), so the forward pass is not compiled again for them."""
    import numba
    fresh = packs_of(model_file, True)
    (path,) = cache_files(home)
    hit = packs_of(model_file, True)
    mem = packs_of(model_file, False)
    for w in (fresh, hit):
        for name in ("q", "s"):
            a = getattr(w.packs, name)
            assert _mapped_from(a) is not None, name
            assert numba.typeof(a) == numba.typeof(getattr(mem.packs, name)), name
        assert_same_packs(w.packs, mem.packs)
    assert _mapped_from(mem.packs.q) is None
    maps = _maps_of(path.resolve())
    assert maps and all(line.split()[1] == "rw-p" for line in maps), maps   # private: copy-on-write
    if hasattr(mmap, "MADV_HUGEPAGE"):                                   # asked for huge pages ("hg")
        flags = [b.split("VmFlags:")[1].split() for b in _smaps_of(path.resolve())]
        assert flags and all("hg" in f for f in flags), flags


def _smaps_of(path: Path) -> list[str]:
    """The /proc/self/smaps entries (header line and fields) of the mappings of path."""
    entries = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text())
    return [e for e in entries if e.splitlines()[0].endswith(str(path))]


def recorded_pwrites(monkeypatch) -> list[tuple[int, int]]:
    """(offset, bytes) of every pwrite the pack cache makes from now on, in order (the writes still happen)."""
    calls, real = [], packcache._pwrite
    monkeypatch.setattr(packcache, "_pwrite", lambda fd, d, off: (calls.append((off, len(memoryview(d).cast("B")))),
                                                                 real(fd, d, off)))
    return calls


@pytest.mark.parametrize("threads", [1, 3])
def test_blocks_write_whole_aligned_blocks_in_any_order(tmp_path, monkeypatch, threads):
    """Pieces of the file's regions, in random sizes and a random order, from several threads: the file holds
    every byte where it was put and zeros elsewhere, and each pwrite is one whole block at its boundary (the last
    block: the file's tail); a piece for a block already written is written as it comes."""
    import random
    from concurrent.futures import ThreadPoolExecutor
    monkeypatch.setattr(packcache, "BLOCK", 4096)
    size = 5 * 4096 + 1000
    regions = [(0, 100), (128, 7000), (7024, 7030), (12288, size - 8), (size - 8, size)]
    data = np.random.default_rng(0).integers(1, 256, size, dtype=np.uint8)
    rnd = random.Random(threads)
    pieces = []
    for s0, e0 in regions:
        at = s0
        while at < e0:
            n = min(e0 - at, rnd.randint(1, 3000))
            pieces.append((at, n))
            at += n
    rnd.shuffle(pieces)
    calls = recorded_pwrites(monkeypatch)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, size)
        out = packcache.Blocks(fd, size, regions)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda p: out.write(data[p[0]:p[0] + p[1]], p[0]), pieces))
        assert not out.open                                  # every block complete before close
        whole = list(calls)
        out.write(data[20:30], 20)                           # again into a block already written
        with pytest.raises(ValueError, match="do not fit"):
            out.write(data[:10], size - 5)                   # past the end: an error, not an endless loop
        out.close()
    finally:
        os.close(fd)
    want = np.zeros(size, np.uint8)
    for s0, e0 in regions:
        want[s0:e0] = data[s0:e0]
    assert np.array_equal(np.fromfile(path, np.uint8), want)
    # every block with region bytes in one whole write (block 2 holds none: never written, it stays zero)
    assert sorted(whole) == [(b, min(4096, size - b)) for b in range(0, size, 4096) if b // 4096 != 2]
    assert calls[len(whole):] == [(20, 10)]


def test_a_pack_file_is_written_in_whole_blocks(home, model_file, monkeypatch):
    """Packing into the cache writes the file one whole aligned block at a time (so the page cache can keep it in
    huge folios), and the file reads back as the packs."""
    monkeypatch.setattr(packcache, "BLOCK", 8192)
    calls = recorded_pwrites(monkeypatch)
    fresh = packs_of(model_file, True)
    (path,) = cache_files(home)
    size = path.stat().st_size
    assert size > 4 * 8192 and calls
    assert all(off % 8192 == 0 and n == min(8192, size - off) for off, n in calls), calls
    assert_same_packs(fresh.packs, packs_of(model_file, False).packs)


def test_packing_streams_one_chunk_at_a_time(home, tmp_path, monkeypatch):
    """A first load never holds the packed model, or a whole matrix's temporaries: the Python-side peak
    (tracemalloc sees numpy's buffers) of packing into the cache file stays within a few chunks, on a model
    whose packs are many times that. The old loader (whole-matrix prepare, then concatenate) peaked above twice
    the packs."""
    import tracemalloc
    path = tmp_path / "wide.gguf"
    d = dict(n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, n_layer=2, head_dim=64)
    write_model(path, "llama", qtype=T.Q5_0, d=d)
    monkeypatch.setattr(weights, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setattr(packcache, "BLOCK", 16 << 10)            # the file's write blocks: a chunk's size, too
    g, cfg = open_gguf(path)
    packed = load_weights(g, cfg, pack_cache=False, quiet=True).packs.nbytes
    assert packed > 4 << 20
    g, cfg = open_gguf(path)
    tracemalloc.start()
    try:
        w = load_weights(g, cfg, quiet=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert w.packs_from == "packed, cached"
    assert peak < packed / 4, (peak, packed)


@pytest.mark.parametrize("qt", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16,
                                T.F32], ids=lambda t: t.name)
def test_fast_prepare_and_chunks_are_the_bytes_of_prepare(qt, monkeypatch):
    """prepare_fast is prepare, byte for byte (every type; random bytes, rows not a multiple of a tile), and the
    packs of a model packed chunk by chunk, on threads, are those of a whole-matrix prepare concatenated."""
    from lumen.kernels.matmul import prepare
    from lumen.format.quants import quant_info
    rng = np.random.default_rng(int(qt))
    info = quant_info(qt)
    mats = [(rng.integers(0, 256, (rows, 512 // info.block_size * info.type_size), dtype=np.uint8), qt)
            for rows in (130, 64, 1)]
    for raw, _ in mats:
        a, b = prepare(raw, qt), weights.prepare_fast(raw, qt)
        assert a[:4] == b[:4] and a.q.shape == b.q.shape and a.s.shape == b.s.shape
        assert a.q.tobytes() == b.q.tobytes() and a.s.tobytes() == b.s.tobytes()
    whole = [prepare(raw, qt) for raw, _ in mats]
    monkeypatch.setattr(weights, "CHUNK_BYTES", 1)                   # one tile a chunk
    for threads in (1, 2):
        packs = weights.pack_all(mats, threads=threads)
        buf = packs.qf if whole[0].family == 4 else packs.q
        assert buf.tobytes() == b"".join(p.q.tobytes() for p in whole)
        assert packs.s.tobytes() == b"".join(p.s.tobytes() for p in whole)



def test_requantized_packs_are_q4_0_of_the_weights_and_cached_apart(home, model_file):
    """load_weights(requant=Q4_0) packs each matrix stored in more than 4.5 bits per weight as ggml's Q4_0 of its
    values (the bytes of packing that Q4_0 tensor), keeps the others as stored, and caches them in a file of their
    own beside the packs as stored; a hit reads the bytes of a fresh requantization."""
    from lumen.format.quants import QT, bits_per_weight, quantize_q4_0
    g, cfg = open_gguf(model_file)
    tensors = [g.tensors[f"blk.{il}.{name}.weight"] for il in range(cfg.n_layer) for name in weights.MATS]
    tensors.append(g.tensors.get("output.weight", g.tensors["token_embd.weight"]))    # load_weights' order
    mats = []
    for t in tensors:
        if bits_per_weight(t.qtype) > 4.5:
            x = dequantize(t.data, T(int(t.qtype))).reshape(t.shape).astype(np.float32)
            mats.append((quantize_q4_0(x), QT.Q4_0))
        else:
            mats.append((t.data, t.qtype))
    assert {int(qt) for _, qt in mats} == {int(QT.Q4_0)}                  # (MIXED: Q5_1, Q8_0, F16, BF16, ...)
    assert len({int(t.qtype) for t in tensors}) > 3
    want = weights.pack_all(mats)
    stored = packs_of(model_file, True)
    req = load_weights(g, cfg, pack_cache=True, requant=QT.Q4_0)
    assert req.packs_from == "packed, cached" and len(cache_files(home)) == 2
    assert_same_packs(req.packs, want)
    hit = load_weights(g, cfg, pack_cache=True, requant=QT.Q4_0)
    assert hit.packs_from == "cache"
    assert_same_packs(hit.packs, want)
    again = packs_of(model_file, True)                                   # the packs as stored are still there
    assert again.packs_from == "cache"
    assert_same_packs(again.packs, stored.packs)
    with pytest.raises(ValueError, match="Q4_0 only"):
        load_weights(g, cfg, pack_cache=False, requant=QT.Q8_0)
