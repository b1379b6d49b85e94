"""`python -m lumen.profile` as a subprocess on SmolLM2 with a fake machine cache, and its report and plots
(lumen/profile/report.py). lumen.machine itself: tests/model/test_machine.py."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

FAKE = {"cpu": None, "cores": os.cpu_count(), "threads": os.cpu_count(), "version": None, "bw_1t_gbps": 10.0,
        "bw_gbps": 20.0, "fma_1t_gflops": 50.0, "fma_gflops": 100.0, "int8_dot_1t_gops": 150.0,
        "int8_dot_gops": 300.0, "int8_dot_isa": "fake isa",
        "int8_dot_widths": {"256": {"1t_gops": 75.0, "gops": 150.0}, "512": {"1t_gops": 150.0, "gops": 300.0}},
        "l1d_bytes": 48 << 10, "l2_bytes": 2 << 20,
        "l3_bytes": 32 << 20, "measured_at": "fake"}


@pytest.fixture(scope="module")
def home(tmp_path_factory, new_home):
    """A LUMEN_HOME with the real models and their packs linked in, and a fake machine.json."""
    from lumen.machine import VERSION, cpu_model, machine_key
    d = new_home(tmp_path_factory.mktemp("lumen_home"))
    (d / "machine.json").write_text(json.dumps(dict(FAKE, cpu=cpu_model(), cpu_key=machine_key(), version=VERSION)))
    return d


def run(home, *args, timeout=300, columns=200):
    env = dict(os.environ, LUMEN_HOME=str(home), COLUMNS=str(columns))
    return subprocess.run([sys.executable, "-m", "lumen.profile", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def full(home, smollm2_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("out")
    r = run(home, "--model", smollm2_path, "--prompt-tokens", 16, "--gen-tokens", 4, "--threads", 2,
            "--json", d / "p.json", "--plot", d / "p.png")
    return r, d


def _rows(out: str, title: str) -> list[list[str]]:
    """The body rows of the rich table whose title starts with `title`."""
    lines = out.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(title))
    rows = []
    for ln in lines[i + 4:]:
        if not ln.startswith("│"):
            break
        rows.append([c.strip() for c in ln.strip("│").split("│")])
    return rows


def _op_rows(out: str, title: str) -> list[list[str]]:
    """The rows of the op table whose title starts with `title` (no vertical rules: cells split at spaces, the
    'bound by' cell rejoined). The table ends at the first line that is not an op row: a footnote, or the next
    phase's title ("decode: 3 tokens ..."), which follows at once when no op of this phase is above its roof."""
    lines = out.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(title))
    rows = []
    for ln in lines[i + 3:]:
        if not re.match(r"^\w+\s+\d+\s", ln):
            break
        cells = ln.split()
        rows.append(cells[:8] + [" ".join(cells[8:-1]), cells[-1]])
    return rows


def test_report_tables(full):
    from lumen.profile.report import matmul_ops
    r, _ = full
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # 4 generated tokens: the first is sampled from the prefill step, then 3 decode steps
    for title in ("prefill: 16 tokens in 1 step,", "decode: 3 tokens in 3 steps,", "ms per layer",
                  "Python/dispatch overhead"):
        assert title in out, out
    assert "coverage decode: min" in out and "coverage prefill: min" in out
    flat = " ".join(out.split())                    # the machine line wraps where the CPU's name ends it
    assert "int8 dot 300 GOP/s (roof of the matmuls: fake isa)" in flat and "memory read 20.0 GB/s" in flat
    for phase in ("prefill", "decode"):
        rows = _op_rows(out, phase + ":")
        ops = {row[0] for row in rows}
        assert {*matmul_ops(), "attention", "embed"} <= ops
        assert not ops & {"qk_norm", "post_attn_norm", "post_ffn_norm"}, "a llama has none of these: no row"
        for row in rows:
            for cell in row[1:8]:
                assert math.isfinite(float(cell.rstrip("%")))
            assert row[8] in ("memory", "int8 dot", "f32 FMA", "-")
            if row[9].endswith("*"):                        # above its roof: explained under the table
                assert re.search(rf"^\* {row[0]} at {row[9][:-2]}% of its roof: ", out, re.M), (row, out)
    layers = _rows(out, "ms per layer")
    assert [int(row[0]) for row in layers] == list(range(30))
    over = {row[0]: float(row[1]) for row in _rows(out, "Python/dispatch overhead")}
    assert {"schedule", "prepare", "dispatch", "return", "sample", "detokenize", "unattributed", "total"} <= set(over)


