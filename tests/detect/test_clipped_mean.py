import json
import math

import numpy as np
import pytest
from scipy.stats import binom, kstest, norm

from verinfer.detect import load_detector
from verinfer.detect.base import decode_f8, encode_f8
from verinfer.detect.clipped_mean import MAX_NULL_SAMPLE, ClippedMeanDetector
from verinfer.errors import VerinferError


def M(values) -> dict:
    """A score table of one margin column."""
    return {"margin": np.asarray(values, dtype=np.float64)}


@pytest.fixture(scope="module")
def honest():
    rng = np.random.default_rng(0)
    v = rng.exponential(1.0, 300_000)
    v[rng.random(v.size) < 1e-3] = np.inf  # filtered-out claimed tokens
    return v


@pytest.fixture(scope="module")
def det(honest):
    return ClippedMeanDetector(score_name="margin", clip_quantile=0.999, target_fpr=0.01).fit(M(honest))


def test_fit_learned_attributes(det, honest):
    fin = honest[np.isfinite(honest)]
    assert det.clip_ == pytest.approx(np.quantile(fin, 0.999))
    assert det.null_sample_.size == MAX_NULL_SAMPLE and det.n_train_ == honest.size  # subsampled
    assert det.null_sample_.max() == det.clip_ and np.isfinite(det.null_sample_).all()
    assert det.null_mean_ == pytest.approx(det.null_sample_.mean())
    assert det.null_std_ == pytest.approx(det.null_sample_.std(ddof=1))
    again = ClippedMeanDetector().fit(M(honest))  # deterministic
    assert np.array_equal(again.null_sample_, det.null_sample_) and again.threshold(50) == det.threshold(50)
    with pytest.raises(Exception):
        det.clip_quantile = 0.5  # frozen config
    assert det.score(M([0.0, np.inf])) == pytest.approx(det.clip_ / 2)


def test_fpr_on_fresh_honest_batches_is_target(det):
    rng = np.random.default_rng(1)
    n, b = 3000, 100
    x = rng.exponential(1.0, (n, b))
    x[rng.random(x.shape) < 1e-3] = np.inf
    flagged = sum(det.predict(M(row)) for row in x)
    # binomial 99.9% interval around the target, widened for the threshold's own resampling error
    lo, hi = binom.ppf([0.0005, 0.9995], n, det.target_fpr)
    assert lo - 10 <= flagged <= hi + 10, flagged
    assert 0.003 < flagged / n < 0.02


def test_p_values_uniform_under_null(det):
    rng = np.random.default_rng(2)
    p = np.array([det.p_value(M(rng.exponential(1.0, 40))) for _ in range(600)])
    assert kstest(p, "uniform").pvalue > 1e-3
    assert abs(np.mean(p <= 0.05) - 0.05) < 0.03


def test_flags_shifted_distribution(det):
    rng = np.random.default_rng(3)
    bad = det.verdict(M(rng.exponential(1.3, 1000)))
    assert bad.flagged and bad.p_value < 1e-12 and bad.p_value_method == "saddle-point"
    assert bad.p_value <= bad.extra["p_value_bound"] < 1e-10  # the Chernoff bound is above it, and tight-ish
    ok = det.verdict(M(rng.exponential(1.0, 1000)))
    assert not ok.flagged and ok.p_value_method == "resampled" and ok.p_value > 0.01
    assert set(ok.reported) == {"flagged", "pooled", "threshold", "p_value", "p_value_method", "p_value_bound", "n_tokens", "target_fpr",
                       "score", "clip", "tail_probability", "threshold_fpr", "more_tokens_needed", "power",
                       "detectable_excess", "decision"}
    assert ok.n_tokens == 1000 and ok.score == "margin" and ok.extra["clip"] == det.clip_
    # a resampled p-value is (1 + #null means >= observed) / (1 + B)
    null = det.null_means(1000)
    assert ok.p_value == (1 + np.sum(null >= ok.pooled)) / (1 + null.size)
    assert ok.threshold == pytest.approx(np.quantile(null, 0.99))


def test_threshold_resampled_matches_normal_approximation(det):
    n = 10_000  # 2000 x 10k draws: still resampled; 20k tokens switch to the CLT
    normal = det.null_mean_ + norm.isf(0.01) * det.null_std_ / math.sqrt(n)
    assert det.threshold(n) == pytest.approx(normal, abs=0.1 * det.null_std_ / math.sqrt(n))
    big = det.verdict(M(np.full(20_000, det.null_mean_ + 0.1)))
    assert big.threshold == pytest.approx(det.null_mean_ + norm.isf(0.01) * det.null_std_ / math.sqrt(20_000))
    assert big.p_value_method == "saddle-point" and big.flagged


