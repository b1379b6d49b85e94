"""Disaggregated prefill: a request's KV cache moved from the engine that prefilled it to the engine that decodes
it, in the shape of vLLM V1's KV connector (KVConnectorBase_V1). Each Engine has one `KVConnector` (engine.kv),
which plays either role.

Prefill engine (the producer); the request comes with kv_transfer_params={"do_remote_decode": True}, max_tokens=1:
    request_finished(seq)   when it ends (stop or length) its blocks stay held (pinned in the block manager), and
                            its final output carries kv_transfer_params: {"remote_engine_id", "remote_request_id",
                            "remote_block_ids", "num_tokens"} (the tokens whose K/V those blocks hold)
    export(rid, first)      the held blocks from index `first` on, as whole-block runs (KVRun); then released
    release(rid)            given up (the decode side failed or the client left; Engine.abort(rid) does this too)
    expire(now)             holds older than kv_hold_timeout_s are released (every step, every export)
Decode engine (the consumer):
    first_missing(ids)      the first of the prompt's blocks its prefix cache lacks: pull from there on only
    engine.add_request(ids, params, kv_transfer_params=<the producer's>, kv_data=KVData(runs))
    num_external_tokens     at admission (vLLM's get_num_new_matched_tokens): prompt tokens that need no compute,
                            the local prefix hit extended by the received runs
    after_alloc             (update_state_after_alloc) the runs written into the blocks just allocated, past the
                            local hit (blocks the prefix cache already holds are skipped). The request then computes
                            its last prompt token, whose logits give the first token (as vLLM's decode does), and
                            decodes as if it had prefilled itself.

A run is `n` consecutive blocks of the producer's pool: one contiguous uint16 array (L, n, K + V) holding, per
layer and block, the block's K (n_head_kv, head_dim, BLOCK) then its V (n_head_kv, BLOCK, head_dim_v), f16 bits as
lumen.model.forward's KV lays them out: one copy per run, not one per layer per block. Attention is batch-invariant
(lumen.kernels.attention), so the imported K/V are the bits the decode engine would have computed itself, and
greedy output through prefill -> decode is one engine's.

    ids = engine.tokenizer.encode(...)
    transfer(prefill, decode, ids, params)       the whole hand-off in one process (tests, examples)
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np

from ..errors import LumenError
from ..kernels.attention import BLOCK
from .admission import RequestError
from .sampling.params import SamplingParams

DO_REMOTE_DECODE = "do_remote_decode"          # the producer's request: hold the KV when done
PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0)   # a producer's own token is never used: the
#                                                 consumer computes the last prompt position and samples the first
KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "num_tokens")


class KVTransferError(LumenError):
    """The KV asked for is not held (never made, released, expired) or does not fit this engine."""


@dataclass
class KVRun:
    first: int                      # index of its first block among the request's blocks
    data: np.ndarray                # (L, n, K + V) u2: n blocks' K then V, per layer

    @property
    def n_blocks(self) -> int:
        return self.data.shape[1]


@dataclass
class KVData:
    """What a decode engine received: runs of consecutive block indices, in order."""
    runs: list[KVRun]

    @property
    def first(self) -> int:
        return self.runs[0].first if self.runs else 0

    @property
    def end(self) -> int:
        return self.runs[-1].first + self.runs[-1].n_blocks if self.runs else 0

    @property
    def nbytes(self) -> int:
        return sum(r.data.nbytes for r in self.runs)


@dataclass
class _Hold:
    key: tuple
    blocks: list[int]
    num_tokens: int
    since: float


@dataclass
class KVStats:
    """Counters: holds made, exported (bytes, seconds copying), released and expired; imports, their bytes and
    blocks, the blocks the local prefix cache supplied instead, imports dropped (recomputed instead)."""
    held: int = 0
    exported: int = 0
    exported_bytes: int = 0
    released: int = 0
    expired: int = 0
    imported: int = 0
    imported_bytes: int = 0
    imported_blocks: int = 0
    skipped_blocks: int = 0
    dropped: int = 0
    export_s: float = 0.0
    import_s: float = 0.0


def block_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(index of the first, first block id, count) of each run of consecutive block ids."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(blocks):
        if out and out[-1][1] + out[-1][2] == b:
            i0, b0, n = out[-1]
            out[-1] = (i0, b0, n + 1)
        else:
            out.append((i, b, 1))
    return out


class KVConnector:
    def __init__(self, kv, blocks, lock, *, hold_timeout_s: float, engine_id: str | None = None):
        """kv: the runner's KV pool (lumen.model.forward.KV); blocks: the engine's BlockManager; lock: the
        engine's lock (the block manager is changed only under it)."""
        self.kv, self.blocks, self.lock = kv, blocks, lock
        self.hold_timeout_s = hold_timeout_s
        self.engine_id = engine_id or uuid.uuid4().hex[:16]
        L, _, KV_, hd, _ = kv.k.shape
        self.k_size, self.v_size = KV_ * hd * BLOCK, KV_ * BLOCK * kv.v.shape[4]   # u2 per block and layer
        self.n_layer = L
        self._holds: dict[str, _Hold] = {}
        self.stats = KVStats()

    @property
    def block_bytes(self) -> int:
        return self.n_layer * (self.k_size + self.v_size) * 2

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    # ---- producer (scheduler half)
    def request_finished(self, seq, now: float) -> None:
        """seq ended (stop or length) and asked for its KV to be held: pin its computed blocks, name them in its
        kv_transfer_params. Called under the engine's lock, before its blocks are freed."""
        n = seq.num_computed
        blocks = self.blocks.held(seq.request_id)[:self.blocks.blocks_for(n)]
        key = ("kv-hold", seq.request_id)
        self.blocks.pin(key, blocks)
        self._holds[seq.request_id] = _Hold(key, blocks, n, now)
        self.stats.held += 1
        seq.kv_transfer_params = {"remote_engine_id": self.engine_id, "remote_request_id": seq.request_id,
                                  "remote_block_ids": blocks, "num_tokens": n}

    def expire(self, now: float | None = None) -> int:
        """Release the holds older than hold_timeout_s; returns how many."""
        now = time.perf_counter() if now is None else now
        with self.lock:
            old = [rid for rid, h in self._holds.items() if now - h.since > self.hold_timeout_s]
            for rid in old:
                self.blocks.unpin(self._holds.pop(rid).key)
            self.stats.expired += len(old)
        return len(old)

    def release(self, request_id: str) -> bool:
        """Give up a hold (no-op for one not held); True when there was one."""
        with self.lock:
            h = self._holds.pop(request_id, None)
            if h is not None:
                self.blocks.unpin(h.key)
                self.stats.released += 1
        return h is not None

    # ---- producer (worker half)
    def export(self, request_id: str, first: int = 0, end: int | None = None) -> list[KVRun]:
        """The K/V of held blocks first .. end-1 (default: all) as whole-block runs; then the hold is released
        (the copy is the transfer). KVTransferError when the request's KV is not held."""
        t0 = time.perf_counter()
        self.expire(t0)
        with self.lock:
            h = self._holds.pop(request_id, None)      # taken: no expiry while copying; still pinned
        if h is None:
            raise KVTransferError(f"the KV of request {request_id!r} is not held here (expired after "
                                  f"{self.hold_timeout_s:g} s, released, or never made)")
        try:
            end = len(h.blocks) if end is None else min(end, len(h.blocks))
            runs = []
            for i0, b0, n in block_runs(h.blocks[first:end]):
                data = np.empty((self.n_layer, n, self.k_size + self.v_size), np.uint16)
                data[:, :, :self.k_size] = self.kv.k[:, b0:b0 + n].reshape(self.n_layer, n, -1)
                data[:, :, self.k_size:] = self.kv.v[:, b0:b0 + n].reshape(self.n_layer, n, -1)
                runs.append(KVRun(first + i0, data))
        finally:
            with self.lock:
                self.blocks.unpin(h.key)
        self.stats.exported += 1
        self.stats.exported_bytes += sum(r.data.nbytes for r in runs)
        self.stats.export_s += time.perf_counter() - t0
        return runs

    # ---- consumer (scheduler half)
    def first_missing(self, token_ids) -> int:
        """The index of the first of the prompt's blocks this engine's prefix cache lacks (the last prompt token is
        always computed, so never counted)."""
        with self.lock:
            return len(self.blocks.cached_prefix(token_ids, len(token_ids) - 1).blocks)

    def check(self, params, data: KVData | None, n_prompt: int) -> None:
        """RequestError unless params (a producer's kv_transfer_params) and data fit this engine and prompt."""
        if not isinstance(params, dict):
            raise RequestError("kv_transfer_params must be a dict")
        if params.get(DO_REMOTE_DECODE):
            if data is not None:
                raise RequestError("kv_data is for a decode request, not one with do_remote_decode")
            return
        missing = [k for k in KEYS if k not in params]
        if missing:
            raise RequestError(f"kv_transfer_params lacks {', '.join(missing)}")
        n = params["num_tokens"]
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= n_prompt + 1:
            raise RequestError(f"kv_transfer_params' num_tokens must be in [0, {n_prompt + 1}], got {n!r}")
        if data is None:
            return
        at = data.first
        for r in data.runs:
            if r.first != at:
                raise RequestError("kv_data's runs must cover consecutive blocks, in order")
            d = r.data
            if not (isinstance(d, np.ndarray) and d.dtype == np.uint16 and d.ndim == 3 and d.shape[0] == self.n_layer
                    and d.shape[2] == self.k_size + self.v_size and d.shape[1] >= 1):
                raise RequestError(f"kv_data's runs must be uint16 ({self.n_layer}, n, {self.k_size + self.v_size}) "
                                   f"arrays (this model's KV blocks), got {getattr(d, 'dtype', type(d))} "
                                   f"{getattr(d, 'shape', '')}")
            at += r.n_blocks
        if data.end > self.blocks.blocks_for(n):
            raise RequestError(f"kv_data holds {data.end} blocks, more than num_tokens {n} fill")

    def num_external_tokens(self, seq, hit) -> int:
        """How many of seq's tokens need no compute when it is admitted with the local prefix hit `hit`: the hit,
        extended by the received runs when they begin at or before its end (else they are dropped: recomputed)."""
        data = seq.kv_data
        if data is None:
            return hit.n_tokens
        if data.first > len(hit.blocks) or not data.runs:
            seq.kv_data = None
            self.stats.dropped += 1
            return hit.n_tokens
        n = min(seq.kv_transfer_params["num_tokens"], data.end * BLOCK, seq.num_tokens - 1)
        return max(hit.n_tokens, n)

    def after_alloc(self, seq, hit, start: int) -> None:
        """seq was admitted with `start` tokens needing no compute: write the received blocks it needs past the
        local hit into the blocks it now holds, and let the data go. Called under the engine's lock."""
        data, seq.kv_data = seq.kv_data, None
        if data is None:
            return
        t0 = time.perf_counter()
        mine = self.blocks.held(seq.request_id)
        lo, hi = len(hit.blocks), self.blocks.blocks_for(start)
        for r in data.runs:
            a, b = max(lo, r.first), min(hi, r.first + r.n_blocks)
            if a >= b:
                continue
            part = r.data[:, a - r.first:b - r.first]
            dst = np.asarray(mine[a:b], np.int64)
            n = b - a
            self.kv.k[:, dst] = part[:, :, :self.k_size].reshape(self.kv.k.shape[0], n, *self.kv.k.shape[2:])
            self.kv.v[:, dst] = part[:, :, self.k_size:].reshape(self.kv.v.shape[0], n, *self.kv.v.shape[2:])
            self.stats.imported_blocks += n
            self.stats.imported_bytes += part.nbytes
        self.stats.imported += 1
        self.stats.skipped_blocks += lo             # the prefix cache had them: not pulled, or not written
        self.stats.import_s += time.perf_counter() - t0


