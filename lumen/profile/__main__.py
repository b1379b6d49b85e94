"""Profile Lumen on this machine: `python -m lumen.profile [MODE] ...`, one parser for every mode (MODES below).

    python -m lumen.profile --machine [--remeasure] [--json F|-]  # this machine's limits (measured once, cached)
    python -m lumen.profile --model smollm2-135m --prompt-tokens 512 --gen-tokens 128 \\
        [--threads T] [--json F.json] [--plot F.png] [--phase prefill|decode] [--op NAME] [--layer N]
    python -m lumen.profile --model M --overhead [--repeats 5] [--json F]   # decode tok/s: timers off / out / on
    python -m lumen.profile --engine --model M [--max-num-batched-tokens N] [--max-num-seqs S] [--tiny] [--plot F]
    python -m lumen.profile --serving FILE [--json F] [--plot F.png]    # a serving profile (lumen.serve --profile)

--engine and --serving are lumen/profile/serving_cli.py; the rest is this file.

The prompt is exactly --prompt-tokens tokens (a fixed text's tokens repeated, BOS first when the model adds one);
generation is greedy. A warm-up generate (JIT compile) runs before the profiled one and is not reported.

Tables: per op type and phase (calls, ms, share of the phase's wall time, us/call, GB/s, GFLOP/s, FLOP/byte, what
bounds it and its share of its roofline bound = min(peak, intensity x bandwidth), with the int8 dot peak
(vpdpbusd, measured by lumen.machine) for the matmuls and the f32 FMA peak for the rest, and a note explaining any
op above its roof); the bytes a decode step reads against the model's GGUF tensor bytes; ms per layer and phase;
the per-decode-step Python/dispatch overhead; per-step coverage. --phase/--op/--layer restrict the tables to those
records. The numbers, tables and plots are lumen/profile/report.py.

--json F writes the profiler's steps and records plus the summary tables and machine limits. --plot F.png writes
two PNGs: F.png, the roofline (a panel per phase, a point per op type with its own marker and colour, the memory,
int8 dot and f32 FMA roofs with their measured values), and F-ops.png (F's stem + "-ops"), the time per token of
each op, stacked, for prefill and decode.

Not imported by the package (lumen.profile is the profiler context manager, lumen/__init__.py); run with -m.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from lumen.errors import LumenError
from lumen.model.store import DEFAULT_MODEL
from lumen.profile.report import GLUE, PHASES, ops_png, plot, print_machine, print_report, summarize
from ..commands import Parser, check_writable, prog, threads_error, trained_context_only
from ..engine.config import EngineConfig

TEXT = ("The history of the city begins with a small settlement on the river, where traders met to exchange "
        "grain, salt and cloth. Over the centuries it grew into a busy port, and its markets drew merchants from "
        "distant lands who brought new languages, foods and ideas with them.")


MODES = """modes (one at a time; without one, a profiled generate run):
  (default)       profile a generate run op by op: --model, --prompt-tokens,
                  --gen-tokens, --threads, --phase/--op/--layer, --json, --plot
  --machine       this machine's measured limits (measured once, cached;
                  --remeasure measures again); --json (--json -: the limits as
                  JSON on stdout, instead of the table)
  --overhead      decode tok/s with the timers off, compiled out
                  (LUMEN_TIMERS=0) and on: --repeats, --json
  --engine        the engine's measured step costs and their fit:
                  --max-num-batched-tokens, --max-num-seqs, --max-model-len,
                  --tiny, --remeasure, --json, --plot (the cost surface)
  --serving FILE  the report of a serving profile written by
                  `lumen.serve --profile FILE`: TTFT and ITL p50/p99 and what
                  they are made of; --json, --plot
