"""Disaggregated prefill in one process (lumen.engine.kv_transfer): a prefill engine holds a finished request's
KV, a decode engine pulls the blocks its prefix cache lacks as whole-block runs and decodes; the output is one
engine's, token for token, and no block is leaked on either side: not on success, not when a hold times out, not
when the decode side gives up or receives something that does not fit."""
import time

import numpy as np
import pytest

import lumen
from goldens import corpus
from lumen import SamplingParams
from lumen.engine.engine import Engine, RequestError
from lumen.engine.kv_transfer import DO_REMOTE_DECODE, KVData, KVRun, KVTransferError, block_runs, transfer
from lumen.kernels.attention import BLOCK

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    path = request.getfixturevalue({"smollm2-135m": "smollm2_path", "qwen2.5-coder-0.5b": "qwen05_path"}
                                   [request.param])
    return lumen.load(path, ctx=1024, threads=2)


def engine(model, **kw):
    return Engine(model, **{"max_num_seqs": 4, "max_num_batched_tokens": 64, "kv_cache_mb": 32, **kw})


def run(eng) -> dict:
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return outs


def prompts(model):
    ids = model.tokenize(corpus()["ppl_text"] * 4)
    return [ids[:5], ids[3:3 + BLOCK + 1], ids[40:80], ids[100:300]]   # short, one block + 1, mid-block, chunked


def test_block_runs_group_consecutive_ids():
    assert block_runs([7, 8, 9, 3, 4, 11]) == [(0, 7, 3), (3, 3, 2), (5, 11, 1)]
    assert block_runs([]) == []


