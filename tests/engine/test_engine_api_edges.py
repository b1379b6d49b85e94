"""The engine's public methods given input they must refuse: a clear ValueError or TypeError, raised before the
engine changes, and the engine serves the next request as before."""
import pytest

import lumen
from lumen import SamplingParams
from lumen.engine.config import SpeculativeConfig
from lumen.engine.engine import Engine, RequestError
from lumen.errors import LumenError


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return Engine(lumen.load(smollm2_path, ctx=256, threads=2), max_num_seqs=4, kv_cache_mb=16)


def serves(engine) -> bool:
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0]
    return (out.finish_reason == "length" and engine.blocks.num_free == engine.blocks.n_blocks
            and not engine.has_unfinished())


@pytest.mark.parametrize("prompt", [["1", "2"], ("7",), [b"1"]])
def test_a_token_id_prompt_of_strings_is_refused(engine, prompt):
    with pytest.raises(RequestError, match="must hold integers"):
        engine.add_request(prompt)
    assert serves(engine)


@pytest.mark.parametrize("rid", [5, ("a",), [1], b"x", ""])
def test_a_request_id_that_is_not_a_nonempty_string_is_refused(engine, rid):
    with pytest.raises((TypeError, ValueError), match="request_id must be a non-empty string"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id=rid)
    assert serves(engine)


@pytest.mark.parametrize("rid", [[1], {"a": 1}, 5])
def test_abort_of_a_non_string_id_is_a_type_error(engine, rid):
    with pytest.raises(TypeError, match="request_id must be a string"):
        engine.abort(rid)
    assert serves(engine)


def test_generate_interrupted_leaves_no_request_behind(engine, monkeypatch):
    """An exception out of a step (KeyboardInterrupt, an engine bug) ends generate; its requests must not stay
    queued, holding blocks and costing every later step."""
    calls, run = [0], engine.runner.run_plan

    def fail_second(*a):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return run(*a)
    monkeypatch.setattr(engine.runner, "run_plan", fail_second)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=8, temperature=0))
    monkeypatch.undo()
    assert engine.num_running == engine.num_waiting == 0
    engine.step()                                       # the aborts' outputs
    assert serves(engine)


@pytest.mark.parametrize("kw, match", [
    (dict(speculative=None), "speculative must be a SpeculativeConfig"),
    (dict(speculative="ngram"), "speculative must be a SpeculativeConfig"),
    (dict(speculative=SpeculativeConfig(), num_speculative_tokens=3), "not both"),
])
def test_engine_speculative_option_errors_name_it(smollm2_path, kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Engine(smollm2_path, max_num_seqs=1, kv_cache_mb=4, **kw)


def test_engine_takes_a_speculative_config(engine):
    e = Engine(engine.parts, max_num_seqs=1, kv_cache_mb=4, speculative=SpeculativeConfig(num_speculative_tokens=3))
    assert e.engine_config.speculative.num_speculative_tokens == 3


def test_without_chunked_prefill_a_prompt_over_the_budget_still_runs(engine):
    """With chunked prefill off a prompt runs whole, but one longer than max_num_batched_tokens never could:
    it is chunked even so, instead of waiting forever (and everything queued behind it)."""
    e = Engine(engine.parts, max_num_seqs=2, max_num_batched_tokens=32, enable_chunked_prefill=False,
               kv_cache_mb=4, max_model_len=256)
    p = SamplingParams(max_tokens=3, temperature=0)
    rids = [e.add_request(list(range(100, 140)), p), e.add_request([1, 2, 3], p)]
    done = {}
    for _ in range(50):
        done.update((o.request_id, o) for o in e.step() if o.finished)
        if not e.has_unfinished():
            break
    assert [done[r].finish_reason for r in rids if r in done] == ["length", "length"]
    ref = Engine(engine.parts, max_num_seqs=1, kv_cache_mb=4, max_model_len=256).generate([list(range(100, 140))], p)
    assert done[rids[0]].token_ids == ref[0].token_ids


def test_a_max_model_len_too_big_for_memory_is_a_lumen_error(engine, monkeypatch):
    """Engine(max_model_len=10**9) died with numpy's 'Unable to allocate 119. GiB' for the RoPE tables. (Made to
    fail here whatever the machine's memory.)"""
    import lumen.engine.runner as runner

    def no_memory(*a):
        raise MemoryError("Unable to allocate 119. GiB")
    monkeypatch.setattr(runner, "make_arch", no_memory)
    with pytest.raises(LumenError, match="max_model_len 1000000000,.* do not fit in memory"):
        Engine(engine.parts, max_model_len=10 ** 9, max_num_seqs=1, kv_cache_mb=4)


@pytest.mark.parametrize("metrics", ["x", {}, 0])
def test_metrics_not_request_metrics_is_a_type_error(engine, metrics):
    """A wrong metrics object was taken, then failed inside the scheduler after its blocks were allocated: the
    step raised AttributeError and a block leaked for good."""
    with pytest.raises(TypeError, match="metrics must be a RequestMetrics"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), metrics=metrics)
    assert serves(engine)


