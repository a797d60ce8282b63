import numpy as np
import pytest

from verinfer.detect.likelihood_ratio import LikelihoodRatioDetector, token_bins, token_bins_loop
from verinfer.errors import VerinferError


def _tokens(n, mismatch, scale, rng, filtered=0.0):
    em = rng.random(n) >= mismatch
    m = np.where(em, 0.0, rng.exponential(scale, n))
    ce = np.where(em, rng.exponential(1.0, n), rng.exponential(2.0 + scale, n))
    f = rng.random(n) < filtered
    m[f], ce[f], em[f] = np.inf, np.inf, False
    gap = np.where(em, 0.0, rng.normal(0.2 if scale > 0.1 else 0.0, 1.0, n))
    return {"margin": m, "exact_match": em, "cross_entropy": ce, "logit_gap": gap}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return {"honest": _tokens(60_000, 0.005, 0.05, rng), "heldout": _tokens(30_000, 0.005, 0.05, rng),
            "alt": _tokens(20_000, 0.03, 0.5, rng, 0.002), "mis": _tokens(20_000, 0.02, 0.4, rng)}


def test_bins_vectorized_equal_loop(data):
    d = data["alt"]
    me, ce = (0.01, 0.05, 0.2, 0.3), (1.0, 3.0, 8.0)
    for gap in (None, d["logit_gap"]):
        fast = token_bins(d["margin"], d["exact_match"], d["cross_entropy"], me, ce, gap)
        np.testing.assert_array_equal(fast, token_bins_loop(d["margin"], d["exact_match"], d["cross_entropy"], me, ce, gap))
    assert len(np.unique(fast)) > 20


def test_fit_weights_and_honest_fpr(data):
    det = LikelihoodRatioDetector(n_null_batches=500).fit(data["honest"], [data["alt"]])
    assert det.p0_.sum() == pytest.approx(1) and det.p1_.sum() == pytest.approx(1)
    np.testing.assert_allclose(det.weights_, np.log(det.p1_ / det.p0_))
    assert det.weights_[0] < 0 < det.weights_[-1]
    rng = np.random.default_rng(1)
    h = data["heldout"]
    flags = []
    for _ in range(300):
        idx = rng.integers(0, h["margin"].size, 300)
        flags.append(det.predict({k: v[idx] for k, v in h.items()}))
    assert np.mean(flags) <= 0.03
    mis = {k: v[:1000] for k, v in data["mis"].items()}
    v = det.verdict(mis)
    assert v["flagged"] and v["p_value"] < 0.01 and v["more_tokens_needed"] is None
    assert v["n_tokens"] == 1000 and v["target_fpr"] == 0.01


def test_honest_only_fit_save_load(tmp_path, data):
    det = LikelihoodRatioDetector(n_null_batches=200).fit(data["honest"])
    assert det.n_alternatives_ == 0
    det.save(tmp_path / "d.json")
    back = LikelihoodRatioDetector.load(tmp_path / "d.json")
    mis = {k: v[:300] for k, v in data["mis"].items()}
    assert back.pooled(mis) == pytest.approx(det.pooled(mis))
    assert back.threshold(300) == pytest.approx(det.threshold(300))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(VerinferError):
        LikelihoodRatioDetector.load(tmp_path / "bad.json")
    with pytest.raises(VerinferError, match="not fitted"):
        LikelihoodRatioDetector().threshold(10)


def test_replay_library_detector_separates_the_alternative():
    from verinfer.detect.likelihood_ratio import ReplayLibraryDetector

    rng = np.random.default_rng(4)

    def claims(n, produced_by_alt):
        # honest verifier margin and alternative-replay margin: the producer's replay reproduces it
        flip = lambda r: np.where(rng.random(n) < r, rng.exponential(0.3, n), 0.0)  # noqa: E731
        own, other = flip(0.003), flip(0.02)
        m, a = (other, own) if produced_by_alt else (own, other)
        return {"margin": m, "margin_alt": a}

    det = ReplayLibraryDetector(alternatives=("margin_alt",), n_null_batches=500).fit(claims(50_000, False))
    assert det.clip_ > 0
    x = det.token_columns(claims(1000, False))
    np.testing.assert_allclose(det.statistic_of_means(x.mean(0), 1000),
                               max(np.sqrt(1000) * (x[:, c].mean() - det.mu_[c]) / det.sd_[c] for c in range(2)))
    honest_flags = [det.predict(claims(300, False)) for _ in range(100)]
    alt_flags = [det.predict(claims(1000, True)) for _ in range(100)]
    assert np.mean(honest_flags) <= 0.05 and np.mean(alt_flags) >= 0.9
    v = det.verdict(claims(300, True))
    assert set(v) >= {"flagged", "threshold_fpr", "tail_probability", "more_tokens_needed"}


def test_replay_library_groups_guard_a_noisier_new_honest_config():
    from verinfer.detect.likelihood_ratio import ReplayLibraryDetector

    rng = np.random.default_rng(6)

    def honest(n, rate):
        return {"margin": np.where(rng.random(n) < rate, rng.exponential(0.3, n), 0.0),
                "margin_alt": np.where(rng.random(n) < 0.02, rng.exponential(0.3, n), 0.0)}

    parts = [honest(20_000, r) for r in (0.002, 0.003, 0.006)]
    pooled = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    groups = np.repeat([0, 1, 2], 20_000)
    plain = ReplayLibraryDetector(alternatives=("margin_alt",), n_null_batches=300).fit(pooled)
    strat = ReplayLibraryDetector(alternatives=("margin_alt",), n_null_batches=300).fit(pooled, groups=groups)
    assert strat.tau_[0] > 0 and strat.threshold(5000) > plain.threshold(5000)
    new = honest(20_000, 0.007)          # an honest config noisier than any calibration one
    x = strat.token_columns(new)
    stats = strat.batch_statistics(x, 5000, 200, rng)
    assert np.mean(stats > strat.threshold(5000)) <= 0.05 < np.mean(stats > plain.threshold(5000))
