"""detect.tail: the saddle-point tail of a batch mean against resampling (where resampling
resolves it) and against exact distributions (far in the tail)."""

import math

import numpy as np
import pytest
from scipy.stats import binom, multinomial

from verinfer.detect.clipped_mean import ClippedMeanDetector
from verinfer.detect.tail import chernoff_bound, compress, mean_tail


def margins(rng, size, rate=0.004):
    """Margin-like honest values: mostly exact matches (0), rare mismatches, clipped at 0.3."""
    return np.where(rng.random(size) < rate, np.minimum(rng.exponential(0.1, size), 0.3), 0.0)


@pytest.mark.parametrize("n", [300, 1000])
def test_saddle_point_matches_resampling_at_1e_2_to_1e_3(n):
    rng = np.random.default_rng(0)
    w = margins(rng, 40_000)
    v, s = compress(w)
    # resampling n draws with replacement, 400k times: the number of draws off 0 is binomial, and
    # only those are drawn (the same distribution as drawing all n, in a fraction of the time)
    nz, batches = w[w > 0], 400_000
    k = rng.binomial(n, nz.size / w.size, batches)
    means = np.bincount(np.repeat(np.arange(batches), k), nz[rng.integers(0, nz.size, k.sum())], batches) / n
    for q in (1e-2, 3e-3, 1e-3):
        x = float(np.quantile(means, 1 - q))
        resampled = float(np.mean(means >= x))
        se = math.sqrt(resampled / means.size)
        assert mean_tail(v, s, n, x) == pytest.approx(resampled, abs=4 * se + 0.05 * resampled), (q, x)
        assert chernoff_bound(v, s, n, x) >= mean_tail(v, s, n, x)


def test_saddle_point_matches_the_exact_trinomial_tail_at_1e_12():
    """Three non-lattice values: the exact tail of the mean of 1000 draws sums the multinomial
    over every (k1, k2) reaching the mean; the saddle point is within 2% of it at 1e-12 and 1e-30."""
    vals, probs = np.array([0.0, 1.0, math.sqrt(2.0)]), np.array([0.95, 0.03, 0.02])
    n = 1000
    k1, k2 = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    ok = k1 + k2 <= n
    k1, k2 = k1[ok], k2[ok]
    logpmf = multinomial.logpmf(np.stack([n - k1 - k2, k1, k2], axis=1), n, probs)
    mean = (k1 + k2 * math.sqrt(2.0)) / n
    for target in (1e-12, 1e-30):
        order = np.argsort(-mean)
        tail = np.cumsum(np.exp(logpmf[order]))
        x = float(mean[order][np.searchsorted(tail, target)])
        exact = float(np.exp(logpmf[mean >= x - 1e-12]).sum())
        got = mean_tail(vals, probs, n, x)
        assert got == pytest.approx(exact, rel=0.02), (target, got, exact)
        assert exact <= chernoff_bound(vals, probs, n, x) < 100 * exact


def test_two_values_are_exact_binomial_and_the_maximum_is_exact():
    v, s = compress([0.0] * 99 + [1.0])
    assert mean_tail(v, s, 500, 0.05) == pytest.approx(binom.sf(24, 500, 0.01))
    v, s = compress([0.0, 0.5, 1.0, 1.0])
    assert mean_tail(v, s, 20, 1.0) == pytest.approx(0.5 ** 20)
    assert mean_tail(v, s, 20, 1.01) == 0.0 and mean_tail(v, s, 20, -1.0) == 1.0


def test_few_mismatches_per_batch_never_exceed_the_chernoff_bound():
    """At 10 tokens a batch holds 0.04 mismatches on average: the jump regime where the formula is
    poor; what it reports is capped by the (valid) Chernoff bound, never 0 where the tail is not."""
    rng = np.random.default_rng(1)
    v, s = compress(margins(rng, 30_000))
    for x in (0.0004, 0.002, 0.01):
        p = mean_tail(v, s, 10, x)
        assert 0.0 < p <= chernoff_bound(v, s, 10, x)


def test_detector_p_values_reach_1e_12_where_the_evidence_does():
    """The clipped-mean p-value: resampled near the threshold (>= 10 resampled means beyond),
    saddle-point beyond it; no floor at 1/(1 + B) = 0.0005."""
    rng = np.random.default_rng(2)
    det = ClippedMeanDetector().fit({"margin": margins(rng, 50_000)})
    near = det.verdict({"margin": margins(rng, 1000, rate=0.006)})
    assert near.p_value_method == "resampled" and near.p_value > 1 / (det.n_null_batches + 1)
    far = det.verdict({"margin": margins(rng, 1000, rate=0.05)})
    assert far.flagged and far.p_value_method == "saddle-point" and 0 < far.p_value < 1e-12
    assert far.p_value <= far.extra["p_value_bound"]


def test_power_of_an_ok_verdict_matches_resampling_the_stated_alternative():
    """An ok verdict states the probability that a deviation of 2x the honest mean would have been
    flagged at its tokens: the saddle-point value against batches resampled from that alternative
    (the honest null exponentially tilted to twice its mean)."""
    from verinfer.detect.tail import tilt

    rng = np.random.default_rng(3)
    det = ClippedMeanDetector().fit({"margin": margins(rng, 40_000)})
    v, s = compress(det.null_sample_)
    q = tilt(v, s, 2 * float(s @ v))
    assert float(q @ v) == pytest.approx(2 * float(s @ v))
    for n in (300, 1000, 3000):
        thr = det.threshold(n)
        sims = v[rng.choice(v.size, (4000, n), p=q)].mean(axis=1)
        expect = float(np.mean(sims > thr))
        got = det.power(n)["probability"]
        assert got == pytest.approx(expect, abs=4 * math.sqrt(expect * (1 - expect) / 4000) + 0.02), n
    ok = det.verdict({"margin": margins(rng, 1000)})
    assert not ok.flagged and ok.extra["power"]["n_tokens"] == 1000 and ok.extra["power"]["effect"] == 2.0
    assert f"caught at these 1000 tokens with probability {ok.extra['power']['probability']:.2f}" in ok.decision
