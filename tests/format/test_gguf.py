"""GGUF loading: real files parse like gguf-py reads them, tensors stay zero-copy, and every bad file fails clearly."""
import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from lumen.model.config import config_from_metadata
from lumen.errors import GGUFError, UnsupportedError
from lumen.format.gguf import GGUFFile
from lumen.model.parts import open_gguf
from synth import write_model


@pytest.mark.slow
def test_real_file_matches_gguf_py(model_path):
    """Every metadata value as gguf-py reads it; every tensor's type, shape and bytes at the offset gguf-py reads
    them from (the same bytes of the same file: compared by position, so no page of the file is read twice)."""
    g = GGUFFile(model_path)
    r = GGUFReader(model_path)
    for key, field in r.fields.items():
        if not key.startswith("GGUF."):
            assert g.metadata[key] == field.contents(), key
    assert len(g.tensors) == len(r.tensors)
    base = g.buf.ctypes.data
    for t in r.tensors:
        mine = g.tensors[t.name]
        assert list(mine.dims) == [int(d) for d in t.shape]
        assert mine.qtype == t.tensor_type
        assert (mine.offset, mine.nbytes) == (t.data_offset, t.n_bytes), t.name
        assert mine.data.ctypes.data - base == mine.offset and mine.data.nbytes == mine.nbytes, t.name
        assert np.shares_memory(mine.data, g.buf), "tensor data must be a zero-copy view of the mmap"


def test_real_configs(smollm2_path, gemma3_path):
    _, c = open_gguf(smollm2_path)
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_vocab) == \
        ("llama", 30, 576, 9, 3, 64, 49152)
    assert c.n_gqa == 3 and not any(c.swa_layers) and c.rope_base == 100000.0
    _, g = open_gguf(gemma3_path)
    assert (g.arch, g.n_layer, g.n_embd, g.n_head, g.n_head_kv, g.head_dim, g.n_vocab) == \
        ("gemma3", 18, 640, 4, 1, 256, 262144)
    # llama.cpp's gemma3 pattern: every 6th layer is global, the rest use the 512-token window and RoPE base 10k
    assert [i for i, s in enumerate(g.swa_layers) if not s] == [5, 11, 17]
    assert g.sliding_window == 512 and g.rope_base_of(0) == 10000.0 and g.rope_base_of(5) == 1e6
    assert g.embd_scale == pytest.approx(640 ** 0.5) and g.attn_scale == pytest.approx(1 / 16)


def test_cli_prints_table(smollm2_path):
    r = subprocess.run([sys.executable, "-m", "lumen.gguf", str(smollm2_path)], capture_output=True, text=True,
                       env={"COLUMNS": "200", "PATH": ""}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "blk.0.attn_q.weight" in r.stdout and "Q4_1" in r.stdout and "207,360" in r.stdout
    assert "tokenizer.ggml.model" in r.stdout


def test_cli_bad_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    r = subprocess.run([sys.executable, "-m", "lumen.gguf", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "not a GGUF file" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_synthetic_models_load(tmp_path, arch):
    path = tmp_path / "m.gguf"
    write_model(path, arch)
    g, cfg = open_gguf(path)
    assert cfg.arch == arch and cfg.qkv_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "gemma3")


def _raises(path, exc, match):
    with pytest.raises(exc, match=match):
        open_gguf(path)


def test_bad_magic_and_version(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + bytes(60))
    _raises(p, GGUFError, "not a GGUF file")
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 7, 0, 0))
    _raises(p, GGUFError, "unsupported GGUF version 7")
    p.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    _raises(p, GGUFError, "big-endian")
    p.write_bytes(b"GGUF")
    _raises(p, GGUFError, "not a GGUF file")
    _raises(tmp_path / "missing.gguf", GGUFError, "cannot open")


def test_truncated(tmp_path):
    src = tmp_path / "m.gguf"
    write_model(src, "llama")
    data = src.read_bytes()
    g = GGUFFile(src)
    last = max(g.tensors.values(), key=lambda t: t.offset)
    del g
    for cut, match in ((100, "truncated"), (last.offset + 10, "beyond the end of the file")):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        _raises(p, GGUFError, match)


