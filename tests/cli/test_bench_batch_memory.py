"""`lumen bench batch` refuses a parallel level whose run cannot fit in memory, before it runs: -npl 100000 was
killed by the kernel's OOM killer (exit 137, and the machine's other processes starved of memory meanwhile)."""
from __future__ import annotations


def test_a_level_beyond_the_memory_is_one_line_error(smollm2_path, monkeypatch, capsys):
    from lumen.bench import batch
    from lumen.bench.cli import main
    monkeypatch.setattr(batch, "available_mb", lambda: 50.0, raising=False)      # a 50 MB machine
    assert main(["batch", "--model", str(smollm2_path), "-npp", "8", "-ntg", "2", "-npl", "1,256", "-r", "1",
                 "-t", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: -npl 256 sequences of -npp 8 tokens need about ") and "0.1 GB available" in last \
        and last.endswith("use a smaller -npl or -npp"), err


def test_the_estimate_counts_the_kv_cache_and_the_prefill_step(smollm2_path):
    """SmolLM2 (KV 368,640 bytes a block): the default shape (-npl 16 of -npp 128) fits well under a GB;
    -npl 100000 of -npp 8 (the OOM-killed run) needs more than 30 GB; unknown free memory refuses nothing."""
    import lumen
    from lumen.bench.batch import memory_error, memory_needed
    m = lumen.load(smollm2_path, ctx=64, threads=1)
    per_block = m.runner.kv_bytes_per_block
    small = memory_needed(m.config, 16 * 17 * per_block, 128, 16)
    assert 16 * 17 * per_block < small < 1e9
    assert memory_needed(m.config, 100000 * per_block, 8, 100000) > 30e9
    assert memory_error(m.config, 100000 * per_block, 8, 100000, 20_000.0) is not None
    assert memory_error(m.config, 16 * 17 * per_block, 128, 16, 20_000.0) is None
    assert memory_error(m.config, 100000 * per_block, 8, 100000, None) is None