def needed_blocks(params: dict, n_prompt: int) -> int:
    """How many of the producer's blocks a decode of an n_prompt-token prompt uses (it computes the last prompt
    token itself)."""
    return -(-min(params["num_tokens"], n_prompt - 1) // BLOCK)


def transfer(prefill, decode, token_ids: list[int], params, *, fetch=None) -> str:
    """Run token_ids through `prefill` (one token, KV held), pull the blocks `decode` lacks, and queue the request
    on `decode` with them; returns its request id there (step `decode` to run it). fetch(kv_transfer_params, first):
    the runs (default: prefill.kv.export, in this process). Both engines run the same model."""
    rid = prefill.add_request(token_ids, PREFILL_PARAMS, kv_transfer_params={DO_REMOTE_DECODE: True})
    out = None
    while out is None or not out.finished:
        for o in prefill.step():
            if o.request_id == rid:
                out = o
    if out.kv_transfer_params is None:
        raise KVTransferError(f"the prefill ended with {out.finish_reason}: {out.error}")
    p = out.kv_transfer_params
    first = decode.kv.first_missing(token_ids)
    runs = (fetch or (lambda p, first: prefill.kv.export(p["remote_request_id"], first,
                                                         needed_blocks(p, len(token_ids)))))(p, first)
    return decode.add_request(token_ids, params, kv_transfer_params=p, kv_data=KVData(runs))
