"""Speculative decoding per workload: `lumen.generate` plain, with `--speculative ngram` and (given
--draft-model) with `--speculative draft`, interleaved.

    python -m lumen.bench spec --model qwen2.5-coder-1.5b [--draft-model qwen2.5-coder-0.5b] [-n 160] [-r 5]
        [-t 2] [--prompts-per-kind 3] [--kinds completion,edit,chat] [--num-speculative-tokens 5]
        [--llama-lookup PATH [--llama-args -nr]] [--json FILE]

Workloads (--kinds): completion (the head of a function to write on), edit (a whole function and a rename: the
answer repeats the prompt), chat (a free question through the chat template), from
lumen/bench/data/spec_prompts.json; and code, extract, summarize from the serving request set
(lumen/bench/data/prompts.json); the first --prompts-per-kind of each. Every run is its own `python -m
lumen.generate` process at temperature 0 with --ignore-eos, so prompt and output lengths are fixed; the decode
t/s and the acceptance come from its stats line. Repetition by repetition the methods of a prompt run one after
another in a rotating order, so a noisy neighbour hits all of them. Per kind and method: the median over prompts
and repetitions of decode t/s, of the speed-up over the plain run of the same prompt and repetition, of the
acceptance (accepted / drafted) and of the mean tokens per verification step. All outputs of a prompt must be
the same text (greedy speculation is exact); a difference is reported and fails the run.

--llama-lookup PATH runs llama.cpp's `llama-lookup` (prompt lookup decoding) on the same GGUF, prompts, thread
count and -n, with its default draft length and --spec-draft-n-max 0 as its plain decode, interleaved likewise
(raw prompts: the chat workload's question is given without a template there).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .tools import ToolNotFound, comma_list, find_tool, refuse, split_args
from ..commands import Parser, check_writable, prog
from ..cpu import usable_cpus
from ..engine.config import EngineConfig

SPEC_KINDS = ("completion", "edit", "chat")         # spec_prompts.json
SERVE_KINDS = ("code", "extract", "summarize")      # prompts.json
KINDS = SPEC_KINDS + SERVE_KINDS
_STATS = re.compile(r"decode ([\d.]+) tok/s .*?\| (\d+) generated")
_SPEC = re.compile(r"(?:ngram|draft): (\d+)% of (\d+) drafted accepted, ([\d.]+) tok/verify step")
_LL_SPEED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_LL_N = re.compile(r"\b(n_drafted|n_accept|n_predict)\s*=\s*(\d+)")
_NO_ROOM = re.compile(r"the prompt \((\d+) tokens\) and --max-tokens (\d+) exceed the context of (\d+) tokens")
DATA = Path(__file__).parent / "data"


def prompts(kinds: list[str], per_kind: int) -> list[dict]:
    """The first per_kind prompts of each kind, in kind order: {"id", "kind", "prompt", "chat"}."""
    items = {}
    for name in ("spec_prompts.json", "prompts.json"):
        for x in json.loads((DATA / name).read_text())["items"]:
            if (x["kind"] in SPEC_KINDS) == (name == "spec_prompts.json"):
                items.setdefault(x["kind"], []).append({"chat": False, **x})
    out = []
    for kind in kinds:
        some = items.get(kind, [])[:per_kind]
        if not some:
            raise SystemExit(f"error: no prompts of kind {kind!r} (kinds: {', '.join(KINDS)})")
        out += some
    return out


def failure(stderr: str) -> str:
    """What a failed lumen.generate said: its `error: ` line (not the compile notes before it), else its last
    500 characters. A -n beyond its context is said in this tool's flags: generate's own (--max-tokens, --ctx)
    are not this command's."""
    errors = [ln[len("error: "):] for ln in stderr.splitlines() if ln.startswith("error: ")]
    if errors and (m := _NO_ROOM.search(errors[-1])):
        n_prompt, n, ctx = map(int, m.groups())
        return (f"-n {n} does not fit: the prompt takes {n_prompt} of lumen.generate's {ctx} tokens of context; "
                f"use -n {ctx - n_prompt} or less")
    return errors[-1] if errors else stderr.strip()[-500:] or "it printed nothing"


def run_lumen(model: str, prompt: str, n: int, threads: int, method: str, k: int, draft_model: str | None = None,
              chat: bool = False) -> dict:
    """One `lumen.generate` run; method "plain", "ngram" or "draft" (with draft_model)."""
    cmd = [sys.executable, "-m", "lumen.generate", "-m", model, "--no-escape", "-p", prompt, "-n", str(n),
           "--ignore-eos", "--temp", "0", "-t", str(threads)]
    if chat:
        cmd.append("--chat")
    if method != "plain":
        cmd += ["--speculative", method, "--num-speculative-tokens", str(k)]
    if method == "draft":
        cmd += ["--draft-model", draft_model]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"lumen.generate failed ({r.returncode}): {failure(r.stderr)}")
    m = _STATS.search(r.stderr)
    if not m:
        raise RuntimeError(f"no stats line in lumen.generate's output: {r.stderr.strip()[-300:]}")
    row = {"tps": float(m.group(1)), "tokens": int(m.group(2)), "text": r.stdout}
    s = _SPEC.search(r.stderr)
    if method != "plain":
        row.update(accepted_pct=float(s.group(1)) if s else 0.0, drafted=int(s.group(2)) if s else 0,
                   tok_per_step=float(s.group(3)) if s else 1.0)
    return row


