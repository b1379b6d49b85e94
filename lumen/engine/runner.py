"""The model runner: owns one model's forward-pass bundles (weights, KV pool, scratch) and turns a step's plan
into the forward pass's Batch (`run_plan`), runs it, and hands back the logits of the rows to sample. Model's
prefill/decode, the draft model and the cost calibration fill the batch themselves (`set_tokens`, `set_out_rows`).

Each forward pass runs on the threads the Governor gives it (lumen.engine.threads): up to n_threads, fewer while
other processes (or the server's own event loop) want the cores. Sizes are fixed at construction: at most
`max_tokens` tokens per step, `max_rows` sequences holding blocks (rows of the block table), `max_blocks` blocks
per sequence, `n_blocks` blocks in the pool. Nothing on the per-step path allocates except the small views of the
preallocated batch arrays.
"""
from __future__ import annotations

import errno
import mmap

import numpy as np

from ..kernels.attention import BLOCK, attention_scratch
from ..kernels.matmul import FACC, unpack_scratch
from ..kernels.rope import rope_cache
from ..kernels.scratch import per_thread
from ..kernels.work import counters
from ..model.config import ROPE_NEOX, Config
from ..errors import LumenError
from ..timer import active as profiler_active
from .threads import Governor
from ..model.forward import KV, Arch, AttnScratch, Batch, MMScratch, Scratch, Weights, forward, n_slots
from ..model import precompile

f32 = np.float32


