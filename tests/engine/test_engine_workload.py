"""A randomized workload through the step API against each request run alone: requests added between steps,
aborted at any stage, prompts sharing prefixes of odd lengths, a KV pool small enough to preempt, greedy and
seeded sampling, n-gram speculation, stop tokens and strings, min_tokens, penalties. Every request that was not
aborted ends with the token ids, logprobs, text and finish reason it has alone; the pool is consistent after every
step and whole at the end. (Sampled requests that speculate are left out of the comparison: which uniforms decide
their tokens depends on the drafts, lumen.engine.sampling.params.)"""
import random

import pytest

import lumen
from lumen import SamplingParams
from lumen.engine.engine import Engine


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=512, threads=2)


def requests(model, rng):
    base = model.tokenize("The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, " * 20)
    out = []
    for i in range(14):
        a, n = rng.choice([0, 0, 3, 17]), rng.choice([5, 16, 31, 32, 33, 47, 90, 150])
        out.append((base[a:a + n], SamplingParams(
            max_tokens=rng.choice([1, 5, 20, 40]), temperature=rng.choice([0, 0, 0.8]), seed=i, logprobs=1,
            speculative=rng.choice([None, None, "ngram"]), min_tokens=rng.choice([0, 0, 1]),
            stop_token_ids=rng.choice([(), (base[a + n],)]), stop=rng.choice([(), (" the",), ("\n",)]),
            repeat_penalty=rng.choice([1.0, 1.3]), ignore_eos=rng.choice([False, True]))))
    return out


def summary(o):
    return o.token_ids, o.logprobs, o.finish_reason, o.text


@pytest.mark.parametrize("seed", [4, 7, 9])
def test_random_workload_matches_each_request_alone(model, seed):
    rng = random.Random(seed)
    reqs = requests(model, rng)
    alone = Engine(model, max_num_seqs=1, kv_cache_mb=64, max_model_len=512, enable_prefix_caching=False)
    want = [summary(alone.generate([p], sp)[0]) for p, sp in reqs]
    per = model.runner.kv_bytes_per_block
    e = Engine(model, max_num_seqs=rng.choice([3, 6, 16]), max_num_batched_tokens=rng.choice([8, 24, 64, 200]),
               kv_cache_mb=per * 12 / 2 ** 20, max_model_len=512, scheduler=rng.choice(["fcfs", "paced"]))
    todo, index, done, aborted = list(range(len(reqs))), {}, {}, set()
    rng.shuffle(todo)
    for _ in range(2000):
        if not todo and not e.has_unfinished():
            break
        if todo and rng.random() < 0.5:
            i = todo.pop()
            index[e.add_request(*reqs[i])] = i
        if index and rng.random() < 0.03:
            rid = rng.choice(list(index))
            e.abort(rid)
            aborted.add(rid)
        done.update((o.request_id, o) for o in e.step() if o.finished)
        e.blocks.check()
    assert sorted(done) == sorted(index)
    compared = [r for r in index if r not in aborted and not (reqs[index[r]][1].speculative
                                                              and reqs[index[r]][1].temperature)]
    assert len(compared) >= 6
    assert [summary(done[r]) for r in compared] == [want[index[r]] for r in compared]
    assert e.blocks.num_free == e.blocks.n_blocks
