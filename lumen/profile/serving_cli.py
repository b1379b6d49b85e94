"""`python -m lumen.profile --engine` and `--serving`: the engine's step cost model, and a serving profile's report.
The command line (one parser for every mode) is lumen/profile/__main__.py; these are its two modes' bodies.

    python -m lumen.profile --engine --model M [--threads T] [--max-num-batched-tokens N] [--max-num-seqs S]
                            [--json F] [--plot F.png] [--tiny] [--remeasure]
        measures (or reads from $LUMEN_HOME/costs) what each step shape costs here, prints the table, the fitted
        model t = f + b max(0, T - T*) + c S + d K, and with --plot draws the cost surface: step time against
        tokens in the step for each kind of step, the fit, and the knee T* where steps turn compute-bound.
    python -m lumen.profile --serving FILE [--json F] [--plot F.png]
        the report of a serving profile written by `lumen.serve --profile FILE` (or lumen.profile.serving.save):
        TTFT and ITL p50/p99 and what they are made of (lumen/profile/serving.py).
"""
from __future__ import annotations

import json


def plot_costs(model, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(9, 5.5))
    kinds = {"decode": [], "prefill": [], "mixed": []}
    for T, S, K, t in model.samples:
        kind = "prefill" if S == 1 and T > 1 else "decode" if T == S else "mixed"
        kinds[kind].append((T, S, K, t))
    marks = {"decode": ("o", "tab:blue"), "prefill": ("s", "tab:orange"), "mixed": ("^", "tab:green")}
    for kind, pts in kinds.items():
        if pts:
            T, S, K, t = map(np.array, zip(*pts))
            ax.scatter(T, t * 1e3, marker=marks[kind][0], color=marks[kind][1], label=f"{kind} steps (measured)")
            ax.scatter(T, [model.fit.predict(*x) * 1e3 for x in zip(T, S, K)], marker="x", color=marks[kind][1],
                       alpha=0.6, label=f"{kind} steps (fit)")
    Ts = np.unique(np.geomspace(1, max(s[0] for s in model.samples), 200).round())
    f = model.fit
    ax.plot(Ts, [f.predict(T, 1, T * (T + 1) / 2) * 1e3 for T in Ts], color="gray", lw=1,
            label="fit, one sequence's prefill")
    ax.axvline(f.knee, color="red", ls="--", lw=1)
    ax.text(f.knee * 1.05, ax.get_ylim()[1] * 0.9, f"compute-bound past T* = {f.knee:.0f} tokens", color="red")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens in the step (T)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title + "\n" + f.describe(), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def engine_main(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .. import Engine, load
    from ..engine.costs.steps import calibrate
    console = Console()
    from ..errors import LumenError
    model = load(args.model, ctx=64, threads=args.threads)
    if args.max_model_len > model.config.ctx_train:    # as every command line refuses it
        raise LumenError(f"--max-model-len {args.max_model_len} is beyond the {model.config.ctx_train} tokens this "
                         "model was trained on; use a smaller --max-model-len")
    eng = Engine(model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    cm = calibrate(eng.runner, eng.cost_key, tiny=args.tiny, use_cache=not args.remeasure)
    t = Table(title=f"{model.config.name or model.path.name}: measured step costs ({cm.source}), "
                    f"{eng.threads} threads")
    for col in ("tokens T", "seqs S", "keys K", "ms", "fit ms", "error"):
        t.add_column(col, justify="right")
    for row in cm.table():
        t.add_row(str(row["tokens"]), str(row["seqs"]), str(row["keys"]), f"{row['ms']:.2f}",
                  f"{row['predicted_ms']:.2f}", f"{100 * (row['predicted_ms'] / row['ms'] - 1):+.0f}%")
    console.print(t)
    console.print(cm.fit.describe(), markup=False)
    console.print(f"steps turn compute-bound past T* = {cm.fit.knee:.0f} tokens; below it a step costs "
                  f"{cm.fit.floor * 1e3:.2f} ms whatever its size", markup=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": str(model.path), "threads": eng.threads, **cm.to_json(), "table": cm.table()}, f,
                      indent=1)
        console.print(f"wrote {args.json}", markup=False)
    if args.plot:
        plot_costs(cm, args.plot, f"{model.config.name or model.path.name}, {eng.threads} threads")
        console.print(f"wrote {args.plot}", markup=False)
    return 0


def serving_main(args) -> int:
    from . import serving
    prof, traces = serving.load(args.serving)
    rep = serving.report(prof, traces)
    if not rep["requests"]:
        print(f"{args.serving}: no request finished while the server ran with --profile (send some before stopping "
              "it): nothing to report")
        return 1
    serving.print_report(rep)
    print(serving.summary_line(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot_serving(rep, args.plot)
        print(f"wrote {args.plot}")
    return 0


def plot_serving(rep: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from .serving import PARTS
    cols = [k for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99") if f"{k}_s" in rep]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(cols)
    cmap = plt.get_cmap("tab20")
    for i, part in enumerate(PARTS):
        vals = [rep[f"{c}_parts"][part] * rep[f"{c}_s"] * 1e3 for c in cols]
        ax.bar(cols, vals, bottom=bottom, color=cmap(i), label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms (stacked: what the time is made of)")
    ax.set_title(f"serving profile: {rep['requests']} requests, coverage min {100 * rep['coverage_min']:.1f}%")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
