"""The report of `python -m lumen.profile`: the summary numbers, the printed tables and the two plots.

summarize(prof, lim, ...) -> s          per op and phase: time, GB/s, GFLOP/s, FLOP/byte, roof and share of it
print_report(s, lim, title, console)    the tables, with a note for every op above its roof
roofline_figure(s, title) -> Figure     one panel per phase; every op type a point with its own marker and colour
ops_figure(s, title) -> Figure          the time per token of each op, stacked, for prefill and decode

Each op's roof is min(peak, FLOP/byte x bandwidth): the memory read bandwidth of lumen.machine, and as the peak
the int8 dot rate (vpdpbusd, lumen.machine) for the matmuls, whose work is integer dots, and the f32 FMA rate for
every other op. The bandwidth roof streams a 1 GB array from memory; an op whose data sits in a cache can read
faster than that, and the report says so where it happens rather than hiding the point.
"""
from __future__ import annotations

import statistics

from lumen.kernels.policy import PAR_ROWS

GLUE = ("schedule", "prepare", "dispatch", "return", "sample", "detokenize")
PHASES = ("prefill", "decode")
BUSY = 0.5  # load average per CPU from which a measurement of the limits is flagged as taken on a busy machine
INT8, FMA, MEMORY = "int8 dot", "f32 FMA", "memory"


# ---- the numbers ----
def matmul_ops() -> tuple[str, ...]:
    """The ops that are matmuls, whose work is int8 dots: lumen/profile/costs.py's matmul ops and the head."""
    from .costs import MAT_OF
    return (*MAT_OF, "output")


def roofs(lim: dict, threads: int) -> dict:
    """The ceilings for a run on `threads` threads: the 1-thread limits for 1 thread, else the all-thread ones."""
    one = threads == 1
    bw, fma, i8 = (lim.get(k1, lim[k]) if one else lim[k] for k, k1 in (
        ("bw_gbps", "bw_1t_gbps"), ("fma_gflops", "fma_1t_gflops"), ("int8_dot_gops", "int8_dot_1t_gops")))
    return {"bw_gbps": bw, "fma_gflops": fma, "int8_dot_gops": i8,
            "int8_dot_isa": lim.get("int8_dot_isa", "?"), "threads": threads,
            "l1d_bytes": lim.get("l1d_bytes", 0), "l2_bytes": lim.get("l2_bytes", 0),
            "l3_bytes": lim.get("l3_bytes", 0), "measured_at": lim.get("measured_at", "?")}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def _cache_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _cache_holding(nbytes: float, L: dict) -> str | None:
    """The smallest cache of one core that holds nbytes, as 'L2 (2 MiB)', or None."""
    for key, name in (("l1d_bytes", "L1"), ("l2_bytes", "L2"), ("l3_bytes", "L3")):
        if L.get(key) and nbytes <= L[key]:
            return f"{name} ({_cache_size(L[key])})"
    return None


def above_roof_note(r: dict, phase: str, L: dict, sizes: dict | None) -> str:
    """Why the op in row r reads or computes faster than its roof: where its data sits. sizes: the model's bytes
    (model_bytes in lumen/profile/__main__.py), or None."""
    if r["bound_by"] != MEMORY:
        peak = L["int8_dot_gops"] if r["roof"] == INT8 else L["fma_gflops"]
        return (f"above the measured {r['roof']} peak ({peak:.0f}): the limits (measured {L['measured_at']}) may "
                f"have been taken under more load than this run; re-measure with --machine --remeasure")
    stream = f"faster than the memory roof (a 1 GB stream, {L['bw_gbps']:.1f} GB/s)"
    per_call = r["bytes_per_call"]
    resident = sizes and sizes["matrix_bytes"] + sizes["kv_cache_bytes"]
    held = _cache_holding(resident, L) if resident else None
    if r["op"] == "attention" and phase != "decode" and sizes:
        layer_kv = sizes["kv_cache_bytes"] / sizes["n_layer"]
        where = _cache_holding(layer_kv, L)
        if where:
            return (f"its bytes count every key once per query that reads it ({_mb(per_call)} per call), but a "
                    f"chunk's queries share the layer's keys, whose K and V ({_mb(layer_kv)} at most) stay in the "
                    f"{where} cache after the first read: far fewer bytes come from memory than counted")
    if r["roof"] == INT8 or r["op"] in ("embed", "attention"):
        if held:
            return (f"its data ({_mb(per_call)} per call) comes back once per step, and the model's packed weights "
                    f"and KV cache ({_mb(resident)} in all) fit in the {held} cache, so it stays cached from one "
                    f"step to the next: {stream}")
    else:
        near = _cache_holding(per_call, L)
        if near:
            return f"reads {_mb(per_call)} per call, activations the op before it just wrote, from the {near} " \
                   f"cache: {stream}"
    return (f"unexplained: its {_mb(per_call)} per call do not stay in a cache as far as the sizes tell; re-measure "
            f"the limits on a quiet machine (--machine --remeasure)")


