import json
import math

import numpy as np
import pytest
from scipy.stats import binom, kstest, norm

from verinfer.detect.detectors import MAX_NULL_SAMPLE, ClippedMeanDetector
from verinfer.errors import VerinferError


@pytest.fixture(scope="module")
def honest():
    rng = np.random.default_rng(0)
    v = rng.exponential(1.0, 300_000)
    v[rng.random(v.size) < 1e-3] = np.inf  # filtered-out claimed tokens
    return v


@pytest.fixture(scope="module")
def det(honest):
    return ClippedMeanDetector(score="margin", clip_quantile=0.999, target_fpr=0.01).fit(honest)


def test_fit_learned_attributes(det, honest):
    fin = honest[np.isfinite(honest)]
    assert det.clip_ == pytest.approx(np.quantile(fin, 0.999))
    assert det.null_sample_.size == MAX_NULL_SAMPLE and det.n_train_ == honest.size  # subsampled
    assert det.null_sample_.max() == det.clip_ and np.isfinite(det.null_sample_).all()
    assert det.null_mean_ == pytest.approx(det.null_sample_.mean())
    assert det.null_std_ == pytest.approx(det.null_sample_.std(ddof=1))
    again = ClippedMeanDetector().fit(honest)  # deterministic
    assert np.array_equal(again.null_sample_, det.null_sample_) and again.threshold(50) == det.threshold(50)
    with pytest.raises(Exception):
        det.clip_quantile = 0.5  # frozen config
    assert det.pooled([0.0, np.inf]) == pytest.approx(det.clip_ / 2)


def test_fpr_on_fresh_honest_batches_is_target(det):
    rng = np.random.default_rng(1)
    n, b = 3000, 100
    x = rng.exponential(1.0, (n, b))
    x[rng.random(x.shape) < 1e-3] = np.inf
    flagged = sum(det.predict(row) for row in x)
    # binomial 99.9% interval around the target, widened for the threshold's own resampling error
    lo, hi = binom.ppf([0.0005, 0.9995], n, det.target_fpr)
    assert lo - 10 <= flagged <= hi + 10, flagged
    assert 0.003 < flagged / n < 0.02


def test_p_values_uniform_under_null(det):
    rng = np.random.default_rng(2)
    p = np.array([det.p_value(rng.exponential(1.0, 40)) for _ in range(600)])
    assert kstest(p, "uniform").pvalue > 1e-3
    assert abs(np.mean(p <= 0.05) - 0.05) < 0.03


def test_flags_shifted_distribution(det):
    rng = np.random.default_rng(3)
    bad = det.verdict(rng.exponential(1.3, 1000))
    assert bad["flagged"] and bad["p_value"] < 1e-3 and bad["p_value_method"] == "normal"
    assert bad["p_value"] <= 1 / (det.n_null_batches + 1)
    ok = det.verdict(rng.exponential(1.0, 1000))
    assert not ok["flagged"] and ok["p_value_method"] == "resampled" and ok["p_value"] > 0.01
    assert set(ok) == {"flagged", "pooled", "threshold", "p_value", "p_value_method", "n_tokens", "target_fpr",
                       "score", "clip"}
    assert ok["n_tokens"] == 1000 and ok["score"] == "margin" and ok["clip"] == det.clip_
    # a resampled p-value is (1 + #null means >= observed) / (1 + B)
    null = det.null_means(1000)
    assert ok["p_value"] == (1 + np.sum(null >= ok["pooled"])) / (1 + null.size)
    assert ok["threshold"] == pytest.approx(np.quantile(null, 0.99))


def test_threshold_resampled_matches_normal_approximation(det):
    n = 10_000  # 2000 x 10k draws: still resampled; 20k tokens switch to the CLT
    normal = det.null_mean_ + norm.isf(0.01) * det.null_std_ / math.sqrt(n)
    assert det.threshold(n) == pytest.approx(normal, abs=0.1 * det.null_std_ / math.sqrt(n))
    big = det.verdict(np.full(20_000, det.null_mean_ + 0.1))
    assert big["threshold"] == pytest.approx(det.null_mean_ + norm.isf(0.01) * det.null_std_ / math.sqrt(20_000))
    assert big["p_value_method"] == "normal" and big["flagged"]