@pytest.mark.parametrize("stop", ["token", "string", "max_tokens"])
def test_speculative_logprobs_end_with_the_tokens(engine, stop):
    """A verification step accepts several tokens at once; when a stop token, a stop string or max_tokens ends
    the request among them, the logprobs of the tokens after the end were kept: 3 logprobs for 1 token."""
    ids = "The quick brown fox jumps over the lazy dog. " * 12
    plain = SamplingParams(max_tokens=24, temperature=0, logprobs=1, ignore_eos=True)
    want = engine.generate([ids], plain)[0]
    end = 5                                                   # the request ends with its 6th token
    kw = {"token": dict(stop_token_ids=[want.token_ids[end]]),
          "string": dict(stop=[engine.tokenizer.decode(want.token_ids[end:end + 1]).strip() or "x"]),
          "max_tokens": dict(max_tokens=end + 1)}[stop]
    for sp in (plain.replace(**kw), plain.replace(speculative="ngram", **kw)):
        out = engine.generate([ids], sp)[0]
        assert len(out.logprobs) == len(out.token_ids)
        assert out.logprobs == want.logprobs[:len(out.token_ids)]


def test_counts_in_errors_are_singular_or_plural(engine, smollm2_path):
    """It said "the prompt (1 tokens)": one token, one KV block are singular, other counts plural."""
    n = engine.max_model_len
    with pytest.raises(lumen.ContextError, match=rf"^the prompt \(1 token\) plus max_tokens \({n}\) exceeds"):
        engine.add_request([1], SamplingParams(max_tokens=n))
    with pytest.raises(lumen.ContextError, match=rf"^the prompt \(2 tokens\) plus max_tokens \({n - 1}\) exceeds"):
        engine.add_request([1, 2], SamplingParams(max_tokens=n - 1))
    m = lumen.load(smollm2_path, ctx=16, threads=1)
    with pytest.raises(lumen.ContextError, match=r"^the prompt \(1 token\) plus max_tokens \(16\) exceeds the "
                                                 r"context of 16 tokens"):
        m.generate([1], max_tokens=16)
    m.prefill(list(range(1, 16)))
    with pytest.raises(lumen.ContextError, match=r"^15 tokens in the cache \+ 2 new ones exceed"):
        m.prefill([1, 2])
    m.prefill([1])
    with pytest.raises(lumen.ContextError, match=r"^16 tokens in the cache \+ 1 new one exceed"):
        m.decode(1)
    assert serves(engine)


def test_plural():
    from lumen.errors import plural
    assert [plural(n, "token") for n in (0, 1, 2)] == ["0 tokens", "1 token", "2 tokens"]


