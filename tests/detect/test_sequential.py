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
    for x in det.sequential_blocks():  # no claim ids: every token a block, uncapped
        assert (group_log_mgf(x, seq.lambdas) <= seq.psi_LC + 1e-12).all()
    assert det.llr_clip_ is not None      # 90,000 honest tokens: the fixed test's evidence is capped ...
    np.testing.assert_array_equal(np.concatenate(det.sequential_blocks()),  # ... the e-process's is not
                                  np.concatenate([det._llr(g, capped=False) for g in det.null_gaps_]))
    x = det.sequential_evidence(_claims(300, 0.08, rng))[0]
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
    assert v.flagged and v.extra["decided_at_tokens"] == v.n_tokens < 20_000 and v.pooled >= 100
    assert v.p_value <= 0.01 and v.target_fpr == 0.01 and v.extra["tokens_available"] == 20_000
    h = seq.verdict(_claims(500, 0.05, rng, eps=5e-4))
    assert not h.flagged and h.extra["decided_at_tokens"] is None and h.n_tokens == 500 and 0 < h.p_value <= 1
    cm = ClippedMeanDetector().fit({"margin": np.abs(rng.normal(size=5000))})
    with pytest.raises(VerinferError, match="no per-claim honest sums"):  # fit without claim ids
        SequentialAudit(cm)
    with pytest.raises(ValueError, match="alpha"):
        SequentialAudit(det, alpha=1.5)


def _claim_table(n_claims, rng, sigma=0.05, spread=0.0, eps=5e-4, length=40, prefix="c"):
    """Claims of `length` tokens whose noise scale is the claim's own, sigma x exp(N(0, spread^2)):
    a claim's tokens share it (dependent tokens), claims are independent."""
    parts = [_claims(length, sigma * math.exp(spread * rng.normal()), rng, eps=eps) for _ in range(n_claims)]
    t = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    t["claim_id"] = np.repeat([f"{prefix}{i}" for i in range(n_claims)], length)
    return t