def decode_bytes(prof, sizes: dict) -> dict:
    """What a decode step reads, from its records: weights (every packed matrix once and an embedding row per
    token, as lumen/profile/costs.py counts them), KV (attention's bytes less its query and output rows) and
    activations (the rest), against the model's GGUF tensor bytes."""
    steps = [s for s in prof.steps if s.phase == "decode"]
    recs = prof.select("decode")
    n = max(1, len(steps))
    tokens = sum(s.n_tokens for s in steps) / n
    total = sum(r.bytes for r in recs) / n
    attn = [r for r in recs if r.op == "attention"]
    kv = (sum(r.bytes for r in attn) / n - tokens * sizes["n_layer"] * sizes["attn_act_bytes"]) if attn else 0.0
    weights = sizes["matrix_bytes"] + tokens * sizes["embed_row_bytes"]
    out = {"total": total, "weights": weights, "kv": kv, "activations": total - weights - kv,
           "gguf_tensors": sizes["gguf_tensor_bytes"]}
    out["line"] = (f"decode reads {total / 1e6:.1f} MB per step: {weights / 1e6:.1f} MB weights (GGUF tensors "
                   f"{out['gguf_tensors'] / 1e6:.1f} MB), {kv / 1e6:.1f} MB KV, "
                   f"{out['activations'] / 1e6:.1f} MB activations")
    if tokens < PAR_ROWS:      # row-wise ops run serially (lumen.kernels.policy): matmuls and attention fork
        mats = matmul_ops()
        out["parallel_regions"] = sum(r.op in mats or r.op == "attention" for r in recs) / n
        out["line"] += f"; {out['parallel_regions']:.0f} parallel regions per step (matmuls, attention)"
    return out


def summarize(prof, lim: dict, threads: int, phase: str | None, op: str | None, layer: int | None,
              sizes: dict | None = None) -> dict:
    """The report's numbers: per-op rows per phase (with each op's roof and a note when above it), ms per layer,
    decode overhead (whole steps: left out when op or layer picks some records), coverage, and (given the model's
    sizes) the bytes a decode step reads."""
    from lumen.profile import Agg
    L = roofs(lim, threads)
    matmuls = matmul_ops()
    prof.select(phase, op, layer)  # LumenError on an unknown phase, op or layer
    phases = [phase] if phase else [p for p in PHASES if any(s.phase == p for s in prof.steps)]
    out = {"limits": L, "ops": {}, "layers": {}, "phases": {}, "notes": {}}
    for ph in phases:
        steps = [s for s in prof.steps if s.phase == ph]
        wall = sum(s.wall_s for s in steps)
        tokens = sum(s.n_tokens for s in steps)
        step_bytes = sum(r.bytes for r in prof.select(ph)) / max(1, len(steps))
        by_op: dict[str, Agg] = {}
        by_layer: dict[int, Agg] = {}
        for r in prof.select(ph, op, layer):
            by_op.setdefault(r.op, Agg()).add(r)
            if r.layer >= 0:
                by_layer.setdefault(r.layer, Agg()).add(r)
        rows, notes = [], {}
        for name, a in sorted(by_op.items(), key=lambda kv: -kv[1].seconds):
            if name not in GLUE and name != op and a.bytes == 0 and a.flops == 0:
                continue        # a layer op this architecture does not have (qk_norm in llama): no row
            roof, peak = (INT8, L["int8_dot_gops"]) if name in matmuls else (FMA, L["fma_gflops"])
            bound, bound_by, share = None, None, None
            if a.flops > 0:
                bound = min(peak, a.intensity * L["bw_gbps"])
                bound_by = MEMORY if a.intensity * L["bw_gbps"] < peak else roof
                share = a.gflops / bound
            elif a.bytes > 0:
                roof, bound_by, share = MEMORY, MEMORY, a.gbps / L["bw_gbps"]  # data movement: bandwidth bounds it
            else:
                roof = None
            row = {"op": name, "calls": a.calls, "ms": a.seconds * 1e3,
                   "share": a.seconds / wall if wall else 0.0, "us_per_call": a.seconds / a.calls * 1e6,
                   "gbps": a.gbps, "gflops": a.gflops, "intensity": a.intensity, "bytes_per_call": a.bytes / a.calls,
                   "roof": roof, "bound_by": bound_by, "bound_gflops": bound, "roofline_share": share}
            if share is not None and share > 1.0:
                notes[name] = above_roof_note(row, ph, L, sizes)
            rows.append(row)
        out["ops"][ph] = rows
        out["notes"][ph] = notes
        out["layers"][ph] = {il: a.seconds * 1e3 for il, a in sorted(by_layer.items())}
        cov = prof.coverage(ph)
        shares = sorted(s for _, _, s in cov)
        out["phases"][ph] = {"steps": len(steps), "tokens": tokens, "wall_ms": wall * 1e3,
                             "tok_per_s": tokens / wall if wall else 0.0, "bytes_per_step": step_bytes,
                             "coverage_min": shares[0] if shares else 1.0,
                             "coverage_median": statistics.median(shares) if shares else 1.0,
                             "unattributed_ms": prof.unattributed_s(ph) * 1e3}
    if "decode" in phases and op is None and layer is None:     # the glue of whole steps: not under --op/--layer
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
    if "decode" in phases and sizes:
        out["decode_bytes"] = decode_bytes(prof, sizes)
    return out