def test_degenerate_null_all_zero():
    d = ClippedMeanDetector().fit(np.zeros(1000))
    assert d.threshold(10) == 0.0 and not d.predict(np.zeros(10)) and d.p_value(np.zeros(10)) == 1.0
    assert d.clip_ == 1.0  # no spread in the honest data: clip one unit above it, not at 0
    assert d.predict([0.0] * 9 + [np.inf]) is True  # a filtered-out claim is visible
    d2 = ClippedMeanDetector(clip_quantile=1.0).fit(np.r_[np.zeros(999), 1.0])
    assert d2.predict(np.r_[np.zeros(5), 1.0, 1.0]) and d2.p_value(np.ones(10)) == 0.0


def test_save_load_round_trip(det, tmp_path):
    path = tmp_path / "sub" / "det.json"
    det.save(path)
    back = ClippedMeanDetector.load(path)
    assert back == det and back.config() == det.config()
    assert np.array_equal(back.null_sample_, det.null_sample_)
    for k in ("clip_", "null_mean_", "null_std_", "n_train_"):
        assert getattr(back, k) == getattr(det, k)
    x = np.random.default_rng(4).exponential(1.1, 700)
    assert back.verdict(x) == det.verdict(x)
    assert [p.name for p in path.parent.iterdir()] == ["det.json"]  # no temp file left behind
    d = json.loads(path.read_text())
    assert d["format"] == "verinfer.ClippedMeanDetector" and d["version"] == 1