def test_report_fits_80_columns_in_a_pipe(home, smollm2_path):
    """In a pipe at 80 columns the op tables keep every column and no table line is wider than 80 (the decode
    bytes line alone is one long line, for grep)."""
    r = run(home, "--model", smollm2_path, "--prompt-tokens", 8, "--gen-tokens", 3, columns=80)
    assert r.returncode == 0, r.stderr
    wide = [ln for ln in r.stdout.splitlines() if len(ln) > 80 and not ln.startswith("decode reads")]
    assert not wide, wide
    for phase in ("prefill", "decode"):
        rows = _op_rows(r.stdout, phase + ":")
        assert rows and all(len(row) == 10 and "…" not in " ".join(row) for row in rows)


def test_decode_bytes_line(full, smollm2_path):
    """Bytes per decode step: weights (every packed matrix once and an embedding row) + KV + activations."""
    from lumen.format.gguf import GGUFFile
    r, d = full
    assert r.returncode == 0, r.stderr
    m = re.search(r"^decode reads ([\d.]+) MB per step: ([\d.]+) MB weights \(GGUF tensors ([\d.]+) MB\), "
                  r"([\d.]+) MB KV, ([\d.]+) MB activations; (\d+) parallel regions per step", r.stdout, re.M)
    assert m, r.stdout
    total, weights, gguf, kv, act, regions = map(float, m.groups())
    assert regions == 5 * 30 + 1                    # per layer q/k/v, o, gate/up, down, attention; the head
    g = GGUFFile(smollm2_path)
    assert gguf == pytest.approx(sum(t.nbytes for t in g.tensors.values()) / 1e6, abs=0.05)
    g.close()
    assert total == pytest.approx(weights + kv + act, abs=0.15)
    assert 0.95 * gguf < weights <= 1.05 * gguf    # the packs are no larger than the GGUF
    assert 0 < kv < weights and 0 < act < 0.1 * weights
    b = json.loads((d / "p.json").read_text())["summary"]["decode_bytes"]
    assert b["total"] == pytest.approx(b["weights"] + b["kv"] + b["activations"])


def test_json_and_plots(full):
    r, d = full
    assert r.returncode == 0, r.stderr
    data = json.loads((d / "p.json").read_text())
    assert data["records"] and data["steps"][0]["phase"] == "prefill"
    s = data["summary"]
    assert s["run"]["prompt_tokens"] == 16 and s["run"]["gen_tokens"] == 4
    assert data["machine"]["bw_gbps"] == 20.0 and data["machine"]["int8_dot_gops"] == 300.0
    dec = {row["op"]: row for row in s["ops"]["decode"]}
    q = dec["o"]
    assert q["calls"] == 30 * 3 and q["gflops"] > 0 and q["intensity"] > 0
    # the matmul bound uses the int8 dot peak, the rest the FMA peak, both against the bandwidth
    assert q["roof"] == "int8 dot" and q["bound_gflops"] == pytest.approx(min(300.0, q["intensity"] * 20.0))
    assert q["roofline_share"] == pytest.approx(q["gflops"] / q["bound_gflops"])
    att = dec["attention"]
    assert att["roof"] == "f32 FMA" and att["bound_gflops"] == pytest.approx(min(100.0, att["intensity"] * 20.0))
    for ph, rows in s["ops"].items():   # every op above its roof has its note
        assert {row["op"] for row in rows if (row["roofline_share"] or 0) > 1} == set(s["notes"][ph])
    assert 0.9 <= s["phases"]["decode"]["coverage_min"] <= 1.0
    for name in ("p.png", "p-ops.png"):
        blob = (d / name).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000


