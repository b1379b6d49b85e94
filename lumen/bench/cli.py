"""`python -m lumen.bench [single|batch|offline|serve|spec] ...`: pick the benchmark, pass it the rest."""
from __future__ import annotations

import sys

from ..commands import prog

COMMANDS = ("single", "batch", "offline", "serve", "spec")
USAGE = """usage: {prog} [single|batch|offline|serve|spec] ...

benchmarks (`{prog} COMMAND --help` for each one's options):
  single   llama-bench style: pp / tg of one sequence (the default when no command is given)
  batch    llama-batched-bench style: npl sequences of npp prompt tokens, ntg generated tokens each
  offline  a committed workload of mixed requests through the engine, against the same requests one by one
  serve    vllm-bench-serve style: streamed requests against any OpenAI-compatible server, TTFT / TPOT / ITL /
           E2E percentiles, throughput, goodput, /health latency
  spec     speculative decoding per workload kind: lumen.generate with and without --speculative ngram,
           interleaved; beside llama.cpp's llama-lookup

the default command, single:
"""


# Flags whose value is another tool's command line, often one flag: `--llama-args "-nr"`.
PASS_THROUGH = ("--llama-args", "--serve-args")


def glue_pass_through(argv: list[str]) -> list[str]:
    """`--llama-args -nr` as `--llama-args=-nr`: argparse takes a value that starts with a dash (and has no
    space) for an option of its own and says "expected one argument"."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if argv[i] in PASS_THROUGH and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = glue_pass_through(list(sys.argv[1:] if argv is None else argv))
    named = bool(argv) and argv[0] in COMMANDS
    if argv and not named and not argv[0].startswith("-"):     # a typo, not single's first option
        print(f"{prog('bench')}: unknown benchmark {argv[0]!r}; benchmarks: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    cmd = argv.pop(0) if named else "single"
    if not named and argv in (["-h"], ["--help"]):
        print(USAGE.format(prog=prog("bench")))   # no command given: the commands, then single's options
    if cmd == "batch":
        from .batch import main as run
    elif cmd == "offline":
        from .offline import main as run
    elif cmd == "serve":
        from .serve import main as run
    elif cmd == "spec":
        from .spec import main as run
    else:
        from .single import main as run
    return run(argv)