def test_degenerate_null_is_refused_and_a_thin_one_warned():
    """Issue 15: with 16 calibration requests every honest margin was 0, the threshold became 0 and
    an honest server was flagged at p = 0. Now fit refuses a null without spread, and an honest
    configuration with fewer than 1/FPR tokens; a clip or null resting on few tokens is warned."""
    with pytest.raises(VerinferError, match="degenerate honest null: all 1000 honest margin values are 0") as e:
        ClippedMeanDetector().fit(M(np.zeros(1000)))
    assert "more honest claims" in e.value.fix
    with pytest.raises(VerinferError, match="only 60 scored tokens.*1/FPR = 100"):
        ClippedMeanDetector().fit(M(np.arange(160.0)), groups=[0] * 100 + [1] * 60)
    d = ClippedMeanDetector().fit(M(np.r_[np.zeros(997), 1.0, 2.0, 3.0]))
    assert any("rests on 1 tokens above it" in w for w in d.warnings_)
    assert any("only 3 honest tokens differ from the most common value 0" in w for w in d.warnings_)
    rng = np.random.default_rng(0)
    assert ClippedMeanDetector().fit(M(rng.exponential(1.0, 20_000))).warnings_ == []  # 20 tokens above the clip


def test_save_load_round_trip(det, tmp_path):
    path = tmp_path / "sub" / "det.json"
    det.save(path)
    back = ClippedMeanDetector.load(path)
    assert back == det and back.config() == det.config()
    assert np.array_equal(back.null_sample_, det.null_sample_)
    for k in ("clip_", "null_mean_", "null_std_", "n_train_"):
        assert getattr(back, k) == getattr(det, k)
    x = M(np.random.default_rng(4).exponential(1.1, 700))
    assert back.verdict(x) == det.verdict(x)
    assert [p.name for p in path.parent.iterdir()] == ["det.json"]  # no temp file left behind
    d = json.loads(path.read_text())
    assert d["format"] == "verinfer.ClippedMeanDetector" and d["version"] == 2


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
    d["version"] = 2
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
        ClippedMeanDetector(score_name="bogus")
    d = ClippedMeanDetector().fit(M(np.arange(100.0)))
    with pytest.raises(ValueError, match="empty"):
        d.verdict(M([]))
    with pytest.raises(ValueError, match="NaN"):
        d.verdict(M([np.nan]))
    with pytest.raises(TypeError, match="score table"):
        d.verdict(np.arange(10.0))  # a bare array is not a score table
    with pytest.raises(VerinferError, match="lack the column cross_entropy.*clipped-mean") as e:
        ClippedMeanDetector(score_name="cross_entropy").fit(M(np.arange(100.0)))
    assert "verinfer score" in e.value.fix


def test_verdict_reports_confidence(det, honest):
    rng = np.random.default_rng(5)
    fin = honest[np.isfinite(honest)]
    v = det.verdict(M(rng.choice(fin, 200) + 0.05))  # small excess
    assert v.tail_probability == v.p_value and v.threshold_fpr <= 0.02
    if not v.flagged:
        assert v.more_tokens_needed is None or v.more_tokens_needed >= 1
    pooled = det.null_mean_ + 0.1
    n_star = det.tokens_to_flag(pooled, 100)
    assert n_star == math.ceil((norm.isf(0.01) * det.null_std_ / 0.1) ** 2)
    d = det.verdict_from_pooled(pooled, 100)
    assert not d.flagged and d.more_tokens_needed == n_star - 100
    assert "consistent with honest inference" in d.decision and "only if it persisted" in d.decision
    assert det.verdict_from_pooled(det.null_mean_ - 0.1, 100).more_tokens_needed is None
    assert det.verdict_from_pooled(det.null_mean_ + 2.0, 100).flagged


def test_stratified_null_holds_fpr_for_every_honest_group(tmp_path):
    """Two honest configurations with different noise levels: a pooled null flags the noisier one
    far more often than target_fpr; the stratified null keeps each at or below it."""
    rng = np.random.default_rng(3)
    quiet, noisy = rng.exponential(1.0, 20_000), rng.exponential(1.25, 20_000)
    pooled = ClippedMeanDetector(clip_quantile=1.0).fit(M(np.r_[quiet, noisy]))
    strat = ClippedMeanDetector(clip_quantile=1.0).fit(M(np.r_[quiet, noisy]), groups=["q"] * 20_000 + ["n"] * 20_000)
    fresh = rng.exponential(1.25, (400, 300))  # fresh batches of the noisy honest configuration
    fpr_pooled = np.mean([pooled.predict(M(b)) for b in fresh])
    fpr_strat = np.mean([strat.predict(M(b)) for b in fresh])
    assert fpr_pooled > 0.2 and fpr_strat <= 0.03
    assert strat.threshold(300) > pooled.threshold(300)
    assert strat.p_value(M(fresh[0])) >= pooled.p_value(M(fresh[0]))
    strat.save(tmp_path / "d.json")
    back = ClippedMeanDetector.load(tmp_path / "d.json")
    assert back.null_group_sizes_ == strat.null_group_sizes_ and back.threshold(300) == strat.threshold(300)