def test_roofline_figure_names_every_op(full):
    """A panel per phase, a point per op with FLOPs, each op once in the legend with a style of its own, the roofs
    with their measured values."""
    import matplotlib.pyplot as plt
    from lumen.profile.report import matmul_ops, op_styles, roofline_figure
    _, d = full
    s = json.loads((d / "p.json").read_text())["summary"]
    fig = roofline_figure(s, "test")
    try:
        plotted = {ph: {r["op"] for r in rows if r["gflops"] > 0} for ph, rows in s["ops"].items()}
        ops = set().union(*plotted.values())
        assert len(ops) >= 12
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        entries: dict[str, list[str]] = {}
        for lb in labels:
            if lb.removesuffix(" (matmul)") in ops:
                entries.setdefault(lb.removesuffix(" (matmul)"), []).append(lb)
        assert sorted(entries) == sorted(ops) and all(len(v) == 1 for v in entries.values())  # each op once
        assert all(v[0].endswith(" (matmul)") == (op in matmul_ops()) for op, v in entries.items())
        assert any("300 GOP/s" in lb for lb in labels) and any("100 GFLOP/s" in lb for lb in labels)
        styles = op_styles(sorted(ops), matmul_ops())
        looks = {(st["marker"], str(st.get("color", st.get("facecolors"))), str(st["edgecolors"]))
                 for st in styles.values()}
        assert len(looks) == len(ops)                                # no two ops look alike
        axes = fig.get_axes()
        assert [ax.get_title().split(":")[0] for ax in axes] == ["prefill", "decode"]
        for ax, ph in zip(axes, ["prefill", "decode"]):
            assert len(ax.collections) == len(plotted[ph])           # one point per op
            texts = " ".join(t.get_text() for t in ax.texts)
            assert "int8 dot 300 GOP/s" in texts and "f32 FMA 100 GFLOP/s" in texts and "memory read 20.0 GB/s" in texts
            assert all(op in texts for op in plotted[ph])            # every point labelled in place
        assert "FLOP per byte" in axes[0].get_xlabel() and "GFLOP/s" in axes[0].get_ylabel()
    finally:
        plt.close(fig)


LIM = {"bw_gbps": 16.0, "fma_gflops": 94.0, "int8_dot_gops": 377.0, "l1d_bytes": 48 << 10, "l2_bytes": 2 << 20,
       "l3_bytes": 300 << 20, "measured_at": "then"}
SIZES = {"matrix_bytes": 111e6, "kv_cache_bytes": 15e6, "n_layer": 30}


@pytest.mark.parametrize("op, phase, per_call, bound_by, roof, says", [
    ("attn_residual", "decode", 6.9e3, "memory", "f32 FMA", "activations the op before it just wrote, from the L1"),
    ("output", "decode", 32e6, "memory", "int8 dot", "fit in the L3 (300 MiB) cache, so it stays cached"),
    ("attention", "prefill", 51e6, "memory", "f32 FMA", "a chunk's queries share the layer's keys"),
    ("attention", "decode", 0.4e6, "memory", "f32 FMA", "fit in the L3"),
    ("act", "prefill", 400e6, "memory", "f32 FMA", "unexplained"),
    ("down", "prefill", 1e6, "int8 dot", "int8 dot", "above the measured int8 dot peak (377)"),
])
def test_above_roof_notes(op, phase, per_call, bound_by, roof, says):
    """An op above its roof is explained by where its data fits, or said to be unexplained."""
    from lumen.profile.report import above_roof_note
    row = {"op": op, "bytes_per_call": per_call, "bound_by": bound_by, "roof": roof}
    assert says in above_roof_note(row, phase, LIM, SIZES)
    if op == "output":   # a model that does not fit in L3 leaves the point unexplained
        assert "unexplained" in above_roof_note(row, phase, dict(LIM, l3_bytes=32 << 20), SIZES)


