"""Speculative decoding: greedy output bit-identical to plain decoding (n-gram lookup and a draft model), the
sampled output distribution equal to the target's (a chi-square test that two wrong acceptance rules fail),
seeded requests reproducible, requests with and without speculation in one step, and across preemption."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

import lumen
import synth
from goldens import corpus
from lumen import Engine, SamplingParams
from lumen.engine.sampling.sampler import PICK, RESIDUAL, uniform
from lumen.engine.config import SpeculativeConfig
from lumen.engine.sequence import Status
from lumen.engine.costs.steps import StepCosts
from lumen.engine.speculative import (PRIOR, NgramDrafter, SpecState, Speculator, choose_k, expected_tokens,
                                      skipped, update_alpha, verify)
from lumen.engine.speculative.verify import draw, prob


def write_tiny(path, seed: int, n_vocab: int = 16, sharp: float = 8.0, reverse: bool = False):
    """A 2-layer llama with a 16-token vocabulary (14 letters, "ab", an end token) and F16 weights; `sharp`
    scales the embedding so the next-token distributions are neither flat nor certain; `reverse`: the letters in
    the other order (another vocabulary of the same size)."""
    d = dict(n_embd=64, n_ff=96, n_head=4, n_head_kv=2, n_layer=2, head_dim=16)
    rng = np.random.default_rng(seed)
    letters = [chr(ord("a") + i) for i in range(n_vocab - 2)]
    toks = letters[::-1 if reverse else 1] + ["ab", "<eos>"]
    tensors = synth.model_tensors("llama", n_vocab, rng, d)
    tensors["token_embd.weight"] *= sharp
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(d["n_layer"])
    w.add_context_length(256)
    w.add_embedding_length(d["n_embd"])
    w.add_feed_forward_length(d["n_ff"])
    w.add_head_count(d["n_head"])
    w.add_head_count_kv(d["n_head_kv"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(toks)
    w.add_token_types([1] * (n_vocab - 1) + [3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(n_vocab - 1)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
    for name, arr in tensors.items():
        if arr.ndim == 2:
            w.add_tensor(name, arr.astype(np.float16), raw_dtype=T.F16)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    target = lumen.load(write_tiny(d / "target.gguf", 1), ctx=128, threads=2)
    draft = lumen.load(write_tiny(d / "draft.gguf", 2), ctx=128, threads=2)
    return target, draft


# ---------------------------------------------------------------- greedy: bit-identical output

def prompts(model):
    text = corpus()["ppl_text"]
    ids = model.tokenize(text * 3)
    code = model.tokenize("def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n")
    return [ids[:200] + ids[:60], code, ids[300:340]]     # repeats (drafts accepted), code, plain prose


@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_greedy_ngram_is_bit_identical(name, smollm2_path, gemma3_path):
    m = lumen.load(smollm2_path if name == "smollm2-135m" else gemma3_path, ctx=1024, threads=2)
    m.speculation(num_speculative_tokens=4)
    accepted = 0
    for ids in prompts(m):
        plain = m.engine.generate([ids], SamplingParams(max_tokens=48, temperature=0))[0]
        spec = m.engine.generate([ids], SamplingParams(max_tokens=48, temperature=0, speculative="ngram"))[0]
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text
        accepted += spec.metrics.spec_accepted
    assert accepted > 0                                   # the repeated passage was drafted and accepted


def test_greedy_draft_model_is_bit_identical(tiny):
    target, draft = tiny
    eng = Engine(target, max_model_len=128, max_num_seqs=8, kv_cache_mb=4, draft_model=draft,
                 num_speculative_tokens=3)
    same = Engine(target, max_model_len=128, max_num_seqs=8, kv_cache_mb=4, draft_model=target,
                  num_speculative_tokens=3, adaptive_k=False)        # always drafts (the tiny model's steps are
                                                                     # too short for drafting to pay)
    for i, ids in enumerate([[0, 1, 2, 3], [5, 4, 3], list(range(14)) * 3]):
        p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        plain = eng.generate([ids], p)[0]
        spec = eng.generate([ids], p.replace(speculative="draft"))[0]
        assert spec.token_ids == plain.token_ids, i
        selfspec = same.generate([ids], p.replace(speculative="draft"))[0]     # the target drafting for itself
        assert selfspec.token_ids == plain.token_ids
        assert selfspec.metrics.spec_accepted == selfspec.metrics.spec_proposed > 0   # every draft accepted


# ---------------------------------------------------------------- sampling: the target's distribution

N_SAMPLES = 20_000
N_FOIL = 5_000          # the wrong rules' runs: they fail by far (max chi2 at 20,000 samples: accept_all 43,369,
                        # no_residual 478; at 5,000: 11,039 and 119, against the limit of 50; the seeds are fixed)
POSITIONS = 4
PROMPT = [0, 1, 2, 3]
PARAMS = SamplingParams(max_tokens=POSITIONS, temperature=1.0, ignore_eos=True)


def exact_marginals(model) -> list[np.ndarray]:
    """The target's marginal distribution of each of the first POSITIONS sampled tokens, by enumerating every
    prefix (16^3 of them for the last position): one teacher-forced pass per prefix gives its next-token p."""
    V = model.config.n_vocab
    out = [np.zeros(V) for _ in range(POSITIONS)]

    def walk(prefix, weight, depth):
        x = np.float64(model.logits(PROMPT + prefix)[-1])
        p = np.exp(x - x.max())
        p /= p.sum()
        out[depth] += weight * p
        if depth + 1 < POSITIONS:
            for t in range(V):
                walk(prefix + [t], weight * p[t], depth + 1)
    walk([], 1.0, 0)
    return out


def wrong_verify(rule: str):
    """A deliberately wrong acceptance rule in lumen.engine.speculative.verify's place (the statistical test's
    foils): "accept_all" keeps every draft token; "no_residual" accepts a draft token when the draft's
    probability is no higher than the target's, and otherwise draws afresh from the target, not the residual."""
    def verify_wrong(row, draft, k, key, pos, sampler):
        emitted = []
        for i in range(k + 1):
            ids, p = sampler.distribution(row(i))
            if i >= len(draft.tokens):
                emitted.append(draw(ids, p, uniform(key, pos + i, PICK)))
                return emitted, i
            d = draft.tokens[i]
            q_ids, q = (None, None) if draft.q is None else draft.q[i]
            q_d = 1.0 if q is None else prob(q_ids, q, d)
            if rule == "accept_all" or q_d <= prob(ids, p, d):
                emitted.append(d)
                if i == k:
                    return emitted, k
                continue
            emitted.append(draw(ids, p, uniform(key, pos + i, RESIDUAL)))
            return emitted, min(i, k)
        raise AssertionError("unreachable")
    return verify_wrong


