import math

import numpy as np
import pytest
from scipy.special import logsumexp
from scipy.stats import norm

from verinfer.detect.clipped_mean import ClippedMeanDetector
from verinfer.detect.glrt import PerturbationGLRTDetector
from verinfer.detect.sequential import SequentialAudit, group_log_mgf
from verinfer.errors import VerinferError


def _claims(n, sigma, rng, eps=0.0):
    """Signed gaps under the perturbation model (as tests/detect/test_glrt.py): flip to the
    runner-up with probability Phi(-a / (sqrt(2) sigma)), a fraction eps of outliers."""
    a = rng.exponential(1.0, n)
    d = np.where(rng.random(n) < norm.cdf(-a / (math.sqrt(2) * sigma)), a, -a)
    out = rng.random(n) < eps
    d[out] = 1.0 + rng.exponential(1.0, out.sum())
    return {"gap_0": d, "gapT_1.1": d}


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.default_rng(0)
    sigmas = (0.045, 0.05, 0.055)
    parts = [_claims(30_000, s, rng, eps=5e-4) for s in sigmas]
    pooled = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    det = PerturbationGLRTDetector(temperature_factors=(1.1,), top_p_slack=0.0, envelope=False, n_null_batches=300,
                                   sigma_factors=(1.5, 2.0, 3.0), eps_factors=(10.0, 100.0))
    return det.fit(pooled, groups=np.repeat([0, 1, 2], 30_000)), rng


def test_e_process_matches_a_loop_and_the_allowance_covers_every_group(fitted):
    det, rng = fitted
    seq = SequentialAudit(det, alpha=0.01, lambdas=(0.25, 1.0))
    for x in det.group_evidence():
        assert (group_log_mgf(x, seq.lambdas) <= seq.psi_LC + 1e-12).all()
    x = det.token_scores(_claims(300, 0.08, rng))
    comps = np.zeros((2, x.shape[1]))
    slow = []
    for t in range(len(x)):
        for li, lam in enumerate(seq.lambdas):
            comps[li] += lam * x[t] - seq.psi_LC[li]
        slow.append(logsumexp(comps) - math.log(comps.size))
    np.testing.assert_allclose(seq.log_e_values(x), slow, rtol=1e-10, atol=1e-10)
    t = seq.stopping_time(x)
    assert t is None or slow[t - 1] >= math.log(100) > max(slow[: t - 1], default=-np.inf)


def test_anytime_false_positive_rate_on_honest_streams_and_power(fitted):
    """Honest streams (a calibration configuration and a new one inside their range) of 4,000
    tokens: flagged at any time in at most alpha of them (+ sampling slack); a noisier provider is
    flagged, and sooner than the fixed-size test needs for the same power."""
    det, rng = fitted
    seq = SequentialAudit(det, alpha=0.05)
    for sigma in (0.05, 0.052):
        pool = det.token_scores(_claims(40_000, sigma, rng, eps=5e-4))
        flags = [seq.stopping_time(pool[rng.integers(0, len(pool), 4000)]) is not None for _ in range(150)]
        assert np.mean(flags) <= 0.05 + 0.035
    bad = det.token_scores(_claims(40_000, 0.08, rng, eps=5e-4))
    times = [seq.stopping_time(bad[rng.integers(0, len(bad), 10_000)]) for _ in range(40)]
    assert all(t is not None for t in times)
    median = float(np.median(times))
    power = lambda n: np.mean(det.batch_statistics(bad, n, 300, rng) > det.threshold(n))  # noqa: E731
    assert power(int(median)) < 0.99                       # the fixed test at the median stopping time


def test_verdict_fields_and_errors(fitted):
    det, rng = fitted
    seq = SequentialAudit(det, alpha=0.01)
    v = seq.verdict(_claims(20_000, 0.15, rng))
    assert v["flagged"] and v["decided_at_tokens"] == v["n_tokens"] < 20_000 and v["pooled"] >= 100
    assert v["p_value"] <= 0.01 and v["target_fpr"] == 0.01 and v["tokens_available"] == 20_000
    h = seq.verdict(_claims(500, 0.05, rng, eps=5e-4))
    assert not h["flagged"] and h["decided_at_tokens"] is None and h["n_tokens"] == 500 and 0 < h["p_value"] <= 1
    cm = ClippedMeanDetector().fit({"margin": np.abs(rng.normal(size=5000))})
    with pytest.raises(VerinferError, match="--detector glrt"):
        SequentialAudit(cm)
    with pytest.raises(ValueError, match="alpha"):
        SequentialAudit(det, alpha=1.5)