@pytest.mark.slow
def test_filters(home, smollm2_path):
    r = run(home, "--model", smollm2_path, "--prompt-tokens", 8, "--gen-tokens", 3, "--phase", "decode",
            "--op", "down", "--layer", 2)
    assert r.returncode == 0, r.stderr
    rows = _op_rows(r.stdout, "decode:")
    assert [row[0] for row in rows] == ["down"] and rows[0][1] == "2"
    assert "prefill:" not in r.stdout
    assert [row[0] for row in _rows(r.stdout, "ms per layer")] == ["2"]


def test_filters_that_match_nothing_say_so(home, smollm2_path):
    """--op attention --layer -1 (attention runs inside the layer stack) printed two empty tables and nothing
    else; a note says no record matches, and names the ops recorded at layer -1."""
    r = run(home, "--model", smollm2_path, "--prompt-tokens", 8, "--gen-tokens", 2, "--op", "attention",
            "--layer", -1)
    assert r.returncode == 0, r.stderr
    assert "note: no records match --op attention --layer -1: attention does not run there" in r.stderr, r.stderr
    recorded = r.stderr.split("ops recorded with --layer -1: ")[1].split(", ")
    assert "attention" not in recorded and "sample" in [x.strip() for x in recorded], r.stderr


@pytest.mark.parametrize("args, code, msg", [
    (["--max-num-seqs", "0"], 2, "error: --max-num-seqs must be at least 1, got 0"),
    (["--max-num-batched-tokens", "-1"], 2, "error: --max-num-batched-tokens must be at least 1, got -1"),
    (["--max-model-len", "100000000"], 2, "error: --max-model-len must be between 1 and 16777216, got 100000000"),
    (["--max-model-len", "9000"], 1, "error: --max-model-len 9000 is beyond the 8192 tokens this model was trained "
                                     "on; use a smaller --max-model-len"),
])
def test_engine_flags_are_checked_before_the_calibration(home, smollm2_path, args, code, msg):
    """--engine's flags exited 1 with the engine's field names ("max_num_seqs must be ...", "max_pos 100000000 is
    beyond exact float32 positions") once the model had loaded; they are usage errors in the flags' names, and a
    context past the trained one (SmolLM2: 8192) is refused as every command line refuses it (it was calibrated)."""
    r = run(home, "--engine", "--tiny", "--model", smollm2_path, *args)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines()[-1] == msg, r.stderr


def test_overhead_with_few_generated_tokens(home, smollm2_path):
    """--overhead's warm-ups generated 4 tokens whatever --gen-tokens was, past the context it loads (prompt +
    gen + 1): --gen-tokens 2 died with "exceeds the context of 7 tokens". --gen-tokens 1 times no decode step: a
    usage error."""
    r = run(home, "--overhead", "--model", smollm2_path, "--repeats", 1, "--prompt-tokens", 4, "--gen-tokens", 2,
            "--threads", 1)
    assert r.returncode == 0, r.stderr
    assert "decode tok/s medians over 1: compiled out " in r.stdout, r.stdout
    r = run(home, "--overhead", "--model", smollm2_path, "--gen-tokens", 1)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "error: --overhead needs --gen-tokens 2 or more (decode steps to time), got 1"), r.stderr


def test_decode_phase_of_a_run_without_a_decode_step_is_a_usage_error(home, smollm2_path):
    """--gen-tokens 1 samples its token from the prefill step: --phase decode reported "decode: 0 tokens in 0
    steps" and "-96.4 MB activations" per step."""
    r = run(home, "--model", smollm2_path, "--prompt-tokens", 4, "--gen-tokens", 1, "--phase", "decode")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == ("error: --phase decode needs --gen-tokens 2 or more: the first generated token is "
                                "sampled from the prefill step") and r.stdout == "", r.stderr


