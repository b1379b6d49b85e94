"""python -m lumen.bench: rows, --json, flag errors, and --compare llama.cpp without llama_cpp installed; and the
benchmark gates' choice of baseline (tests/benchmarks: one baseline per CPU)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lumen.bench import single as bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def no_llama_run(smollm2_path, tmp_path_factory):
    """One small run with --compare llama.cpp where `import llama_cpp` raises ImportError (a stub package on
    PYTHONPATH shadows the real one)."""
    tmp = tmp_path_factory.mktemp("bench")
    stub = tmp / "stub" / "llama_cpp"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('stubbed out by tests/cli/test_bench.py')\n")
    out = tmp / "bench.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub.parent), str(ROOT)]), COLUMNS="160")
    r = subprocess.run([sys.executable, "-m", "lumen.bench", "--model", str(smollm2_path), "-p", "8", "-n", "4",
                        "-r", "2", "-t", "1", "--json", str(out), "--compare", "llama.cpp"],
                       capture_output=True, text=True, env=env, timeout=600)
    return r, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.slow
def test_rows_printed(no_llama_run):
    r, _ = no_llama_run
    assert r.returncode == 0, r.stderr
    for row in ("pp8", "tg4", "pp32", "tg32"):
        assert row in r.stdout
    assert "GB/s" in r.stdout and "peak RSS" in r.stdout
    assert "Traceback" not in r.stderr


def test_compare_without_llama_cpp_prints_hint(no_llama_run):
    r, data = no_llama_run
    assert bench.COMPARE_HINT in r.stderr
    assert data["info"]["engines"] == ["Lumen"]


def test_json_content(no_llama_run):
    _, data = no_llama_run
    info = data["info"]
    assert info["threads"] == 1 and info["reps"] == 2 and info["tests"] == ["pp8", "tg4", "pp32", "tg32"]
    assert info["weight_bytes"]["Lumen"] > 50e6 and info["rss_lumen_mb"] > 0
    figs = {(f["test"], f["unit"]): f for f in data["figures"]}
    assert set(figs) == {("pp8", "t/s"), ("tg4", "t/s"), ("tg4", "GB/s"), ("pp32", "t/s"), ("tg32", "t/s"),
                         ("tg32", "GB/s")}
    for f in figs.values():
        v = f["Lumen"]
        assert len(v["values"]) == 2 and all(x > 0 for x in v["values"])
        assert v["mean"] == pytest.approx(sum(v["values"]) / 2)
    tg, gb = figs[("tg4", "t/s")]["Lumen"], figs[("tg4", "GB/s")]["Lumen"]
    assert gb["mean"] == pytest.approx(tg["mean"] * info["weight_bytes"]["Lumen"] / 1e9)


@pytest.mark.parametrize("argv, msg", [
    (["-p", "0"], "-p must be at least 1"),
    (["-n", "-3"], "-n must be at least 1"),
    (["-r", "0"], "-r must be at least 1"),
    (["--threads", "0"], "--threads must be between 1 and"),
    (["--threads", "100000"], "--threads must be between 1 and"),
    (["--small", "-1"], "--small must be 0"),
    # the load's "ctx must be an integer in [1, 16777216]" (status 1) named a flag bench does not have
    (["-p", "100000000000"], "-p must be at most 16777216 (the longest context Lumen holds), got 100000000000"),
    (["-n", "16777216"], "-n must be at most 16777215"),
    (["-p", "abc"], "invalid int value"),
    (["--compare", "vllm"], "invalid choice"),
])
def test_bad_flags(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["single"], ["batch"], ["offline"], ["serve", "--url", "http://127.0.0.1:9"],
                                  ["spec"]], ids=lambda a: a[0])
def test_json_path_is_checked_before_the_run(argv, tmp_path, capsys):
    """A --json FILE that cannot be written is a usage error at once, not a traceback after the whole run."""
    from lumen.bench.cli import main
    with pytest.raises(SystemExit) as e:
        main([*argv, "--json", str(tmp_path / "missing" / "out.json")])
    assert e.value.code == 2
    assert "cannot write the JSON to" in capsys.readouterr().err


def test_offline_kv_cache_too_small_is_one_line_error(smollm2_path, capsys):
    from lumen.bench.offline import main
    assert main(["--model", str(smollm2_path), "--requests", "1", "--kv-cache-mb", "1", "--no-baseline"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("lumen: ")]   # (packing)
    assert len(err) == 1 and err[0].startswith("error: the prompt (") and "raise kv_cache_mb" in err[0], err


@pytest.mark.parametrize("argv, says", [
    (["single", "-p", "9000", "-n", "2", "-r", "1"], "error: ctx=9000 is beyond the 8192 tokens this model was "
     "trained on (output past that is unreliable); use a smaller -p or -n"),
    (["single", "-p", "8", "-n", "2", "--small", "9000", "-r", "1"], "error: ctx=9001 is beyond the 8192 tokens "
     "this model was trained on (output past that is unreliable); use a smaller --small"),      # (not -p or -n)
    (["batch", "-npp", "9000", "-ntg", "2", "-npl", "1", "-r", "1"], "error: -npp 9000 + -ntg 2 + 1 tokens are "
     "beyond the 8192 tokens this model was trained on; use a smaller -npp or -ntg"),
], ids=["single", "single-small", "batch"])
def test_context_beyond_the_trained_one_is_refused(smollm2_path, argv, says, capsys):
    """As lumen.generate refuses it (SmolLM2: 8192 tokens), at once, not after minutes of prefill."""
    from lumen.bench.cli import main
    assert main([*argv, "--model", str(smollm2_path)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == says


def test_batch_runs_one_generated_token(smollm2_path, capsys):
    """-ntg 1: the warm-up asked for 2 generated tokens, beyond the engine's max_model_len (npp + ntg + 1), and
    died with a ContextError traceback before the first repetition."""
    from lumen.bench.cli import main
    assert main(["batch", "--model", str(smollm2_path), "-npp", "4", "-ntg", "1", "-npl", "1,2", "-r", "1",
                 "-t", "1"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "npp 4, ntg 1" in out, err


def test_batch_runs_on_a_model_with_padded_embedding_rows(qwen05_path, capsys):
    """Qwen2.5's embedding has rows past its tokenizer's ids (151,936 for 151,665), which the engine refuses in a
    prompt: `bench batch -m qwen2.5-coder-1.5b`, the README's command, stopped at once with "token id 151860 is
    outside the vocabulary" (its random prompts were drawn up to the rows)."""
    from lumen.bench.cli import main
    assert main(["batch", "--model", str(qwen05_path), "-npp", "1100", "-ntg", "2", "-npl", "1", "-r", "1",
                 "-t", "2"]) == 0          # (1100 ids: the 1062nd of the seeded draw up to the rows is a padding row)
    out, err = capsys.readouterr()
    assert "error" not in err and "npp 1100, ntg 2" in out, err


