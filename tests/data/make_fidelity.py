"""Make tests/data/fidelity.llamacpp.json: how far llama.cpp's logits are from exact math on a golden text.

tests/model/test_fidelity.py holds Lumen to these numbers: on the same token ids, Lumen's KL divergence from the float64
forward of the same quantized weights (tests/ref_forward.py), and its top-1 agreement with it, must be no worse
than llama.cpp's, beyond what the text can resolve (see the test).

For each model:
  1. Under llama-cpp-python's interpreter (--llama-python), this script runs itself with --dump: it tokenizes the
     golden text, evaluates it teacher forced in one fresh context and saves every position's full-vocabulary
     f32 logits (N, V) to a temporary .npy, with the token ids and llama.cpp's settings. It does so twice: with
     the settings below, and again with flash attention on (a second, equally faithful llama.cpp).
  2. Under Lumen's interpreter (the one running this script), the float64 reference forward runs on the same
     ids (tests/ref_forward.py: compare), and per position p (the prediction of token p+1; the last position
     predicts past the text)
         kl[p]    = sum_v p_ref(v) log(p_ref(v) / p_llama(v))     (natural log, the whole vocabulary)
         top-1[p] = argmax ref == argmax llama.cpp                 (lowest id on a tie)
     The JSON gets their mean and rate with standard errors, and per position the KL, both argmaxes and the
     reference's -log p_ref(next token), so a test can check that its reference is the one measured against.
     The flash-attention run is recorded as summary numbers only (`flash_attn_variant`): how far two faithful
     llama.cpp runs land from each other, in standard errors.

Tool:     llama-cpp-python 0.3.36 (its bundled llama.cpp, built from source on this machine by pip), `Llama` class.
Settings: llama-cpp-python's defaults except: CPU only (n_gpu_layers=0), n_threads = n_threads_batch = 2, n_ctx =
          the smallest multiple of 256 holding the text, logits_all=True (f32 logits of every position), seed 42,
          verbose off, and use_extra_bufts=False. Defaults that matter (recorded per model): n_batch = n_ubatch =
          512, F16 K/V cache, flash attention off (llama-cpp-python's default), full-size SWA cache.
          use_extra_bufts=False: with the default (True) llama.cpp puts the weights in its AMX buffer on this CPU
          (Xeon with AMX_INT8, under KVM) and dies with SIGILL at `tileloadd` in ggml_backend_amx_mul_mat on the
          first batch, for both models. With it off, every matmul runs ggml's plain CPU kernels (activations
          quantized to q8_0 / q8_1 / q8_K), which any x86 CPU runs; the repacked kernels that other CPUs would use
          by default quantize activations the same way and differ in summation order only. llama-cpp-python has
          no argument for the field, so dump() patches llama_model_default_params (as make_gemma3_longctx.py).
          Threads (1 or 2) and n_batch (64 or 512) give bit-identical logits here; flash attention does not.
Models:   SmolLM2, Gemma 3 and Qwen2.5-Coder-0.5B as Lumen's model store fetches them, checked by sha256
          (tests/data/README.md).
Text:     golden_text() below, from tests/data/corpus.json only: English prose, Python code and Korean technical
          prose, joined by blank lines; tokenized by llama.cpp with add_bos=True, special=False (a BOS is added
          only when the model asks for one: Gemma yes, SmolLM2 and Qwen no). Qwen2.5-Coder-0.5B gets a shorter
          text of its own, short_text() (stored in its entry): the float64 forward of 0.5B parameters over a
          151,936-token head costs a test about 0.1-0.2 s per position on 2 cores.

Command (from the repository root, Lumen's venv active; 1.5-3 minutes on 2 shared cores, peak RSS 2.7 GB, most of
it llama.cpp's logits buffer; the output is byte-identical between runs of the same day, timings are printed only):
    python tests/data/make_fidelity.py --llama-python /tmp/lcpvenv/bin/python
`--models NAME ...` measures only those models and keeps the others' entries of the file as they are.
/tmp/lcpvenv: `python3 -m venv /tmp/lcpvenv && /tmp/lcpvenv/bin/pip install numpy llama-cpp-python==0.3.36`
(pip builds llama.cpp from source, about 8 minutes on 2 cores). The tests only read the JSON: they never need
llama-cpp-python.
"""

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
N_THREADS = 2
SEED = 42
KOREAN_STRINGS = 2
MODELS = {  # Lumen's model name -> (file, sha256)
    "smollm2-135m": ("SmolLM2-135M-Instruct.Q4_1.gguf",
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3-270m": ("gemma-3-270m-q4_k_m.gguf",
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    "qwen2.5-coder-0.5b": ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}
SHORT = ("qwen2.5-coder-0.5b",)  # measured on short_text(): the float64 reference of a 0.5B model is slow
CODE_STRINGS, KOREAN_SHORT = 4, 1
# Positions per pass of the reference over the output head: one pass for the short text (the head's 151,936 rows
# are dequantized once per pass); the reference's numbers do not depend on it (its row blocks stay the same).
CHUNK_BYTES = {"qwen2.5-coder-0.5b": 1 << 28}


def golden_text(corpus: dict) -> str:
    """Three passages of corpus.json joined by blank lines:
    - prose: ppl_text from its "A. HISTORY OF THE SOFTWARE" heading up to the release table (the Zen of Python
      before it is left out: both engines are at KL 0.02-0.1 on that memorized text, so a few positions would
      decide the mean);
    - code: the corpus strings that are Python (from textwrap.py), in corpus order, one per line;
    - Korean: the first KOREAN_STRINGS corpus strings with Hangul in them, one per line."""
    t = corpus["ppl_text"]
    a = t.index("A. HISTORY OF THE SOFTWARE")
    prose = t[a:t.index("    Release ", a)].rstrip()
    code = "\n".join(s for s in corpus["strings"] if s.startswith(("    ", "\nif", "# Hard")))
    korean = "\n".join([s for s in corpus["strings"] if any("\uac00" <= ch <= "\ud7a3" for ch in s)][:KOREAN_STRINGS])
    return "\n\n".join([prose, code, korean])


def short_text(corpus: dict) -> str:
    """The first CODE_STRINGS Python strings of corpus.json, one per line, then a blank line and the first
    KOREAN_SHORT Korean strings: about 280 tokens of code and Hangul, for a model whose float64 forward is slow."""
    code = [s for s in corpus["strings"] if s.startswith(("    ", "\nif", "# Hard"))][:CODE_STRINGS]
    korean = [s for s in corpus["strings"] if any("\uac00" <= ch <= "\ud7a3" for ch in s)][:KOREAN_SHORT]
    return "\n".join(code) + "\n\n" + "\n".join(korean)


def sha256_of(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cpu_model() -> str:
    """"<model name> (family F model M stepping S)" of the first CPU in /proc/cpuinfo."""
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break
            k, _, v = line.partition(":")
            info[k.strip()] = v.strip()
    if "model name" not in info:
        return platform.processor()
    return f"{info['model name']} (family {info.get('cpu family')} model {info.get('model')} " \
           f"stepping {info.get('stepping')})"


# ---- step 1: llama.cpp (runs under llama-cpp-python's interpreter) ----

def dump(model_path: str, text_path: str, out_dir: str, flash_attn: str) -> None:
    """Tokenize the text, evaluate it in a fresh context, save logits.npy (N, V) f32 and meta.json."""
    import llama_cpp
    import llama_cpp.llama_cpp as lc
    from llama_cpp import Llama

    if llama_cpp.__version__ != LLAMA_CPP_PYTHON_VERSION:
        sys.exit(f"llama-cpp-python {llama_cpp.__version__}, expected {LLAMA_CPP_PYTHON_VERSION}")
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    probe = Llama(model_path, vocab_only=True, verbose=False)
    tokens = probe.tokenize(text.encode("utf-8"), add_bos=True, special=False)  # BOS only if the model adds one
    add_bos = len(tokens) == len(probe.tokenize(text.encode("utf-8"), add_bos=False, special=False)) + 1
    del probe
    n_ctx = -(-len(tokens) // 256) * 256
    default_params = lc.llama_model_default_params

    def params_without_extra_bufts():
        p = default_params()
        p.use_extra_bufts = False  # no AMX / repacked weight buffers: plain ggml CPU kernels (see the docstring)
        return p

    lc.llama_model_default_params = params_without_extra_bufts  # Llama() has no argument for this field
    try:
        llm = Llama(model_path, n_gpu_layers=0, n_ctx=n_ctx, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                    seed=SEED, logits_all=True, flash_attn=flash_attn == "on", verbose=False)
    finally:
        lc.llama_model_default_params = default_params
    assert llm.model_params.use_extra_bufts is False
    t0 = time.time()
    llm.eval(tokens)
    seconds = time.time() - t0
    logits = np.ascontiguousarray(llm.scores[: len(tokens)], dtype=np.float32)  # (N, V)
    assert np.isfinite(logits).all()
    np.save(os.path.join(out_dir, "logits.npy"), logits)
    cp = llm.context_params
    meta = {
        "tokens": [int(t) for t in tokens],
        "add_bos": add_bos,
        "seconds": round(seconds, 2),
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {
            "n_gpu_layers": 0, "n_ctx": n_ctx, "n_threads": cp.n_threads, "n_threads_batch": cp.n_threads_batch,
            "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch, "seed": SEED, "logits_all": True, "logits": "f32",
            "flash_attn_type": int(cp.flash_attn_type), "type_k": int(cp.type_k), "type_v": int(cp.type_v),
            "swa_full": bool(cp.swa_full), "use_extra_bufts": False,
            "tokenize": "llm.tokenize(text.encode('utf-8'), add_bos=True, special=False)",
        },
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f)


# ---- step 2: the float64 reference (runs under Lumen's interpreter) ----

def run_llamacpp(llama_python: str, model_path: str, text: str, tmp: str, flash_attn: str) -> str:
    out = os.path.join(tmp, f"fa-{flash_attn}")
    os.makedirs(out)
    text_path = os.path.join(tmp, "text.txt")
    with open(text_path, "w", encoding="utf-8") as f:
        f.write(text)
    subprocess.run([llama_python, os.path.abspath(__file__), "--dump", model_path, text_path, out, flash_attn],
                   check=True)
    return out


def rows(npy: str, a: int, b: int) -> np.ndarray:
    """Rows a..b-1 of a saved (N, V) array, read through a mapping that is dropped at once (keeps RSS low)."""
    mm = np.load(npy, mmap_mode="r")
    out = np.array(mm[a:b])
    del mm
    return out


def summary(kl: np.ndarray, agree: np.ndarray) -> dict:
    n = len(kl)
    return {"kl_mean": float(kl.mean()), "kl_se": float(kl.std(ddof=1) / math.sqrt(n)),
            "top1": float(agree.mean()), "top1_se": float(math.sqrt(agree.mean() * (1 - agree.mean()) / n)),
            "top1_agree": int(agree.sum())}


def measure(name: str, model_path: str, text: str, llama_python: str) -> dict:
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from lumen.model.parts import open_gguf
    from ref_forward import RefModel, compare

    file, sha = MODELS[name]
    got = sha256_of(model_path)
    if got != sha:
        sys.exit(f"{model_path}: sha256 {got}, expected {sha}")
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        runs = [run_llamacpp(llama_python, model_path, text, tmp, fa) for fa in ("off", "on")]
        metas = []
        for d in runs:
            with open(os.path.join(d, "meta.json")) as f:
                metas.append(json.load(f))
        meta, meta_fa = metas
        ids = meta["tokens"]
        assert meta_fa["tokens"] == ids
        g, cfg = open_gguf(model_path)
        t0 = time.time()
        npys = [os.path.join(d, "logits.npy") for d in runs]
        fid, fid_fa = compare(RefModel(g, cfg), ids, lambda a, b: [rows(p, a, b) for p in npys], n_others=2,
                              chunk_bytes=CHUNK_BYTES.get(name, 1 << 26))
        ref_seconds = time.time() - t0
    agree, agree_fa = fid.top_ref == fid.top_other, fid_fa.top_ref == fid_fa.top_other
    main, fa = summary(fid.kl, agree), summary(fid_fa.kl, agree_fa)
    n = len(ids)
    print(f"{name}: {n} positions; llama.cpp KL(f64 || llama.cpp) {main['kl_mean']:.6f} ± {main['kl_se']:.6f}, "
          f"top-1 {main['top1'] * 100:.2f}% ± {main['top1_se'] * 100:.2f} ({main['top1_agree']}/{n}); "
          f"flash attention: KL {fa['kl_mean']:.6f}, top-1 {fa['top1'] * 100:.2f}%; "
          f"llama.cpp eval {meta['seconds']} s, reference {ref_seconds:.1f} s")
    own_text = {"text": text, "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                "text_source": "tests/data/corpus.json through make_fidelity.short_text: the first "
                               f"{CODE_STRINGS} Python strings, the first {KOREAN_SHORT} Korean string"} \
        if name in SHORT else {}
    return {
        **own_text,
        "model_file": file,
        "model_sha256": sha,
        "add_bos": meta["add_bos"],
        "n_positions": n,
        "tokens": ids,
        **main,
        "kl": [float(f"{v:.6g}") for v in fid.kl],
        "top1_ref": [int(v) for v in fid.top_ref],
        "top1_llamacpp": [int(v) for v in fid.top_other],
        "ref_nll_next": [float(f"{v:.9g}") for v in fid.nll_ref],
        "ref_nll_mean": float(fid.nll_ref.mean()),
        "flash_attn_variant": {**fa, "kl_minus_main_in_se": round((fa["kl_mean"] - main["kl_mean"]) / main["kl_se"], 3),
                               "top1_minus_main_in_se": round((fa["top1"] - main["top1"]) / main["top1_se"], 3),
                               "flash_attn_type": meta_fa["settings"]["flash_attn_type"]},
        "llamacpp_settings": meta["settings"],
    }, meta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-python", help="python of a venv with llama-cpp-python 0.3.36 (and numpy)")
    ap.add_argument("--corpus", default=os.path.join(HERE, "corpus.json"))
    ap.add_argument("--out", default=os.path.join(HERE, "fidelity.llamacpp.json"))
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                    help="measure these models only, keeping the others' entries of --out as they are")
    ap.add_argument("--dump", nargs=4, metavar=("MODEL", "TEXT", "OUT_DIR", "FLASH_ATTN"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dump:
        return dump(*args.dump)
    if not args.llama_python:
        ap.error("--llama-python is required")

    from lumen.model.store import resolve

    with open(args.corpus, encoding="utf-8") as f:
        corpus = json.load(f)
    text = golden_text(corpus)
    t0 = time.time()
    models, meta, kept = {}, None, {}
    if set(args.models) != set(MODELS) and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            kept = json.load(f)
        if kept["text"] != text:
            sys.exit(f"{args.out} was made on another golden text: measure every model")
    for name in MODELS:
        if name not in args.models:
            models[name] = kept["models"][name]
            continue
        models[name], meta = measure(name, str(resolve(name, quiet=True)),
                                     short_text(corpus) if name in SHORT else text, args.llama_python)
        if kept:   # the file's provenance is the first run's; this model's own is here
            models[name]["provenance"] = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(),
                                          "llama_cpp_python": meta["llama_cpp_python"],
                                          "command": "python tests/data/make_fidelity.py --llama-python "
                                                     f"/tmp/lcpvenv/bin/python --models {' '.join(args.models)}"}
    out = {
        "what": "KL(f64 || llama.cpp) and top-1 agreement with the float64 forward of the same quantized weights "
                "(tests/ref_forward.py), teacher forced over the golden text, per model; made by "
                "tests/data/make_fidelity.py (its docstring has every setting)",
        "text": text,
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "text_source": "tests/data/corpus.json through make_fidelity.golden_text: ppl_text from 'A. HISTORY OF "
                       "THE SOFTWARE' to the release table, the Python strings, the first 2 Korean strings",
        "provenance": kept["provenance"] if kept else {
            "llama_cpp_python": meta["llama_cpp_python"],
            "llamacpp_system_info": meta["system_info"],
            "cpu": cpu_model(),
            "n_threads": N_THREADS,
            "date": datetime.date.today().isoformat(),
            "script": "tests/data/make_fidelity.py",
            "command": "python tests/data/make_fidelity.py --llama-python /tmp/lcpvenv/bin/python",
        },
        "models": models,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes), {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
