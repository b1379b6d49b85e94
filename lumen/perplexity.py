"""Perplexity of a text file, the way llama-perplexity computes it.

    python -m lumen.perplexity --model M --file F [--ctx N]

The text is tokenized once (BOS as the model's default), cut into chunks of ctx tokens, and each chunk runs from
an empty cache; a text shorter than ctx is one chunk of all its tokens (a note says so). Like llama-perplexity,
the first token of each chunk is replaced by BOS when the model adds BOS, and only the second half of each chunk
is scored (the first half is context), so every scored token sees at least ctx/2 tokens. `--score all` scores
every next-token prediction of each chunk instead.
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from .errors import LumenError
from .model.store import DEFAULT_MODEL
from .commands import Parser, prog, run, threads_error
from .engine.config import THREAD_FLAGS, EngineConfig



def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of targets (n,) under logits (n, V), computed in float64."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    return lse - x[np.arange(len(targets)), targets]


def min_tokens(score: str) -> int:
    """The fewest tokens a chunk needs to score one prediction: 3 when its first half is context, else 2."""
    return 3 if score == "half" else 2


def check_length(n: int, score: str) -> None:
    """LumenError when a text of n tokens is too short to score one prediction."""
    if n < min_tokens(score):
        raise LumenError(f"the text has {n} token{'s' * (n != 1)}; at least {min_tokens(score)} are needed to score "
                         "one (use a longer file)")


def chunk_nll(model, ids: list[int], ctx: int, score: str = "half") -> list[np.ndarray]:
    """Per chunk, the NLL of each scored next-token prediction. A text shorter than ctx is one chunk of all its
    tokens (as llama-perplexity with a smaller -c), so a short file still gets a figure; LumenError only when it
    is too short to score any token."""
    check_length(len(ids), score)
    ctx = min(ctx, len(ids))
    out = []
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos_default else None
    for a in range(0, len(ids) - ctx + 1, ctx):
        chunk = list(ids[a:a + ctx])
        if bos is not None:
            chunk[0] = bos
        logits = model.logits(chunk)                    # (n, V)
        first = len(chunk) // 2 if score == "half" else 0
        out.append(log_softmax_nll(logits[first:-1], np.asarray(chunk[first + 1:], dtype=np.int64)))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog=prog("perplexity"), description=__doc__.splitlines()[0])
    ap.add_argument("--model", "-m", default=DEFAULT_MODEL,
                    help=f"registry name or path to a .gguf file (default {DEFAULT_MODEL})")
    ap.add_argument("--file", "-f", required=True, help="a UTF-8 text file")
    ap.add_argument("--ctx", "--ctx-size", "-c", type=int, default=512, help="tokens per chunk (default 512)")
    ap.add_argument("--force-ctx", action="store_true",
                    help="allow --ctx beyond the model's trained context (output past it is unreliable)")
    ap.add_argument("--score", choices=("half", "all"), default="half",
                    help="score the second half of each chunk (llama-perplexity) or every position")
    EngineConfig.add_cli_args(ap, only=THREAD_FLAGS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.ctx < (4 if args.score == "half" else 2):
        ap.error(f"--ctx must be at least 4 (2 with --score all), got {args.ctx}")
    from .llm import MAX_CTX
    if args.ctx > MAX_CTX:                              # a flag out of its range: said before the model loads
        ap.error(f"--ctx must be at most {MAX_CTX}, got {args.ctx}")
    if why := threads_error(args.threads):
        ap.error(why)
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:                               # (the reason once: not Python's "[Errno 2] ...: 'x'")
        print(f"error: --file {args.file}: cannot read it ({e.strerror or e})", file=sys.stderr)
        return 1
    except UnicodeDecodeError as e:
        print(f"error: --file {args.file} is not valid UTF-8 ({e.reason} at byte {e.start})", file=sys.stderr)
        return 1
    try:
        from rich.console import Console
        from .generate import load_model, status_while_compiling
        from .model.parts import build_tokenizer, make_parts, open_gguf
        from .model.store import resolve
        path = resolve(args.model)
        g, cfg = open_gguf(path)                        # the tokenizer first: the text's length sets the context
        tok = build_tokenizer(g.metadata)
        ids = tok.encode(text, add_bos=tok.default_bos(text, False), special=False)     # as Model.tokenize(text)
        check_length(len(ids), args.score)              # said before the weights load and the kernels compile
        n = min(args.ctx, len(ids))                     # a shorter text is one chunk: only n tokens of context
        if n > cfg.ctx_train and not args.force_ctx:    # (load_model's refusal, before the weights load)
            raise LumenError(f"ctx={n} is beyond the {cfg.ctx_train} tokens this model was trained on (output past "
                             "that is unreliable); pass --force-ctx to use it anyway")
        with status_while_compiling(Console(stderr=True, highlight=False)):
            model = load_model(path, n, args.threads, args.force_ctx, n_batch=min(n, 512),
                               adaptive_threads=args.adaptive_threads, parts=make_parts(path, g, cfg, tok))
            model.warmup()
        if len(ids) < args.ctx:
            print(f"note: the text has {len(ids)} tokens, fewer than --ctx {args.ctx}: the context is reduced "
                  f"to {len(ids)}, one chunk", file=sys.stderr)
        print(f"{len(ids)} tokens, {len(ids) // n} chunks of {n}", file=sys.stderr)
        nll_all = []
        for i, nll in enumerate(chunk_nll(model, ids, args.ctx, args.score)):
            nll_all.append(nll)
            cat = np.concatenate(nll_all)
            print(f"[{i + 1}]{math.exp(cat.mean()):.4f}", end=" ", flush=True)
        print()
    except BrokenPipeError:                              # stdout's reader is gone (`| head`): commands.run ends it
        raise
    except (LumenError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cat = np.concatenate(nll_all)
    ppl = math.exp(cat.mean())
    # standard error of the mean NLL, carried to the perplexity as llama-perplexity reports it
    err = cat.std(ddof=1) / math.sqrt(len(cat)) if len(cat) > 1 else 0.0
    print(f"Final estimate: PPL = {ppl:.4f} +/- {ppl * err:.5f}  ({len(cat)} scored tokens, mean NLL {cat.mean():.6f})")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
