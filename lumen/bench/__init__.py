"""Benchmarks, each beside its llama.cpp counterpart: `python -m lumen.bench [single|batch|offline|serve|spec] ...`
(lumen/bench/cli.py; `python -m lumen.bench --help` lists them).

    single   llama-bench style: pp / tg of one sequence (the default when no subcommand is given)
    batch    llama-batched-bench style: npl sequences of npp prompt tokens, ntg generated tokens each
    offline  a committed workload of mixed requests through the engine, against the same requests one by one
    serve    vllm-bench-serve style: streamed requests against any OpenAI-compatible server (lumen.serve,
             llama-server), TTFT / TPOT / ITL / E2E percentiles, throughput, goodput, /health latency
    spec     speculative decoding per workload kind, with and without --speculative ngram, beside llama-lookup
"""