"""
# Options of one mode only (dest -> its default); giving one with another mode is an error.
RUN_ONLY = {"prompt_tokens": 512, "gen_tokens": 128, "phase": None, "op": None, "layer": None}
ENGINE_ONLY = {"max_num_batched_tokens": 2048, "max_num_seqs": 32, "max_model_len": 2048, "tiny": False}
OVERHEAD_ONLY = {"repeats": 5}


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog=prog("profile"), formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s [MODE] [OPTIONS]   (modes: see below)",
                                 description="Profile Lumen on this machine: a generate run op by op against the\n"
                                             "roofline, the machine's limits, the timers' overhead, the engine's\n"
                                             "step costs, or a server's serving profile.",
                                 epilog=MODES)
    mode = ap.add_argument_group("mode").add_mutually_exclusive_group()
    mode.add_argument("--machine", action="store_true", help="print this machine's measured limits and exit")
    mode.add_argument("--overhead", action="store_true",
                      help="measure decode tok/s with the timers off, compiled out (LUMEN_TIMERS=0) and on")
    mode.add_argument("--engine", action="store_true",
                      help="measure (or read from $LUMEN_HOME/costs) the engine's step costs, print the table and the "
                           "fitted model t = f + b max(0, T - T*) + c S + d K")
    mode.add_argument("--serving", metavar="FILE",
                      help="report a serving profile written by `python -m lumen.serve --profile FILE`")
    mode.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # --overhead's compiled-out process
    common = ap.add_argument_group("common options")
    common.add_argument("--model", "-m", default=DEFAULT_MODEL, help="registry name or path to a .gguf file")
    EngineConfig.add_cli_args(common, only=("threads",))
    common.add_argument("--remeasure", action="store_true",
                        help="measure again instead of reading the cache (machine limits; --engine: the step costs)")
    common.add_argument("--json", metavar="F", help="write the run's records and summary, the limits (--machine), "
                                                     "the tok/s (--overhead), the table or the report as JSON to F")
    common.add_argument("--plot", metavar="F.png", help="a run: the roofline to F.png and the op times to F-ops.png; "
                                                         "--engine: the cost surface; --serving: the time split")
    run = ap.add_argument_group("a profiled run (the default mode)")
    run.add_argument("--prompt-tokens", type=int, help="prompt length in tokens (default 512)")
    run.add_argument("--gen-tokens", type=int, help="tokens to generate (default 128; --overhead too)")
    run.add_argument("--phase", help="report only this phase (prefill or decode)")
    run.add_argument("--op", help="report only this op (e.g. attention, down, sample)")
    run.add_argument("--layer", type=int, help="report only this layer (-1: ops outside the layer stack)")
    over = ap.add_argument_group("--overhead")
    over.add_argument("--repeats", type=int, help="repeats of each --overhead variant (default 5)")
    eng = ap.add_argument_group("--engine")
    eng.add_argument("--max-num-batched-tokens", type=int, help="the engine's token budget per step (default 2048)")
    eng.add_argument("--max-num-seqs", type=int, help="sequences per step (default 32)")
    eng.add_argument("--max-model-len", type=int, help="the engine's context (default 2048)")
    eng.add_argument("--tiny", action="store_true", default=None, help="a 5-shape grid (tests)")
    return ap


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace, str]:
    """The arguments and the mode ("run", "machine", "overhead", "engine", "serving", "worker"); an option of
    another mode is an error. Mode options left out get their defaults."""
    ap = build_parser()
    args = ap.parse_args(argv)
    mode = next((m for m in ("machine", "overhead", "engine", "serving", "worker") if getattr(args, m)), "run")
    allowed = {"run": RUN_ONLY, "worker": RUN_ONLY, "machine": {}, "serving": {},
               "overhead": {**OVERHEAD_ONLY, "prompt_tokens": 512, "gen_tokens": 128}, "engine": ENGINE_ONLY}[mode]
    for dest, default in {**RUN_ONLY, **ENGINE_ONLY, **OVERHEAD_ONLY}.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        elif dest not in allowed:
            flag = "--" + dest.replace("_", "-")
            ap.error(f"{flag} does not go with {'a profiled run' if mode == 'run' else '--' + mode}")
    if mode in ("machine", "serving"):
        given = [f for f, on in (("--model", args.model != DEFAULT_MODEL), ("--threads", args.threads is not None))
                 if on]
        if given:
            ap.error(f"{given[0]} does not go with --{mode}")
    return ap, args, mode


# ---- inputs ----
def make_prompt(model, n: int) -> list[int]:
    """Exactly n token ids: BOS (when the model adds one) and TEXT's tokens repeated."""
    head = model.tokenize(TEXT)
    body = model.tokenize(TEXT, add_bos=False)
    bos = head[:len(head) - len(body)] if head[len(head) - len(body):] == body else []
    ids = list(bos)
    while len(ids) < n:
        ids.extend(body)
    return ids[:n]