@pytest.mark.parametrize("args, code, msg", [
    (["--phase", "training"], 2, "unknown phase 'training'"),
    (["--op", "flash"], 2, "unknown op 'flash'; ops are act, attention,"),
    (["--layer", "-2"], 2, "unknown layer -2"),
    (["--layer", "99"], 1, "unknown layer 99"),
    (["--prompt-tokens", "0"], 2, "--prompt-tokens must be at least 1"),
    (["--gen-tokens", "-3"], 2, "--gen-tokens must be at least 1"),
    (["--prompt-tokens", "x"], 2, "invalid int value"),
    (["--prompt-tokens", "16777215"], 2, "--prompt-tokens + --gen-tokens must be below 16777216 (the longest "
                                         "context Lumen holds), got 16777217"),     # (was "ctx must be ...", 1)
    (["--json", "/no/such/dir/p.json"], 2, "does not exist"),
    (["--plot", "/no/such/dir/p.png"], 2, "does not exist"),
])
@pytest.mark.slow
def test_bad_input(home, smollm2_path, args, code, msg):
    r = run(home, "--model", smollm2_path, "--prompt-tokens", 4, "--gen-tokens", 2, *args)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert msg in r.stderr and "Traceback" not in r.stderr


def test_unwritable_path_fails_before_the_run(home, smollm2_path, tmp_path):
    r = run(home, "--model", smollm2_path, "--json", tmp_path)  # a directory; default 512+128 would take long
    assert r.returncode == 2 and "is a directory" in r.stderr and "Traceback" not in r.stderr


def test_context_beyond_the_trained_one_is_refused(home, smollm2_path):
    """As lumen.generate refuses it: SmolLM2 was trained on 8192 tokens; 9000 would run for minutes."""
    r = run(home, "--model", smollm2_path, "--prompt-tokens", 9000, "--gen-tokens", 2, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "Warning" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: ctx=9003 is beyond the 8192 tokens this model was trained on (output past that is unreliable); "
        "use fewer --prompt-tokens or --gen-tokens")


def test_machine_prints_cached_limits(home):
    r = run(home, "--machine")
    assert r.returncode == 0, r.stderr
    assert "memory read GB/s" in r.stdout and "20.0" in r.stdout
    assert re.search(r"int8 dot GOP/s \(the roof\) +│ +150 │ +300", r.stdout) and "int8 dot: fake isa" in r.stdout
    assert re.search(r"256-bit vectors +│ +75 │ +150", r.stdout)
    assert re.search(r"512-bit vectors +│ +150 │ +300", r.stdout)
    assert "caches per core: L1d 48 KiB, L2 2 MiB, L3 32 MiB" in r.stdout
    from lumen.machine import machine_key
    assert f"measured on (and reused only on) {machine_key()}" in " ".join(r.stdout.split())


@pytest.mark.parametrize("load, busy", [(None, False), (0.1, False), (2.0 * (os.cpu_count() or 1), True)])
def test_machine_says_when_it_was_measured_on_a_busy_machine(load, busy):
    import io
    from rich.console import Console
    from lumen.profile.report import print_machine
    out = io.StringIO()
    print_machine(dict(FAKE, cpu="fake CPU", version=1, load_avg=load), Console(file=out, width=200))
    said = "warning: measured under a load average of" in out.getvalue()
    assert said == busy, out.getvalue()
    assert not busy or "may be low; measure again on a quiet machine (--machine --remeasure)" in out.getvalue()


def test_machine_json_writes_the_limits(home, tmp_path):
    r = run(home, "--machine", "--json", tmp_path / "m.json")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "m.json").read_text()) == json.loads((home / "machine.json").read_text())


