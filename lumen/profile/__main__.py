"""Profile a generate run op by op against this machine's roofline: `python -m lumen.profile ...`.

    python -m lumen.profile --machine [--remeasure]      # this machine's limits (measured once, cached)
    python -m lumen.profile --model smollm2-135m --prompt-tokens 512 --gen-tokens 128 \\
        [--threads T] [--json F.json] [--plot F.png] [--phase prefill|decode] [--op NAME] [--layer N]
    python -m lumen.profile --model M --overhead [--repeats 5]   # decode tok/s: timers off / compiled out / on

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
from lumen.profile.report import PHASES, ops_png, plot, print_machine, print_report, summarize

TEXT = ("The history of the city begins with a small settlement on the river, where traders met to exchange "
        "grain, salt and cloth. Over the centuries it grew into a busy port, and its markets drew merchants from "
        "distant lands who brought new languages, foods and ideas with them.")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lumen.profile",
                                 description="Profile a generate run op by op against this machine's roofline.")
    ap.add_argument("--machine", action="store_true", help="print this machine's measured limits and exit")
    ap.add_argument("--remeasure", action="store_true",
                    help="measure the machine limits again (with --machine or a run)")
    ap.add_argument("--model", "-m", default=DEFAULT_MODEL, help="registry name or path to a .gguf file")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prompt length in tokens (default 512)")
    ap.add_argument("--gen-tokens", type=int, default=128, help="tokens to generate (default 128)")
    ap.add_argument("--threads", "-t", type=int, default=None, help="threads (default: all cores)")
    ap.add_argument("--json", metavar="F", help="write the records and the summary as JSON to F")
    ap.add_argument("--plot", metavar="F.png", help="write the roofline to F.png and the op times to F-ops.png")
    ap.add_argument("--phase", help="report only this phase (prefill or decode)")
    ap.add_argument("--op", help="report only this op (e.g. attention, down, sample)")
    ap.add_argument("--layer", type=int, help="report only this layer (-1: ops outside the layer stack)")
    ap.add_argument("--overhead", action="store_true",
                    help="measure decode tok/s with the timers off, compiled out (LUMEN_TIMERS=0) and on")
    ap.add_argument("--repeats", type=int, default=5, help="repeats of each --overhead variant (default 5)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # --overhead's compiled-out process
    return ap


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
    from lumen.engine.forward import MATS
    from lumen.kernels.layout import matrix_nbytes
    w, c = model.runner.w, model.config
    mats = [int(i) for name in MATS for i in getattr(w, name)] + [int(w.output)]
    return {"gguf_tensor_bytes": sum(t.nbytes for t in model.gguf.tensors.values()),
            "matrix_bytes": sum(matrix_nbytes(w.packs.table[i]) for i in mats),
            "embed_row_bytes": int(w.token_embd.shape[1]),
            "kv_cache_bytes": sum(a.nbytes for a in model.runner.kv), "n_layer": c.n_layer,
            "attn_act_bytes": 4 * (c.q_dim + c.n_head * c.head_dim_v)}


def check_writable(path: str, what: str) -> str | None:
    """Why `path` cannot be written, or None."""
    p = Path(path)
    if p.is_dir():
        return f"{what} path {path} is a directory"
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return f"cannot write {what} to {path}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return f"cannot write {what} to {path}: permission denied"
    return None


# ---- the run ----
def profiled_run(model, prompt_tokens: int, gen_tokens: int):
    import lumen
    from lumen.engine.llm import GenStats
    model.warmup()
    for _ in model.generate(make_prompt(model, min(prompt_tokens, 8)), max_tokens=2):  # warm the generate path
        pass
    ids = make_prompt(model, prompt_tokens)
    stats = GenStats()
    with lumen.profile() as prof:
        for _ in model.generate(ids, max_tokens=gen_tokens, stats=stats):
            pass
    return prof, stats


# ---- overhead: timers off vs compiled out vs on ----
def _decode_tps(model, ids, gen_tokens, profiled: bool) -> float:
    import lumen
    from lumen.engine.llm import GenStats
    st = GenStats()
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
    _decode_tps(model, ids, 4, False)
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
    _decode_tps(model, ids, 4, True)
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--engine" in argv or "--serving" in argv or any(a.startswith("--serving=") for a in argv):
        from .serving_cli import main as cost_main          # the engine's step costs, a serving profile
        return cost_main(argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    from rich.console import Console
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    if args.worker:
        return worker(args.model, args.prompt_tokens, args.gen_tokens, args.threads)
    if args.prompt_tokens < 1:
        ap.error(f"--prompt-tokens must be at least 1, got {args.prompt_tokens}")
    if args.gen_tokens < 1:
        ap.error(f"--gen-tokens must be at least 1, got {args.gen_tokens}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.phase is not None and args.phase not in PHASES:
        print(f"error: unknown phase {args.phase!r}; phases are {', '.join(PHASES)}", file=sys.stderr)
        return 2
    for path, what in ((args.json, "the JSON"), (args.plot, "the plot")):
        why = path and check_writable(path, what)
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2
    if args.plot:
        why = check_writable(ops_png(args.plot), "the op plot")
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2
    try:
        from lumen.machine import limits
        lim = limits(remeasure=args.remeasure)
        if args.machine:
            print_machine(lim, console)
            return 0
        from lumen import load
        model = load(args.model, ctx=args.prompt_tokens + args.gen_tokens + 1, threads=args.threads)
        if args.overhead:
            overhead(model, args.model, args.prompt_tokens, args.gen_tokens, args.threads, args.repeats, console)
            return 0
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
    sys.exit(main())