def model_bytes(model) -> dict:
    """The model's data as the profile counts it: its GGUF tensors' bytes; the packed weights a forward step reads
    (every matrix once, and an embedding row per token: lumen/profile/costs.py's weight bytes); the KV cache
    allocated; attention's f32 query and output rows per token and layer (costs.py counts them with its KV reads)."""
    from lumen.model.forward import MATS
    from lumen.kernels.layout import matrix_nbytes
    w, c = model.runner.w, model.config
    mats = [int(i) for name in MATS for i in getattr(w, name)] + [int(w.output)]
    return {"gguf_tensor_bytes": sum(t.nbytes for t in model.gguf.tensors.values()),
            "matrix_bytes": sum(matrix_nbytes(w.packs.table[i]) for i in mats),
            "embed_row_bytes": int(w.token_embd.shape[1]),
            "kv_cache_bytes": sum(a.nbytes for a in model.runner.kv), "n_layer": c.n_layer,
            "attn_act_bytes": 4 * (c.q_dim + c.n_head * c.head_dim_v)}


# ---- the run ----
def profiled_run(model, prompt_tokens: int, gen_tokens: int):
    import lumen
    from lumen.engine.sequence import RequestMetrics
    model.warmup()
    for _ in model.generate(make_prompt(model, min(prompt_tokens, 8)), max_tokens=2):  # warm the generate path
        pass
    ids = make_prompt(model, prompt_tokens)
    stats = RequestMetrics()
    with lumen.profile() as prof:
        for _ in model.generate(ids, max_tokens=gen_tokens, stats=stats):
            pass
    return prof, stats


# ---- overhead: timers off vs compiled out vs on ----
def _decode_tps(model, ids, gen_tokens, profiled: bool) -> float:
    import lumen
    from lumen.engine.sequence import RequestMetrics
    st = RequestMetrics()
    if profiled:
        with lumen.profile():
            for _ in model.generate(ids, max_tokens=gen_tokens, stats=st):
                pass
    else:
        for _ in model.generate(ids, max_tokens=gen_tokens, stats=st):
            pass
    return st.decode_tps


def worker(model_path: str, prompt_tokens: int, gen_tokens: int, threads: int | None) -> int:
    """--overhead's compiled-out side: one decode tok/s line per 'run' line on stdin."""
    from lumen import load
    model = load(model_path, ctx=prompt_tokens + gen_tokens + 1, threads=threads)
    ids = make_prompt(model, prompt_tokens)
    model.warmup()
    _decode_tps(model, ids, min(4, gen_tokens), False)     # (within the context: prompt + gen_tokens + 1)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(f"{_decode_tps(model, ids, gen_tokens, False):.4f}", flush=True)
    return 0


def overhead(model, model_arg: str, prompt_tokens: int, gen_tokens: int, threads: int | None, repeats: int,
             console) -> dict:
    ids = make_prompt(model, prompt_tokens)
    model.warmup()
    _decode_tps(model, ids, min(4, gen_tokens), True)      # (within the context: prompt + gen_tokens + 1)
    env = dict(os.environ, LUMEN_TIMERS="0")
    cmd = [sys.executable, "-m", "lumen.profile", "--worker", "--model", str(model.path),
           "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens)]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with console.status("starting the compiled-out process (LUMEN_TIMERS=0; compiles on first use)..."):
            if proc.stdout.readline().strip() != "ready":
                raise LumenError("the LUMEN_TIMERS=0 worker process failed to start")
        res = {"off": [], "compiled_out": [], "on": []}
        for i in range(repeats):
            res["off"].append(_decode_tps(model, ids, gen_tokens, False))
            proc.stdin.write("run\n")
            proc.stdin.flush()
            res["compiled_out"].append(float(proc.stdout.readline()))
            res["on"].append(_decode_tps(model, ids, gen_tokens, True))
            console.print(f"repeat {i + 1}/{repeats}: off {res['off'][-1]:.1f} | compiled out "
                          f"{res['compiled_out'][-1]:.1f} | on {res['on'][-1]:.1f} tok/s")
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=60)
    med = {k: statistics.median(v) for k, v in res.items()}
    out = {"tok_per_s": res, "median": med, "off_cost": 1 - med["off"] / med["compiled_out"],
           "on_cost": 1 - med["on"] / med["compiled_out"]}
    console.print(f"decode tok/s medians over {repeats}: compiled out {med['compiled_out']:.1f} | off {med['off']:.1f} "
                  f"({100 * out['off_cost']:+.1f}% cost) | on {med['on']:.1f} ({100 * out['on_cost']:+.1f}% cost)")
    return out


