"""An offline workload through the engine against the same requests one by one.

    python -m lumen.bench offline --model smollm2-135m [--requests 128] [--max-num-seqs 16] [--max-num-batched-tokens 512]
        [--kv-cache-mb MB] [-t T] [--json F]

The requests are the first --requests of lumen/bench/data/prompts.json taken round-robin over its kinds (code
edits with the file in the prompt, quoting from a passage, summaries, short chat questions: prompts of 10 to
700 tokens), each with its own max_tokens (16 to 256, varied by request), greedy. The engine gets them all at
once; the baseline runs each with Model.generate, one after another, in the same process. Reported:
end-to-end output tok/s of both and their ratio, whether every request produced the same tokens both ways
(batch invariance: it must), and the KV memory efficiency: over the engine's steps, the share of the slots of
allocated blocks that hold a token (a block shared by several sequences counted once).
"""
from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from ..commands import Parser, check_writable, prog, threads_error
from ..engine.config import EngineConfig

PROMPTS = Path(__file__).with_name("data") / "prompts.json"
OUT_LENGTHS = (16, 48, 96, 160, 256)


def load_prompts() -> list[dict]:
    return json.loads(PROMPTS.read_text())["items"]


def workload(n: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens) x n: round-robin over the kinds, output lengths cycling through OUT_LENGTHS."""
    items = load_prompts()
    by_kind: dict[str, list] = {}
    for it in items:
        by_kind.setdefault(it["kind"], []).append(it)
    order = [it for group in itertools.zip_longest(*by_kind.values()) for it in group if it is not None]
    out = []
    for i in range(n):
        it = order[i % len(order)]
        out.append((it["prompt"], min(it["max_tokens"], OUT_LENGTHS[i % len(OUT_LENGTHS)])))
    return out


def kv_efficiency(engine) -> float | None:
    """Filled slots / slots of allocated blocks right now; a shared block counts once (its fullest holder)."""
    from ..kernels.attention import BLOCK
    fill: dict[int, int] = {}
    for seq in engine.scheduler.running:
        for i, b in enumerate(engine.blocks.held(seq.request_id)):
            fill[b] = max(fill.get(b, 0), min(BLOCK, max(0, seq.num_computed - i * BLOCK)))
    return sum(fill.values()) / (BLOCK * len(fill)) if fill else None


def run_engine(engine, reqs, params_of) -> tuple[float, dict, list[float]]:
    rid = {}
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(reqs):
        rid[engine.add_request(prompt, params_of(n))] = i
    done, eff = {}, []
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[rid[o.request_id]] = o
        e = kv_efficiency(engine)
        if e is not None:
            eff.append(e)
    return time.perf_counter() - t0, done, eff


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog=prog("bench offline"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default="smollm2-135m", help="registry name or .gguf path")
    ap.add_argument("--requests", type=int, default=128, help="requests (default 128)")
    EngineConfig.add_cli_args(ap, only=("threads", "adaptive_threads", "max_num_seqs", "max_num_batched_tokens",
                                        "kv_cache_mb"))
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-by-one run")
    ap.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests must be at least 1, got {args.requests}")
    if args.json and (why := check_writable(args.json, "the JSON")):      # before the run, not after it
        ap.error(why)
    try:                                                 # the engine's flags: usage errors, before the model loads
        config = EngineConfig.from_cli_args(args, max_model_len=2048)
    except ValueError as e:
        ap.error(str(e))
    if why := threads_error(args.threads):
        ap.error(why)
    from .. import Engine, SamplingParams, load
    from ..errors import LumenError
    try:
        model = load(args.model, ctx=2048, threads=args.threads, adaptive_threads=args.adaptive_threads)
        engine = Engine(model, config)
    except (LumenError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    reqs = workload(args.requests)
    params_of = lambda n: SamplingParams(max_tokens=n, temperature=0)  # noqa: E731
    try:
        engine.generate(["warm up"], params_of(4))
        t_eng, outs, eff = run_engine(engine, reqs, params_of)
    except LumenError as e:                  # a request the engine refuses (--kv-cache-mb too small for it)
        print(f"error: {e}", file=sys.stderr)
        return 1
    n_out = sum(len(o.token_ids) for o in outs.values())
    n_in = sum(len(o.prompt_token_ids) for o in outs.values())
    res = {"model": str(model.path), "requests": len(reqs), "prompt_tokens": n_in, "output_tokens": n_out,
           "engine_s": t_eng, "engine_tps": n_out / t_eng, "kv_efficiency_mean": statistics.mean(eff) if eff else None,
           "steps": engine.steps, "preemptions": engine.scheduler.num_preemptions,
           "prefix_hit_tokens": engine.blocks.hit_tokens, "max_num_seqs": args.max_num_seqs,
           "budget": args.max_num_batched_tokens,
           "threads": model.threads}
    print(f"engine: {len(reqs)} requests, {n_in} prompt + {n_out} output tokens in {t_eng:.1f} s = "
          f"{n_out / t_eng:.1f} output tok/s ({engine.steps} steps, {res['preemptions']} preemptions); KV slots "
          f"in use {100 * (res['kv_efficiency_mean'] or 0):.1f}% (mean over steps)")
    if not args.no_baseline:
        same, t0 = 0, time.perf_counter()
        for i, (prompt, n) in enumerate(reqs):
            toks = [t.id for t in model.generate(prompt, max_tokens=n)]        # end tokens are not yielded
            same += toks == [t for t in outs[i].token_ids if t not in engine.end_ids]
        t_one = time.perf_counter() - t0
        res.update(one_by_one_s=t_one, one_by_one_tps=n_out / t_one, speedup=t_one / t_eng, identical=same)
        print(f"one by one (Model.generate): {t_one:.1f} s = {n_out / t_one:.1f} output tok/s; engine "
              f"{t_one / t_eng:.2f}x; identical outputs {same}/{len(reqs)}")
    if args.json:
        try:                                             # (checked before the run; a read-only mount, a full disk)
            Path(args.json).write_text(json.dumps(res, indent=1))
        except OSError as e:
            print(f"error: cannot write the JSON to {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0