def lazy_zeros(shape: tuple, dtype) -> np.ndarray:
    """A zeroed array whose pages are backed only once written: anonymous mmap, in base pages. For the KV cache:
    numpy asks for transparent huge pages on large arrays, so the first token of each layer made 2 MB resident per
    layer and per K/V (1.5B at a 2k context: +107 MB; at 8k: +272 MB for a few tokens)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype, count=int(np.prod(shape))).reshape(shape)


def make_arch(cfg: Config, max_pos: int, rope_freqs) -> Arch:
    """The Arch bundle of a Config; RoPE tables for positions 0 .. max_pos-1 (0: global layers, 1: local, only
    when the model has sliding-window layers: at a 32k context each table is 17 MB, filled at load)."""
    bases = (cfg.rope_base, cfg.rope_base_local) if any(cfg.swa_layers) else (cfg.rope_base,)
    cos = np.empty((len(bases), max_pos, cfg.n_rot // 2), f32)
    sin = np.empty((len(bases), max_pos, cfg.n_rot // 2), f32)
    for i, base in enumerate(bases):
        cos[i], sin[i] = rope_cache(base, cfg.n_rot, max_pos, cfg.rope_freq_scale, rope_freqs)
    L = cfg.n_layer
    return Arch(n_layer=L, n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                head_dim_v=cfg.head_dim_v, qkv_bias=bool(cfg.qkv_bias), qk_norm=bool(cfg.qk_norm),
                post_norms=bool(cfg.post_norms), gelu=cfg.act == "gelu", neox=cfg.rope_type == ROPE_NEOX,
                eps=f32(cfg.rms_eps), attn_scale=f32(cfg.attn_scale), embd_scale=f32(cfg.embd_scale),
                softcap=f32(cfg.final_logit_softcap),
                windows=np.array([cfg.window_of(i) for i in range(L)], np.int64),
                rope_sel=np.array([1 if s else 0 for s in cfg.swa_layers], np.int64), rope_cos=cos, rope_sin=sin)


def make_scratch(cfg: Config, max_tokens: int, max_pos: int, n_threads: int) -> Scratch:
    E, H, KV_, hd, hdv, F = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v, cfg.n_ff
    B = max_tokens
    max_in = max(E, F, H * hdv)
    G = max_in // 32
    mm = MMScratch(xq=np.zeros(B * max_in, np.int8), xd=np.zeros(B * G, f32), xs=np.zeros(B * G, f32),
                   xf=np.zeros(B * max_in, f32), facc=per_thread((n_threads, FACC), f32),
                   wbuf=unpack_scratch(n_threads, max_in, B), work=counters(n_threads))
    return Scratch(x=np.zeros((B, E), f32), xn=np.zeros((B, E), f32), q=np.zeros((B, H * hd), f32),
                   k=np.zeros((B, KV_ * hd), f32), v=np.zeros((B, KV_ * hdv), f32), att=np.zeros((B, H * hdv), f32),
                   ffa=np.zeros((B, F), f32), ffb=np.zeros((B, F), f32), mm=mm,
                   attn=AttnScratch(*attention_scratch(H, hdv, max_pos, n_threads)),
                   times=np.zeros(n_slots(cfg.n_layer), np.int64))


class Runner:
    def __init__(self, cfg: Config, weights: Weights, rope_freqs, *, n_blocks: int, max_tokens: int, max_rows: int,
                 max_blocks: int, n_threads: int, adaptive_threads: bool = True):
        self.cfg = cfg
        self.max_tokens, self.max_rows, self.max_blocks = max_tokens, max_rows, max_blocks
        max_pos = max_blocks * BLOCK
        self.arch = make_arch(cfg, max_pos, rope_freqs)
        self.w = weights
        L, KV_, hd, hdv = cfg.n_layer, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v
        try:
            self.kv = KV(k=lazy_zeros((L, n_blocks, KV_, hd, BLOCK), np.uint16),      # f16 bits
                         v=lazy_zeros((L, n_blocks, KV_, BLOCK, hdv), np.uint16))
        except OSError as e:                        # ENOMEM: more than the machine lets this process map
            if e.errno != errno.ENOMEM:
                raise
            gb = 2 * L * n_blocks * KV_ * BLOCK * (hd + hdv) / 1e9
            raise LumenError(f"the KV cache of {n_blocks * BLOCK} tokens needs {gb:.1f} GB, more than this machine "
                             "can map: use a smaller context (ctx, max_model_len) or kv_cache_mb") from None
        self.n_blocks = n_blocks
        self.scr = make_scratch(cfg, max_tokens, max_pos, n_threads)
        self.table = np.zeros((max_rows, max_blocks), np.int64)     # block tables, one row per sequence
        self._tokens = np.zeros(max_tokens, np.int64)
        self._positions = np.zeros(max_tokens, np.int64)
        self._seqs = np.zeros(max_tokens, np.int64)
        self._slots = np.zeros(max_tokens, np.int64)
        self._out_rows = np.zeros(max_tokens, np.int64)
        self.logits = np.zeros((0, cfg.n_vocab), f32)               # grown to the most rows a step samples
        self._entry = None                                          # the compiled forward, called directly
        self.governor = Governor(n_threads, adaptive_threads)       # each step's thread count (threads.py)

    @property
    def kv_bytes_per_block(self) -> int:
        return (self.kv.k.nbytes + self.kv.v.nbytes) // self.n_blocks

    def logits_rows(self, n: int) -> np.ndarray:
        if self.logits.shape[0] < n:
            self.logits = np.zeros((n, self.cfg.n_vocab), f32)
        return self.logits

    def forward(self, n: int, n_out: int, logits: np.ndarray | None = None, *, phase: str = "prefill",
                n_seqs: int = 1, kv_tokens: int = 0) -> np.ndarray:
        """Run the first n entries of the batch arrays (filled by the caller) and the first n_out out rows;
        returns logits (n_out, V), written into `logits` when given."""
        out = self.logits_rows(n_out) if logits is None else logits
        if not (out.dtype == f32 and out.ndim == 2 and out.shape[0] >= n_out and out.shape[1] == self.cfg.n_vocab
                and out.flags.c_contiguous and out.flags.writeable):
            raise ValueError(f"logits must be a writeable C-contiguous float32 (>= {n_out}, {self.cfg.n_vocab}) array")
        prof = profiler_active()
        own = prof.enabled and not prof.in_step
        if own:
            prof.begin_step(phase, n, n_seqs, kv_tokens)
        self.governor.threads()
        args = self.forward_args(n, n_out, out, prof.enabled)
        batch = args[3]
        if self._entry is None:
            self.load()                           # every call has the same types, checked above, so it skips
        self._entry(*args)                        # the dispatcher's typing of the bundles (~35 us a call)
        self.governor.done()
        if prof.enabled:
            prof.record_forward(self, batch, own)
        return out[:n_out]

    def load(self) -> None:
        """Have the forward pass's code, compiled or loaded from Numba's cache (a first run: what
        lumen.model.precompile compiled meanwhile), without running it. The first forward call does it; the CLI
        calls it before the prompt, so that its time to the first token is the step's, not the code's load."""
        if self._entry is None:
            sig = tuple(forward.typeof_pyval(a) for a in self.forward_args(0, 0, self.logits_rows(0), False))
            precompile.wait()
            forward.compile(sig)
            self._entry = forward.overloads[sig].entry_point

    def forward_args(self, n: int, n_out: int, out: np.ndarray, profiled: bool) -> tuple:
        """The arguments of lumen.model.forward.forward for the first n batch entries and n_out out rows."""
        batch = Batch(self._tokens[:n], self._positions[:n], self._seqs[:n], self._slots[:n], self.table,
                      self._out_rows[:n_out])
        return self.arch, self.w, self.kv, batch, self.scr, out, profiled

    def set_tokens(self, i: int, tokens, start: int, row: int) -> int:
        """Put tokens (at positions start, start+1, ...) of the sequence in block-table `row` into the batch at
        i, i+1, ...; returns the next free index."""
        n = len(tokens)
        j = i + n
        self._tokens[i:j] = tokens
        if n == 1:
            self._positions[i] = start
            self._seqs[i] = row
            self._slots[i] = self.table[row, start // BLOCK] * BLOCK + start % BLOCK
        else:
            pos = np.arange(start, start + n)
            self._positions[i:j] = pos
            self._seqs[i:j] = row
            self._slots[i:j] = self.table[row, pos // BLOCK] * BLOCK + pos % BLOCK
        return j

    def set_out_rows(self, rows) -> int:
        self._out_rows[:len(rows)] = rows
        return len(rows)

    def run_plan(self, plan: list, drafts: dict, prof) -> tuple[np.ndarray, int, int]:
        """Run a step's plan (lumen.engine.scheduler.Scheduled entries; drafts: {seq: drafted tokens} of those
        with room reserved for them, run after their pending token): the logits of the sampled rows (a request
        with a draft: its last 1 + len(draft) rows), the step's tokens and the keys attention reads. After the
        sampled rows, in plan order, come the rows of the prompt positions whose logprobs a request still wants
        (Sequence.prompt_rows), in a logits array of their own: the engine's buffer does not grow for them."""
        i, out_rows, kv_tokens, n_keys, n_decode, prompt_rows = 0, [], 0, 0, 0, None
        for s in plan:
            toks = s.seq.tokens[s.start:s.start + s.n]
            draft = drafts.get(s.seq, ()) if s.k else ()
            if s.seq.prompt_logprobs is not None:
                first, count = s.seq.prompt_rows(s.start, s.n)
                if count:
                    prompt_rows = [] if prompt_rows is None else prompt_rows
                    prompt_rows.extend(range(i + first - s.start, i + first - s.start + count))
            i = self.set_tokens(i, toks + draft if draft else toks, s.start, s.row)
            n = s.n + len(draft)
            kv_tokens += s.start + n
            n_keys += n * s.start + n * (n + 1) // 2
            n_decode += s.n == 1
            if s.samples:
                out_rows.extend(range(i - 1 - len(draft), i))
        phase = "decode" if n_decode == len(plan) else "prefill" if n_decode == 0 else "mixed"
        logits = None
        if prompt_rows is not None:
            out_rows += prompt_rows
            logits = np.empty((len(out_rows), self.cfg.n_vocab), f32)
        n_out = self.set_out_rows(out_rows)
        if prof.enabled:
            prof.describe(phase, i, len(plan), kv_tokens, tuple(s.seq.request_id for s in plan))
            prof.lap("prepare")
        return self.forward(i, n_out, logits), i, n_keys