def no_match(prof, phase: str | None, op: str | None, layer: int | None) -> str:
    """Why the tables are empty: --phase/--op/--layer each name something recorded, but no record has them all
    (attention at --layer -1, outside the layer stack). Names what the other filters do match."""
    given = [f"--{k} {v}" for k, v in (("phase", phase), ("op", op), ("layer", layer)) if v is not None]
    where = " and ".join(f"--{k} {v}" for k, v in (("phase", phase), ("layer", layer)) if v is not None)
    if op is not None and where:
        ops = sorted({r.op for r in prof.select(phase, None, layer)})
        return (f"no records match {' '.join(given)}: {op} does not run there; ops recorded with {where}: "
                f"{', '.join(ops) or 'none'}")
    return f"no records match {' '.join(given)}"


def check_outputs(args, mode: str) -> str | None:
    """Why the --json/--plot files cannot be written, checked before any measuring (an --engine calibration takes
    minutes): a missing or unwritable directory, no matplotlib, a plot format matplotlib cannot write, or a flag the
    mode has no output for (--machine and --overhead draw nothing)."""
    if args.plot and mode in ("machine", "overhead"):
        return f"--plot does not go with --{mode} (it draws nothing; --json writes its numbers)"
    for flag, value in (("--json", args.json), ("--plot", args.plot)):
        if value is not None and not value.strip():
            return f"{flag} needs a file name, got {value!r}"
    if args.json == "-" and mode != "machine":
        return "--json - (JSON on stdout) goes with --machine only; give a file name"
    outs = [(args.json, "the JSON"), (args.plot, "the plot")]
    if args.plot and mode == "run":
        outs.append((ops_png(args.plot), "the op plot"))
    for path, what in outs:
        why = path and path != "-" and check_writable(path, what)
        if why:
            return why
    if args.plot:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            return "--plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')"
        formats = Figure().canvas.get_supported_filetypes()
        ext = Path(args.plot).suffix.lower().lstrip(".")
        if ext not in formats:
            return (f"cannot write the plot to {args.plot}: {'.' + ext if ext else 'no'} file extension; "
                    f"use one of {', '.join('.' + f for f in sorted(formats))}")
    return None