def sample_marginals(target, draft, rule: str, n: int = N_SAMPLES) -> list[np.ndarray]:
    eng = Engine(target, max_model_len=16, max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_mb=8,
                 draft_model=draft, num_speculative_tokens=2, enable_prefix_caching=False, adaptive_k=False)
    eng.speculator.verify_rule = verify if rule == "exact" else wrong_verify(rule)
    p = PARAMS.replace(speculative="draft", num_speculative_tokens=2)
    outs = eng.generate([PROMPT] * n, [p.replace(seed=i) for i in range(n)])
    V = target.config.n_vocab
    counts = np.zeros((POSITIONS, V))
    for o in outs:
        assert len(o.token_ids) == POSITIONS
        counts[np.arange(POSITIONS), o.token_ids] += 1
    assert sum(o.metrics.spec_proposed for o in outs) > n             # the draft really proposed (k up to 2)
    return counts


def chi2(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """Pearson's chi-square statistic and its degrees of freedom, over the bins with expected count >= 5 (the
    rest pooled into one)."""
    n = counts.sum()
    exp = n * p
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    keep = e > 0
    return float(((obs[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


# chi-square critical value at p = 1e-4 for up to 15 degrees of freedom is below 45; the tests use 50
CHI2_LIMIT = 50.0


@pytest.fixture(scope="module")
def exact(tiny):
    return exact_marginals(tiny[0])


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution(tiny, exact):
    counts = sample_marginals(*tiny, "exact")
    for i in range(POSITIONS):
        stat, dof = chi2(counts[i], exact[i])
        tv = 0.5 * np.abs(counts[i] / N_SAMPLES - exact[i]).sum()
        print(f"\nposition {i}: chi2 {stat:.1f} (dof {dof}), total variation {tv:.4f}")
        assert stat < CHI2_LIMIT and tv < 0.02


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["accept_all", "no_residual"])
def test_wrong_acceptance_rules_fail_the_same_test(tiny, exact, rule):
    """The same statistic catches both wrong rules: accepting every draft token, and accepting when the draft's
    probability is no higher than the target's, else drawing afresh from the target (not the residual)."""
    counts = sample_marginals(*tiny, rule, N_FOIL)
    stats = [chi2(counts[i], exact[i])[0] for i in range(POSITIONS)]
    print(f"\n{rule}: chi2 per position {[round(s, 1) for s in stats]}")
    assert max(stats) > CHI2_LIMIT


# ---------------------------------------------------------------- seeds, mixed batches, preemption

def test_seeded_speculation_is_reproducible_and_batch_invariant(tiny):
    """A seeded request samples the same tokens alone or beside others, whatever k the engine picked."""
    target, draft = tiny
    p = SamplingParams(max_tokens=20, temperature=0.9, top_k=8, seed=7, ignore_eos=True, speculative="draft")
    eng = Engine(target, max_model_len=64, max_num_seqs=8, kv_cache_mb=4, draft_model=draft)
    alone = eng.generate([[1, 2, 3]], p)[0].token_ids
    mixed = eng.generate([[4, 5], [1, 2, 3], [7] * 10, [1, 2, 3]],
                         [p.replace(seed=1), p, SamplingParams(max_tokens=20, temperature=0),
                          p.replace(num_speculative_tokens=1)])
    assert mixed[1].token_ids == alone and mixed[3].token_ids == alone
    plain = eng.generate([[1, 2, 3]], p.replace(speculative=None))[0].token_ids   # same seed, no drafts
    assert len(plain) == len(alone)


@pytest.mark.slow
def test_mixed_batch_and_preemption_greedy(smollm2_path):
    """Requests speculating (n-gram) and not, in one engine whose pool forces preemption: each equals its
    plain run alone."""
    m = lumen.load(smollm2_path, ctx=1024, threads=2)
    ids = prompts(m)
    reqs = [(ids[0], "ngram"), (ids[1], None), (ids[2], "ngram"), (ids[0][:120], None), (ids[1] * 2, "ngram")]
    alone = [m.engine.generate([r], SamplingParams(max_tokens=40, temperature=0))[0].token_ids for r, _ in reqs]
    tight = Engine(m, max_model_len=512, max_num_seqs=5, max_num_batched_tokens=128,
                   kv_cache_mb=26 * m.runner.kv_bytes_per_block / 2 ** 20)
    outs = tight.generate([r for r, _ in reqs], [SamplingParams(max_tokens=40, temperature=0, speculative=s)
                                                 for _, s in reqs])
    assert [o.token_ids for o in outs] == alone
    assert tight.scheduler.num_preemptions > 0
    assert tight.blocks.num_free == tight.blocks.n_blocks
    assert any(o.metrics.spec_accepted for o in outs)


# ---------------------------------------------------------------- the drafter and the choice of k

def test_ngram_drafter_proposes_what_followed():
    class S:
        pass
    seq = S()
    seq.spec = SpecState()
    seq.tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    d = NgramDrafter(1, 3).propose([(seq, 3)])[seq]
    assert d.tokens == [4, 5, 9]                 # "1 2 3" was followed by 4 5 9
    seq.tokens = [7, 8, 6]
    seq.spec = SpecState()
    assert NgramDrafter(1, 3).propose([(seq, 3)]) == {}          # nothing to match


def test_acceptance_is_kept_per_match_length():
    """A draft after a long match and one after a short match are judged apart: poor 1-token matches must not
    stop the drafting of 3-token matches (and the other way round)."""
    st, dr = SpecState(), NgramDrafter(1, 3)
    assert dr.match(st, [1, 2, 3, 4, 5, 9, 1, 2, 3]) == 3
    assert dr.match(st, [1, 2, 3, 4, 5, 9, 1, 2, 3, 8, 5]) == 1
    assert dr.match(st, [6, 7]) is None
    d = NgramDrafter(1, 3).propose([(type("S", (), {"spec": SpecState(), "tokens": [1, 2, 3, 4, 1, 2, 3]})(), 2)])
    assert [x.n for x in d.values()] == [3]
    for _ in range(10):
        update_alpha(st, 4, 0, n=1)
        update_alpha(st, 4, 4, n=3)
    assert st.alpha_of(1) < 0.05 and st.alpha_of(3) > 0.95
    assert st.steps == 20 and st.proposed == 80 and st.accepted == 40


def test_choose_k_weighs_acceptance_against_measured_cost():
    flat = lambda k: 1.0 + 0.01 * k            # noqa: E731  bandwidth-bound: extra tokens nearly free
    steep = lambda k: 1.0 + 1.0 * k            # noqa: E731  compute-bound: each token costs a step
    assert choose_k(0.9, 8, flat) == 8
    assert choose_k(0.05, 8, flat) <= 1
    assert choose_k(0.9, 8, steep) == 0          # speculation does not pay: plain decode
    assert math.isclose(expected_tokens(0.5, 2), 1.75)


# ---------------------------------------------------------------- k by measured cost

class _Params:
    def __init__(self, speculative):
        self.speculative, self.num_speculative_tokens = speculative, None


class _Seq:
    """What the speculator reads of a decoding request."""
    def __init__(self, speculative="draft", alpha=0.8, tokens=(5, 6, 7), left=1000):
        self.params = _Params(speculative)
        self.spec = SpecState(hits=alpha)
        self.tokens = list(tokens)                     # the default has no n-gram match
        self.output_ids, self.max_tokens = [], left    # tokens it may still generate
        self.chooser = SimpleNamespace(sampler=SimpleNamespace(greedy=True))


MATCH = (1, 2, 3, 4, 1, 2, 3)                          # ends in "1 2 3", which occurred before


class _CaughtUp(dict):
    """A draft cache that holds every token of each request (no gap to catch up on)."""
    def get(self, seq, default=None):
        return len(seq.tokens) - 1


class _Draft:
    FOLD = 8

    def __init__(self, ms_per_step):
        self.costs, self.cost_ratio = StepCosts(), 0.4
        self.costs.add(1, ms_per_step * 1e-3, 1)
        self.done = _CaughtUp()


def _speculator(target_ms: dict, draft_ms: float | None = None) -> Speculator:
    """A Speculator over a fake cost table: target_ms {tokens: ms} of one-sequence steps, draft_ms a draft step."""
    costs = StepCosts()
    for n, ms in target_ms.items():
        costs.add(n, ms * 1e-3, 1)
    return Speculator(SpeculativeConfig(num_speculative_tokens=5), costs,
                      None if draft_ms is None else _Draft(draft_ms))


FLAT = {n: 20.0 + 0.5 * (n - 1) for n in range(1, 7)}        # bandwidth-bound: a verification costs ~a step
STEEP = {n: 20.0 * n for n in range(1, 7)}                   # compute-bound: each row costs a step


@pytest.mark.parametrize("target, draft_ms, alpha, wins", [
    (FLAT, 3.0, 0.8, True),            # a cheap, good draft
    (FLAT, 15.0, 0.6, False),          # a draft step 3/4 of the target's at 0.6 acceptance: plain decode is faster
    (FLAT, 15.0, 0.95, True),          # ... unless nearly every draft is accepted
    (STEEP, 1.0, 0.9, False),          # verification rows cost what steps cost: nothing beats plain decode
])
def test_k_by_measured_cost_includes_the_draft(target, draft_ms, alpha, wins):
    sp = _speculator(target, draft_ms)
    seq = _Seq("draft", alpha)
    k = sp._choose_k(seq, room=5, planned=0)
    assert (k > 0) == wins, k
    if k:                                  # the k chosen has the most expected tokens per second, k = 0 included
        rate = lambda j: expected_tokens(alpha, j) / (target[1 + j] + j * draft_ms)   # noqa: E731
        assert rate(k) == max(rate(j) for j in range(6)) and rate(k) > rate(0)


def test_k_by_measured_cost_ngram():
    seq = _Seq("ngram", tokens=MATCH)
    seq.spec.judged_n[3] = (0.5, 1.0)
    assert _speculator(FLAT)._choose_k(seq, room=5, planned=0) >= 3
    assert _speculator(STEEP)._choose_k(seq, room=5, planned=0) == 0
    assert seq.spec.alpha_of(3) > 0.5                  # judged not to pay: drifts back towards the prior


def test_draft_cost_before_it_is_measured_follows_the_bytes():
    sp = _speculator(FLAT, 10.0)
    sp.draft.costs = StepCosts()                      # nothing measured: the target's step scaled by bytes
    assert math.isclose(sp.draft_cost(0.020), 0.020 * 0.4)


def test_a_skipped_draft_request_recovers():
    sp = _speculator(FLAT, 15.0)
    seq = _Seq("draft", 0.3)
    seq.spec.judged = 1.0
    assert sp._choose_k(seq, room=5, planned=0) == 0
    assert 0.3 < seq.spec.alpha < PRIOR and math.isclose(seq.spec.hits / seq.spec.judged, seq.spec.alpha)


def test_drafting_must_beat_plain_decode_by_the_margin():
    """At the break-even the estimate's noise makes drafting lose: k > 0 only past MARGIN."""
    from lumen.engine.speculative.speculator import MARGIN
    cost = {0: 0.014, 1: 0.018}.__getitem__             # a 2-row step at 1.29x a 1-row one
    even = 0.018 / 0.014 - 1                           # alpha at which k = 1 breaks even
    assert choose_k(even + 0.01, 1, cost) == 0
    assert choose_k(even + 0.01, 1, cost, margin=1.0) == 1
    assert choose_k(MARGIN * 0.018 / 0.014 - 1 + 0.01, 1, cost) == 1


def test_failed_verifications_slow_the_way_back():
    """Each verification in a row that accepts nothing halves how fast a skipped estimate drifts back towards the
    prior, so text that never turns predictable is probed ever more rarely; an accepted draft resets it."""
    def skips_to_reach(st, n, level):
        for i in range(1, 10_000):
            skipped(st, n)
            if (st.alpha_of(n) if n else st.alpha) >= level:
                return i
    probes, st = [], SpecState()
    st.judged_n[2] = (0.3, 1.0)
    for _ in range(4):                                 # a probe at 0.3 fails, then skips until 0.3 again
        update_alpha(st, 1, 0, n=2)
        probes.append(skips_to_reach(st, 2, 0.3))
    assert all(b > 1.6 * a for a, b in zip(probes, probes[1:])), probes
    update_alpha(st, 1, 1, n=2)                        # accepted: back to the first pace
    assert st.misses[2] == 0
    st2 = SpecState(hits=0.3)
    update_alpha(st2, 1, 0)                            # the draft model's estimate (n = 0) the same way
    update_alpha(st2, 1, 0)
    fresh = SpecState(hits=st2.hits, judged=st2.judged)
    assert st2.misses[0] == 2 and skips_to_reach(st2, 0, 0.3) > 3 * skips_to_reach(fresh, 0, 0.3)


def test_a_new_match_length_starts_from_the_requests_others():
    """A match length never verified is estimated from the request's other lengths, pooled with the prior: on text
    whose drafts keep failing, a longer match is not probed with k_max at the prior."""
    st = SpecState()
    assert st.alpha_of(3) == PRIOR
    for _ in range(6):
        update_alpha(st, 2, 0, n=1)
    assert st.alpha_of(3) < 0.4 and 3 not in st.judged_n
    st2 = SpecState()
    update_alpha(st2, 3, 3, n=1)
    assert st2.alpha_of(3) > 0.8                       # a request whose drafts pass expects more


def test_a_draft_far_behind_pays_its_catch_up_first():
    """The draft model's first forward runs the tokens its cache lacks: k is priced with them, spread over the
    tokens the request has left (up to PAYBACK), so a request with few tokens left that the draft has not followed
    for long does not draft where a caught-up one would, and one with many left catches up."""
    sp = _speculator(FLAT, 3.0)
    sp.draft.costs.add(9, 0.010, 1)                    # a forward of 9 tokens: 10 ms
    seq = _Seq("draft", 0.8, tokens=range(200), left=6)
    assert sp._choose_k(seq, room=5, planned=0) > 0    # caught up
    sp.draft.done = {seq: 20}                          # 179 tokens behind
    assert sp.draft_gap(seq, 0.020) > 0.1
    assert sp._choose_k(seq, room=5, planned=0) == 0
    seq.max_tokens = 1000
    assert sp._choose_k(seq, room=5, planned=0) > 0


def test_a_lagging_draft_model_catches_up_and_drafts_again():
    """A draft that pays when caught up (9 ms against a 20 ms step, at the prior) drafts with the prompt's last
    FOLD tokens still to run, and after steps it did not draft in: its catch-up, paid once, is not charged whole to
    one draft (which kept it from drafting, and the lag only grew by a token a step)."""
    sp = _speculator(FLAT, 9.0)
    sp.draft.costs.add(9, 0.018, 1)                    # the first forward with the FOLD tokens: 9 ms more
    seq = _Seq("draft", PRIOR, tokens=range(100))
    for lag in (sp.draft.FOLD, 12, 20):
        sp.draft.done = {seq: len(seq.tokens) - 1 - lag}
        assert sp.draft_gap(seq, 0.020) > 0.008
        assert sp._choose_k(seq, room=5, planned=0) > 0, lag


def test_plain_decode_is_not_priced_above_a_larger_step():
    """One slow first step (cold caches) would price plain decode high for as long as drafting kept it from being
    measured again; the prediction is capped by what larger steps cost."""
    sp = _speculator({1: 60.0, 2: 20.5, 6: 22.5})
    assert math.isclose(sp.step_cost(1, 1), 0.0205)
    assert math.isclose(sp.step_cost(6, 1), 0.0225)


def test_with_nothing_measured_a_few_drafts_explore():
    """A process's first verifications (no step cost measured) run EXPLORE drafts, not k_max: enough to price every
    k after them, and a wrong guess costs little."""
    from lumen.engine.speculative.speculator import EXPLORE
    sp = Speculator(SpeculativeConfig(num_speculative_tokens=5), StepCosts(), None)
    assert 1 <= EXPLORE < 5
    assert sp._choose_k(_Seq("ngram", tokens=MATCH), room=5, planned=0) == EXPLORE
    sp.costs.add(1, 0.020, 1)
    sp.costs.add(1 + EXPLORE, 0.021, 1)                # then priced: a flat cost curve and the prior 0.7 draft 5
    assert sp._choose_k(_Seq("ngram", tokens=MATCH), room=5, planned=0) == 5


def test_one_rejected_draft_does_not_end_a_draft_model_that_pays():
    """The draft model's estimate moves slowly: a draft that pays at the prior (a 9 ms draft step for a 20 ms
    target) still drafts after its first draft is rejected, and stops after a run of rejections."""
    sp = _speculator(FLAT, 9.0)
    seq = _Seq("draft", PRIOR)
    assert sp._choose_k(seq, room=5, planned=0) > 0
    update_alpha(seq.spec, 1, 0)
    assert sp._choose_k(seq, room=5, planned=0) > 0
    for _ in range(4):
        update_alpha(seq.spec, 1, 0)
    assert sp._choose_k(seq, room=5, planned=0) == 0
    st = SpecState()                                   # an n-gram match length's estimate moves faster
    update_alpha(st, 1, 0, n=2)
    update_alpha(st, 1, 0)
    assert st.alpha_of(2) < st.alpha < PRIOR


def test_acceptance_estimate_is_per_token():
    """At k = 5 and a per-token rate of 0.8, accepted / proposed reads about 0.54; accepted / judged reads 0.8."""
    rng = np.random.default_rng(0)
    st = SpecState()
    for _ in range(400):
        a = 0
        while a < 5 and rng.random() < 0.8:
            a += 1
        update_alpha(st, 5, a, weight=0.02)
    assert abs(st.alpha - 0.8) < 0.06
    assert st.accepted / st.proposed < 0.65


def test_step_costs_by_shape():
    c = StepCosts()
    c.add(6, 0.030, rows=1)                # a verification of 5 drafts
    c.add(6, 0.020, rows=6)                # six decodes
    assert c.predict(6, 1) == 0.030 and c.predict(6, 6) == 0.020
    assert c.known(6, 1) and not c.known(6, 2) and c.known(6)
    assert math.isclose(c.predict(6), 0.028)          # any rows: the token count's average
    assert c.predict(40) is None                      # one count measured, no fallback: explore
    c.fallback = lambda n, rows: 0.5
    assert c.predict(40, 3) == 0.5
    for r in range(StepCosts.SHAPES + 10):            # a bounded table of recent shapes
        c.add(1, 0.01, rows=r + 10)
    assert len(c.shapes) == StepCosts.SHAPES and not c.known(6, 1)


def test_draft_vocab_head_is_a_prefix_and_lossless(smollm2_path):
    """A draft whose head computes the first 1024 token ids: the same greedy output, drafts only from them."""
    m = lumen.load(smollm2_path, ctx=512, threads=2)
    eng = Engine(m, max_model_len=512, max_num_seqs=2, kv_cache_mb=16, draft_model=m, draft_vocab=1000,
                 num_speculative_tokens=4, adaptive_k=False)
    draft = eng.speculator.draft
    assert draft.vocab == 1024
    seen = []
    propose = draft.propose

    def spy(reqs):
        out = propose(reqs)
        for d in out.values():
            seen.extend(d.tokens)
        return out
    draft.propose = spy
    ids = prompts(m)[1]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = eng.generate([ids], p)[0]
    spec = eng.generate([ids], p.replace(speculative="draft"))[0]
    assert spec.token_ids == plain.token_ids
    assert seen and max(seen) < 1024 and spec.metrics.spec_accepted > 0
    full = Engine(m, max_model_len=512, max_num_seqs=2, kv_cache_mb=16, draft_model=m, draft_vocab=None)
    assert full.speculator.draft.vocab == m.config.n_vocab
    assert full.speculator.draft.cost_ratio == 1.0 and draft.cost_ratio < 0.8     # its head reads 1/48 of its rows


def test_a_draft_by_path_is_requantized_to_q4_0_and_lossless(smollm2_path):
    """A draft model given by path has its matrices stored in more than 4.5 bits per weight (SmolLM2's Q4_1, Q8_0)
    packed as Q4_0 (draft_quant, the default), fewer bytes a drafted token; the output stays plain decoding's,
    sampled too; draft_quant=None keeps them as stored, and a loaded Model drafts as it was loaded."""
    from lumen.kernels.layout import C_QT
    from lumen.format.quants import QT
    m = lumen.load(smollm2_path, ctx=512, threads=2)
    kw = dict(max_model_len=512, max_num_seqs=2, kv_cache_mb=16, num_speculative_tokens=4, adaptive_k=False)
    eng = Engine(m, draft_model=smollm2_path, **kw)
    table = eng.speculator.draft.parts.bundle.packs.table
    assert set(table[:, C_QT].tolist()) == {int(QT.Q4_0)}
    assert int(QT.Q4_1) in set(m.parts.bundle.packs.table[:, C_QT].tolist())     # (and its Q8_0 head)
    assert eng.speculator.draft.cost_ratio < 0.95 * Engine(m, draft_model=m, **kw).speculator.draft.cost_ratio
    stored = Engine(m, draft_model=smollm2_path, draft_quant=None, **kw).speculator.draft.parts.bundle.packs.table
    assert np.array_equal(stored[:, C_QT], m.parts.bundle.packs.table[:, C_QT])
    ids = prompts(m)[1]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = eng.generate([ids], p)[0]
    spec = eng.generate([ids], p.replace(speculative="draft"))[0]
    assert spec.token_ids == plain.token_ids and 0 < spec.metrics.spec_accepted < spec.metrics.spec_proposed + 1
    with pytest.raises(ValueError, match="draft_quant"):
        Engine(m, draft_model=smollm2_path, draft_quant="q8_0", **kw)

def test_greedy_qwen_drafting_for_itself_and_ngram_is_bit_identical(qwen05_path):
    """Qwen2.5-Coder-0.5B (the draft the 1.5B uses) drafting for itself, its head cut to the first 32768 ids
    (the default), and n-gram lookup: greedy output equals plain decoding, on code to copy and on free text."""
    m = lumen.load(qwen05_path, ctx=512, threads=2)
    eng = Engine(m, max_model_len=512, max_num_seqs=2, kv_cache_mb=16, draft_model=m, num_speculative_tokens=4,
                 adaptive_k=False)
    code = "Here is a function:\n```python\ndef add(a, b):\n    return a + b\n```\nRename a to x:\n```python\n"
    for text in (code, "The three largest cities of France are"):
        ids = m.tokenize(text)
        p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        plain = eng.generate([ids], p)[0]
        for how in ("draft", "ngram"):
            spec = eng.generate([ids], p.replace(speculative=how))[0]
            assert spec.token_ids == plain.token_ids, (text, how)
            assert spec.text == plain.text
    assert eng.speculator.draft.vocab == 32768


def test_a_draft_request_drafts_by_ngram_when_that_pays_more():
    """A draft-model request with a good n-gram match drafts from the prompt (no model step); without a match,
    or with a poor one, from the draft model."""
    sp = _speculator(FLAT, 6.0)
    seq = _Seq("draft", 0.7, MATCH)
    seq.spec.judged_n[3] = (0.9, 1.0)
    assert sp._choose_k(seq, room=5, planned=0) > 0 and sp.source(seq) == "ngram"
    seq.spec.judged_n[3] = (0.1, 1.0)
    assert sp._choose_k(seq, room=5, planned=0) > 0 and sp.source(seq) == "draft"
    seq.tokens = [7, 8, 9]                             # no match
    assert sp._choose_k(seq, room=5, planned=0) > 0 and sp.source(seq) == "draft"
    seq.tokens = list(MATCH)
    seq.spec.judged_n[3] = (0.9, 1.0)
    seq.chooser.sampler.greedy = False                 # sampled: its tokens must not depend on what drafted
    assert sp._choose_k(seq, room=5, planned=0) > 0 and sp.source(seq) == "draft"
    # the model's estimate and the lookup's are kept apart
    update_alpha(seq.spec, 4, 4, n=3)
    assert seq.spec.alpha == 0.7 and seq.spec.alpha_of(3) > 0.1


def test_the_draft_prefills_its_prompt_beside_the_targets(tiny):
    """The draft's cache takes the prompt in the step that prefills the target's (up to the tokens its first draft
    forward takes), not in the first decode step; the output stays the plain one."""
    target, draft = tiny
    eng = Engine(target, max_model_len=128, max_num_seqs=2, kv_cache_mb=4, draft_model=draft, adaptive_k=False)
    ids = list(range(14)) * 2
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, speculative="draft")
    rid = eng.add_request(ids, p)
    seq = eng._seqs[rid]
    eng.step()                                         # the prompt's step
    assert eng.speculator.draft.done[seq] == len(ids) - 1 - eng.speculator.draft.FOLD
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == eng.generate([ids], p.replace(speculative=None))[0].token_ids


def test_a_greedy_draft_stops_after_a_guess(tiny):
    """A greedy draft stops after a token the draft gives less than its confidence bound (1.01: after the first
    token; 0: never), and the output stays the plain one."""
    target, draft = tiny
    eng = Engine(target, max_model_len=128, max_num_seqs=2, kv_cache_mb=4, draft_model=draft,
                 num_speculative_tokens=4, adaptive_k=False)
    dm = eng.speculator.draft
    lengths = []
    propose = dm.propose

    def spy(reqs):
        out = propose(reqs)
        lengths.extend(len(d.tokens) for d in out.values())
        return out
    dm.propose = spy
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = eng.generate([[1, 2, 3]], p)[0].token_ids
    for confidence, most in ((1.01, 1), (0.0, 4)):
        dm.confidence, lengths[:] = confidence, []
        assert eng.generate([[1, 2, 3]], p.replace(speculative="draft"))[0].token_ids == plain
        assert max(lengths) == most


# ---------------------------------------------------------------- the draft model's rows and blocks

def _draft_holds_nothing(eng) -> None:
    dm, sp = eng.speculator.draft, eng.speculator
    assert dm.done == {} and dm.blocks.num_free == dm.blocks.n_blocks
    assert len(dm.blocks._free_rows) == dm.runner.table.shape[0]
    assert sp._drafts == {} and sp._source == {}
    dm.blocks.check()


def test_the_draft_frees_a_request_when_it_ends(tiny):
    """A finished or aborted request gives back its draft-model row and blocks (and the speculator its drafts) by
    the time its final output is out, even when no speculating request comes after it; queued, prefilling and
    decoding requests alike."""
    target, draft = tiny
    eng = Engine(target, max_model_len=128, max_num_seqs=4, kv_cache_mb=4, draft_model=draft, adaptive_k=False,
                 num_speculative_tokens=3)
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, speculative="draft")
    outs = eng.generate([[1, 2, 3, 4] * 3, [5, 6, 7] * 4, [2, 3] * 7, [9] * 20, [1]],
                        [p, p.replace(temperature=0.8, seed=3), p.replace(max_tokens=1), p, p])
    assert [o.finish_reason for o in outs] == ["length"] * 5
    assert sum(o.metrics.spec_proposed for o in outs) > 0
    _draft_holds_nothing(eng)
    for steps_before_abort in (0, 1, 3):              # queued; its prompt in the draft; decoding, drafts made
        rids = [eng.add_request([1, 2, 3] * 12, p.replace(max_tokens=60)) for _ in range(2)]
        for _ in range(steps_before_abort):
            eng.step()
        if steps_before_abort:
            assert eng.speculator.draft.done
        for rid in rids:
            eng.abort(rid)
        finals = [o for _ in range(3) for o in eng.step()]
        assert sorted(o.finish_reason for o in finals if o.finished) == ["abort", "abort"]
        assert not eng.has_unfinished()
        _draft_holds_nothing(eng)


def test_an_abort_between_steps_frees_the_draft_at_once(tiny):
    """Aborted while no step runs (a Model.generate loop left early, a client gone between steps), a request
    gives back its draft-model row at once, not at some later step."""
    target, draft = tiny
    eng = Engine(target, max_model_len=128, max_num_seqs=2, kv_cache_mb=4, draft_model=draft, adaptive_k=False)
    rid = eng.add_request([1, 2, 3] * 12, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True,
                                                        speculative="draft"))
    for _ in range(3):
        eng.step()
    assert eng.speculator.draft.done
    eng.abort(rid)
    _draft_holds_nothing(eng)


def test_a_draft_with_another_vocabulary_of_the_same_size_is_refused(tiny, tmp_path):
    target, _ = tiny
    other = lumen.load(write_tiny(tmp_path / "other.gguf", 2, reverse=True), ctx=128, threads=2)
    with pytest.raises(ValueError, match="token 0 is 'n' in the draft, 'a' in the target"):
        Engine(target, max_model_len=128, max_num_seqs=2, kv_cache_mb=4, draft_model=other)


def test_seeded_ngram_sampling_does_not_depend_on_k_or_the_batch(tiny):
    """A seeded sampled request drafting by n-gram lookup gets the same tokens whatever k the engine runs and
    whatever runs beside it: every position is decided by the acceptance rule on a draft token that depends on
    the tokens before it alone (or drawn plainly where the lookup has none)."""
    target, _ = tiny
    prompt = [1, 2, 3, 4, 5] * 6
    p = SamplingParams(max_tokens=24, temperature=0.7, seed=5, ignore_eos=True, speculative="ngram")
    got = []
    for k in (1, 3, 8):
        eng = Engine(target, max_model_len=128, max_num_seqs=4, kv_cache_mb=4, num_speculative_tokens=k,
                     adaptive_k=False)
        outs = eng.generate([prompt, [6, 7] * 9, prompt], [p, p.replace(seed=9), p.replace(num_speculative_tokens=2)])
        assert outs[0].token_ids == outs[2].token_ids
        m = outs[0].metrics
        assert 0 < m.spec_accepted < m.spec_proposed              # drafts accepted and rejected
        got.append(outs[0].token_ids)
    assert got[0] == got[1] == got[2]


def test_a_request_with_no_draft_is_proposed_again_without_one():
    """A request proposed twice at the same tokens (it waited: preempted, or out of budget) whose drafter had
    nothing for it gets no draft the second time either, not a None in place of one (verification reads it)."""
    sp = _speculator(FLAT)
    seq = _Seq("ngram")                                # no n-gram match
    seq.num_tokens = len(seq.tokens)
    assert sp._propose([(seq, 1)]) == {}
    assert sp._propose([(seq, 1)]) == {}



@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_the_first_token_is_drawn_plainly_whatever_the_chunks(tiny, spec):
    """A sampled request's first token is a plain draw even when its prompt's last chunk is its last token alone
    (the step that computes it could draft after it): the same token as when the prompt runs whole."""
    target, draft = tiny
    prompt = [1, 2, 3, 4] * 8 + [1]                   # 33 tokens: chunks of 32 and 1 at a budget of 32
    p = SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True, speculative=spec)
    kw = dict(max_model_len=64, max_num_seqs=2, kv_cache_mb=4, draft_model=draft, adaptive_k=False,
              enable_prefix_caching=False)              # (a cache hit would run the last token alone, undrafted)
    chunked, whole = Engine(target, max_num_batched_tokens=32, **kw), Engine(target, max_num_batched_tokens=64, **kw)
    for seed in range(8):
        assert (chunked.generate([prompt], p.replace(seed=seed))[0].token_ids
                == whole.generate([prompt], p.replace(seed=seed))[0].token_ids), seed


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_speculation_under_preemption_matches_each_request_alone(tiny, spec):
    """Eight greedy and seeded sampled requests that speculate, in a pool of 8 blocks that keeps preempting them:
    each gets the tokens it gets alone, and the pool and the draft end empty."""
    target, draft = tiny
    kvb = target.runner.kv_bytes_per_block
    alone = Engine(target, max_model_len=64, max_num_seqs=1, kv_cache_mb=4, draft_model=draft)
    eng = Engine(target, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, kv_cache_mb=8 * kvb / 2 ** 20,
                 draft_model=draft, adaptive_k=False, num_speculative_tokens=6)
    prompts = [[(i + j) % 14 for j in range(20 + 3 * i)] for i in range(8)]
    ps = [SamplingParams(max_tokens=64 - len(p), temperature=0.8 * (i % 2), seed=i, ignore_eos=True, speculative=spec)
          for i, p in enumerate(prompts)]
    outs = eng.generate(prompts, ps)
    assert [o.token_ids for o in outs] == [alone.generate([p], sp)[0].token_ids for p, sp in zip(prompts, ps)]
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.num_free == eng.blocks.n_blocks
    _draft_holds_nothing(eng)