# ---- printing ----
def limits_line(L: dict, cpu: str) -> str:
    return (f"machine: {cpu} | {L['threads']} threads | memory read {L['bw_gbps']:.1f} GB/s | f32 FMA "
            f"{L['fma_gflops']:.0f} GFLOP/s (roof of the other ops) | int8 dot {L['int8_dot_gops']:.0f} GOP/s "
            f"(roof of the matmuls: {L['int8_dot_isa']})")


def _num(x: float) -> str:
    """At least 3 significant digits in at most 6 characters below 100000 (the op table fits 80 columns)."""
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 1000 else f"{x:.0f}"


def print_report(s: dict, lim: dict, title: str, console) -> None:
    from rich import box
    from rich.table import Table
    L = s["limits"]
    console.print(f"[bold]{title}[/]")
    console.print(limits_line(L, lim.get("cpu", "?")), markup=False)
    for ph, rows in s["ops"].items():
        p = s["phases"][ph]
        t = Table(title=f"{ph}: {p['tokens']} tokens in {p['steps']} step{'s' * (p['steps'] != 1)}, "
                        f"{p['wall_ms']:.1f} ms, "
                        f"{p['tok_per_s']:.1f} tok/s", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, padding=0)  # fits 80 columns
        for col in ("op", "calls", "ms", "share", "us/call", "GB/s", "GFLOP/s", "FLOP/B", "bound by",
                    "of roof"):
            t.add_column(col, justify="left" if col in ("op", "bound by") else "right", no_wrap=True)
        for r in rows:
            roof = r["roofline_share"]
            t.add_row(r["op"], str(r["calls"]), _num(r["ms"]), f"{100 * r['share']:.1f}%",
                      _num(r["us_per_call"]), _num(r["gbps"]), _num(r["gflops"]), _num(r["intensity"]),
                      r["bound_by"] or "-", "-" if roof is None else f"{100 * roof:.0f}%" + ("*" if roof > 1 else ""))
        console.print(t)
        for op, note in s["notes"].get(ph, {}).items():
            share = next(r["roofline_share"] for r in rows if r["op"] == op)
            console.print(f"* {op} at {100 * share:.0f}% of its roof: {note}", markup=False)
    if s.get("decode_bytes"):
        console.print(s["decode_bytes"]["line"], markup=False, soft_wrap=True)     # one line, for grep
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


