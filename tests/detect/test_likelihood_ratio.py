import numpy as np
import pytest

from verinfer.detect.likelihood_ratio import N_CE_BANDS, N_DIRECTIONS, LikelihoodRatioDetector, token_bins
from verinfer.errors import VerinferError



def token_bins_loop(margin, exact_match, cross_entropy, margin_edges, ce_edges, logit_gap=None) -> np.ndarray:
    """Reference for `token_bins`, one token at a time."""
    q50, q90, q99, mx = margin_edges
    c50, c90, cmx = ce_edges
    out = []
    gaps = logit_gap if logit_gap is not None else [0.0] * len(margin)
    for m, em, ce, g in zip(margin, exact_match, cross_entropy, gaps):
        if em:
            out.append(0)
            continue
        if np.isinf(m):
            i = 6
        elif m > 4 * mx:
            i = 5
        elif m > mx:
            i = 4
        else:
            i = sum(m >= e for e in (q50, q90, q99))
        j = 3 if ce > cmx else sum(ce >= e for e in (c50, c90))
        out.append(1 + (i * N_DIRECTIONS + int(g > 0)) * N_CE_BANDS + j)
    return np.array(out, dtype=np.int64)


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
    det = LikelihoodRatioDetector(n_null_batches=500).fit(data["honest"], alternatives=[data["alt"]])
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
    assert v.flagged and v.p_value < 0.01 and v.more_tokens_needed is None
    assert v.n_tokens == 1000 and v.target_fpr == 0.01


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


def test_groups_stratify_the_null(tmp_path, data):
    """With groups the null keeps each honest group's weights (ClippedMeanDetector.fit_null); the
    per-token weights are the same, the threshold is the worst group's, and it survives a save."""
    h = data["honest"]
    groups = np.arange(h["margin"].size) % 3
    plain = LikelihoodRatioDetector(n_null_batches=200).fit(h)
    strat = LikelihoodRatioDetector(n_null_batches=200).fit(h, groups=groups)
    np.testing.assert_array_equal(plain.weights_, strat.weights_)
    assert strat.null_.null_group_sizes_ == [20_000] * 3 and plain.null_.null_group_sizes_ == [60_000]
    strat.save(tmp_path / "s.json")
    back = LikelihoodRatioDetector.load(tmp_path / "s.json")
    assert back.null_.null_group_sizes_ == [20_000] * 3 and back.threshold(300) == strat.threshold(300)
    with pytest.raises(VerinferError, match="logit_gap"):
        plain.verdict({k: v for k, v in h.items() if k != "logit_gap"})
