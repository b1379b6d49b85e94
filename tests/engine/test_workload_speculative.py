"""Speculative decoding under a workload: n-gram and draft-model requests (SmolLM2 drafting for itself) beside plain
ones, in a pool that preempts, with stop strings, max_tokens 1, structured output and n > 1 (one prompt, seeds
seed + i as the server sends them). Greedy requests give the tokens of plain decoding alone; seeded ones the tokens
they give alone with the same speculation; and nothing stays held: the pool, the draft model's rows, the
speculator's drafts."""
import pytest

import lumen
from lumen import SamplingParams
from lumen.engine.engine import Engine
from lumen.engine.structured import Constraint

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=512, threads=2)


def workload(model):
    code = model.tokenize("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
                          "def mul(a, b):\n    return a * b\n\n\n" * 4)
    reqs = []
    for i, spec in enumerate(["ngram", "draft", None, "ngram", "draft", "ngram"]):
        reqs.append((code[3 * i:3 * i + 40 + 9 * i], SamplingParams(max_tokens=28, temperature=0, speculative=spec)))
    reqs += [(code[:30], SamplingParams(max_tokens=1, temperature=t, seed=1, speculative=s))
             for t, s in [(0, "ngram"), (0.8, "draft")]]
    reqs += [(code[5:50], SamplingParams(max_tokens=30, temperature=0, speculative=s, stop=("mul",)))
             for s in ("ngram", "draft")]
    story = model.tokenize("Once upon a time, in a small village by the sea, there lived a girl who")
    reqs += [(story, SamplingParams(max_tokens=20, temperature=1.0, seed=7 + i, speculative=s))
             for s in ("ngram", "draft") for i in range(3)]                      # n = 3, seeds 7, 8, 9
    reqs += [(model.tokenize("A person as JSON: "), SamplingParams(
        max_tokens=24, temperature=0, speculative=s, constraint=Constraint.json_schema(SCHEMA))) for s in ("ngram", "draft")]
    return reqs


def summary(o):
    return o.token_ids, o.finish_reason, o.text, o.stop_reason


def test_speculation_under_preemption_is_lossless_and_leaves_nothing_held(model):
    reqs = workload(model)
    alone = Engine(model, max_num_seqs=1, kv_cache_mb=32, max_model_len=256, enable_prefix_caching=False,
                   draft_model=model)
    plain = [summary(o) for o in alone.generate([p for p, _ in reqs], [sp.replace(speculative=None)
                                                                       for _, sp in reqs])]
    spec = [summary(o) for o in alone.generate([p for p, _ in reqs], [sp for _, sp in reqs])]
    per = model.runner.kv_bytes_per_block
    eng = Engine(model, max_num_seqs=6, max_num_batched_tokens=40, kv_cache_mb=per * 14 / 2 ** 20,
                 max_model_len=256, draft_model=model, num_speculative_tokens=4)
    raw = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    outs = [summary(o) for o in raw]
    greedy = [i for i, (_, sp) in enumerate(reqs) if sp.temperature == 0]
    assert [outs[i] for i in greedy] == [plain[i] for i in greedy]
    assert outs == spec
    assert eng.scheduler.num_preemptions > 0
    assert outs[8][1] == "stop" and outs[8][3] == "mul" and "mul" not in outs[8][2]
    n3 = [outs[i][0] for i in range(10, 13)]
    assert len({tuple(t) for t in n3}) > 1                # n > 1: the seeds differ, so do the choices
    assert sum(o.metrics.spec_accepted for o in raw) > 20          # the drafts were verified, and many kept
    eng.blocks.check()
    assert eng.blocks.num_free == eng.blocks.n_blocks and not eng.has_unfinished()
    sp_ = eng.speculator
    assert not sp_._drafts and not sp_._source and not sp_.draft.done
    assert sp_.draft.blocks.num_free == sp_.draft.blocks.n_blocks
