import numpy as np
import pytest

from verinfer.detect.metrics import auc_at_fpr, auc_vs_tokens, batch_means, split_tokens, tokens_to_detect
from verinfer.detect.metrics import auc_at_fpr_bound

NEG, POS = [0.0, 1.0, 2.0, 3.0], [1.5, 2.5, 3.5, 4.0]


def test_mcclish_partial_auc_by_hand():
    # ROC of POS vs NEG: (0,0) (0,.25) (0,.5) (.25,.5) (.25,.75) (.5,.75) (.5,1) (.75,1) (1,1).
    # max_fpr=.5: area = .25*.5 + .25*.75 = .3125; McClish = (1 + (A - f^2/2) / (f - f^2/2)) / 2
    assert auc_at_fpr(NEG, POS, max_fpr=0.5) == pytest.approx(0.5 * (1 + (0.3125 - 0.125) / (0.5 - 0.125)))
    assert auc_at_fpr(NEG, POS, max_fpr=0.5) == pytest.approx(0.75)
    # max_fpr=.4 cuts the flat .75 segment: A = .125 + .15*.75 = .2375
    assert auc_at_fpr(NEG, POS, max_fpr=0.4) == pytest.approx(0.5 * (1 + (0.2375 - 0.08) / (0.4 - 0.08)))
    # full AUC = 13/16 pairs ordered correctly
    assert auc_at_fpr(NEG, POS, max_fpr=1.0) == pytest.approx(13 / 16)


def test_auc_perfect_reversed_and_errors():
    assert auc_at_fpr([0, 1, 2], [3, 4, 5]) == 1.0
    assert auc_at_fpr([3, 4, 5], [0, 1, 2]) == 0.5  # less divergent than honest: not penalized
    assert auc_at_fpr([1, 2], [1, 2]) == 0.5
    with pytest.raises(ValueError):
        auc_at_fpr([], [1.0])


def test_batch_means_without_replacement_within_batch():
    rng = np.random.default_rng(0)
    v = 2.0 ** np.arange(48)  # distinct powers of two: a batch sum identifies its members (exact in fp64)
    sums = [int(m * 4) for m in batch_means(v, 4, 500, rng)]
    assert all(bin(s).count("1") == 4 for s in sums)  # 4 distinct members in every batch
    assert len(set(sums)) > 100  # and the batches differ
    assert batch_means(v, 49, 10, rng).size == 0


def test_large_batches_are_bootstrapped_not_shrunk():
    rng = np.random.default_rng(0)
    v = rng.exponential(1.0, 200)
    means = batch_means(v, 200, 4000, rng)  # batch = the whole set: without replacement the sd would be 0
    assert means.std() == pytest.approx(v.std() / np.sqrt(200), rel=0.1)
    assert batch_means(np.arange(20.0), 1, 1000, rng).mean() == pytest.approx(9.5, rel=0.2)


def test_split_tokens():
    tr, te = split_tokens(11, np.random.default_rng(1))
    assert len(tr) == 6 and len(te) == 5  # round(5.5) = 6
    assert sorted(np.r_[tr, te].tolist()) == list(range(11))


def test_auc_vs_tokens_exponential_shift():
    rng = np.random.default_rng(0)
    honest = rng.exponential(1.0, 100_000)
    honest[:100] = np.inf  # filtered-out tokens get clipped
    misconf = rng.exponential(1.3, 100_000)
    sizes = (1, 10, 30, 100, 200, 500, 1000, 60_000)
    auc = auc_vs_tokens(honest, misconf, sizes, clip_q=0.999, n_batches=2000, rng=rng)
    assert auc[60_000] is None  # larger than a test split
    vals = [auc[b] for b in sizes[:-1]]
    assert all(b >= a - 0.02 for a, b in zip(vals, vals[1:]))  # grows with batch size
    assert vals[0] < 0.52 and vals[-1] == pytest.approx(1.0, abs=1e-3)
    # reference: fresh i.i.d. batches from the two distributions, clipped at Exp(1)'s 99.9% quantile
    c, ref_rng = -np.log(1e-3), np.random.default_rng(100)
    for b in (100, 200):  # reference about 0.76 and 0.93 (below the normal approximation: skewed means)
        ref = auc_at_fpr(np.minimum(ref_rng.exponential(1.0, (20_000, b)), c).mean(1),
                         np.minimum(ref_rng.exponential(1.3, (20_000, b)), c).mean(1))
        assert auc[b] == pytest.approx(ref, abs=0.06)
    # 200 tokens -> about 0.93, 500 -> 0.999: the 0.99 crossing is at 500
    assert tokens_to_detect(auc) == 500