def test_a_running_request_drafts_though_waiting_ones_hold_the_draft_rows(tiny):
    """Two sequences run at once; the draft model's two rows went to the first prompt and to a waiting one it
    prefilled, and the second request (a one-token prompt, never prefilled) runs: it takes the waiting one's row,
    so it drafts, and its seeded tokens are those it samples alone (it sampled plainly, without a draft, and
    they differed)."""
    target, draft = tiny
    alone = Engine(target, max_model_len=64, max_num_seqs=1, kv_cache_mb=4, draft_model=draft, adaptive_k=False)
    eng = Engine(target, max_model_len=64, max_num_seqs=2, kv_cache_mb=4, draft_model=draft, adaptive_k=False)
    prompts = [[(3 * j) % 14 for j in range(20)], [5], [(j + 1) % 14 for j in range(24)]]
    ps = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, speculative="draft")] + [
        SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True, speculative="draft") for s in (3, 4)]
    outs = eng.generate(prompts, ps)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone.generate(prompts, ps)]
    assert outs[1].metrics.spec_steps > 1
    _draft_holds_nothing(eng)


def test_the_draft_row_a_running_request_takes_is_never_a_preempted_one_s(tiny):
    """Rows full: one held by a waiting prompt, one by a request preempted after its first token (it samples with a
    draft again when readmitted). A running request takes the waiting prompt's row; a waiting prompt takes none."""
    target, draft = tiny
    eng = Engine(target, max_model_len=64, max_num_seqs=2, kv_cache_mb=4, draft_model=draft)
    d = eng.speculator.draft
    p = SamplingParams(max_tokens=8, temperature=0.8, seed=1, speculative="draft")
    preempted, prompt, running, later = (eng._seqs[eng.add_request([1, 2, 3, 4], p)] for _ in range(4))
    preempted.output_ids.append(5)                  # (as after its first token and a preemption: waiting)
    assert d._admit(prompt) and d._admit(preempted) and not d._admit(later)
    running.status = Status.RUNNING
    assert d._admit(running) and list(d.done) == [preempted, running]
    assert not d._admit(later)
    for q in (preempted, running):
        d.forget(q)
    assert d.blocks.num_free == d.blocks.n_blocks


def test_a_request_that_can_never_draft_costs_the_draft_nothing(tiny):
    """max_tokens 1 (a prefill for another engine, a classifier's one token), or 2 greedy: no position is ever
    drafted, so the draft model does not prefill the prompt either."""
    target, draft = tiny
    eng = Engine(target, max_model_len=128, max_num_seqs=4, kv_cache_mb=4, draft_model=draft, adaptive_k=False)
    forwards = []
    run = eng.speculator.draft._forward
    eng.speculator.draft._forward = lambda items, sample: forwards.append(len(items)) or run(items, sample)
    p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, speculative="draft")
    prompt = list(range(14)) * 3
    outs = eng.generate([prompt] * 3, [p, p.replace(temperature=0.8, seed=1), p.replace(max_tokens=2)])
    assert [len(o.token_ids) for o in outs] == [1, 1, 2] and forwards == []
    eng.generate([prompt], p.replace(max_tokens=3))                  # one that can draft still does
    assert forwards