def test_huge_counts(tmp_path):
    src = tmp_path / "m.gguf"
    write_model(src, "llama")
    data = bytearray(src.read_bytes())
    for off, match in ((8, "tensor count"), (16, "metadata count")):
        d = bytearray(data)
        d[off:off + 8] = struct.pack("<Q", 2 ** 62)
        p = tmp_path / "huge.gguf"
        p.write_bytes(bytes(d))
        _raises(p, GGUFError, match)
    # the first key's length
    d = bytearray(data)
    d[24:32] = struct.pack("<Q", 2 ** 40)
    p.write_bytes(bytes(d))
    _raises(p, GGUFError, "length")


def test_tensor_offset_beyond_file(tmp_path):
    src = tmp_path / "m.gguf"
    write_model(src, "llama")
    trace = []
    GGUFFile(src, trace=trace)
    off = next(pos for pos, fmt, what in trace if what.startswith("offset of tensor"))
    d = bytearray(src.read_bytes())
    d[off:off + 8] = struct.pack("<Q", 2 ** 50)
    src.write_bytes(bytes(d))
    _raises(src, GGUFError, "beyond the end of the file")


def test_unknown_tensor_type(tmp_path):
    src = tmp_path / "m.gguf"
    write_model(src, "llama")
    trace = []
    GGUFFile(src, trace=trace)
    off = next(pos for pos, fmt, what in trace if what.startswith("type of tensor"))
    d = bytearray(src.read_bytes())
    d[off:off + 4] = struct.pack("<I", 999)
    src.write_bytes(bytes(d))
    _raises(src, GGUFError, "unknown type id 999")


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "m.gguf"
    write_model(p, "llama", arch_name="mamba")
    _raises(p, UnsupportedError, "architecture 'mamba' is not supported")


def test_unsupported_quant_type_clean(tmp_path):
    p = tmp_path / "m.gguf"
    write_model(p, "llama", tensor_types={"blk.1.ffn_up.weight": T.IQ4_NL})
    _raises(p, UnsupportedError, "IQ4_NL, which Lumen does not support")


def test_missing_tensor(tmp_path):
    p = tmp_path / "m.gguf"
    write_model(p, "llama", drop=("blk.1.ffn_down.weight",))
    _raises(p, GGUFError, "missing tensor 'blk.1.ffn_down.weight'")
    write_model(p, "qwen2", drop=("blk.0.attn_k.bias",))
    _raises(p, GGUFError, "missing tensor 'blk.0.attn_k.bias'")


def test_tied_output_allowed(tmp_path):
    p = tmp_path / "m.gguf"
    write_model(p, "llama", drop=("output.weight",))
    g, cfg = open_gguf(p)
    assert "output.weight" not in g.tensors


def test_inconsistent_shape(tmp_path):
    p = tmp_path / "m.gguf"
    write_model(p, "llama", reshape={"blk.0.attn_k.weight": (64, 64)})
    _raises(p, GGUFError, r"blk.0.attn_k.weight' has shape \[64, 64\], expected \[64, 32\]")


def test_bad_metadata_values(tmp_path):
    p = tmp_path / "m.gguf"
    write_model(p, "llama", meta={"llama.attention.head_count_kv": 3})
    _raises(p, GGUFError, "not a multiple of head_count_kv")
    with pytest.raises(GGUFError, match="missing metadata key 'llama.block_count'"):
        config_from_metadata({"general.architecture": "llama"})


@pytest.mark.parametrize("base", [0.0, -1.0])
def test_a_rope_base_that_is_not_positive_is_refused_at_load(tmp_path, base):
    """It loaded and failed at the first forward pass, as "base -1.0 and freq_scale 1.0 must be positive"."""
    p = tmp_path / "m.gguf"
    write_model(p, "llama", meta={"llama.rope.freq_base": base})
    _raises(p, GGUFError, rf"rope.freq_base {base} must be positive")


# --- the header cache: a parsed header is reused only for the same bytes --------------------------------------

def _same(a: GGUFFile, b: GGUFFile) -> None:
    assert (a.version, a.metadata, a.header_end, a.alignment, a.data_start) == \
        (b.version, b.metadata, b.header_end, b.alignment, b.data_start)
    assert {n: (t.qtype, t.dims, t.offset, t.nbytes) for n, t in a.tensors.items()} == \
        {n: (t.qtype, t.dims, t.offset, t.nbytes) for n, t in b.tensors.items()}


def _entries(d):
    return sorted(d.glob("*.header"))