def print_machine(lim: dict, console) -> None:
    from rich.table import Table
    t = Table(title=f"machine limits: {lim['cpu']}, {lim['cores']} cores", title_justify="left")
    t.add_column("limit")
    t.add_column("1 thread", justify="right")
    t.add_column(f"{lim['threads']} threads", justify="right")
    t.add_row("memory read GB/s", f"{lim['bw_1t_gbps']:.1f}", f"{lim['bw_gbps']:.1f}")
    t.add_row("f32 FMA GFLOP/s", f"{lim.get('fma_1t_gflops', float('nan')):.0f}", f"{lim['fma_gflops']:.0f}")
    t.add_row("int8 dot GOP/s (the roof)", f"{lim['int8_dot_1t_gops']:.0f}", f"{lim['int8_dot_gops']:.0f}")
    for bits, r in sorted(lim.get("int8_dot_widths", {}).items(), key=lambda kv: int(kv[0])):
        t.add_row(f"  {bits}-bit vectors", f"{r['1t_gops']:.0f}", f"{r['gops']:.0f}")
    console.print(t)
    console.print(f"int8 dot: {lim['int8_dot_isa']}, the matmul tiles' building block on L1-resident data",
                  markup=False)
    caches = ", ".join(f"{n} {_cache_size(lim[k])}" for k, n in
                       (("l1d_bytes", "L1d"), ("l2_bytes", "L2"), ("l3_bytes", "L3")) if lim.get(k))
    console.print(f"caches per core: {caches or 'unknown'}")
    if lim.get("cpu_key"):
        console.print(f"measured on (and reused only on) {lim['cpu_key']}", markup=False)
    load = lim.get("load_avg")
    if isinstance(load, (int, float)) and load >= BUSY * lim["cores"]:
        console.print(f"warning: measured under a load average of {load:.2f} on {lim['cores']} CPUs: other work "
                      f"shared the cores, so these limits may be low; measure again on a quiet machine "
                      f"(--machine --remeasure)", markup=False)
    console.print(f"measured {lim.get('measured_at', '?')}; ridge points: f32 FMA "
                  f"{lim['fma_gflops'] / lim['bw_gbps']:.1f}, int8 dot {lim['int8_dot_gops'] / lim['bw_gbps']:.1f} "
                  f"FLOP/byte")


# ---- plots ----
def op_order(ops) -> list[str]:
    """The ops in forward order (the engine's OPS), then anything else sorted."""
    try:
        from lumen.model.forward import OPS
    except ImportError:
        OPS = ()
    return [o for o in OPS if o in ops] + sorted(o for o in ops if o not in OPS)