def test_single_runs_one_token_tests(smollm2_path, capsys):
    """-p 1 -n 1 made a 2-token context, and the warm-up's 1-token prompt + 2 decodes died with a ContextError
    traceback."""
    assert bench.main(["--model", str(smollm2_path), "-p", "1", "-n", "1", "--small", "0", "-r", "1", "-t", "1"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "pp1" in out and "tg1" in out, err


def test_unknown_benchmark_is_named(capsys):
    from lumen.bench.cli import main
    assert main(["sngle", "-r", "1"]) == 2
    assert capsys.readouterr().err == ("python -m lumen.bench: unknown benchmark 'sngle'; benchmarks: single, batch, "
                                       "offline, serve, spec\n")


def test_missing_model_is_one_line_error(capsys):
    assert bench.main(["--model", "/nonexistent/model.gguf", "-p", "4", "-n", "2", "-r", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no such model file") and "Traceback" not in err


def test_load_llama_cpp_import_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    assert bench.load_llama_cpp("unused.gguf", 1, 64) is None
    assert bench.COMPARE_HINT in capsys.readouterr().err


def test_make_tests():
    names = lambda ts: [t.name for t in ts]  # noqa: E731
    assert names(bench.make_tests(512, 128, 32)) == ["pp512", "tg128", "pp32", "tg32"]
    assert names(bench.make_tests(32, 32, 32)) == ["pp32", "tg32"]
    assert names(bench.make_tests(512, 128, 0)) == ["pp512", "tg128"]


def test_run_interleaves_and_ratios():
    """Engines alternate rep by rep; ratios are of the means and the median of the paired ratios."""
    calls = []

    class Fake:
        def __init__(self, name, secs):
            self.name, self.secs, self.weight_bytes = name, secs, 1e9

        def pp(self, ids):
            calls.append((self.name, "pp"))
            return self.secs

        def tg(self, tok, n):
            calls.append((self.name, "tg"))
            return self.secs

    a, b = Fake("A", 0.5), Fake("B", 1.0)
    import numpy as np
    figs = bench.run([a, b], bench.make_tests(4, 4, 0), 2, np.arange(4), None)
    assert calls == [("A", "pp"), ("B", "pp"), ("A", "tg"), ("B", "tg")] * 2
    rows = bench.summarise(figs, [a, b])
    assert [(r["test"], r["unit"]) for r in rows] == [("pp4", "t/s"), ("tg4", "t/s"), ("tg4", "GB/s")]
    for r in rows:
        assert r["ratio"] == pytest.approx(2.0) and r["ratio_median_paired"] == pytest.approx(2.0)
    assert rows[2]["A"]["mean"] == pytest.approx(8.0)  # 4 tokens / 0.5 s x 1 GB


# ---- the benchmark gates (tests/benchmarks): one baseline per CPU, never another CPU's

def test_gate_baselines_are_per_cpu():
    """baseline.json maps CPU keys to entries, each with its cases and the CPU it was written on."""
    data = json.loads((ROOT / "tests" / "benchmarks" / "baseline.json").read_text())
    assert set(data) == {"cpus"} and data["cpus"]
    for key, entry in data["cpus"].items():
        cpu = entry["meta"]["cpu"]
        assert key == f"{cpu['model']} | {cpu['id']} | {cpu['cpus']} CPUs | {' '.join(cpu['isa']) or 'no AVX2'}"
        assert cpu["id"].startswith(("family ", "implementer ")), key     # not the name alone (Zen 4 / Zen 5)
        assert entry["cases"] and all("k_ref" in c and c["norm"] > 0 for c in entry["cases"].values())


def test_gates_skip_a_cpu_without_baseline():
    """On a CPU with no baseline the smoke pass measures nothing and says so, with the command that records one
    (LUMEN_BENCH_CPU stands in for another CPU here)."""
    env = dict(os.environ, LUMEN_BENCH_SMOKE="1", LUMEN_BENCH_CPU="Some Other CPU | 2 CPUs | avx2 fma")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/benchmarks"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "passed" not in r.stdout and "failed" not in r.stdout
    assert "NOT GATED" in r.stdout and "no baseline in baseline.json for LUMEN_BENCH_CPU (Some Other CPU" in r.stdout
    assert "LUMEN_BENCH=1 LUMEN_BENCH_WRITE=1 python -m pytest -q tests/benchmarks" in r.stdout
    assert "bringing up nodes" not in r.stdout, "the gates ran under xdist workers"


def test_gates_print_their_summary_in_one_process():
    """A gated case's figures reach the summary table: the gates run in the pytest process itself, not in an
    xdist worker (addopts' -n 2), whose results the summary never saw. One small case, gated against the
    committed entry whatever this CPU is (pass or fail does not matter here). And a matmul case through matvec,
    whose recorded calls include an inlined dispatcher (act_rows), which the replay loop once failed to compile."""
    key = next(iter(json.loads((ROOT / "tests" / "benchmarks" / "baseline.json").read_text())["cpus"]))
    env = dict(os.environ, LUMEN_BENCH_SMOKE="1", LUMEN_BENCH_CPU=key)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/benchmarks",
                        "-k", "(attention and decode and ctx1024) or (ffn_up and N1)"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert "bringing up nodes" not in r.stdout, r.stdout[-3000:]
    assert f"gated against the baseline of LUMEN_BENCH_CPU: '{key}'" in r.stdout, r.stdout[-3000:]
    errors = [line for line in r.stdout.splitlines()         # a gate's verdict may fail (a busy host); nothing else
              if "Error" in line and "slower than baseline" not in line and not line.endswith(": AssertionError")]
    assert not errors, r.stdout[-3000:]
    for case in ("attention-gemma3-270m-H4x1-D256-decode-ctx1024 ", "matmul-smollm2-135m-Q4_1-ffn_up-1536x576-N1 "):
        assert case in r.stdout, r.stdout[-3000:]


SMALL = {"single": ["-p", "2", "-n", "2", "-r", "1", "--small", "0"], "batch": ["-npp", "2", "-ntg", "2", "-npl", "1",
         "-r", "1"], "spec": ["-n", "2", "-r", "1", "--prompts-per-kind", "1", "--kinds", "chat"],
         "serve": ["--serve-model", "smollm2-135m", "--num-prompts", "1"]}
TOOLS = {"single": ("--llama-bench", "LLAMA_BENCH"), "batch": ("--llama-batched-bench", "LLAMA_BATCHED_BENCH"),
         "spec": ("--llama-lookup", None), "serve": ("--llama-server", "LLAMA_SERVER")}


def _tool_error(argv, monkeypatch, capsys, env=None) -> str:
    """The one error line (and nothing else) of `lumen.bench ARGV` (SMALL shapes, so a run that went on would be short), exit 2."""
    from lumen.bench.cli import main
    for var in ("LLAMA_BENCH", "LLAMA_BATCHED_BENCH", "LLAMA_SERVER"):
        monkeypatch.delenv(var, raising=False)
    for var, value in (env or {}).items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as e:
        main([*argv, *SMALL[argv[0]], "-t", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("python -m lumen.bench "), err
    return err


@pytest.mark.parametrize("sub", list(TOOLS))
@pytest.mark.parametrize("what", ["missing", "not executable", "a directory", "not on PATH"])
def test_a_wrong_llama_tool_path_is_a_usage_error_before_any_work(sub, what, tmp_path, monkeypatch, capsys):
    """`batch --llama-batched-bench /wrong/path` went on with Lumen alone; every bench's tool flag now refuses a
    path that is not an executable file, at once, naming it."""
    path = {"missing": str(tmp_path / "no-such-binary"), "not executable": str(tmp_path / "plain"),
            "a directory": str(tmp_path), "not on PATH": "no-such-llama-tool"}[what]
    (tmp_path / "plain").write_text("#!/bin/sh\n")
    flag = TOOLS[sub][0]
    line = _tool_error([sub, flag, path], monkeypatch, capsys)
    assert f"{flag} {path}: " in line, line
    assert ("does not exist" if what == "missing" else "is not on $PATH" if what == "not on PATH" else
            "is not an executable file") in line, line


@pytest.mark.parametrize("sub", ["single", "batch", "serve"])
def test_a_wrong_llama_tool_in_the_environment_is_a_usage_error(sub, tmp_path, monkeypatch, capsys):
    """$LLAMA_SERVER naming nothing fell back to llama-server on $PATH; $LLAMA_BATCHED_BENCH to Lumen alone."""
    flag, var = TOOLS[sub]
    line = _tool_error([sub, "--compare", "llama.cpp"], monkeypatch, capsys, {var: str(tmp_path / "nothing")})
    assert f"${var} {tmp_path / 'nothing'}: does not exist" in line, line


def test_batch_compare_without_the_tool_anywhere_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    line = _tool_error(["batch", "--compare", "llama.cpp"], monkeypatch, capsys)
    assert "llama-batched-bench not found: give --llama-batched-bench PATH" in line, line


def test_a_tool_given_by_name_is_found_on_path(tmp_path, monkeypatch):
    from lumen.bench.tools import find_tool
    tool = tmp_path / "llama-bench"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    assert find_tool("llama-bench", "--llama-bench", "llama-bench", "LLAMA_BENCH") == str(tool)
    assert find_tool("llama-bench", "--llama-bench", None, "LLAMA_BENCH") == str(tool)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert find_tool("llama-bench", "--llama-bench", None, "LLAMA_BENCH") is None


@pytest.mark.parametrize("sub, flag", [("batch", "--llama-args"), ("single", "--llama-args"), ("spec", "--llama-args"),
                                       ("serve", "--llama-args"), ("serve", "--serve-args")])
def test_pass_through_flags_take_a_value_that_starts_with_a_dash(sub, flag, capsys):
    """`--llama-args "-nr"`, as the help's example writes it: argparse took "-nr" for an option of its own and
    said "expected one argument". The value is passed on; the usage error met next is another flag's."""
    from lumen.bench.cli import main
    bad = {"batch": ["-npl", "0"], "single": ["-r", "0"], "spec": ["-r", "0"], "serve": ["--num-prompts", "0"]}[sub]
    with pytest.raises(SystemExit) as e:
        main([sub, flag, "-nr", *bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "expected one argument" not in err, err


@pytest.mark.parametrize("argv, msg", [
    (["--url", "notaurl"], "--url notaurl: give the server's base URL, e.g. http://127.0.0.1:8000"),
    (["--url", "127.0.0.1:8000"], "give the server's base URL"),
])
def test_serve_names_a_bad_url_or_model_before_it_starts(argv, msg, capsys):
    """They were "error: UnsupportedProtocol: Request URL is missing an 'http://' ..." and "error: FetchError: ..."
    after the run had begun."""
    from lumen.bench.serve import main
    with pytest.raises(SystemExit) as e:
        main([*argv, "--num-prompts", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "Traceback" not in err, err


def test_serve_says_why_the_server_it_started_ended(tmp_path, capsys, monkeypatch):
    """A server started here that exits before it comes up: its own error, without Python's "RuntimeError: ", and
    where its whole log is kept."""
    import tempfile
    from lumen.bench.serve import main
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"root:x:0:0" * 10)
    assert main(["--serve-model", str(bad), "--num-prompts", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: Lumen exited (1) before it came up: ") and "not a GGUF file" in err, err
    log = err.rsplit("(log: ", 1)[1].split(")")[0]
    assert Path(log).parent == tmp_path and "not a GGUF file" in Path(log).read_text()


@pytest.mark.parametrize("pieces, measured", [(1, False), (63, True)])
def test_tool_calling_tpot_is_not_measured_from_one_piece(pieces, measured, monkeypatch):
    """profiling/tool_calling.py: under "auto" the server holds back an answer that starts like a tool call and
    sends its 64 tokens in one piece; the TPOT of that is not 0 ms (it was, and the verdict read "0.00x")."""
    import math

    import httpx
    monkeypatch.syspath_prepend(str(ROOT / "profiling"))
    import tool_calling

    def handler(request):
        head = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}
        text = [{"choices": [{"index": 0, "delta": {"content": "x"}}]} for _ in range(pieces)]
        usage = {"choices": [], "usage": {"completion_tokens": 64}}
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in [head, *text, usage]) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    real = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    t = tool_calling.tpot("http://test", tool_calling.TOOLS, "auto")
    assert math.isnan(t) != measured and (not measured or t >= 0)
    assert tool_calling.ratio(t, 0.02).startswith("not measured") != measured


@pytest.mark.parametrize("kind", ["sleep", "busy"])
def test_corunner_ends_with_a_benchmark_that_was_killed(kind):
    """A benchmark killed inside a --corunner block (SIGKILL, SIGTERM: no finally runs) left its co-runner
    spinning for up to an hour (run_beside's bound); the co-runner now ends once its benchmark's process is gone."""
    import time
    code = ("import os, sys\nfrom lumen.bench.corunner import corunner\n"
            f"with corunner({kind!r}, seconds=3600) as p:\n    print(p.pid, flush=True)\n    os._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                       timeout=60, cwd=ROOT)     # the co-runner holds the inherited stderr open while it lives
    pid = int(r.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)
    alive = Path(f"/proc/{pid}").exists()
    if alive:
        os.kill(pid, 9)
    assert not alive, f"the {kind} co-runner outlived its benchmark"


def test_a_server_that_printed_nothing_is_said_so():
    """A server that exits at once and silently (here /bin/false as llama-server): the error said "before it came
    up:  (log: ...)", an empty reason."""
    from lumen.bench.launch import Server
    s = Server("llama.cpp", ["/bin/false"])
    with pytest.raises(RuntimeError) as e:
        s.start(timeout=30)
    s.log.unlink()
    assert str(e.value).startswith("llama.cpp exited (1) before it came up: it printed nothing (log: "), str(e.value)


def test_a_llama_tool_that_printed_nothing_is_said_so(smollm2_path):
    """--llama-bench / --llama-batched-bench / --llama-lookup /bin/false said "failed (exit 1): " and no reason."""
    from lumen.bench import batch, spec
    from lumen.bench.single import LlamaBenchEngine
    runs = [lambda: LlamaBenchEngine("/bin/false", smollm2_path, 1, [], 10).tg(1, 2),
            lambda: batch.run_llama("/bin/false", str(smollm2_path), 4, 2, [1], 1, []),
            lambda: spec.run_llama("/bin/false", str(smollm2_path), "hi", 2, 1, None, [])]
    for run in runs:
        with pytest.raises(RuntimeError) as e:
            run()
        assert str(e.value).endswith("1): it printed nothing"), str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["batch", "-npl", "1,2,"], "-npl '1,2,' has an empty item"),
    (["batch", "--corunner", "busy,"], "--corunner 'busy,' has an empty item"),
    (["single", "--corunner", "sleep,,busy"], "--corunner 'sleep,,busy' has an empty item"),
    (["spec", "--kinds", "completion,"], "--kinds 'completion,' has an empty item"),
    (["serve", "--concurrency", "1,,4"], "--concurrency '1,,4' has an empty item"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_list_flag_refuses_an_empty_item(argv, message, capsys):
    """`-npl 1,2,` ran levels 1 and 2, and `--kinds completion,` one kind, as if the typo were not there."""
    from lumen.bench.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1, err


def test_a_bare_tool_name_in_this_directory_says_to_write_dot_slash(tmp_path, monkeypatch):
    """`cd build/bin; ... --llama-bench llama-bench` said only "is not on $PATH" of a file the user could see."""
    from lumen.bench.tools import ToolNotFound, find_tool
    (tmp_path / "llama-bench").write_text("#!/bin/sh\n")
    (tmp_path / "llama-bench").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ToolNotFound, match=r"^--llama-bench llama-bench: is not on \$PATH; the file in this directory "
                                           r"is \./llama-bench \(give the path"):
        find_tool("llama-bench", "--llama-bench", "llama-bench")
    assert find_tool("llama-bench", "--llama-bench", "./llama-bench") == "./llama-bench"
    with pytest.raises(ToolNotFound, match=r"^--llama-bench nothing: is not on \$PATH \(give the path"):
        find_tool("llama-bench", "--llama-bench", "nothing")


@pytest.mark.parametrize("sub", ["batch", "serve"])
def test_a_missing_tool_points_to_a_help_that_says_how_to_build_it(sub, monkeypatch, capsys):
    """batch's "llama-batched-bench not found ... (how to build it: python -m lumen.bench batch --help)" pointed
    to a --help without a word on building it (the steps were in the module's docstring only)."""
    monkeypatch.setenv("PATH", "/nonexistent")
    line = _tool_error([sub, "--compare", "llama.cpp"], monkeypatch, capsys)
    command = re.search(r"how to build it: python -m lumen\.bench (\w+) --help", line)
    assert command and command.group(1) == sub, line
    from lumen.bench.cli import main
    with pytest.raises(SystemExit):
        main([sub, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "cmake --build build" in text and "llama-cpp-python==0.3.36" in text, text[-600:]
    # the build the README gives: the extensions /proc/cpuinfo reports, never AMX (a native build dies with SIGILL
    # where the OS does not grant AMX), not a native one with -nr as the way out (the help once said so)
    assert "-DGGML_NATIVE=OFF" in text and "-DGGML_AMX_INT8=OFF" in text and "-nr (--no-repack) only" not in text


def test_the_help_builds_llama_cpp_as_the_readme_does():
    from lumen.bench.tools import BUILD_LLAMA
    readme = (Path(__file__).parents[2] / "lumen" / "bench" / "README.md").read_text()
    for line in BUILD_LLAMA.splitlines()[1:-1]:        # the configure step, flag by flag
        assert line.strip() in readme, line