def test_header_cache_gives_what_the_parse_gives_without_parsing(tmp_path, monkeypatch):
    p, d = tmp_path / "m.gguf", tmp_path / "cache"
    write_model(p, "qwen2")
    parsed = GGUFFile(p)
    _same(GGUFFile(p, cache=d), parsed)                  # a miss: parsed, and the entry written
    assert len(_entries(d)) == 1

    def no_parse(self):
        raise AssertionError("parsed although the cache holds this file's header")
    monkeypatch.setattr(GGUFFile, "_parse_header", no_parse)
    hit = GGUFFile(p, cache=d)
    _same(hit, parsed)
    assert np.array_equal(hit.tensors["token_embd.weight"].data, parsed.tensors["token_embd.weight"].data)


def test_header_cache_is_not_trusted_for_other_bytes(tmp_path):
    """An entry found for a file whose header bytes differ (same size; here the entry is pointed at on purpose,
    as a file rewritten within one tick of the clocks would find it) is a miss: the file is parsed again."""
    from lumen.format.gguf import HeaderCache
    p, d = tmp_path / "m.gguf", tmp_path / "cache"
    write_model(p, "llama")
    entry_for_old = HeaderCache(d, GGUFFile(p, cache=d)).path
    data = bytearray(p.read_bytes())
    at = data.index(b"llama", 40)                        # a metadata string's bytes: "llama" -> "LLAMA"
    data[at:at + 5] = b"LLAMA"
    p.write_bytes(bytes(data))
    changed = GGUFFile(p)
    store = HeaderCache(d, changed)
    store.path = entry_for_old
    assert store.read() is None


def test_header_cache_survives_bad_entries_and_keeps_one_per_file(tmp_path):
    p, d = tmp_path / "m.gguf", tmp_path / "cache"
    write_model(p, "llama")
    GGUFFile(p, cache=d)
    (entry,) = _entries(d)
    for junk in (b"", b"not a pickle", entry.read_bytes()[:100]):
        entry.write_bytes(junk)
        _same(GGUFFile(p, cache=d), GGUFFile(p))         # parsed again, and the entry written again
        assert _entries(d) == [entry] and entry.stat().st_size > 1000
    write_model(p, "llama", seed=1)                      # the file replaced: its new entry replaces the old
    _same(GGUFFile(p, cache=d), GGUFFile(p))
    assert len(_entries(d)) == 1 and _entries(d) != [entry]


def test_header_cache_keeps_no_bad_file_and_follows_the_pack_cache_switch(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    bad = tmp_path / "bad.gguf"
    write_model(bad, "llama", meta={"llama.attention.head_count_kv": 3})
    for _ in range(2):                                    # the same error on the second open: nothing was kept
        _raises(bad, GGUFError, "not a multiple of head_count_kv")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(GGUFError, match="cannot fit in a file of 100 bytes"):
        GGUFFile(truncated, cache=d)
    assert not d.exists() or not _entries(d)
    good = tmp_path / "m.gguf"
    write_model(good, "llama")
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path / "home"))
    d = tmp_path / "home" / "headers"
    monkeypatch.setenv("LUMEN_PACK_CACHE", "0")
    open_gguf(good)
    open_gguf(good, cache=True)                           # (the argument wins)
    assert len(_entries(d)) == 1
    _entries(d)[0].unlink()
    monkeypatch.setenv("LUMEN_PACK_CACHE", "1")
    open_gguf(good, cache=False)
    assert not _entries(d)
    open_gguf(good)
    assert len(_entries(d)) == 1


def test_header_cache_drops_the_entries_of_deleted_files(tmp_path):
    """Writing an entry removes those of files that no longer exist and those of another format (never a hit);
    the entries of files that still exist stay."""
    d = tmp_path / "cache"
    paths = [tmp_path / f"m{i}.gguf" for i in range(3)]
    for i, p in enumerate(paths[:2]):
        write_model(p, "llama", seed=i)
        GGUFFile(p, cache=d)
    kept, gone = _entries(d)
    assert "m0-" in kept.name and "m1-" in gone.name
    legacy = d / "old-0000000000000000-0000000000000000.header"
    legacy.write_bytes(b"\x80\x05an entry of the format before")
    paths[1].unlink()
    GGUFFile(paths[0], cache=d)                          # a hit writes nothing: nothing is removed
    assert gone.exists() and legacy.exists()
    write_model(paths[2], "llama", seed=2)
    GGUFFile(paths[2], cache=d)                          # a miss writes its entry and removes what cannot be hit
    assert kept.exists() and not gone.exists() and not legacy.exists() and len(_entries(d)) == 2
    _same(GGUFFile(paths[0], cache=d), GGUFFile(paths[0]))
