"""benchmarks/sampled_peers.py: the peers for sampled, unseeded replies. Hand-computed examples of
RUT's score, randomized rank and Cramer-von Mises test, of the mean cross-entropy test, and of
Model Equality Testing run by its own package (a spy sees the package's call); then, on the shipped
testbed, each peer's p-value for an honest vendor (not small) and for two different vendors,
temperature 1.5 and the draft model (small).

MET needs `model-equality-testing` (`pip install --no-deps model-equality-testing==0.0.2`: its
imports, numpy, torch, matplotlib and tqdm, are verinfer's already); its tests skip without it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import cramervonmises

from benchmarks import sampled_peers as sp
from verinfer.models.testbed import TARGET_DIR

try:  # imported once here: the package's __init__ pulls in transformers and matplotlib (seconds)
    import model_equality_testing as met
    import model_equality_testing.algorithm  # noqa: F401
except ImportError:
    met = None
needs_met = pytest.mark.skipif(met is None, reason="model-equality-testing not installed "
                                                    "(pip install --no-deps model-equality-testing==0.0.2)")


# --- RUT ----------------------------------------------------------------------------------------------------------

def test_log_rank_hand_example():
    logits_TV = torch.tensor([[3.0, 1.0, 2.0, 0.0],    # token 2: one larger logit -> rank 2
                              [0.0, 5.0, 1.0, 1.0],    # token 3: 5 larger, 1 tied -> rank 2 (ties take the best)
                              [4.0, 4.0, 4.0, 9.0],    # token 3: the argmax -> rank 1
                              [0.0, 1.0, 2.0, 3.0]])   # token 0: 3 larger -> rank 4
    assert sp.log_rank(logits_TV, [2, 3, 3, 0]) == pytest.approx((math.log(2) + math.log(2) + 0 + math.log(4)) / 4)
    with pytest.raises(ValueError, match="T = 3"):
        sp.log_rank(logits_TV, [0, 1, 2])


def test_rut_statistic_hand_example():
    local = [1.0, 2.0, 2.0, 3.0]
    assert sp.rut_statistic(2.0, local, u=0.5) == 0.5              # (1 below + 0.5 x 2 tied) / 4
    assert sp.rut_statistic(2.0, local, u=0.0) == 0.25
    assert sp.rut_statistic(2.0, local, u=1.0) == 0.75
    assert sp.rut_statistic(3.0, local, u=0.25) == (3 + 0.25) / 4
    assert sp.rut_statistic(0.5, local, u=0.9) == 0.0              # below every local sample
    assert sp.rut_statistic(7.0, local, u=0.9) == 1.0              # above every one
    with pytest.raises(ValueError):
        sp.rut_statistic(1.0, local, u=1.5)


def test_rut_test_is_cramer_von_mises_of_the_ranks():
    rng = np.random.default_rng(5)
    local = rng.normal(size=(100, 100))
    same, shifted = rng.normal(size=100), rng.normal(0.5, 1.0, size=100)
    r = sp.rut_ranks(same, local, seed=3)
    u = np.random.default_rng(3).uniform(size=100)
    assert r == pytest.approx([(np.sum(s < a) + ui * np.sum(s == a)) / 100 for a, s, ui in zip(same, local, u)])
    # the paper's omega^2 = 1/(12n) + sum_i ((2i-1)/(2n) - r_(i))^2, p from scipy's CvM
    n, rs = r.size, np.sort(r)
    omega2 = 1 / (12 * n) + np.sum(((2 * np.arange(1, n + 1) - 1) / (2 * n) - rs) ** 2)
    res = cramervonmises(r, "uniform")
    assert res.statistic == pytest.approx(omega2)
    assert sp.rut_test(same, local, seed=3) == res.pvalue > 0.05
    assert sp.rut_test(shifted, local, seed=3) < 1e-4


def test_rut_ties_are_randomized():
    """Every score tied (a discrete score that cannot tell replies apart): each rank is U_i, so the
    ranks are exactly uniform and the test keeps its level."""
    local = np.zeros((200, 10))
    r = sp.rut_ranks(np.zeros(200), local, seed=7)
    assert r == pytest.approx(np.random.default_rng(7).uniform(size=200))
    assert sp.rut_test(np.zeros(200), local, seed=7) > 0.05


# --- mean cross-entropy ---------------------------------------------------------------------------------------------

def test_token_cross_entropies_hand_example():
    logits_TV = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    assert sp.token_cross_entropies(logits_TV, [0, 1], temperature=1.0) == pytest.approx([math.log(4), math.log(4 / 3)])
    # at T = 0.5 the probabilities are 1/10 and 9/10; top-k 1 drops token 0
    assert sp.token_cross_entropies(logits_TV, [0, 1], temperature=0.5) == pytest.approx([math.log(10), math.log(10 / 9)])
    assert sp.token_cross_entropies(logits_TV, [0, 1], temperature=1.0, top_k=1).tolist() == [math.inf, 0.0]


def test_mean_ce_test_hand_example():
    api = [[1.0, 2.0], [3.0]]                                     # mean 2
    local = [[[0.0, 0.0], [5.0, 5.0], [1.0, 1.0]],                # prompt 0, samples j = 0, 1, 2
             [[0.0], [5.0], [3.0]]]                               # prompt 1
    # honest batches: j=0 mean 0, j=1 mean 5, j=2 mean 5/3; one of 3 >= 2
    assert sp.mean_cross_entropy(api) == 2.0
    assert sp.mean_ce_test(api, local) == (1 + 1) / (3 + 1)
    assert sp.mean_ce_test([[9.0], [9.0]], local) == 1 / 4        # above every honest batch: the floor 1/(m+1)


# --- Model Equality Testing: its package ---------------------------------------------------------------------------

def _samples(rng, probs, n_prompts, per_prompt, L):
    """n_prompts x per_prompt (prompt, completion) pairs, as the package's paper samples them: the
    prompt uniform, then each of L tokens ~ probs[prompt] independently."""
    return [(int(i), [int(t) for t in rng.choice(len(probs[i]), size=L, p=probs[i])])
            for i in rng.integers(0, n_prompts, n_prompts * per_prompt)]


@needs_met
def test_met_is_the_packages_test(monkeypatch):
    from model_equality_testing.algorithm import run_two_sample_test
    from model_equality_testing.distribution import CompletionSample
    from model_equality_testing.tests import mmd_hamming

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(6), size=4)
    a, b = _samples(rng, probs, 4, 10, 5), _samples(rng, probs, 4, 10, 5)
    a[3] = (a[3][0], a[3][1][:2])                                  # a short completion: padded with -1
    assert max(len(c) for _, c in a + b) == 5 and {i for i, _ in a + b} == {0, 1, 2, 3}
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return run_two_sample_test(*args, **kwargs)

    monkeypatch.setattr(met.algorithm, "run_two_sample_test", spy)
    p = sp.met_test(a, b, n_prompts=4, b=50, seed=11)
    (api, local), kw = calls[0]
    assert kw == {"pvalue_type": "permutation_pvalue", "stat_type": "mmd_hamming", "b": 50}
    assert isinstance(api, CompletionSample) and isinstance(local, CompletionSample)
    assert api.m == local.m == 4 and api.L == local.L == 5 and api.N == local.N == 40
    assert api.sequences[3].tolist() == [a[3][0], *a[3][1], -1, -1, -1]  # prompt index, then the padded completion
    # the same p-value as the package called directly, the same seed in torch's global generator
    torch.manual_seed(11)
    direct, stat = run_two_sample_test(CompletionSample(np.array([i for i, _ in a]), api.completion_sample, 4),
                                       CompletionSample(np.array([i for i, _ in b]), local.completion_sample, 4),
                                       pvalue_type="permutation_pvalue", stat_type="mmd_hamming", b=50)
    assert p == direct
    assert stat == mmd_hamming(api, local)
    # the caller's torch stream is untouched; L past the longest completion scales every MMD alike
    torch.manual_seed(1)
    before = torch.rand(1)
    torch.manual_seed(1)
    sp.met_test(a, b, n_prompts=4, b=50, seed=11)
    assert torch.rand(1) == before
    assert sp.met_test(a, b, n_prompts=4, b=50, seed=11, L=40) == p


@needs_met
def test_met_level_and_power():
    """Same distribution: 24 independent draws give p-values spread over [0, 1] (a level-0.05 test
    rejects about one in 20: 6% measured over 120 draws here); another distribution (half of each
    prompt's mass moved): rejected."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(8), size=10)
    q = 0.5 * p + 0.5 * rng.dirichlet(np.ones(8), size=10)
    null = [sp.met_test(_samples(rng, p, 10, 10, 6), _samples(rng, p, 10, 10, 6), n_prompts=10, b=50, seed=s)
            for s in range(24)]
    assert sum(x < 0.05 for x in null) <= 4 and 0.3 < np.median(null) < 0.7
    local = _samples(rng, p, 10, 10, 6)
    assert sp.met_test(_samples(rng, q, 10, 10, 6), local, n_prompts=10, b=100) < 0.01
    # strings: the package's unicode code points (its default); "ab?" against "ab" + "x?": the
    # two samples differ at every draw of the second sample's prompt 0
    a = [(0, "abc"), (0, "abd"), (1, "x"), (1, "y")] * 5
    b = [(0, "xbc"), (0, "xbd"), (1, "x"), (1, "y")] * 5
    assert sp.met_test(a, b, b=100) < 0.01 and sp.met_test(a, a[::-1], b=100) > 0.5


@pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built")
def test_reply_scores_are_teacher_forced_per_reply():
    """The batched scores (replay batches of several claims) equal the per-reply functions on one
    un-batched forward of prompt + reply, row t of which is the distribution of token t + 1."""
    from verinfer.engine.engine import Engine
    from verinfer.models.load import load_model, model_info
    from verinfer.models.prompts import prompts_for

    engine = Engine(load_model(TARGET_DIR), eos_token_id=model_info(TARGET_DIR).eos_token_id)
    prompts = prompts_for(TARGET_DIR, 3, 0, 24)
    replies = [r[0] for r in sp.sample_replies(engine, prompts, 1, temperature=0.7, max_tokens=6, seed=0)]
    lr, ce = sp.reply_scores(engine, prompts, replies, temperature=0.7, top_k=20)
    for p, r, lr_i, ce_i in zip(prompts, replies, lr, ce):
        logits_TV = engine.forward_sequence(p + r)[0][len(p) - 1 : len(p) + len(r) - 1]
        assert lr_i == pytest.approx(sp.log_rank(logits_TV, r), abs=1e-9)
        assert ce_i == pytest.approx(sp.token_cross_entropies(logits_TV, r, temperature=0.7, top_k=20), abs=1e-4)
        assert len(r) == 6 or r[-1] == engine.eos_token_id


def test_log_ranks_recorded_while_sampling_equal_the_replayed_ones():
    """`sample_replies(log_ranks=...)` records each reply's mean log-rank from the logits its tokens
    were drawn from; the teacher-forced replay (`reply_scores`) of the same ids gives the same value,
    and asking for them leaves the replies unchanged."""
    from verinfer.engine.engine import Engine
    from verinfer.models.load import load_model, model_info

    from verinfer.models.prompts import prompts_for

    engine = Engine(load_model(TARGET_DIR), eos_token_id=model_info(TARGET_DIR).eos_token_id)
    prompts = prompts_for(TARGET_DIR, 3, 1, 24)
    lrs: list = []
    replies = sp.sample_replies(engine, prompts, 2, temperature=1.0, top_p=0.95, max_tokens=8, seed=3, log_ranks=lrs)
    assert replies == sp.sample_replies(engine, prompts, 2, temperature=1.0, top_p=0.95, max_tokens=8, seed=3)
    flat = [r for rs in replies for r in rs]
    lr, _ = sp.reply_scores(engine, [p for p in prompts for _ in range(2)], flat, temperature=1.0)
    assert [len(x) for x in lrs] == [2, 2, 2] and max(lr) > 0
    assert np.allclose([x for xs in lrs for x in xs], lr, atol=1e-4)


# --- on the testbed ---------------------------------------------------------------------------------------------------

# claimed temperature 0.7; 60 prompts x 20 local samples (RUT, mean CE); MET on 300 requests to 30
# prompts; 100 permutations (the package's demo); replies of at most 10 tokens
RUN = dict(n_prompts=60, m=20, met_prompts=30, met_per_prompt=10, max_tokens=10, temperature=0.7, met_b=100, seed=2)


@pytest.fixture(scope="module")
def run():
    pytest.importorskip("model_equality_testing")
    if not (TARGET_DIR / "config.json").is_file():
        pytest.skip("testbed not built")
    return sp.testbed_run(**RUN)


@pytest.mark.slow
def test_honest_vendor_passes(run):
    h = run["honest"]
    assert h["rut"] > 0.01 and h["met"] > 0.01
    assert h["mean_ce"] > 1 / (RUN["m"] + 1)                       # some honest batch has a larger mean
    assert abs(h["api_mean_log_rank"] - h["local_mean_log_rank"]) < 0.15


@pytest.mark.slow
@pytest.mark.parametrize("vendor", ["temperature-1.5", "draft"])
def test_different_vendor_flagged(run, vendor):
    v = run[vendor]
    assert v["rut"] < 0.01 and v["met"] < 0.01
    assert v["mean_ce"] == 1 / (RUN["m"] + 1)                      # above every honest batch
    assert v["api_mean_log_rank"] > v["local_mean_log_rank"] + 0.2