def test_load_errors_name_the_file(det, tmp_path):
    path = tmp_path / "det.json"
    det.save(path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # truncated
    with pytest.raises(VerinferError, match="not valid JSON.*truncated") as e:
        ClippedMeanDetector.load(path)
    assert str(path) in str(e.value)
    d = json.loads(text)
    d["version"] = 99
    path.write_text(json.dumps(d))
    with pytest.raises(VerinferError, match="version 99") as e:
        ClippedMeanDetector.load(path)
    assert str(path) in str(e.value)
    d["version"] = 1
    d["fitted"]["null_sample_f8_base64"] = d["fitted"]["null_sample_f8_base64"][:-400]
    path.write_text(json.dumps(d))
    with pytest.raises(VerinferError, match="malformed detector"):
        ClippedMeanDetector.load(path)
    with pytest.raises(VerinferError, match="no such detector file"):
        ClippedMeanDetector.load(tmp_path / "missing.json")


def test_unfitted_and_bad_input():
    with pytest.raises(VerinferError, match="not fitted"):
        ClippedMeanDetector().threshold(10)
    with pytest.raises(ValueError):
        ClippedMeanDetector(score="bogus")
    d = ClippedMeanDetector().fit(np.arange(100.0))
    with pytest.raises(ValueError, match="empty"):
        d.verdict([])
    with pytest.raises(ValueError, match="NaN"):
        d.verdict([np.nan])


def test_verdict_reports_confidence(det, honest):
    rng = np.random.default_rng(5)
    fin = honest[np.isfinite(honest)]
    v = det.verdict(rng.choice(fin, 200) + 0.05, confidence=True)  # small excess
    assert v["tail_probability"] == v["p_value"] and v["threshold_fpr"] <= 0.02
    if not v["flagged"]:
        assert v["more_tokens_needed"] is None or v["more_tokens_needed"] >= 1
    pooled = det.null_mean_ + 0.1
    n_star = det.tokens_to_flag(pooled, 100)
    assert n_star == math.ceil((norm.isf(0.01) * det.null_std_ / 0.1) ** 2)
    d = det.verdict_from_pooled(pooled, 100)
    assert not d["flagged"] and d["more_tokens_needed"] == n_star - 100 and "not enough evidence" in d["decision"]
    assert det.verdict_from_pooled(det.null_mean_ - 0.1, 100)["more_tokens_needed"] is None
    assert det.verdict_from_pooled(det.null_mean_ + 2.0, 100)["flagged"]


def test_stratified_null_holds_fpr_for_every_honest_group(tmp_path):
    """Two honest configurations with different noise levels: a pooled null flags the noisier one
    far more often than target_fpr; the stratified null keeps each at or below it."""
    rng = np.random.default_rng(3)
    quiet, noisy = rng.exponential(1.0, 20_000), rng.exponential(1.25, 20_000)
    pooled = ClippedMeanDetector(clip_quantile=1.0).fit(np.r_[quiet, noisy])
    strat = ClippedMeanDetector(clip_quantile=1.0).fit(np.r_[quiet, noisy], groups=["q"] * 20_000 + ["n"] * 20_000)
    fresh = rng.exponential(1.25, (400, 300))  # fresh batches of the noisy honest configuration
    fpr_pooled = np.mean([pooled.predict(b) for b in fresh])
    fpr_strat = np.mean([strat.predict(b) for b in fresh])
    assert fpr_pooled > 0.2 and fpr_strat <= 0.03
    assert strat.threshold(300) > pooled.threshold(300)
    assert strat.p_value(fresh[0]) >= pooled.p_value(fresh[0])
    strat.save(tmp_path / "d.json")
    back = ClippedMeanDetector.load(tmp_path / "d.json")
    assert back.null_group_sizes_ == strat.null_group_sizes_ and back.threshold(300) == strat.threshold(300)


# --- PerturbationGLRTDetector ----------------------------------------------------------------------
def _claims(n, sigma, rng, eps=0.0, temp_shift=0.0):
    """Signed gaps under the perturbation model: the verifier's pick leads by a ~ Exp(1); the
    provider (noise std sigma per logit) flips to the runner-up with probability
    Phi(-a / (sqrt(2) sigma)), then d = +a (its margin), else d = -a; a fraction eps are outliers
    (margin 1 + Exp(1)). Temperature columns 0.9 / 1.1: d shifted by -/+ temp_shift * |d| on
    flipped tokens (a provider at 1.1 x T is reproduced better at 1.1)."""
    a = rng.exponential(1.0, n)
    flip = rng.random(n) < norm.cdf(-a / (math.sqrt(2) * sigma))
    d = np.where(flip, a, -a)
    out = rng.random(n) < eps
    d[out] = 1.0 + rng.exponential(1.0, out.sum())
    t09 = np.where(d > 0, d * (1 + temp_shift), d)
    t11 = np.where(d > 0, d * (1 - temp_shift), d)
    return {"gap_0": d, "gapT_0.9": t09, "gapT_1.1": t11}


def _glrt(**kw):
    from verinfer.detect.detectors import PerturbationGLRTDetector

    return PerturbationGLRTDetector(temperature_factors=(0.9, 1.1), top_p_slack=0.0, **kw)


def test_glrt_fit_statistic_and_batches_match_a_loop():
    rng = np.random.default_rng(0)
    det = _glrt(n_null_batches=300).fit(_claims(60_000, 0.05, rng, eps=1e-3))
    assert det.sigma0_ == pytest.approx(0.05, rel=0.15) and 0 < det.eps0_ < 5e-3
    assert len(det.grid_) == 4 + 2 + 2
    t = _claims(500, 0.2, rng)
    x = det.token_columns(t)
    slow = max(sum(x[i, g] for i in range(500)) for g in range(x.shape[1]))      # GLRT: best alternative's LLR
    assert det.statistic(t) == pytest.approx(slow)
    z = _glrt(n_null_batches=300, combine="maxz").fit(_claims(60_000, 0.05, rng, eps=1e-3))
    xz = z.token_columns(t)
    slow_z = max(math.sqrt(500) * (xz[:, g].mean() - z.mu_[g]) / z.sd_[g] for g in range(xz.shape[1]))
    assert z.statistic(t) == pytest.approx(slow_z)
    idx = np.random.default_rng(5).integers(0, 500, (7, 40))
    fast = det.batch_statistics(x, 40, 7, np.random.default_rng(5))
    np.testing.assert_allclose(fast, [det.statistic_of_means(x[i].mean(0), 40) for i in idx])


def test_glrt_holds_fpr_and_beats_the_clipped_margin_on_rare_outliers():
    rng = np.random.default_rng(1)
    honest = _claims(100_000, 0.05, rng, eps=5e-4)
    det = _glrt(n_null_batches=1000).fit(honest)
    cm = ClippedMeanDetector(clip_quantile=0.999).fit(np.maximum(honest["gap_0"], 0))
    n, b = 300, 200
    rate = lambda det_, sets, f=lambda c: c: np.mean([det_.predict(f(c)) for c in sets])  # noqa: E731
    margin = lambda c: np.maximum(c["gap_0"], 0)  # noqa: E731
    assert rate(det, [_claims(n, 0.05, rng, eps=5e-4) for _ in range(b)]) <= 0.03
    # a larger noise scale (quantization): detected
    assert rate(det, [_claims(n, 0.12, rng, eps=5e-4) for _ in range(b)]) >= 0.9
    # 1% outliers (a sampling bug): the outlier column catches what the clipped mean averages away
    buggy = [_claims(n, 0.05, rng, eps=0.01) for _ in range(b)]
    assert rate(det, buggy) >= rate(cm, buggy, margin) + 0.1 and rate(det, buggy) >= 0.55


def test_glrt_groups_guard_a_noisier_new_honest_config():
    rng = np.random.default_rng(2)
    parts = [_claims(30_000, s, rng, eps=5e-4) for s in (0.04, 0.05, 0.06)]
    pooled = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    groups = np.repeat([0, 1, 2], 30_000)
    plain = _glrt(n_null_batches=300).fit(pooled)
    strat = _glrt(n_null_batches=300).fit(pooled, groups=groups)
    assert (strat.tau_[:4] > 0).all() and strat.threshold(3000) > plain.threshold(3000)
    new = strat.token_columns(_claims(30_000, 0.065, rng, eps=5e-4))   # noisier than any calibration config
    stats = strat.batch_statistics(new, 3000, 200, rng)
    assert np.mean(stats > strat.threshold(3000)) <= 0.05 < np.mean(stats > plain.threshold(3000))


def test_glrt_verdict_roundtrip_and_errors(tmp_path):
    from verinfer.detect.detectors import PerturbationGLRTDetector

    rng = np.random.default_rng(3)
    honest = _claims(20_000, 0.05, rng, eps=5e-4)
    det = _glrt(n_null_batches=200).fit(honest, groups=np.arange(20_000) % 2)
    v = det.verdict(_claims(2000, 0.3, rng))
    assert v["flagged"] and v["p_value"] <= 1 / 201 + 1e-12 and v["more_tokens_needed"] is None
    assert v["strongest_alternative"].startswith("noise sigma")
    weak = det.verdict(_claims(30, 0.09, rng))
    assert not weak["flagged"] and set(weak) >= {"threshold_fpr", "tail_probability", "more_tokens_needed"}
    if weak["more_tokens_needed"] is not None:
        assert weak["more_tokens_needed"] >= 1
    assert det.verdict({k: np.full(50, -5.0) for k in honest})["more_tokens_needed"] is None  # nothing to see
    det.save(tmp_path / "g.json")
    back = PerturbationGLRTDetector.load(tmp_path / "g.json")
    t = _claims(400, 0.1, rng)
    assert back.statistic(t) == pytest.approx(det.statistic(t))
    assert back.threshold(100) == pytest.approx(det.threshold(100))
    (tmp_path / "bad.json").write_text(json.dumps({"format": "x"}))
    with pytest.raises(VerinferError):
        PerturbationGLRTDetector.load(tmp_path / "bad.json")
    with pytest.raises(VerinferError, match="not fitted"):
        _glrt().threshold(10)
    with pytest.raises(ValueError, match="NaN"):
        det.statistic({k: np.full(5, np.nan) for k in honest})
