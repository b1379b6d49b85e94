"""Where does a step of N rows per weight pass stand against the roofline, op by op, at N = 1 to 512?

    python profiling/per_n_roofline.py [--quick] [--model smollm2-135m] [--ns 1,4,8,16,64,512] [--context 32]
                                       [--steps 6] [--plot F.png]

N sequences of --context random prompt tokens decode together (one engine step = N rows through every matmul),
profiled op by op (lumen.profile) over --steps decode steps. Per op: ms per step and its share of the roofline
(lumen.profile.report.summarize: the op's GOP/s against min(its roof, intensity x bandwidth), the int8 dot roof
for the matmuls, f32 FMA for the rest; the machine's limits from lumen.machine). The step line is the whole step
against its floor, max(weight bytes / bandwidth, N x MACs / int8 roof), and the rows/s line the rows per second
of N against the first N: measured, and with both steps at their floors, which bounds what batching can give on
this host (where the int8 roof is low against the bandwidth, 16 rows cost more than one row's weight stream even
at the roof). --plot writes the matmuls and attention at every N on one roofline.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

import lumen
from lumen import Engine, SamplingParams
from lumen.machine import limits
from lumen.profile.report import roofs, summarize
from token_ids import random_ids
from verdict import checked_model, count, list_of, thread_count, verdict

OPS = ("gate_up", "down", "qkv", "o", "output", "attention")


def profile_n(model: str, threads, N: int, context: int, steps: int, rng):
    """(ms per decode step, summarize() of those steps, MACs per row of the matmuls) for N sequences."""
    eng = Engine(model, threads=threads, max_num_seqs=N, max_num_batched_tokens=max(N * context, 64),
                 kv_cache_mb=max(16, N * (context + steps + 2) * 0.05))
    p = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for _ in range(N):
        eng.add_request(random_ids(rng, context, eng).tolist(), p)
    while eng.num_waiting or any(s.num_computed < len(s.prompt_ids) for s in eng.scheduler.running):
        eng.step()
    eng.step()                                                   # the first decode step (warm) is not measured
    with lumen.profile() as prof:
        while eng.has_unfinished():
            eng.step()
    dec = [s for s in prof.steps if s.phase == "decode" and s.n_seqs == N]
    th = threads or os.cpu_count()
    s = summarize(prof, limits(), th, "decode", None, None)
    return sum(st.wall_s for st in dec) * 1e3 / len(dec), s, len(dec)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m")
    ap.add_argument("--threads", type=thread_count, default=None)
    ap.add_argument("--ns", type=list_of(count), default="1,4,8,16,64,512")
    ap.add_argument("--context", type=count, default=32)
    ap.add_argument("--steps", type=count, default=6)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--quick", action="store_true", help="N = 1, 4; 8-token prompts, 3 steps (for tests)")
    a = ap.parse_args(argv)
    ns = [1, 4] if a.quick else a.ns
    context, steps = (8, 3) if a.quick else (a.context, a.steps)
    checked_model(a.model)                                       # (each N loads it into an engine of its own)
    rng = np.random.default_rng(0)
    th = a.threads or os.cpu_count()
    L = roofs(limits(), th)
    res = {}
    for N in ns:
        step_ms, s, n_steps = profile_n(a.model, a.threads, N, context, steps, rng)
        rows = {r["op"]: r for r in s["ops"]["decode"]}
        res[N] = (step_ms, rows, n_steps)
    # the step's floor: weight bytes (the matmuls' bytes of an N = 1 step) and the matmuls' int8 work
    r0, n0 = res[ns[0]][1], res[ns[0]][2]
    w_bytes = sum(r0[op]["bytes_per_call"] * r0[op]["calls"] for op in OPS[:5] if op in r0) / n0
    head = f"{'op':>10}" + "".join(f" {f'N={N} ms':>10} {'roof':>5}" for N in ns)
    print(f"{a.model}, {th} threads, context {context}: ms per decode step of N sequences and share of the roofline"
          f" (int8 dot {L['int8_dot_gops']:.0f} GOP/s, f32 FMA {L['fma_gflops']:.0f} GFLOP/s, memory "
          f"{L['bw_gbps']:.1f} GB/s)")
    print(head)
    for op in OPS:
        line = f"{op:>10}"
        for N in ns:
            step_ms, rows, n = res[N]
            r = rows.get(op)
            ms = r["ms"] / n if r else 0.0
            sh = r["roofline_share"] if r and r["roofline_share"] is not None else 0.0
            line += f" {ms:10.3f} {100 * sh:4.0f}%"
        print(line)
    line, floor_line, rate_line = f"{'step':>10}", f"{'floor':>10}", f"{'rows/s':>10}"
    steps, floors = [], {}
    for N in ns:
        step_ms, rows, n = res[N]
        flops = sum(rows[op]["gflops"] * rows[op]["ms"] / 1e3 * 1e9 for op in OPS[:5] if op in rows)
        fl = floors[N] = max(w_bytes / (L["bw_gbps"] * 1e9), flops / n / (L["int8_dot_gops"] * 1e9)) * 1e3
        line += f" {step_ms:10.3f} {100 * fl / step_ms:4.0f}%"
        floor_line += f" {fl:10.3f}      "
        # rows per second against the first N's: measured, and what two steps at their floors would give
        n0, t0, f0 = ns[0], res[ns[0]][0], floors[ns[0]]
        rate, rate_fl = N / step_ms / (n0 / t0), N / fl / (n0 / f0)
        rate_line += f" {rate:9.2f}x {rate_fl:4.1f}x"
        steps.append(f"N={N} {step_ms:.2f} ms ({step_ms / t0:.2f}x the time, {rate:.2f}x the rows per second, "
                       f"{rate_fl:.2f}x at the floors; {100 * fl / step_ms:.0f}% of floor)")
    print(line)
    print(floor_line)
    print(rate_line + f"   (rows per second against N={ns[0]}: measured, then with both steps at their floors)")
    if a.plot:
        plot(res, ns, L, a.plot, a.model)
        print(f"roofline: {a.plot}")
    verdict(f"a decode step of N rows against N=1: {'; '.join(steps)}")


def plot(res, ns, L, path: str, model: str) -> None:
    """The matmuls and attention at every N on one roofline (GOP/s against ops per byte)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = np.logspace(-1, 4, 200)
    ax.plot(xs, np.minimum(xs * L["bw_gbps"], L["int8_dot_gops"]), "k-", lw=1, label="int8 dot roof")
    ax.plot(xs, np.minimum(xs * L["bw_gbps"], L["fma_gflops"]), "k--", lw=1, label="f32 FMA roof")
    cmap = plt.get_cmap("viridis")
    markers = dict(zip(OPS, "os^Dvx"))
    for j, N in enumerate(ns):
        rows = res[N][1]
        for op in OPS:
            r = rows.get(op)
            if r and r["intensity"] > 0:
                ax.loglog(r["intensity"], r["gflops"], markers[op], color=cmap(j / max(1, len(ns) - 1)),
                          label=op if j == len(ns) - 1 else None)
    for j, N in enumerate(ns):
        ax.plot([], [], "s", color=cmap(j / max(1, len(ns) - 1)), label=f"N = {N}")
    ax.set_xlabel("ops per byte")
    ax.set_ylabel("GOP/s")
    ax.set_title(f"{model}: a decode step of N sequences, per op")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
