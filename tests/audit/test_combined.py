import numpy as np
import pytest

from verinfer.audit.combined import LikelihoodRatioDetector, token_bins, token_bins_loop
from verinfer.errors import VerinferError


def _tokens(n, mismatch, scale, rng, filtered=0.0):
    em = rng.random(n) >= mismatch
    m = np.where(em, 0.0, rng.exponential(scale, n))
    ce = np.where(em, rng.exponential(1.0, n), rng.exponential(2.0 + scale, n))
    f = rng.random(n) < filtered
    m[f], ce[f], em[f] = np.inf, np.inf, False
    return {"margin": m, "exact_match": em, "cross_entropy": ce}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return {"honest": _tokens(60_000, 0.005, 0.05, rng), "heldout": _tokens(30_000, 0.005, 0.05, rng),
            "alt": _tokens(20_000, 0.03, 0.5, rng, 0.002), "mis": _tokens(20_000, 0.02, 0.4, rng)}


def test_bins_vectorized_equal_loop(data):
    d = data["alt"]
    me, ce = (0.01, 0.05, 0.2, 0.3), (1.0, 3.0, 8.0)
    np.testing.assert_array_equal(token_bins(d["margin"], d["exact_match"], d["cross_entropy"], me, ce),
                                  token_bins_loop(d["margin"], d["exact_match"], d["cross_entropy"], me, ce))


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