def test_machine_json_to_stdout(home, tmp_path):
    """--json -: the limits as JSON alone on stdout (for a script), no table, no file named "-"."""
    r = subprocess.run([sys.executable, "-m", "lumen.profile", "--machine", "--json", "-"], cwd=tmp_path,
                       env=dict(os.environ, LUMEN_HOME=str(home)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads(r.stdout) == json.loads((home / "machine.json").read_text())
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("args, msg", [
    (["--machine", "--plot", "{tmp}/m.png"], "--plot does not go with --machine"),
    (["--overhead", "--plot", "{tmp}/o.png"], "--plot does not go with --overhead"),
    (["--plot", "{tmp}/p.txt"], "cannot write the plot to {tmp}/p.txt: .txt file extension; use one of"),
    (["--plot", "{tmp}/p"], "cannot write the plot to {tmp}/p: no file extension"),
    (["--engine", "--json", "/no/such/dir/c.json"], "the directory /no/such/dir does not exist"),
    (["--engine", "--plot", "{tmp}"], "is a directory"),
    (["--serving", "{tmp}/s.json", "--plot", "/no/such/dir/s.png"], "the directory /no/such/dir does not exist"),
    (["--machine", "--json", ""], "--json needs a file name, got ''"),
    (["--engine", "--plot", " "], "--plot needs a file name, got ' '"),
    (["--serving", "{tmp}/s.json", "--json", "-"], "--json - (JSON on stdout) goes with --machine only"),
])
def test_outputs_that_cannot_be_written_fail_before_any_work(home, tmp_path, args, msg):
    """Every mode checks its --json and --plot before measuring (an --engine calibration takes minutes), and a flag
    a mode has no output for is refused rather than ignored."""
    (tmp_path / "s.json").write_text("{}")
    r = run(home, *[a.format(tmp=tmp_path) for a in args], timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert r.stdout == "" and len(lines) == 1 and lines[0].startswith("error: ")
    assert msg.format(tmp=tmp_path) in lines[0]


@pytest.mark.parametrize("args", [[], ["--engine"], ["--serving", "s.json"]])
def test_plot_without_matplotlib_is_one_line(monkeypatch, tmp_path, args):
    """matplotlib is not a dependency (the `plot` extra): --plot without it says what to install, before any work."""
    import lumen.profile.__main__ as cli
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)         # a blocked import raises ImportError
    (tmp_path / "s.json").write_text("{}")
    argv = [str(tmp_path / a) if a.endswith(".json") else a for a in args] + ["--plot", str(tmp_path / "p.png")]
    assert cli.check_outputs(*cli.parse(argv)[1:]) == (
        "--plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')")


@pytest.mark.parametrize("what", ["missing", "a directory"])
def test_serving_file_that_cannot_be_read(home, tmp_path, what):
    path = tmp_path / "s.json" if what == "missing" else tmp_path
    r = run(home, "--serving", path, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: cannot read the serving profile {path}: "), r.stderr
    assert "Errno" not in r.stderr


def test_ctrl_c_during_an_engine_calibration_is_one_line(monkeypatch, capsys):
    import lumen.profile.__main__ as cli
    import lumen.profile.serving_cli as serving_cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(serving_cli, "engine_main", interrupted)
    assert cli.main(["--engine"]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == "interrupted", err


def test_help_fits_80_columns(monkeypatch):
    """`--help` in an 80-column terminal or a pipe: no line wider than 80 (the modes' epilog included)."""
    from lumen.profile.__main__ import build_parser
    monkeypatch.setenv("COLUMNS", "80")
    text = build_parser().format_help()
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, wide
    assert all(m in text for m in ("--machine", "--overhead", "--engine", "--serving FILE"))


def test_op_and_layer_filters_leave_out_the_whole_step_overhead():
    """--op/--layer restrict the tables to those records: the per-step Python/dispatch table (whole steps' glue)
    is not one of them, so it is left out under a filter and kept without one."""
    from lumen.profile import Profiler, Record, Step
    from lumen.profile.report import summarize
    prof = Profiler()
    for i in range(3):
        prof.steps.append(Step(i, "decode", 1, 1, 4 + i, wall_s=0.010, t0=0.01 * i, t1=0.01 * i + 0.010,
                               requests=("a",)))
        prof.records += [Record(i, "decode", -1, "schedule", 0.001, 0, 0),
                         Record(i, "decode", 0, "attention", 0.002, 1000, 2000),
                         Record(i, "decode", 0, "down", 0.006, 10000, 20000),
                         Record(i, "decode", -1, "sample", 0.001, 0, 0)]
    assert "overhead" in summarize(prof, FAKE, 2, None, None, None)
    s = summarize(prof, FAKE, 2, "decode", "attention", None)
    assert [r["op"] for r in s["ops"]["decode"]] == ["attention"] and "overhead" not in s
    assert "overhead" not in summarize(prof, FAKE, 2, None, None, 0)
