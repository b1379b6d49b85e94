"""Profile a generate run op by op against this machine's roofline: `python -m lumen.profile ...`.

    python -m lumen.profile --machine [--remeasure]      # this machine's limits (measured once, cached)
    python -m lumen.profile --model smollm2-135m --prompt-tokens 512 --gen-tokens 128 \\
        [--threads T] [--json F.json] [--plot F.png] [--phase prefill|decode] [--op NAME] [--layer N]
    python -m lumen.profile --model M --overhead [--repeats 5]   # decode tok/s: timers off / compiled out / on

The prompt is exactly --prompt-tokens tokens (a fixed text's tokens repeated, BOS first when the model adds one);
generation is greedy. A warm-up generate (JIT compile) runs before the profiled one and is not reported.

Tables: per op type and phase (calls, ms, share of the phase's wall time, us/call, GB/s, GFLOP/s, FLOP/byte and
share of the op's roofline bound = min(peak, intensity x bandwidth), with the int8 dot peak (vpdpbusd,
lumen.machine) for the matmuls (their dot products are integer) and the f32 FMA peak for the rest); ms per layer
and phase; the per-decode-step Python/dispatch overhead; per-step coverage. --phase/--op/--layer restrict the
tables to those records.

--json F writes the profiler's steps and records plus the summary tables and machine limits. --plot F.png writes
two PNGs: F.png, the roofline (every op type a point per phase, the bandwidth and compute ceilings), and
F-ops.png (F's stem + "-ops"), the time per token of each op, stacked, for prefill and decode.

Not imported by the package (lumen.profile is the profiler context manager, lumen/__init__.py); run with -m.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lumen.errors import LumenError
from lumen.model.store import DEFAULT_MODEL

TEXT = ("The history of the city begins with a small settlement on the river, where traders met to exchange "
        "grain, salt and cloth. Over the centuries it grew into a busy port, and its markets drew merchants from "
        "distant lands who brought new languages, foods and ideas with them.")
MATMULS = ("q", "k", "v", "o", "gate", "up", "down", "output")
GLUE = ("schedule", "prepare", "dispatch", "return", "sample", "detokenize")
PHASES = ("prefill", "decode")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lumen.profile",
                                 description="Profile a generate run op by op against this machine's roofline.")
    ap.add_argument("--machine", action="store_true", help="print this machine's measured limits and exit")
    ap.add_argument("--remeasure", action="store_true", help="measure the machine limits again (with --machine or a run)")
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


def ops_png(path: str) -> str:
    p = Path(path)
    return str(p.with_name(p.stem + "-ops" + (p.suffix or ".png")))


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


def summarize(prof, lim: dict, threads: int, phase: str | None, op: str | None, layer: int | None) -> dict:
    """The report's numbers: per-op rows per phase, ms per layer, decode overhead, coverage."""
    from lumen.profile import Agg
    bw = lim["bw_gbps"] if threads > 1 else lim.get("bw_1t_gbps", lim["bw_gbps"])
    fma = lim["fma_gflops"] if threads > 1 else lim.get("fma_1t_gflops", lim["fma_gflops"])
    idot = lim["int8_dot_gops"] if threads > 1 else lim.get("int8_dot_1t_gops", lim["int8_dot_gops"])
    prof.select(phase, op, layer)  # LumenError on an unknown phase, op or layer
    phases = [phase] if phase else [p for p in PHASES if any(s.phase == p for s in prof.steps)]
    out = {"limits": {"bw_gbps": bw, "fma_gflops": fma, "int8_dot_gops": idot, "threads": threads},
           "ops": {}, "layers": {}, "phases": {}}
    for ph in phases:
        steps = [s for s in prof.steps if s.phase == ph]
        wall = sum(s.wall_s for s in steps)
        tokens = sum(s.n_tokens for s in steps)
        recs = prof.select(ph, op, layer)
        by_op: dict[str, Agg] = {}
        by_layer: dict[int, Agg] = {}
        for r in recs:
            by_op.setdefault(r.op, Agg()).add(r)
            if r.layer >= 0:
                by_layer.setdefault(r.layer, Agg()).add(r)
        rows = []
        for name, a in sorted(by_op.items(), key=lambda kv: -kv[1].seconds):
            peak = idot if name in MATMULS else fma
            if a.flops > 0:
                bound = min(peak, a.intensity * bw)
                roof = a.gflops / bound
            elif a.bytes > 0:
                bound, roof = None, a.gbps / bw  # pure data movement: bandwidth is the bound
            else:
                bound, roof = None, None
            rows.append({"op": name, "calls": a.calls, "ms": a.seconds * 1e3,
                         "share": a.seconds / wall if wall else 0.0, "us_per_call": a.seconds / a.calls * 1e6,
                         "gbps": a.gbps, "gflops": a.gflops, "intensity": a.intensity,
                         "bound_gflops": bound, "roofline_share": roof})
        out["ops"][ph] = rows
        out["layers"][ph] = {il: a.seconds * 1e3 for il, a in sorted(by_layer.items())}
        cov = prof.coverage(ph)
        shares = sorted(s for _, _, s in cov)
        out["phases"][ph] = {"steps": len(steps), "tokens": tokens, "wall_ms": wall * 1e3,
                             "tok_per_s": tokens / wall if wall else 0.0,
                             "coverage_min": shares[0] if shares else 1.0,
                             "coverage_median": statistics.median(shares) if shares else 1.0,
                             "unattributed_ms": prof.unattributed_s(ph) * 1e3}
    if "decode" in phases:
        n = max(1, out["phases"]["decode"]["steps"])
        wall = out["phases"]["decode"]["wall_ms"] / 1e3
        glue = prof.by_op("decode")
        rows = [{"op": g, "us_per_step": glue[g].seconds / n * 1e6 if g in glue else 0.0,
                 "share": (glue[g].seconds / wall if wall else 0.0) if g in glue else 0.0} for g in GLUE]
        un = prof.unattributed_s("decode")
        rows.append({"op": "unattributed", "us_per_step": un / n * 1e6, "share": un / wall if wall else 0.0})
        rows.append({"op": "total", "us_per_step": sum(r["us_per_step"] for r in rows),
                     "share": sum(r["share"] for r in rows)})
        out["overhead"] = rows
    return out