def op_styles(ops: list[str], matmuls) -> dict[str, dict]:
    """op -> scatter style. Matmuls are filled, every other op hollow; within each kind every op has its own
    marker and colour, so no two ops look alike even without their labels."""
    import matplotlib.pyplot as plt
    colours = list(plt.get_cmap("tab10").colors)
    markers = ["o", "s", "D", "^", "v", "p", "h", "<", ">", "P", "X", "*", "8", "d"]
    out = {}
    for kind in (True, False):
        names = [o for o in ops if (o in matmuls) == kind]
        for i, op in enumerate(names):
            c = colours[(i + (0 if kind else 3)) % len(colours)]
            m = markers[(i + i // len(markers)) % len(markers)]
            out[op] = (dict(marker=m, color=c, edgecolors="k", linewidths=0.6) if kind else
                       dict(marker=m, facecolors="white", edgecolors=c, linewidths=1.8))
    return out


def _label_groups(pts: list[tuple[float, float, str]]) -> list[tuple[float, float, list[str]]]:
    """Points within 2% of each other on both axes share one label."""
    import math
    groups: list[list] = []
    for x, y, op in pts:
        for g in groups:
            if abs(math.log10(g[0] / x)) < 0.009 and abs(math.log10(g[1] / y)) < 0.009:
                g[2].append(op)
                break
        else:
            groups.append([x, y, [op]])
    return [(x, y, ops) for x, y, ops in groups]


def _place_labels(ax, fig, labels: list[tuple[float, float, str, str]], fontsize: float,
                  fixed: list[tuple[float, float, str, str]] = ()) -> None:
    """Write each (x, y, text, colour) beside its point, moving labels up until no two overlap (estimated in
    axes fractions from the text length), with a leader line when a label had to move. `fixed` texts
    (x, y, text, ha) are written first with their bottom at y, starting (ha 'left') or ending (ha 'right') at x,
    and the labels keep clear of them too."""
    import math
    x0, x1 = (math.log10(v) for v in ax.get_xlim())
    y0, y1 = (math.log10(v) for v in ax.get_ylim())
    box = ax.get_position()
    w_in, h_in = box.width * fig.get_figwidth(), box.height * fig.get_figheight()
    cw, lh = fontsize * 0.52 / 72 / w_in, fontsize * 1.3 / 72 / h_in   # a character's width, a line's height
    placed: list[tuple[float, float, float]] = []                     # (left, bottom, right) in axes fractions
    for x, y, text, ha in fixed:
        fx, fy = (math.log10(x) - x0) / (x1 - x0), (math.log10(y) - y0) / (y1 - y0)
        left = fx if ha == "left" else fx - cw * len(text)
        placed.append((left, fy, left + cw * len(text)))
        ax.text(x, y, text, ha=ha, va="bottom", fontsize=fontsize, zorder=5)
    for x, y, text, colour in sorted(labels, key=lambda t: t[1]):
        fx, fy = (math.log10(x) - x0) / (x1 - x0), (math.log10(y) - y0) / (y1 - y0)
        width = cw * len(text)
        left = fx + 0.018 if fx + 0.018 + width < 0.995 else fx - 0.018 - width
        bottom = fy - lh / 2
        moved = True
        while moved:
            moved = False
            for pl, pb, pr in placed:
                if left < pr and pl < left + width and bottom < pb + lh and pb < bottom + lh:
                    bottom, moved = pb + lh, True
        placed.append((left, bottom, left + width))
        far = abs(bottom + lh / 2 - fy) > lh * 0.6
        ax.annotate(text, (x, y), xytext=(left, bottom), textcoords="axes fraction", fontsize=fontsize,
                    color=colour, va="bottom", ha="left", zorder=5,
                    arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6, shrinkA=0, shrinkB=3) if far else None)


def _clear_spot(points: list[tuple[float, float]], bw: float, lo: float, hi: float) -> tuple[float, bool]:
    """Where along the memory roof (x from lo to hi) a label about 0.7 decades long, above or below the line, has
    the fewest points, or labels of points (about a decade to their right), near it: (x, above)."""
    import math
    best = None
    for above in (True, False):
        band = (-0.3, 0.6) if above else (-0.7, 0.2)
        for k in range(12):
            xm = lo * (hi / lo) ** (k / 11) if hi > lo else lo
            near = sum(1 for px, py in points if -1.0 < math.log10(px / xm) < 0.9
                       and band[0] < math.log10(py / (bw * px)) < band[1])
            if best is None or near < best[0]:
                best = (near, xm, above)
    return best[1], best[2]


def roofline_figure(s: dict, title: str):
    """One panel per phase on shared axes: the memory roof, the int8 dot roof (matmuls) and the f32 FMA roof
    (other ops), each with its measured value; a point per op type with FLOPs, its style kept across panels and
    named in the legend, labelled in place; ops above their roof marked in red and explained below the panels."""
    import math
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.lines import Line2D
    L = s["limits"]
    bw, fma, i8 = L["bw_gbps"], L["fma_gflops"], L["int8_dot_gops"]
    phases = list(s["ops"]) or ["(no phase)"]
    pts = {ph: [r for r in s["ops"].get(ph, []) if r["gflops"] > 0 and r["intensity"] > 0] for ph in phases}
    plotted = op_order({r["op"] for rows in pts.values() for r in rows})
    matmuls = {r["op"] for rows in pts.values() for r in rows if r["roof"] == INT8}
    style = op_styles(plotted, matmuls)
    xs = [r["intensity"] for rows in pts.values() for r in rows] or [0.1, 10.0]
    ys = [r["gflops"] for rows in pts.values() for r in rows] or [1.0]
    x = np.logspace(np.log10(min(xs) / 3), np.log10(max(max(xs), i8 / bw) * 4), 300)
    y_lo, y_hi = min(min(ys), x[0] * bw) / 2, max(i8, max(ys)) * 3

    lines = [f"Each point is one op type over all its calls in the phase: x = its FLOPs / its bytes (weights, KV "
             f"cache and activations, estimated from shapes and types), y = its FLOPs / its time. Filled: the "
             f"matmuls, under the int8 dot roof; hollow: the other ops, under the f32 FMA roof. Roofs measured by "
             f"lumen.machine for {L['threads']} thread{'s' if L['threads'] != 1 else ''} ({L['measured_at']}): "
             f"int8 dot = {L['int8_dot_isa']} on L1-resident data; memory = a 1 GB array streamed."]
    skipped = sorted({r["op"] for rows in s["ops"].values() for r in rows if r["gflops"] <= 0 and r["gbps"] > 0})
    if skipped:
        lines.append(f"Not plotted (no FLOPs, pure data movement): {', '.join(skipped)}.")
    for ph in s["ops"]:
        for op, note in (s["notes"].get(ph) or {}).items():
            share = next(r["roofline_share"] for r in s["ops"][ph] if r["op"] == op)
            lines.append(f"* {ph} {op}, {100 * share:.0f}% of its roof: {note}.")
    if s.get("decode_bytes"):
        lines.append(s["decode_bytes"]["line"] + ".")
    text = "\n".join(textwrap.fill(ln, 175, subsequent_indent="   ") for ln in lines)
    n_text = text.count("\n") + 1
    height = 6.4 + 0.16 * n_text
    fig, axes = plt.subplots(1, len(phases), figsize=(6.6 * len(phases) + 3.4, height), sharex=True,
                             sharey=True, squeeze=False)
    axes = list(axes[0])
    fig.subplots_adjust(left=0.055, right=1 - 3.3 / fig.get_figwidth(), top=1 - 0.75 / height,
                        bottom=(0.75 + 0.16 * n_text) / height, wspace=0.05)
    fig.text(0.01, 0.01, text, ha="left", va="bottom", fontsize=7.5)
    fig.suptitle(f"Roofline: {title}", fontsize=11)
    for ax, ph in zip(axes, phases):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(x[0], x[-1])
        ax.set_ylim(y_lo, y_hi)
        ax.grid(True, which="both", alpha=0.2)
        ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
        ax.plot(x, np.minimum(x * bw, i8), "-", color="0.15", lw=1.8, zorder=2)
        m = x >= fma / bw
        ax.plot(x[m], np.full(m.sum(), fma), "--", color="0.15", lw=1.4, zorder=2)
        roof_labels = [(x[-1] / 1.15, i8 * 1.08, f"int8 dot {i8:.0f} GOP/s: roof of the matmuls", "right"),
                       (fma / bw * 1.15, fma * 1.08, f"f32 FMA {fma:.0f} GFLOP/s: roof of the other ops", "left")]
        box = ax.get_position()   # the memory roof's slope on screen: one decade up per decade right
        dx = box.width * fig.get_figwidth() / math.log10(x[-1] / x[0])
        dy = box.height * fig.get_figheight() / math.log10(y_hi / y_lo)
        xm, above = _clear_spot([(r["intensity"], r["gflops"]) for r in pts[ph]], bw, x[0] * 1.3, fma / bw / 6)
        ax.text(xm, xm * bw * (1.25 if above else 1 / 1.25), f"memory read {bw:.1f} GB/s", rotation_mode="anchor",
                rotation=math.degrees(math.atan2(dy, dx)), ha="left", va="bottom" if above else "top", fontsize=8)
        labels = []
        for r in pts[ph]:
            ax.scatter(r["intensity"], r["gflops"], s=70, zorder=4, **style[r["op"]])
        for px, py, ops in _label_groups([(r["intensity"], r["gflops"], r["op"]) for r in pts[ph]]):
            over = [r["roofline_share"] for r in pts[ph] if r["op"] in ops and r["op"] in (s["notes"].get(ph) or {})]
            labels.append((px, py, ", ".join(ops) + (f" ({100 * max(over):.0f}% of roof*)" if over else ""),
                           "firebrick" if over else "0.15"))
        _place_labels(ax, fig, labels, 7.5, roof_labels)
        if ph in s["phases"]:
            p = s["phases"][ph]
            ax.set_title(f"{ph}: {p['tokens']} tokens in {p['steps']} step{'s' * (p['steps'] != 1)}, "
                         f"{p['tok_per_s']:.1f} tok/s",
                         fontsize=10)
    axes[0].set_ylabel("achieved GFLOP/s (matmuls: GOP/s of int8 dot products)")

    handles = [Line2D([], [], color="0.15", lw=1.8, label=f"matmuls' roof: int8 dot\n{i8:.0f} GOP/s or\n"
                                                          f"FLOP/B x {bw:.1f} GB/s"),
               Line2D([], [], color="0.15", lw=1.4, ls="--", label=f"other ops' roof: f32 FMA\n{fma:.0f} GFLOP/s "
                                                                   f"or FLOP/B x {bw:.1f} GB/s")]
    for o in plotted:
        st = style[o]
        handles.append(Line2D([], [], ls="", marker=st["marker"], markersize=8,
                              markerfacecolor=st.get("color", st.get("facecolors")),
                              markeredgecolor=st["edgecolors"], markeredgewidth=st["linewidths"],
                              label=o + (" (matmul)" if o in matmuls else "")))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(1 - 3.2 / fig.get_figwidth(), 1 - 0.75 / height),
               fontsize=8, frameon=False, title="op (one point per phase)", title_fontsize=8.5, labelspacing=0.7)
    return fig