def test_activation_score_reads_only_logged_tokens():
    """fp_l2 exists on logged tokens only (NaN / null elsewhere): token_rows keeps those, max_tokens
    counts them, and a pyarrow table and a dict give the same verdict."""
    import pyarrow as pa

    rng = np.random.default_rng(7)
    v = rng.exponential(1.0, 4000)
    v[::3] = np.nan
    det = ClippedMeanDetector(score_name="fp_l2", n_null_batches=200).fit({"fp_l2": v})
    assert det.n_train_ == np.count_nonzero(~np.isnan(v))
    table = pa.table({"fp_l2": pa.array(v, from_pandas=True), "margin": np.zeros(v.size)})
    assert table["fp_l2"].null_count > 0
    vt, vd = det.verdict(table, max_tokens=100), det.verdict({"fp_l2": v, "margin": np.zeros(v.size)}, max_tokens=100)
    assert vt == vd and vt.n_tokens == 100
    assert vt.pooled == np.minimum(v[~np.isnan(v)][:100], det.clip_).mean()



@pytest.mark.parametrize("edit, match", [
    (lambda f: f.update(clip_=float("nan")), "clip_"),
    (lambda f: f.update(clip_=-1.0), "clip_"),
    (lambda f: f.update(null_std_=float("inf")), "null_std_"),
    (lambda f: f.update(null_mean_=f["null_mean_"] * 1.5), "null_mean_ is .* the null sample's is"),
    (lambda f: f.update(n_train_=-1), "n_train_"),
    (lambda f: f.update(null_sample_f8_base64=encode_f8(np.r_[-1.0, decode_f8(f["null_sample_f8_base64"])[1:]])),
     "null sample value 0 is -1.0, outside"),
    (lambda f: f.update(null_sample_f8_base64=encode_f8(np.r_[np.nan, decode_f8(f["null_sample_f8_base64"])[1:]])),
     "NaN"),
])
def test_an_edited_detector_file_is_refused(det, tmp_path, edit, match):
    """Issue 15: a detector whose clip_ or null sample was edited to NaN or -1 loaded and passed an
    int4 provider as ok. Loading now validates every fitted field (finite, in range, consistent)."""
    path = tmp_path / "det.json"
    det.save(path)
    d = json.loads(path.read_text())
    edit(d["fitted"])
    path.write_text(json.dumps(d))
    with pytest.raises(VerinferError, match=f"malformed detector.*{match}") as e:
        load_detector(path)
    assert str(path) in str(e.value) and "verinfer calibrate" in e.value.fix


def _clustered(n_claims: int, rng, length: int = 50) -> dict:
    """Margins whose level is shared by a claim's tokens (a claim's prompt sets it), as
    cross-entropy is: token = claim level x Exp(1), level = exp(N(0, 0.7^2))."""
    level = np.exp(rng.normal(0.0, 0.7, n_claims))
    return {"margin": np.repeat(level, length) * rng.exponential(1.0, n_claims * length),
            "claim_id": np.repeat([f"c{i}" for i in range(n_claims)], length)}


def test_design_effect_holds_the_fpr_on_batches_of_whole_claims():
    """Tokens of a claim share its level: the token-level null understates the spread of a batch of
    20 whole claims; the design effect measured from claim_id restores the FPR (cross-entropy on the
    detection lab: deff ~15, 18% held-out FPR at 1% before)."""
    from verinfer.detect.clipped_mean import design_effect

    rng = np.random.default_rng(21)
    honest = _clustered(2000, rng)
    with_claims = ClippedMeanDetector(n_null_batches=1000).fit(honest)
    tokens_only = ClippedMeanDetector(n_null_batches=1000).fit({"margin": honest["margin"]})
    deff = with_claims.design_effects_[0]
    assert tokens_only.design_effects_ == [1.0] and 3.0 < deff < 30.0
    assert "design effect" in with_claims.summary()
    # deff = var(mean of a batch of whole claims) / (var(token) / tokens), checked by simulation
    batches = [_clustered(20, rng) for _ in range(400)]
    means = np.array([np.minimum(b["margin"], with_claims.clip_).mean() for b in batches])
    w = np.minimum(honest["margin"], with_claims.clip_)
    assert means.var(ddof=1) / (w.var() / 1000) == pytest.approx(deff, rel=0.25)
    assert design_effect(w, np.repeat(np.arange(2000), 50)) == pytest.approx(deff)
    fpr = np.mean([with_claims.predict(b) for b in batches])
    fpr_tokens = np.mean([tokens_only.predict(b) for b in batches])
    assert fpr <= 0.03 and fpr_tokens >= 0.15
    v = with_claims.verdict(batches[0])
    assert v.p_value > 1e-3 or v.flagged
    # independent tokens: deff ~1, the null unchanged
    flat = {"margin": rng.exponential(1.0, 100_000), "claim_id": np.repeat(np.arange(2000), 50)}
    assert ClippedMeanDetector().fit(flat).design_effects_[0] == pytest.approx(1.0, abs=0.1)
    # too few claims to estimate it: 1, with a warning
    few = ClippedMeanDetector().fit(_clustered(5, rng, length=400))
    assert few.design_effects_ == [1.0] and any("fewer than 10 claims" in x for x in few.warnings_)
    # an edited detector file: a design effect below 1, or one too few, is refused on load
    for bad in ([0.5], [deff, deff]):
        d = with_claims.to_json()
        d["fitted"]["design_effects"] = bad
        with pytest.raises(VerinferError, match="design_effects"):
            ClippedMeanDetector.from_json(d)