# ---- printing ----
def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def print_report(s: dict, lim: dict, title: str, console) -> None:
    from rich.table import Table
    L = s["limits"]
    console.print(f"[bold]{title}[/]")
    console.print(f"machine: {lim.get('cpu', '?')} | {L['threads']} threads | read {L['bw_gbps']:.1f} GB/s | "
                  f"f32 FMA {L['fma_gflops']:.0f} GFLOP/s | int8 dot {L['int8_dot_gops']:.0f} GOP/s")
    for ph, rows in s["ops"].items():
        p = s["phases"][ph]
        t = Table(title=f"{ph}: {p['tokens']} tokens in {p['steps']} steps, {p['wall_ms']:.1f} ms, "
                        f"{p['tok_per_s']:.1f} tok/s", title_justify="left")
        for col in ("op", "calls", "ms", "share", "us/call", "GB/s", "GFLOP/s", "FLOP/B", "of roofline"):
            t.add_column(col, justify="left" if col == "op" else "right", no_wrap=True)
        for r in rows:
            t.add_row(r["op"], str(r["calls"]), f"{r['ms']:.2f}", f"{100 * r['share']:.1f}%",
                      f"{r['us_per_call']:.1f}", f"{r['gbps']:.2f}", f"{r['gflops']:.2f}",
                      f"{r['intensity']:.2f}", _f(None if r["roofline_share"] is None else 100 * r["roofline_share"],
                                                  ".0f") + ("%" if r["roofline_share"] is not None else ""))
        console.print(t)
    if any(s["layers"].values()):
        t = Table(title="ms per layer", title_justify="left")
        t.add_column("layer", justify="right")
        for ph in s["layers"]:
            t.add_column(f"{ph} ms", justify="right")
        layers = sorted({il for d in s["layers"].values() for il in d})
        for il in layers:
            t.add_row(str(il), *[f"{s['layers'][ph].get(il, 0.0):.2f}" for ph in s["layers"]])
        console.print(t)
    if "overhead" in s:
        t = Table(title="Python/dispatch overhead per decode step", title_justify="left")
        for col in ("part", "us/step", "share of decode"):
            t.add_column(col, justify="left" if col == "part" else "right")
        for r in s["overhead"]:
            t.add_row(r["op"], f"{r['us_per_step']:.1f}", f"{100 * r['share']:.2f}%")
        console.print(t)
    for ph, p in s["phases"].items():
        console.print(f"coverage {ph}: min {100 * p['coverage_min']:.1f}% median {100 * p['coverage_median']:.1f}% "
                      f"per step | unattributed {p['unattributed_ms']:.2f} ms of {p['wall_ms']:.1f} ms")