def main(argv: list[str] | None = None) -> int:
    ap, args, mode = parse(argv)
    if why := threads_error(getattr(args, "threads", None)):
        ap.error(why)
    why = check_outputs(args, mode)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if mode == "engine":                                # the engine's flags, before the model loads
        from ..engine.config import check_int
        from ..llm import MAX_CTX
        try:
            for flag, v, hi in (("--max-num-batched-tokens", args.max_num_batched_tokens, None),
                                ("--max-num-seqs", args.max_num_seqs, None),
                                ("--max-model-len", args.max_model_len, MAX_CTX)):
                check_int(flag, v, hi=hi)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if mode in ("engine", "serving"):
        from .serving_cli import engine_main, serving_main          # the engine's step costs, a serving profile
        try:
            return engine_main(args) if mode == "engine" else serving_main(args)
        except (LumenError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
    from rich.console import Console
    console = Console(highlight=False)        # in a pipe: $COLUMNS, else 80 columns
    if mode == "worker":
        return worker(args.model, args.prompt_tokens, args.gen_tokens, args.threads)
    if args.prompt_tokens < 1:
        ap.error(f"--prompt-tokens must be at least 1, got {args.prompt_tokens}")
    if args.gen_tokens < 1:
        ap.error(f"--gen-tokens must be at least 1, got {args.gen_tokens}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    from ..llm import MAX_CTX
    if args.prompt_tokens + args.gen_tokens + 1 > MAX_CTX:      # (the context the run loads; said as "ctx" by it)
        ap.error(f"--prompt-tokens + --gen-tokens must be below {MAX_CTX} (the longest context Lumen holds), got "
                 f"{args.prompt_tokens + args.gen_tokens}")
    if mode == "overhead" and args.gen_tokens < 2:     # decode tok/s: the first token comes from the prefill
        ap.error(f"--overhead needs --gen-tokens 2 or more (decode steps to time), got {args.gen_tokens}")
    if args.phase is not None and args.phase not in PHASES:
        print(f"error: unknown phase {args.phase!r}; phases are {', '.join(PHASES)}", file=sys.stderr)
        return 2
    if args.phase == "decode" and args.gen_tokens < 2 and mode == "run":     # (no decode step to report)
        print("error: --phase decode needs --gen-tokens 2 or more: the first generated token is sampled from the "
              "prefill step", file=sys.stderr)
        return 2
    from lumen.model.forward import OPS
    if args.op is not None and args.op not in OPS + GLUE:          # (before the load and the run)
        print(f"error: unknown op {args.op!r}; ops are {', '.join(sorted(OPS + GLUE))}", file=sys.stderr)
        return 2
    if args.layer is not None and args.layer < -1:
        print(f"error: unknown layer {args.layer}; layers are -1 (ops outside the layer stack) and 0 up",
              file=sys.stderr)
        return 2
    try:
        from lumen.machine import limits
        if args.machine:
            lim = limits(remeasure=args.remeasure)
            if args.json == "-":                                # for a script: the JSON alone on stdout
                print(json.dumps(lim, indent=1))
                return 0
            print_machine(lim, console)
            if args.json:
                Path(args.json).write_text(json.dumps(lim, indent=1))
                console.print(f"wrote {args.json}")
            return 0
        from lumen import load
        with trained_context_only("use fewer --prompt-tokens or --gen-tokens"):
            model = load(args.model, ctx=args.prompt_tokens + args.gen_tokens + 1, threads=args.threads)
        if args.layer is not None and not -1 <= args.layer < model.config.n_layer:
            raise LumenError(f"unknown layer {args.layer}; recorded layers are -1..{model.config.n_layer - 1}")
        if args.overhead:
            res = overhead(model, args.model, args.prompt_tokens, args.gen_tokens, args.threads, args.repeats,
                           console)
            if args.json:
                Path(args.json).write_text(json.dumps({"model": str(model.path), "prompt_tokens": args.prompt_tokens,
                                                       "gen_tokens": args.gen_tokens, "threads": model.threads,
                                                       **res}, indent=1))
                console.print(f"wrote {args.json}")
            return 0
        lim = limits(remeasure=args.remeasure)      # after the model's checks: a wrong --layer is told at once
        with console.status("compiling and warming up (first run only; cached afterwards)..."):
            prof, stats = profiled_run(model, args.prompt_tokens, args.gen_tokens)
        threads = f"{model.threads} thread{'s' if model.threads != 1 else ''}"
        title = (f"{model.config.name or model.path.name} ({model.config.arch}), {stats.prompt_tokens} prompt + "
                 f"{stats.gen_tokens} generated tokens ({stats.stop_reason}), {threads}")
        s = summarize(prof, lim, model.threads, args.phase, args.op, args.layer, model_bytes(model))
        s["run"] = {"model": str(model.path), "prompt_tokens": stats.prompt_tokens, "gen_tokens": stats.gen_tokens,
                    "stop_reason": stats.stop_reason, "threads": model.threads,
                    "prefill_tps": stats.prefill_tps, "decode_tps": stats.decode_tps}
        print_report(s, lim, title, console)
        if (args.op is not None or args.layer is not None) and not any(s["ops"].values()):
            print(f"note: {no_match(prof, args.phase, args.op, args.layer)}", file=sys.stderr)
        if args.json:
            prof.to_json(args.json)
            data = json.loads(Path(args.json).read_text())
            data["summary"] = s
            data["machine"] = lim
            Path(args.json).write_text(json.dumps(data))
            console.print(f"wrote {args.json}")
        if args.plot:
            p1, p2 = plot(s, args.plot, f"{model.config.name or model.path.name}, {threads}")
            console.print(f"wrote {p1} and {p2}")
    except (LumenError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    from lumen.commands import run
    sys.exit(run(main))