def test_auc_vs_tokens_not_more_divergent_is_chance():
    rng = np.random.default_rng(1)
    auc = auc_vs_tokens(rng.exponential(1.3, 4000), rng.exponential(1.0, 4000), (10, 100), 0.999, 300, rng)
    assert auc == {10: 0.5, 100: 0.5}


def test_auc_vs_tokens_tail_pooling_detects_rare_bug():
    rng = np.random.default_rng(2)
    honest = rng.exponential(1.0, 40_000)
    misconf = rng.exponential(1.0, 40_000)
    bug = rng.random(misconf.size) < 0.01
    misconf[bug] = rng.exponential(20.0, bug.sum()) + 8.0  # 1% of tokens far out
    plain = auc_vs_tokens(honest, misconf, (1000,), clip_q=0.9999, n_batches=500, rng=np.random.default_rng(3))
    tail = auc_vs_tokens(honest, misconf, (1000,), clip_q=0.9999, n_batches=500, rng=np.random.default_rng(3),
                         tail_q=0.999)  # clip at 99.99%, zero below 99.9% (appendix E)
    assert tail[1000] > 0.99 and tail[1000] > plain[1000] + 0.05


def test_tokens_to_detect():
    assert tokens_to_detect({1: 0.5, 10: 0.9, 100: 0.995, 1000: 1.0}) == 100
    assert tokens_to_detect({"1": 0.5, "30": 0.99, "10": None}) == 30  # JSON keys, missing sizes
    assert tokens_to_detect({1: 0.5, 10: 0.98}) is None
    assert tokens_to_detect({1: 0.5, 10: 0.9}, target=0.8) == 10


def test_auc_at_fpr_bound_values():
    assert auc_at_fpr_bound(0.0) == 1.0 and auc_at_fpr_bound(1.0) == pytest.approx(0.5)
    # q >= max_fpr: pAUC = a (1 - q) + a^2 / 2 -> McClish 0.5 (1 + a (1 - q) / (a - a^2 / 2))
    q, a = 0.03, 0.01
    assert auc_at_fpr_bound(q) == pytest.approx(0.5 * (1 + a * (1 - q) / (a - a * a / 2)))
    # q < max_fpr: + q^2 / 2 + q (a - q)
    q = 0.004
    p = a * (1 - q) + q * q / 2 + q * (a - q)
    assert auc_at_fpr_bound(q) == pytest.approx(0.5 * (1 + (p - a * a / 2) / (a - a * a / 2)))
    # honest batches without evidence rarer than the misconfigured ones: a looser bound
    assert auc_at_fpr_bound(0.03, q_honest=0.02) > auc_at_fpr_bound(0.03)


def test_auc_at_fpr_bound_holds_and_is_reached():
    # a fraction q of positive batches has no evidence: distributed as the honest batches of the same
    # (no-evidence) kind, which also make up a fraction q of the negatives; the rest separate perfectly
    rng = np.random.default_rng(0)
    n, q = 400_000, 0.02
    blind = lambda: rng.uniform(50, 60, n)  # noqa: E731
    # blind honest batches independent of the score: the detector falls short of the bound
    neg = rng.normal(size=n)
    pos = np.where(rng.random(n) < q, rng.normal(size=n), 100.0)
    assert auc_at_fpr(neg, pos, 0.01) < auc_at_fpr_bound(q)
    # worst case: the no-evidence honest batches are the ones the detector scores highest
    neg = np.where(rng.random(n) < q, blind(), rng.normal(size=n))
    pos = np.where(rng.random(n) < q, blind(), 100.0)
    assert auc_at_fpr(neg, pos, 0.01) == pytest.approx(auc_at_fpr_bound(q), abs=1e-3)
