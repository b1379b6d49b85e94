"""Benchmark regression gates: every quantized matmul at the real shapes of both models (N = 1, 32, one 512 per
model), attention at 128 and 1024 keys (both models' head shapes, decode and prefill), a whole SmolLM2 decode
step and a 512-token SmolLM2 prefill. Skipped unless LUMEN_BENCH=1 (see README.md in this folder).

Only public entry points are called here (lumen.kernels.matmul.prepare / matvec / matmul_batched,
lumen.kernels.attention.attention, Model.prefill / decode); the gate fixture's replay (conftest.Replay) times the
compiled calls they make."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from lumen.format.quants import QT

SMOLLM2, GEMMA = "smollm2-135m", "gemma3-270m"

# (model, qtype, n_in, d_out, tensor) at the real shapes; N=1 and N=32 for all, N=512 where marked
MATMULS = [
    (SMOLLM2, "Q4_1", 576, 192, "attn_k"),
    (SMOLLM2, "Q4_1", 576, 576, "attn_q"),
    (SMOLLM2, "Q4_1", 576, 1536, "ffn_up"),
    (SMOLLM2, "Q4_1", 1536, 576, "ffn_down"),
    (SMOLLM2, "Q8_0", 576, 49152, "token_embd"),
    (GEMMA, "Q5_0", 640, 256, "attn_k"),
    (GEMMA, "Q5_0", 640, 1024, "attn_q"),
    (GEMMA, "Q5_0", 640, 2048, "ffn_up"),
    (GEMMA, "Q8_0", 640, 256, "attn_v"),
    (GEMMA, "Q8_0", 640, 262144, "token_embd"),
    (GEMMA, "Q4_K", 1024, 640, "attn_output"),
    (GEMMA, "Q4_K", 2048, 640, "ffn_down"),
    (GEMMA, "Q6_K", 2048, 640, "ffn_down"),
]
N512 = {(SMOLLM2, "Q4_1", 576, 1536), (GEMMA, "Q5_0", 640, 2048)}
SMOKE_MM = {(SMOLLM2, "Q4_1", 576, 1536, 1), (SMOLLM2, "Q4_1", 576, 1536, 32), (GEMMA, "Q4_K", 2048, 640, 1)}

# (model, n_heads, n_kv_heads, head_dim)
HEADS = [(SMOLLM2, 9, 3, 64), (GEMMA, 4, 1, 256)]


@functools.lru_cache(maxsize=None)
def gguf(name):
    from lumen.format.gguf import GGUFFile
    from lumen.model.store import resolve
    return GGUFFile(resolve(name, quiet=True))


@functools.lru_cache(maxsize=4)
def packed(model, qtype, n_in, d_out, tensor):
    """The first tensor of the model with this name part, type and shape, repacked."""
    from lumen.kernels.matmul import prepare
    for name, t in gguf(model).tensors.items():
        if tensor in name and QT(t.qtype).name == qtype and tuple(t.dims) == (n_in, d_out):
            return prepare(t.data, t.qtype)
    raise LookupError(f"{model} has no {qtype} {tensor} tensor of shape ({n_in}, {d_out})")


def matmul_params():
    out = []
    for model, qt, n_in, d_out, tensor in MATMULS:
        for N in (1, 32) + ((512,) if (model, qt, n_in, d_out) in N512 else ()):
            marks = [pytest.mark.smoke] if (model, qt, n_in, d_out, N) in SMOKE_MM else []
            out.append(pytest.param(model, qt, n_in, d_out, tensor, N, marks=marks,
                                    id=f"{model}-{qt}-{tensor}-{d_out}x{n_in}-N{N}"))
    return out


@pytest.mark.parametrize("model, qtype, n_in, d_out, tensor, N", matmul_params())
def test_matmul(gate, benchmark, model, qtype, n_in, d_out, tensor, N):
    from lumen.kernels.matmul import matmul_batched, matvec
    w = packed(model, qtype, n_in, d_out, tensor)
    x = np.random.default_rng(0).standard_normal((N, n_in)).astype(np.float32)
    out = np.empty((N, d_out), np.float32)
    run = gate.replay(out, matvec if N == 1 else matmul_batched, out, x, w, w.qtype)
    # an output head at N = 1 reads its weights from memory (too large for a replica per round): memory reference
    mem = w.nbytes if N == 1 and w.nbytes > gate.COPY_MAX_BYTES else 0
    _gate(gate, benchmark, f"matmul-{model}-{qtype}-{tensor}-{d_out}x{n_in}-N{N}", run, mem)


def attention_params():
    out = []
    for model, H, Hkv, D in HEADS:
        for ctx in (128, 1024):
            for phase in ("decode", "prefill"):
                marks = [pytest.mark.smoke] if (model, ctx, phase) == (GEMMA, 1024, "decode") else []
                out.append(pytest.param(model, H, Hkv, D, ctx, phase, marks=marks, id=f"{model}-{phase}-ctx{ctx}"))
    return out


@pytest.mark.parametrize("model, H, Hkv, D, ctx, phase", attention_params())
def test_attention(gate, benchmark, model, H, Hkv, D, ctx, phase):
    """decode: one query at position ctx-1 over ctx keys; prefill: ctx queries at 0..ctx-1 (causal)."""
    from lumen.kernels.attention import BLOCK, attention, attention_scratch, kv_pools, kv_store
    from lumen.kernels.policy import split_attention
    rng = np.random.default_rng(0)
    k_pool, v_pool = kv_pools(-(-ctx // BLOCK), Hkv, D, D)           # the paged f16 cache, blocks in order
    kv = rng.standard_normal((ctx, Hkv, D)).astype(np.float32)
    kv_store(k_pool, v_pool, kv, kv, np.arange(ctx))
    table = np.arange(k_pool.shape[0], dtype=np.int64)[None]
    N, pos0 = (1, ctx - 1) if phase == "decode" else (ctx, 0)
    q = rng.standard_normal((N, H, D)).astype(np.float32)             # (N, n_heads, hd)
    out = np.empty((N, H, D), np.float32)
    scratch = attention_scratch(H, D, ctx)
    split = split_attention(N, pos0 + 1)                              # the kernel the forward pass picks
    run = gate.replay(out, attention, out, q, k_pool, v_pool, pos0 + np.arange(N), np.zeros(N, np.int64), table,
                      D ** -0.5, 0, scratch, split)
    _gate(gate, benchmark, f"attention-{model}-H{H}x{Hkv}-D{D}-{phase}-ctx{ctx}", run)


@functools.lru_cache(maxsize=1)
def smollm2_model():
    import numba

    import lumen
    # the threads conftest gave Numba (LUMEN_BENCH_THREADS): a model's steps run on its own count, not Numba's
    return lumen.load(SMOLLM2, ctx=1024, n_batch=512, threads=numba.get_num_threads())


@pytest.mark.smoke
def test_decode_step(gate, benchmark):
    """One whole SmolLM2 decode step at position 64 (the cache position is reset before each step)."""
    m = smollm2_model()
    m.reset()
    m.prefill(np.arange(10, 74))

    def step():
        m.n_past = 64
        m.decode(100)
    _gate(gate, benchmark, "decode-step-smollm2-135m-pos64", gate.python_loop(step, rounds=21),
          memory_bytes=m.weights.decode_bytes)


def test_prefill_512(gate, benchmark):
    m = smollm2_model()
    ids = np.random.default_rng(0).integers(4, m.config.n_vocab, 512)

    def prefill():
        m.reset()
        m.prefill(ids)
    _gate(gate, benchmark, "prefill-smollm2-135m-512", gate.python_loop(prefill))


def _gate(gate, benchmark, case_id, run, memory_bytes=0):
    res = gate.measure(case_id, run, memory_bytes)
    benchmark.extra_info.update({k: v for k, v in res.items() if not k.startswith("ratios")})
    if not benchmark.disabled:  # with --benchmark-enable: pytest-benchmark's own stats of run(k) too
        benchmark.pedantic(run, args=(res["k"],), rounds=3)
    gate.check(case_id, res, lambda: gate.measure(case_id, run, memory_bytes))