def test_prefill_then_decode_gives_one_engines_tokens_and_frees_every_block(model):
    """Greedy and seeded requests through prefill -> decode equal one engine's; a second prompt sharing a prefix
    pulls only the blocks the decode engine's cache lacks; both pools end as they began."""
    ps = prompts(model)
    greedy, seeded = SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=12, temperature=0.9,
                                                                                   top_p=0.95, seed=7)
    reqs = [(p, greedy) for p in ps] + [(ps[2], seeded)]
    one = engine(model)
    refs = [o.token_ids for o in one.generate([p for p, _ in reqs], [sp for _, sp in reqs])]
    pre, dec = engine(model), engine(model)
    free_pre, free_dec = pre.blocks.num_free, dec.blocks.num_free
    rids = [transfer(pre, dec, p, sp) for p, sp in reqs]       # all queued on decode, then decoded together
    assert pre.kv.num_holds == 0 and pre.blocks.num_free == free_pre
    outs = run(dec)
    assert [outs[r].token_ids for r in rids] == refs
    assert dec.kv.stats.imported == len(reqs) and dec.kv.stats.dropped == 0
    # all were pulled before any ran; the repeated prompt found its blocks cached when admitted: not written
    st = dec.kv.stats
    assert pre.kv.stats.exported_bytes == (st.imported_blocks + st.skipped_blocks) * pre.kv.block_bytes
    assert st.imported_bytes == st.imported_blocks * pre.kv.block_bytes and st.skipped_blocks > 0
    # the decode engine's cache now holds the long prompt: a prompt extending it pulls only the new blocks
    ext = ps[3] + ps[2][:20]
    before = pre.kv.stats.exported_bytes
    rid = transfer(pre, dec, ext, greedy)
    assert pre.kv.stats.exported_bytes - before == pre.kv.block_bytes * (-(-(len(ext) - 1) // BLOCK) -
                                                                         (len(ps[3]) - 1) // BLOCK)
    assert run(dec)[rid].token_ids == one.generate([ext], greedy)[0].token_ids
    assert dec.kv.stats.skipped_blocks >= (len(ps[3]) - 1) // BLOCK
    for e, free in ((pre, free_pre), (dec, free_dec)):
        e.blocks.check()
        assert e.blocks.num_free == free and e.blocks.num_pinned == 0 and e.stats()["kv_held_blocks"] == 0


def test_held_kv_is_released_on_timeout_abort_and_failure(smollm2_path):
    model = lumen.load(smollm2_path, ctx=1024, threads=2)
    ids = prompts(model)[3]
    sp = SamplingParams(max_tokens=8, temperature=0)
    pre, dec = engine(model, kv_hold_timeout_s=0.3), engine(model)
    free_pre, free_dec = pre.blocks.num_free, dec.blocks.num_free

    def prefill(p=ids):
        rid = pre.add_request(p, SamplingParams(max_tokens=1, temperature=0),
                              kv_transfer_params={DO_REMOTE_DECODE: True})
        out = run(pre)[rid]
        assert out.kv_transfer_params["num_tokens"] == len(p) and pre.blocks.num_free < free_pre
        assert out.kv_transfer_params["remote_block_ids"] == pre.blocks._pinned[("kv-hold", rid)]
        return out.kv_transfer_params

    # timeout: nobody pulls; the hold expires (at the next step, export or expire) and the export fails cleanly
    p = prefill()
    assert pre.kv.expire() == 0 and pre.stats()["kv_held_blocks"] == (len(ids) + BLOCK - 1) // BLOCK
    time.sleep(0.35)
    with pytest.raises(KVTransferError, match="not held"):
        pre.kv.export(p["remote_request_id"])
    assert pre.blocks.num_free == free_pre and pre.kv.stats.expired == 1
    # the decode side gives up (client gone): abort on the prefill engine releases the hold
    p = prefill()
    pre.abort(p["remote_request_id"])
    assert pre.blocks.num_free == free_pre and pre.kv.stats.released == 1
    # the prefill replica failed mid-transfer: the decode recomputes, same tokens, nothing leaked
    def dead(params, first):
        pre.kv.release(params["remote_request_id"])           # what its death frees on its side
        raise ConnectionError("prefill replica died")
    with pytest.raises(ConnectionError):
        transfer(pre, dec, ids, sp, fetch=dead)
    assert pre.blocks.num_free == free_pre
    rid = dec.add_request(ids, sp)                             # recompute
    assert run(dec)[rid].token_ids == engine(model).generate([ids], sp)[0].token_ids
    # data that does not fit: a clean RequestError, nothing queued or held
    p = prefill()
    runs = pre.kv.export(p["remote_request_id"])
    data = np.concatenate([r.data for r in runs], axis=1)
    bad, swapped = [KVRun(0, data[:, :, :-1])], [KVRun(2, data[:, 2:]), KVRun(0, data[:, :2])]
    for kw, match in ((dict(kv_data=KVData(bad)), "uint16"), (dict(kv_data=KVData(swapped)), "consecutive"),
                      (dict(), "kv_transfer_params")):
        with pytest.raises(RequestError, match=match):
            dec.add_request(ids, sp, kv_transfer_params=p if kw else {"remote_engine_id": "x"}, **kw)
    with pytest.raises(RequestError, match="num_tokens"):
        dec.add_request(ids, sp, kv_transfer_params={**p, "num_tokens": 10 ** 6})
    # runs that begin past the decode cache's hit (its cache was evicted meanwhile): dropped, recomputed
    late = [KVRun(r.first + 1, r.data[:, 1:]) for r in runs[:1]]
    rid = dec.add_request(ids + [5], sp, kv_transfer_params=p, kv_data=KVData(late))
    dec.blocks.by_name.clear()                                 # (forget the cached prefix, as an eviction would)
    dec.blocks._name_of = [None] * dec.blocks.n_blocks
    assert run(dec)[rid].token_ids == engine(model).generate([ids + [5]], sp)[0].token_ids
    assert dec.kv.stats.dropped == 1
    # a prefill that is aborted or fails holds nothing
    rid = pre.add_request(ids[1:], SamplingParams(max_tokens=1), kv_transfer_params={DO_REMOTE_DECODE: True})
    assert not pre.step()                                      # (a chunk of its prompt: not cached, not done)
    pre.abort(rid)
    out = run(pre)[rid]
    assert out.finish_reason == "abort" and out.kv_transfer_params is None
    for e, free in ((pre, free_pre), (dec, free_dec)):
        e.blocks.check()
        assert e.blocks.num_free == free and e.blocks.num_pinned == 0


def test_exported_runs_are_the_pools_blocks(smollm2_path):
    """A run is one contiguous array per run of consecutive blocks: each block's K then V, every layer."""
    model = lumen.load(smollm2_path, ctx=1024, threads=2)
    pre = engine(model)
    rid = pre.add_request(prompts(model)[3], SamplingParams(max_tokens=1), kv_transfer_params={DO_REMOTE_DECODE: True})
    p = run(pre)[rid].kv_transfer_params
    blocks = p["remote_block_ids"]
    k, v = pre.runner.kv.k[:, blocks].copy(), pre.runner.kv.v[:, blocks].copy()
    runs = pre.kv.export(rid, 2)
    assert runs[0].first == 2 and sum(r.n_blocks for r in runs) == len(blocks) - 2
    assert all(r.data.flags.c_contiguous for r in runs)
    data = np.concatenate([r.data for r in runs], axis=1)
    L, n = data.shape[:2]
    np.testing.assert_array_equal(data[:, :, :pre.kv.k_size].reshape(L, n, *k.shape[2:]), k[:, 2:])
    np.testing.assert_array_equal(data[:, :, pre.kv.k_size:].reshape(L, n, *v.shape[2:]), v[:, 2:])