def ops_figure(s: dict, title: str):
    """The time per token of each op, stacked, one panel per phase (each on its own scale), the same colour per op
    in both, the larger segments named in place and the unattributed rest hatched."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    phases = list(s["ops"]) or ["(no phase)"]
    ops = op_order({r["op"] for rows in s["ops"].values() for r in rows})
    colours = list(plt.get_cmap("tab20").colors)
    colour = {op: colours[i % len(colours)] for i, op in enumerate(ops)}
    hatch = {op: ("" if i < len(colours) else "..") for i, op in enumerate(ops)}
    per_tok = {ph: {r["op"]: r["ms"] / max(1, s["phases"][ph]["tokens"]) for r in s["ops"].get(ph, [])}
               for ph in phases}
    order = sorted(ops, key=lambda op: -sum(per_tok[ph].get(op, 0.0) for ph in phases))
    fig, axes = plt.subplots(1, len(phases), figsize=(3.2 * len(phases) + 2.6, 6.5), squeeze=False)
    for ax, ph in zip(axes[0], phases):
        bottom = 0.0
        un = s["phases"][ph]["unattributed_ms"] / max(1, s["phases"][ph]["tokens"]) if ph in s["phases"] else 0.0
        total = sum(per_tok[ph].values()) + un
        for op in order:
            v = per_tok[ph].get(op, 0.0)
            ax.bar([0], [v], bottom=bottom, color=colour[op], hatch=hatch[op], label=op, width=0.6,
                   edgecolor="white", linewidth=0.4)
            if total and v > 0.035 * total:
                ax.text(0, bottom + v / 2, f"{op} {v:.2f}", ha="center", va="center", fontsize=7.5)
            bottom += v
        ax.bar([0], [un], bottom=bottom, color="lightgray", hatch="//", label="unattributed", width=0.6)
        ax.text(0, bottom + un, f"{bottom + un:.2f} ms/token", ha="center", va="bottom", fontsize=9)
        ax.set_xticks([0], [ph])
        ax.set_xlim(-0.6, 0.6)
        ax.set_ylim(0, (bottom + un) * 1.08 or 1)
        ax.set_ylabel(f"{ph}: ms per token")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1 - 2.5 / fig.get_figwidth(), 0.93),
               fontsize=8, frameon=False, title="op (top of the stack first)", title_fontsize=8)
    fig.suptitle(f"Time per token by op: {title}", fontsize=11)
    fig.subplots_adjust(left=0.1, right=1 - 2.6 / fig.get_figwidth(), top=0.92, wspace=0.45)
    return fig


def ops_png(path: str) -> str:
    from pathlib import Path
    p = Path(path)
    return str(p.with_name(p.stem + "-ops" + (p.suffix or ".png")))


def plot(s: dict, path: str, title: str) -> tuple[str, str]:
    """The roofline (path) and the stacked op times per token (path's stem + '-ops')."""
    import matplotlib.pyplot as plt
    path2 = ops_png(path)
    for fig, p in ((roofline_figure(s, title), path), (ops_figure(s, title), path2)):
        fig.savefig(p, dpi=110)
        plt.close(fig)
    return path, path2