def test_claim_blocks_match_a_loop_and_survive_save_load(tmp_path):
    """With claim ids the e-process bets once per claim on the claim's summed (uncapped) evidence,
    the allowance is the honest claims' log-MGF, and it moves only at a claim's last token."""
    rng = np.random.default_rng(5)
    parts = [_claim_table(400, rng, sigma=s, prefix=f"g{i}-") for i, s in enumerate((0.045, 0.05, 0.055))]
    table = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    det = PerturbationGLRTDetector(temperature_factors=(1.1,), top_p_slack=0.0, envelope=False, n_null_batches=200,
                                   sigma_factors=(1.5, 3.0), eps_factors=(10.0,))
    det.fit(table, groups=np.repeat([0, 1, 2], 16_000))
    assert [b.tolist() for b in det.null_block_sizes_] == [[40] * 400] * 3
    blocks = det.sequential_blocks()
    raw = [det._llr(g, capped=False) for g in det.null_gaps_]
    np.testing.assert_allclose(blocks[1], raw[1].reshape(400, 40, -1).sum(axis=1))
    seq = SequentialAudit(det, alpha=0.01, lambdas=(0.125, 0.5))
    for b in blocks:
        assert (group_log_mgf(b, seq.lambdas) <= seq.psi_LC + 1e-12).all()
    audited = _claim_table(30, rng, sigma=0.09, length=25)
    x, claims = det.sequential_evidence(audited)
    assert claims is not None and len(np.unique(claims)) == 30
    log_e = seq.log_e_values(x, claims)
    comps, slow = np.zeros((2, x.shape[1])), []
    for c in range(30):
        z = x[25 * c : 25 * (c + 1)].sum(axis=0)
        for li, lam in enumerate(seq.lambdas):
            comps[li] += lam * z - seq.psi_LC[li]
        slow.append(logsumexp(comps) - math.log(comps.size))
    np.testing.assert_allclose(log_e[24::25], slow, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(log_e[25:49], np.full(24, log_e[24]))   # constant inside claim 2
    assert (log_e[:24] == 0).all()
    v = seq.verdict(audited)
    if v.flagged:
        assert v.extra["decided_at_tokens"] % 25 == 0                      # decided at a claim's end
    det.save(tmp_path / "g.json")
    back = PerturbationGLRTDetector.load(tmp_path / "g.json")
    np.testing.assert_array_equal(SequentialAudit(back, alpha=0.01, lambdas=(0.125, 0.5)).psi_LC, seq.psi_LC)
    d = det.to_json()                                      # edited claim blocks that miss a token: refused
    d["fitted"]["null_block_sizes"][0][0] -= 1
    with pytest.raises(VerinferError, match="block sizes"):
        PerturbationGLRTDetector.from_json(d)


def test_claim_blocks_hold_the_fpr_where_tokens_of_a_claim_are_dependent():
    """Honest claims whose noise scale varies from claim to claim (a prompt's numerics): a token-
    level e-process takes the shared scale for independent evidence and flags honest streams far
    above alpha; the claim-level one holds alpha."""
    rng = np.random.default_rng(8)
    kw = dict(spread=1.5, eps=0.0, length=160)
    parts = [_claim_table(125, rng, prefix=f"g{i}-", **kw) for i in range(3)]
    table = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    make = lambda: PerturbationGLRTDetector(temperature_factors=(1.1,), top_p_slack=0.0, envelope=False,  # noqa: E731
                                            n_null_batches=100, sigma_factors=(1.5, 3.0), eps_factors=(10.0,))
    groups = np.repeat([0, 1, 2], 20_000)
    by_claim = SequentialAudit(make().fit(table, groups=groups), alpha=0.05)
    by_token = SequentialAudit(make().fit({k: v for k, v in table.items() if k != "claim_id"}, groups=groups), alpha=0.05)
    flags = {"claim": 0, "token": 0}
    for _ in range(100):
        stream = _claim_table(50, rng, **kw)
        x, claims = by_claim.detector.sequential_evidence(stream)
        flags["claim"] += by_claim.stopping_time(x, claims) is not None
        flags["token"] += by_token.stopping_time(x) is not None
    assert flags["claim"] / 100 <= 0.05 + 0.05 and flags["token"] / 100 >= 0.2, flags   # measured 0 and ~0.33


def _margin_claims(n_claims, rng, rate, length=32, prefix="m"):
    """Greedy-mode margins: a token diverges with probability `rate` (margin ~ Exp(1)), else 0."""
    m = np.where(rng.random(n_claims * length) < rate, rng.exponential(1.0, n_claims * length), 0.0)
    return {"margin": m, "claim_id": np.repeat([f"{prefix}{i}" for i in range(n_claims)], length)}


def test_clipped_mean_streams_claim_sums(tmp_path):
    """The clipped-mean detector (greedy audits) keeps each honest group's per-claim sums, through
    its file; the e-process leaves honest streams alone and stops a divergent one early."""
    rng = np.random.default_rng(3)
    groups = [_margin_claims(300, rng, r, prefix=f"g{k}-") for k, r in enumerate((0.010, 0.012, 0.015))]
    table = {k: np.concatenate([g[k] for g in groups]) for k in groups[0]}
    det = ClippedMeanDetector(clip_quantile=0.999).fit(table, groups=np.repeat([0, 1, 2], 300 * 32))
    det.save(tmp_path / "d.json")
    back = ClippedMeanDetector.load(tmp_path / "d.json")
    for a, b in zip(det.sequential_blocks(), back.sequential_blocks()):
        assert a.shape == (300, 1) and np.array_equal(a, b)
    seq = SequentialAudit(back, alpha=0.01)
    honest = [seq.verdict(_margin_claims(100, rng, 0.012, prefix=f"h{i}-")).flagged for i in range(20)]
    assert sum(honest) == 0
    bad = seq.verdict(_margin_claims(100, rng, 0.08, prefix="b-"))
    assert bad.flagged and bad.extra["decided_at_tokens"] < 100 * 32 // 2