def run_llama(binary: str, model: str, prompt: str, n: int, threads: int, draft: int | None, extra: list[str]
              ) -> dict:
    cmd = [binary, "-m", model, "-p", prompt, "-n", str(n), "--temp", "0", "--ignore-eos", "-t", str(threads),
           "-c", "4096", *extra]
    if draft is not None:
        cmd += ["--spec-draft-n-max", str(draft)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    m = _LL_SPEED.search(out)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"llama-lookup failed ({r.returncode}): {out.strip()[-500:] or 'it printed nothing'}")
    counts = dict((k, int(v)) for k, v in _LL_N.findall(out))
    drafted, accepted = counts.get("n_drafted", 0), counts.get("n_accept", 0)
    return {"tps": float(m.group(3)), "tokens": int(m.group(1)), "drafted": drafted,
            "accepted_pct": 100.0 * accepted / drafted if drafted else 0.0}


def check_draft(target: str, draft: str) -> None:
    """ValueError (as lumen.generate's) unless the draft model speaks the target's vocabulary, from the two files'
    metadata alone: an incompatible --draft-model must fail before the runs, not at its first one."""
    from types import SimpleNamespace
    from ..engine.speculative.drafters import DraftModel
    from ..model.parts import build_tokenizer, open_gguf
    (g, cfg), (dg, dcfg) = open_gguf(target), open_gguf(draft)
    DraftModel.check_vocabulary(SimpleNamespace(config=dcfg, tokenizer=build_tokenizer(dg.metadata)), cfg.n_vocab,
                                build_tokenizer(g.metadata).tokens)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog=prog("bench spec"), description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="smollm2-135m", help="registry name or .gguf path (default smollm2-135m)")
    ap.add_argument("--draft-model", metavar="MODEL", help="also run --speculative draft with this draft model")
    ap.add_argument("-n", "--n-gen", type=int, default=160, help="generated tokens per run (default 160)")
    ap.add_argument("-r", "--repetitions", type=int, default=5, help="runs of every prompt and method (default 5)")
    ap.add_argument("--prompts-per-kind", type=int, default=3, help="the first N prompts of each kind (default 3)")
    ap.add_argument("--kinds", default=",".join(SPEC_KINDS), help=f"comma-separated, of {', '.join(KINDS)} "
                    f"(default {','.join(SPEC_KINDS)})")
    EngineConfig.add_cli_args(ap, only=("threads", "num_speculative_tokens"))
    ap.add_argument("--llama-lookup", metavar="PATH", help="also run llama.cpp's llama-lookup, interleaved")
    ap.add_argument("--llama-args", default="", help='extra llama-lookup flags, e.g. "-nr"')
    ap.add_argument("--json", metavar="FILE", help="write every run and the summary to FILE")
    args = ap.parse_args(argv)
    extra = split_args(ap, "--llama-args", args.llama_args)
    cores = usable_cpus()                             # (the CPUs this process may use: taskset, a cgroup quota)
    args.threads = cores if args.threads is None else args.threads   # (the help's "all cores", named in the runs)
    if not 1 <= args.threads <= cores:
        ap.error(f"--threads must be between 1 and {cores}, got {args.threads}")
    for flag, v in (("-n", args.n_gen), ("-r", args.repetitions), ("--prompts-per-kind", args.prompts_per_kind),
                    ("--num-speculative-tokens", args.num_speculative_tokens)):
        if v < 1:
            ap.error(f"{flag} must be at least 1, got {v}")
    if not args.kinds.replace(",", "").strip():
        ap.error("--kinds names no workload")
    try:
        kinds = comma_list("--kinds", args.kinds)
    except ValueError as e:
        ap.error(str(e))
    for k in kinds:
        if k not in KINDS:
            ap.error(f"unknown kind {k!r} (kinds: {', '.join(KINDS)})")
    if args.llama_lookup:
        try:
            args.llama_lookup = find_tool("llama-lookup", "--llama-lookup", args.llama_lookup)
        except ToolNotFound as e:
            refuse(ap, str(e))
    if args.json and (why := check_writable(args.json, "the JSON")):      # before the run, not after it
        ap.error(why)
    from ..errors import LumenError
    from ..model.store import resolve
    try:
        gguf = str(resolve(args.model))
        if args.draft_model:
            check_draft(gguf, str(resolve(args.draft_model)))   # (not after the first plain runs)
    except (LumenError, OSError, ValueError) as e:      # the run failed (status 1), as every tool's model lookup
        print(f"error: {e}", file=sys.stderr)
        return 1
    items = prompts(kinds, args.prompts_per_kind)
    methods = ["plain", "ngram"] + (["draft"] if args.draft_model else [])
    runs: list[dict] = []
    mismatches = []
    t_start = time.time()
    try:
        for rep in range(args.repetitions):
            for it in items:
                turn = (rep + len(runs)) % len(methods)
                res = {}
                for method in methods[turn:] + methods[:turn]:
                    res[method] = run_lumen(args.model, it["prompt"], args.n_gen, args.threads, method,
                                            args.num_speculative_tokens, args.draft_model, it["chat"])
                same = all(res[m]["text"] == res["plain"]["text"] for m in methods)
                if not same:
                    mismatches.append(it["id"])
                row = {"id": it["id"], "kind": it["kind"], "rep": rep, "plain_tps": res["plain"]["tps"],
                       "tokens": res["plain"]["tokens"], "same_text": same}
                for m in methods[1:]:
                    row.update({f"{m}_tps": res[m]["tps"], f"{m}_speedup": res[m]["tps"] / res["plain"]["tps"],
                                f"{m}_accepted_pct": res[m]["accepted_pct"],
                                f"{m}_tok_per_step": res[m]["tok_per_step"]})
                if args.llama_lookup:
                    ll = {}
                    for draft in ((None, 0) if rep % 2 == 0 else (0, None)):
                        ll[draft] = run_llama(args.llama_lookup, gguf, it["prompt"], args.n_gen, args.threads, draft,
                                              extra)
                    row.update(llama_plain_tps=ll[0]["tps"], llama_lookup_tps=ll[None]["tps"],
                               llama_speedup=ll[None]["tps"] / ll[0]["tps"],
                               llama_accepted_pct=ll[None]["accepted_pct"])
                runs.append(row)
                print(f"  rep {rep + 1}/{args.repetitions} {it['id']:<16} plain {row['plain_tps']:6.1f}"
                      + "".join(f" | {m} {row[m + '_tps']:6.1f} t/s ({row[m + '_speedup']:.2f}x, "
                                f"{row[m + '_accepted_pct']:.0f}% accepted)" for m in methods[1:])
                      + (f" | llama.cpp {row['llama_plain_tps']:.1f} / lookup {row['llama_lookup_tps']:.1f} "
                         f"({row['llama_speedup']:.2f}x, {row['llama_accepted_pct']:.0f}%)"
                         if args.llama_lookup else ""),
                      file=sys.stderr, flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as e:   # a run that failed: its own error line
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = []
    for kind in kinds:
        rs = [r for r in runs if r["kind"] == kind]
        s = {"kind": kind, "prompts": len({r["id"] for r in rs}), "runs": len(rs),
             "plain_tps": median([r["plain_tps"] for r in rs])}
        for m in methods[1:]:
            for f in ("tps", "speedup", "accepted_pct", "tok_per_step"):
                s[f"{m}_{f}"] = median([r[f"{m}_{f}"] for r in rs])
        if args.llama_lookup:
            s.update(llama_plain_tps=median([r["llama_plain_tps"] for r in rs]),
                     llama_lookup_tps=median([r["llama_lookup_tps"] for r in rs]),
                     llama_speedup=median([r["llama_speedup"] for r in rs]),
                     llama_accepted_pct=median([r["llama_accepted_pct"] for r in rs]))
        summary.append(s)
    head = (f"{args.model}" + (f", draft {args.draft_model}" if args.draft_model else "")
            + f", {args.threads} threads, -n {args.n_gen} (EOS ignored), temperature 0, "
            f"k <= {args.num_speculative_tokens}, medians of {args.repetitions} repetitions x "
            f"{args.prompts_per_kind} prompts per kind")
    print(head)
    cols, sep = "| workload | plain t/s |", "|---|---:|"
    for m in methods[1:]:
        cols += f" {m} t/s | speed-up | accepted | tok/step |"
        sep += "---:|---:|---:|---:|"
    if args.llama_lookup:
        cols += " llama.cpp plain t/s | llama-lookup t/s | speed-up | accepted |"
        sep += "---:|---:|---:|---:|"
    print(cols)
    print(sep)
    for s in summary:
        line = f"| {s['kind']} | {s['plain_tps']:.1f} |"
        for m in methods[1:]:
            line += (f" {s[m + '_tps']:.1f} | {s[m + '_speedup']:.2f}x | {s[m + '_accepted_pct']:.0f}% | "
                     f"{s[m + '_tok_per_step']:.2f} |")
        if args.llama_lookup:
            line += (f" {s['llama_plain_tps']:.1f} | {s['llama_lookup_tps']:.1f} | {s['llama_speedup']:.2f}x | "
                     f"{s['llama_accepted_pct']:.0f}% |")
        print(line)
    if mismatches:
        print(f"error: speculative output differed from plain decoding on {sorted(set(mismatches))}",
              file=sys.stderr)
    if args.json:
        try:                                             # (checked before the run; a read-only mount, a full disk)
            Path(args.json).write_text(json.dumps({"model": args.model, "draft_model": args.draft_model,
                                                   "threads": args.threads, "n_gen": args.n_gen,
                                                   "repetitions": args.repetitions, "summary": summary,
                                                   "runs": runs, "seconds": time.time() - t_start}, indent=1))
        except OSError as e:
            print(f"error: cannot write the JSON to {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 1 if mismatches else 0
