"""llama-batched-bench-style throughput of the engine: npl sequences, each npp prompt tokens then ntg generated.

    python -m lumen.bench batch --model smollm2-135m -npp 128 -ntg 128 -npl 1,2,4,8,16 [-t T] [-r R] [--json F]
        [--compare llama.cpp [--llama-batched-bench PATH]] [--corunner sleep,busy] [--fixed-threads]

Per parallel level npl (each repeated r times, medians reported), as llama-batched-bench measures it:
    PP  the npl prompts (distinct fixed pseudo-random ids, npp each) prefilled in one engine step:
        prompt t/s = npl * npp / T_PP
    TG  ntg engine steps that each decode one token of every sequence: aggregate generation t/s = npl * ntg / T_TG,
        and the step time T_TG / ntg
The engine runs with max_num_seqs = npl, a token budget of npl * npp (so the prompts are one step and the decode
steps are pure), greedy sampling, EOS ignored, and no prefix caching (every prompt is distinct anyway).

--corunner sleep,busy runs every repetition idle and beside each co-runner in turn (lumen.bench.corunner) and
prints each engine's gen t/s beside each, with its ratio to the same engine's idle figure in the same repetition.

--compare llama.cpp runs llama.cpp's own `llama-batched-bench` on the same GGUF, shapes and thread count
(-b 2048 -ub 512 and its defaults otherwise), interleaved with Lumen repetition by repetition. The binary comes
from --llama-batched-bench PATH, $LLAMA_BATCHED_BENCH, or PATH (a given path that is not an executable file, or
no binary at all, is a usage error). `--llama-args` passes extra flags to it. How to build llama.cpp's tools
(with its weight repacking, its default and fastest path, left on; cmake and a C++ compiler needed):
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

from .corunner import corunner, parse_kinds, ratio_rows, render_ratios
from .single import peak_rss_mb, token_ids
from .tools import BUILD_LLAMA, ToolNotFound, comma_list, find_tool, refuse, split_args
from ..commands import Parser, check_writable, prog, threads_error
from ..engine.config import THREAD_FLAGS, EngineConfig, available_mb


# Seconds of rest between the two engines' blocks, both ways. Lumen's one-sequence decode right after
# llama-batched-bench's process exits ran 28.0 ms a step against 21.4-21.7 alone or after this rest (the exiting
# process's gigabyte of repacked weights is still being freed while the next block streams its own weights).
SETTLE_ENGINES_S = 3.0


def memory_needed(cfg, kv_bytes: int, npp: int, npl: int) -> int:
    """Bytes the run writes, at the least: the KV pool (kv_bytes, every block filled by the last decode step), the
    activations of one prefill step of npl * npp tokens (lumen.engine.runner.make_scratch's per-token buffers) and
    a row of logits per sequence."""
    E, F = cfg.n_embd, cfg.n_ff
    q, kv, att = cfg.n_head * cfg.head_dim, cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v), cfg.n_head * cfg.head_dim_v
    per_token = 4 * (2 * E + q + kv + att + 2 * F) + 5 * max(E, F, att)
    return kv_bytes + npl * npp * per_token + 4 * npl * cfg.n_vocab


def memory_error(cfg, kv_bytes: int, npp: int, npl: int, available_mb: float | None) -> str | None:
    """Why -npl sequences of -npp prompt tokens cannot run here: more memory than is available (the run was
    killed by the kernel's OOM killer, -npl 100000), else None. Unknown available memory: None."""
    need = memory_needed(cfg, kv_bytes, npp, npl)
    if available_mb is None or need <= available_mb * 2 ** 20 * 0.9:
        return None
    return (f"-npl {npl} sequences of -npp {npp} tokens need about {need / 1e9:.1f} GB (the KV cache "
            f"{kv_bytes / 1e9:.1f} GB, one prefill step of {npl * npp} tokens the rest), more than the "
            f"{available_mb * 2 ** 20 / 1e9:.1f} GB available; use a smaller -npl or -npp")


def run_lumen(engine, npp: int, ntg: int, npl: int, ids: np.ndarray) -> dict:
    """One repetition at one parallel level: {t_pp, t_tg} seconds."""
    from ..engine.sampling.params import SamplingParams
    params = SamplingParams(max_tokens=ntg + 1, temperature=0, ignore_eos=True)
    rids = [engine.add_request(ids[i * npp:(i + 1) * npp].tolist(), params) for i in range(npl)]
    t0 = time.perf_counter()
    first = engine.step()
    t1 = time.perf_counter()
    if len(first) != npl:
        raise RuntimeError(f"the prefill step gave {len(first)} first tokens for {npl} sequences")
    for _ in range(ntg):
        outs = engine.step()
        if len(outs) != npl:
            raise RuntimeError(f"a decode step advanced {len(outs)} of {npl} sequences")
    t2 = time.perf_counter()
    if engine.has_unfinished():
        raise RuntimeError("sequences were left unfinished")
    del rids
    return {"t_pp": t1 - t0, "t_tg": t2 - t1}


def find_llama_batched_bench(path: str | None) -> str | None:
    """llama-batched-bench: path, else $LLAMA_BATCHED_BENCH, else on $PATH (None); a wrong given path raises
    ToolNotFound."""
    return find_tool("llama-batched-bench", "--llama-batched-bench", path, "LLAMA_BATCHED_BENCH")


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
                  r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|")


def run_llama(binary: str, model: str, npp: int, ntg: int, levels: list[int], threads: int, extra: list[str]
              ) -> dict[int, dict]:
    """One run of llama-batched-bench over all levels: {npl: {t_pp, t_tg}} parsed from its table."""
    ctx = max(levels) * (npp + ntg) + 64
    cmd = [binary, "-m", model, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(ntg),
           "-npl", ",".join(map(str, levels)), "-t", str(threads), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({r.returncode}): {r.stderr.strip()[-500:] or 'it printed nothing'}")
    out = {}
    for line in r.stdout.splitlines() + r.stderr.splitlines():
        m = _ROW.match(line.strip())
        if m:
            pp, tg, b = int(m.group(1)), int(m.group(2)), int(m.group(3))
            if pp == npp and tg == ntg:
                out[b] = {"t_pp": float(m.group(5)), "t_tg": float(m.group(7))}
    missing = [b for b in levels if b not in out]
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no row for npl {missing}")
    return out


def figures(t: dict, npp: int, ntg: int, npl: int) -> dict:
    return {"pp_tps": npl * npp / t["t_pp"], "tg_tps": npl * ntg / t["t_tg"], "step_ms": t["t_tg"] / ntg * 1e3,
            "t_pp": t["t_pp"], "t_tg": t["t_tg"]}


def _median(reps: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in reps) for k in reps[0]}


def _parser() -> argparse.ArgumentParser:
    ap = Parser(prog=prog("bench batch"), description=__doc__.splitlines()[0],   # (the not-found error points here)
                epilog=__doc__[__doc__.index("--compare llama.cpp runs"):].strip() + "\n" + BUILD_LLAMA,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2-135m", help="registry name or .gguf path")
    ap.add_argument("-npp", type=int, default=128, help="prompt tokens per sequence (default 128)")
    ap.add_argument("-ntg", type=int, default=128, help="generated tokens per sequence (default 128)")
    ap.add_argument("-npl", default="1,2,4,8,16", help="parallel levels, comma-separated (default 1,2,4,8,16)")
    ap.add_argument("-r", "--repetitions", type=int, default=3, help="repetitions (default 3; medians)")
    ap.add_argument("--json", metavar="FILE", help="write every figure, per repetition, to FILE")
    ap.add_argument("--compare", choices=["llama.cpp"], help="also run llama-batched-bench, interleaved")
    ap.add_argument("--llama-batched-bench", metavar="PATH",
                    help="the llama-batched-bench binary (implies --compare; default $LLAMA_BATCHED_BENCH, else on "
                         "$PATH)")
    ap.add_argument("--llama-args", default="", help="extra arguments for llama-batched-bench (e.g. \"-nr\")")
    ap.add_argument("--corunner", metavar="KINDS", default=None,
                    help="also measure beside co-runners (sleep, busy; comma-separated), every repetition "
                         "interleaved with the idle one, and print each engine's ratio to its own idle figure")
    EngineConfig.add_cli_args(ap, only=THREAD_FLAGS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    extra = split_args(ap, "--llama-args", args.llama_args)
    try:
        items = comma_list("-npl", args.npl)
    except ValueError as e:
        ap.error(str(e))
    try:
        levels = sorted({int(x) for x in items})
    except ValueError:
        ap.error(f"-npl takes comma-separated integers, got {args.npl!r}")
    for flag, v in (("-npp", args.npp), ("-ntg", args.ntg), ("-r", args.repetitions)):
        if v < 1:
            ap.error(f"{flag} must be at least 1, got {v}")
    if not levels or levels[0] < 1:
        ap.error(f"-npl levels must be positive, got {args.npl!r}")
    try:
        kinds = parse_kinds(args.corunner)
    except ValueError as e:
        ap.error(str(e))
    if args.json and (why := check_writable(args.json, "the JSON")):      # before the run, not after it
        ap.error(why)
    if why := threads_error(args.threads):
        ap.error(why)
    binary = None
    if args.compare or args.llama_batched_bench:
        try:
            binary = find_llama_batched_bench(args.llama_batched_bench)
        except ToolNotFound as e:
            refuse(ap, str(e))
        if binary is None:
            refuse(ap, "llama-batched-bench not found: give --llama-batched-bench PATH or set $LLAMA_BATCHED_BENCH "
                     f"(how to build it: {prog('bench batch')} --help)")
    from rich.console import Console
    from rich.table import Table

    from .. import Engine, load
    from ..errors import LumenError
    from ..model.store import resolve
    try:
        path = resolve(args.model)
        model = load(path, ctx=64, threads=args.threads, adaptive_threads=args.adaptive_threads)
        if args.npp + args.ntg + 1 > model.config.ctx_train:     # as lumen.generate refuses it
            raise LumenError(f"-npp {args.npp} + -ntg {args.ntg} + 1 tokens are beyond the {model.config.ctx_train} "
                             "tokens this model was trained on; use a smaller -npp or -ntg")
        top = levels[-1]
        per_block = model.runner.kv_bytes_per_block
        blocks = top * (-(-(args.npp + args.ntg + 1) // 16)) + 1
        if why := memory_error(model.config, blocks * per_block, args.npp, top, available_mb()):
            raise LumenError(why)
        engine = Engine(model, max_model_len=args.npp + args.ntg + 1, max_num_seqs=top,
                        max_num_batched_tokens=top * args.npp, kv_cache_mb=blocks * per_block / 2 ** 20,
                        enable_prefix_caching=False, adaptive_threads=args.adaptive_threads)
    except (LumenError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from ..engine.admission import prompt_id_end
    ids = token_ids(prompt_id_end(model.tokenizer, model.config.n_vocab), top * args.npp)
    try:                          # warm-up: compile / load the kernels, at a shape within max_model_len (-ntg 1)
        run_lumen(engine, min(args.npp, 8), min(args.ntg, 2), 1, ids)
    except (LumenError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    engines = ["Lumen", "llama.cpp"] if binary else ["Lumen"]
    beside = {k: {e: {b: [] for b in levels} for e in engines} for k in ["none", *kinds]}
    reps = beside["none"]
    for r in range(args.repetitions):
        for kind in ["none", *kinds]:                      # idle, then beside each co-runner, every repetition
            with corunner(kind, seconds=3600):
                for b in levels:
                    try:
                        got = run_lumen(engine, args.npp, args.ntg, b, ids)
                    except (LumenError, RuntimeError) as e:
                        print(f"error: {e}", file=sys.stderr)
                        return 1
                    beside[kind]["Lumen"][b].append(figures(got, args.npp, args.ntg, b))
                if binary:
                    time.sleep(SETTLE_ENGINES_S)
                    try:
                        got = run_llama(binary, str(path), args.npp, args.ntg, levels, model.threads, extra)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        print(f"error: {e}", file=sys.stderr)
                        return 1
                    for b in levels:
                        beside[kind]["llama.cpp"][b].append(figures(got[b], args.npp, args.ntg, b))
                    time.sleep(SETTLE_ENGINES_S)
        if sys.stderr.isatty():
            print(f"\rrep {r + 1}/{args.repetitions} done  ", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    med = {eng: {b: _median(v) for b, v in per.items()} for eng, per in reps.items()}
    t = Table(title=f"{model.config.name or path.name}: npp {args.npp}, ntg {args.ntg}, {model.threads} threads, "
                    f"medians of {args.repetitions}")
    for col in ("npl", "engine", "prompt t/s", "gen t/s", "step ms", "gen vs npl=1"):
        t.add_column(col, justify="right")
    for b in levels:
        for eng in med:
            f = med[eng][b]
            base = med[eng][levels[0]]["tg_tps"] if levels[0] == 1 else None
            ratio = "" if base is None else f"{f['tg_tps'] / base:.2f}x"
            if eng != "Lumen":
                ratio += f"  (Lumen {med['Lumen'][b]['tg_tps'] / f['tg_tps']:.2f}x)"
            t.add_row(str(b), eng, f"{f['pp_tps']:.1f}", f"{f['tg_tps']:.1f}", f"{f['step_ms']:.2f}", ratio)
    console = Console()
    console.print(t)
    ratios = []
    if kinds:
        values = {k: {(f"gen t/s npl={b}", e): [x["tg_tps"] for x in beside[k][e][b]] for e in engines
                      for b in levels} for k in beside}
        ratios = ratio_rows(values, kinds)
        render_ratios(ratios, console, f"beside co-runners, {model.threads} threads, {args.repetitions} reps "
                                       f"(load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    if args.json:
        try:                                             # (checked before the run; a read-only mount, a full disk)
            with open(args.json, "w") as fh:
                json.dump({"model": str(path), "npp": args.npp, "ntg": args.ntg, "threads": model.threads,
                           "levels": levels, "repetitions": reps, "medians": med, "rss_mb": peak_rss_mb(),
                           "corunners": ratios}, fh, indent=1)
        except OSError as e:
            print(f"error: cannot write the JSON to {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0