def test_an_engine_closes_at_the_end_of_its_with_block(engine):
    """`with lumen.Engine(...) as engine:` said "'Engine' object does not support the context manager protocol",
    and there was no close(): a request still queued, a stream still followed and the grammar threads lived on
    with the engine. Closing aborts them (a stream ends with its "abort" output), and a closed engine refuses work
    with one clear line, not an "error" output per prompt."""
    from lumen.engine.structured import Constraint
    with Engine(engine.parts, max_num_seqs=2, kv_cache_mb=16) as e:
        stream = e.stream([1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
        assert not next(stream).finished
        e.add_request([4, 5, 6], SamplingParams(max_tokens=50, constraint=Constraint.choice(["yes", "no"])))
    assert e.closed and [out.finish_reason for out in stream] == ["abort"]
    assert e.blocks.num_free == e.blocks.n_blocks and not e.has_unfinished()
    assert e.structured.compiler._pool._shutdown
    for call in (lambda: e.add_request([1, 2]), lambda: e.generate([[1, 2]], SamplingParams(max_tokens=2)),
                 lambda: e.stream([1, 2])):
        with pytest.raises(LumenError, match=r"^this engine is closed \(engine.close\(\), or the end of its `with`"):
            call()
    e.close()                                           # again: nothing to do
    assert serves(engine)                               # another engine over the same weights


def test_a_max_model_len_beyond_the_trained_context_warns_as_lumen_load_does(engine, smollm2_path):
    """lumen.load(..., max_model_len=...) warns past the trained context; lumen.Engine took any length without a
    word (8192 trained, 100000 given) and generated past it. ModelParts come from a Model that warned already."""
    import warnings
    with pytest.warns(lumen.errors.ContextWarning, match=r"^max_model_len=8200 is beyond the 8192 tokens this "
                                                         r"model was trained on") as caught:
        Engine(smollm2_path, max_model_len=8200, max_num_seqs=1, kv_cache_mb=4)
    assert [w.filename for w in caught] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(smollm2_path, max_model_len=8192, max_num_seqs=1, kv_cache_mb=4)
        Engine(engine.parts, max_model_len=8200, max_num_seqs=1, kv_cache_mb=4)


@pytest.mark.parametrize("stop", ["\n", ["\n"], 5])
def test_a_stream_stop_that_is_not_callable_is_refused_before_the_request_is_queued(engine, stop):
    """stream(..., stop="\\n") (the name of SamplingParams' stop strings) queued the request and failed at the first
    next with "'str' object is not callable" from inside the engine's loop."""
    with pytest.raises(TypeError, match=r"^stop must be a callable .*\(stop strings go in SamplingParams\(stop="):
        engine.stream([1, 2, 3], SamplingParams(max_tokens=2), stop=stop)
    assert not engine.has_unfinished() and serves(engine)


def test_closing_while_another_thread_steps_waits_for_its_step(engine, monkeypatch):
    """close() from one thread while another thread's stream was in a step: the grammar threads were stopped under
    that step, whose masks then failed with "cannot schedule new futures after shutdown" in the streaming thread."""
    import threading
    import time
    from lumen.engine.structured import Constraint
    e = Engine(engine.parts, max_num_seqs=2, kv_cache_mb=16)
    stream = e.stream([1, 2, 3], SamplingParams(max_tokens=40, constraint=Constraint.regex("[a-z ]{1,40}")))
    in_step, start, calls = threading.Event(), e.structured.start_masks, []

    def slow_start(*a):
        calls.append(1)
        if len(calls) == 2:                             # (the first made the mask filler)
            in_step.set()
            time.sleep(0.3)
        return start(*a)
    monkeypatch.setattr(e.structured, "start_masks", slow_start)
    got = []
    t = threading.Thread(target=lambda: got.extend(stream))     # (an exception here would leave got empty)
    t.start()
    assert in_step.wait(30)
    e.close()
    t.join(30)
    assert got and got[-1].finished and got[-1].finish_reason == "abort"


def test_a_kv_cache_smaller_than_max_model_len_is_said_when_the_engine_is_built(engine, caplog):
    """Engine(kv_cache_mb=1) built without a word, and then every request longer than its 32 tokens ended with
    finish_reason "error"; it is said at once (requests are still checked against the pool, as before)."""
    with caplog.at_level("WARNING", logger="lumen.engine"):
        small = Engine(engine.parts, max_model_len=2048, max_num_seqs=1, num_kv_blocks=2)
    said = [r.getMessage() for r in caplog.records if r.name == "lumen.engine"]
    assert said == ["the KV cache holds 32 tokens, fewer than max_model_len 2048: a request needing more ends with "
                    "an error; raise kv_cache_mb or lower max_model_len"], said
    out = small.generate([[1, 2, 3]], SamplingParams(max_tokens=40, temperature=0))[0]
    assert out.finish_reason == "error" and "needs 3 KV blocks but the pool has 2" in out.error
    caplog.clear()
    with caplog.at_level("WARNING", logger="lumen.engine"):
        Engine(engine.parts, max_model_len=32, max_num_seqs=1, num_kv_blocks=2)
    assert not [r for r in caplog.records if r.name == "lumen.engine"]