def plot(s: dict, path: str, title: str) -> tuple[str, str]:
    """The roofline (path) and the stacked op times per token (path's stem + '-ops')."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    L = s["limits"]
    ops = sorted({r["op"] for rows in s["ops"].values() for r in rows})
    palette = list(plt.get_cmap("tab20").colors) + list(plt.get_cmap("Dark2").colors) + list(plt.get_cmap("Set1").colors)
    color = {op: palette[i % len(palette)] for i, op in enumerate(ops)}
    marker = {"prefill": "o", "decode": "^"}

    fig, ax = plt.subplots(figsize=(10, 6.5))
    pts = [(ph, r) for ph, rows in s["ops"].items() for r in rows if r["gflops"] > 0
           and r["intensity"] > 0]
    xs = [r["intensity"] for _, r in pts] or [0.1, 10]
    lo, hi = min(xs + [0.05]) / 2, max(xs + [L["int8_dot_gops"] / L["bw_gbps"] * 4]) * 2
    x = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(x, np.minimum(x * L["bw_gbps"], L["int8_dot_gops"]), "k-", lw=1.5,
            label=f"int8 dot roof: {L['bw_gbps']:.1f} GB/s, {L['int8_dot_gops']:.0f} GOP/s")
    ax.plot(x, np.minimum(x * L["bw_gbps"], L["fma_gflops"]), "k--", lw=1.2,
            label=f"f32 FMA roof: {L['fma_gflops']:.0f} GFLOP/s")
    for ph, r in pts:
        ax.scatter(r["intensity"], r["gflops"], marker=marker[ph], s=55, color=color[r["op"]],
                   edgecolors="k", linewidths=0.5, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved GFLOP/s (GOP/s for the integer matmuls)")
    ax.set_title(f"Roofline: {title}")
    ax.grid(True, which="both", alpha=0.3)
    from matplotlib.lines import Line2D
    handles = ax.get_legend_handles_labels()[0]
    handles += [Line2D([], [], marker=marker[p], ls="", color="gray", markeredgecolor="k", label=p)
                for p in s["ops"]]
    handles += [Line2D([], [], marker="s", ls="", color=color[op], label=op)
                for op in ops if any(r["op"] == op for _, r in pts)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

    path2 = ops_png(path)
    fig, ax = plt.subplots(figsize=(9, 6.5))
    phases = list(s["ops"])
    per_tok = {ph: {r["op"]: r["ms"] / max(1, s["phases"][ph]["tokens"]) for r in s["ops"][ph]} for ph in phases}
    order = sorted(ops, key=lambda op: -sum(per_tok[ph].get(op, 0.0) for ph in phases))
    bottom = np.zeros(len(phases))
    for op in order:
        v = np.array([per_tok[ph].get(op, 0.0) for ph in phases])
        ax.bar(phases, v, bottom=bottom, color=color[op], label=op, width=0.55, edgecolor="white", linewidth=0.4)
        bottom += v
    un = np.array([s["phases"][ph]["unattributed_ms"] / max(1, s["phases"][ph]["tokens"]) for ph in phases])
    ax.bar(phases, un, bottom=bottom, color="lightgray", hatch="//", label="unattributed", width=0.55)
    for i, ph in enumerate(phases):
        ax.text(i, bottom[i] + un[i], f"{bottom[i] + un[i]:.2f} ms/token", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("ms per token")
    ax.set_title(f"Time per token by op: {title}")
    ax.set_ylim(0, max(bottom + un) * 1.1 if len(phases) else 1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path2, dpi=110)
    plt.close(fig)
    return path, path2


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


def print_machine(lim: dict, console) -> None:
    from rich.table import Table
    t = Table(title=f"machine limits: {lim['cpu']}, {lim['cores']} cores", title_justify="left")
    t.add_column("limit")
    t.add_column("1 thread", justify="right")
    t.add_column(f"{lim['threads']} threads", justify="right")
    t.add_row("memory read GB/s", f"{lim['bw_1t_gbps']:.1f}", f"{lim['bw_gbps']:.1f}")
    t.add_row("f32 FMA GFLOP/s", f"{lim.get('fma_1t_gflops', float('nan')):.0f}", f"{lim['fma_gflops']:.0f}")
    t.add_row("int8 dot GOP/s", f"{lim.get('int8_dot_1t_gops', float('nan')):.0f}", f"{lim['int8_dot_gops']:.0f}")
    console.print(t)
    console.print(f"measured {lim.get('measured_at', '?')}; ridge points: FMA {lim['fma_gflops'] / lim['bw_gbps']:.1f}, "
                  f"int dot {lim['int8_dot_gops'] / lim['bw_gbps']:.1f} FLOP/byte")


def main(argv: list[str] | None = None) -> int:
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
        t0 = time.perf_counter()
        model = load(args.model, ctx=args.prompt_tokens + args.gen_tokens + 1, threads=args.threads)
        if args.overhead:
            overhead(model, args.model, args.prompt_tokens, args.gen_tokens, args.threads, args.repeats, console)
            return 0
        with console.status("compiling and warming up (first run only; cached afterwards)..."):
            prof, stats = profiled_run(model, args.prompt_tokens, args.gen_tokens)
        title = (f"{model.config.name or model.path.name} ({model.config.arch}), {stats.prompt_tokens} prompt + "
                 f"{stats.gen_tokens} generated tokens ({stats.stop_reason}), {model.threads} threads")
        s = summarize(prof, lim, model.threads, args.phase, args.op, args.layer)
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
            p1, p2 = plot(s, args.plot, f"{model.config.name or model.path.name}, {model.threads} threads")
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
