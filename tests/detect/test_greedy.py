"""The temperature-0 detector (verinfer.detect.greedy): its score, its null (floored where honest
runs agree exactly), its fixed-size and sequential verdicts beside the calibrated mismatch-rate
test, and its file."""

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from verinfer.detect.calibrate import calibrate
from verinfer.detect.clipped_mean import ClippedMeanDetector
from verinfer.detect.greedy import (FLOOR, GreedyDetector, floor_mismatches, greedy_scores, mismatch_floor,
                                    tie_clip_of)
from verinfer.detect.registry import load_detector, make_detector
from verinfer.detect.sequential import SequentialAudit, group_log_mgf
from verinfer.errors import VerinferError

CLAIM_LEN = 40


def stream(provider: str, n_claims: int, rate: float, scale: float, rng, start: int = 0) -> pa.Table:
    """Greedy scores of n_claims claims: each token a mismatch with probability `rate`, its margin
    exponential with mean `scale` (honest near-ties: a few hundredths of a logit)."""
    n = n_claims * CLAIM_LEN
    mism = rng.random(n) < rate
    margin = np.where(mism, rng.exponential(scale, n) + 1e-4, 0.0)
    ids = np.repeat([f"{provider}-{start + i}" for i in range(n_claims)], CLAIM_LEN)
    return pa.table({"claim_id": ids, "provider": np.repeat(provider, n), "margin": margin, "exact_match": ~mism,
                     "cross_entropy": np.full(n, 0.5)})


HONEST = {"h1": 0.015, "h2": 0.02, "h3": 0.016, "h4": 0.018, "h5": 0.017}  # five honest configurations' rates


@pytest.fixture(scope="module")
def honest():
    rng = np.random.default_rng(0)
    return pa.concat_tables([stream(h, 200, r, 0.05, rng) for h, r in HONEST.items()])


@pytest.fixture(scope="module")
def det(honest):
    return calibrate(honest, list(HONEST), detector="greedy", seed=0)


def test_score_counts_each_mismatch_and_its_margin_up_to_the_cap():
    m = np.array([0.0, 0.0, 0.1, 1.0, 1.5, 2.0, 3.0, np.inf])
    exact = np.array([True, False, False, False, False, False, False, False])
    # inside the honest near-tie zone (m <= c) a mismatch counts FLOOR; beyond it the margin adds, full at 2c
    assert greedy_scores(m, exact, 1.0).tolist() == [0.0, FLOOR, FLOOR, FLOOR, FLOOR + (1 - FLOOR) * 0.5, 1.0, 1.0, 1.0]
    assert greedy_scores(m, exact, 1.0, floor=1.0).tolist() == [0.0, 1, 1, 1, 1, 1, 1, 1]  # floor 1: the count
    assert tie_clip_of(np.array([0, 0.1, 0.2, 0.3, 0.4]), np.array([True, False, False, False, False]), 0.5) == 0.25
    assert tie_clip_of(np.zeros(3), np.ones(3, bool)) == 1.0  # no honest mismatch: one logit


def test_fit_caps_margins_where_honest_near_ties_end(det, honest):
    m = honest["margin"].to_numpy()
    assert det.tie_clip_ == pytest.approx(np.quantile(m[m > 0], det.tie_quantile))
    assert det.clip_ == 1.0 and det.floored_claims_ == [0] * 5
    means = np.array([g.mean() for g in det._groups()])          # a new configuration's prediction bound
    assert det.allowance() == pytest.approx(means.mean() + 3.747 * means.std(ddof=1) * math.sqrt(1.2) - means.max(),
                                            rel=1e-3)
    assert det.threshold(400) == pytest.approx(ClippedMeanDetector.threshold(det, 400) + det.allowance())
    assert "greedy" in det.summary() and det.calibration_.heldout.batches > 0


@pytest.mark.slow  # ~10 s: resampled nulls of 8,000-token batches
def test_verdicts_beside_the_mismatch_rate_test(det, honest):
    """A vendor with 2.5x the honest mismatch rate, its extra ones at larger margins, is flagged by both
    tests, by the greedy one with more certainty and in fewer claims; an honest configuration with
    more near-ties than any calibrated one (a real server's kernels) passes both."""
    mm = calibrate(honest, list(HONEST), detector="greedy", floor=1.0, seed=0)   # the mismatch count
    rng = np.random.default_rng(1)
    def vendor(near_ties: float, larger: float):
        t = pa.concat_tables([stream("v", 100, near_ties, 0.05, rng), stream("v", 100, larger, 0.6, rng, start=100)])
        return t.take(np.argsort(np.repeat(np.r_[np.arange(100) * 2, np.arange(100) * 2 + 1], CLAIM_LEN),
                                 kind="stable"))   # the two kinds of claims interleaved

    weak = vendor(0.017, 0.025)         # 1.2x the honest rate: the count cannot tell, the margins can
    assert det.verdict(weak).flagged and not mm.verdict(weak).flagged
    vendor = vendor(0.03, 0.05)
    g, m = det.verdict(vendor), mm.verdict(vendor)
    assert g.flagged and m.flagged and g.p_value < m.p_value
    seq_g = SequentialAudit(det, alpha=0.01).verdict(vendor)
    seq_m = SequentialAudit(mm, alpha=0.01).verdict(vendor)
    assert seq_g.flagged and (not seq_m.flagged or seq_g.extra["decided_at_tokens"] <= seq_m.extra["decided_at_tokens"])
    real = stream("h9", 200, 0.024, 0.05, rng)     # 1.2x the worst calibrated configuration's near-ties
    for d in (det, mm):
        assert not d.verdict(real).flagged and not SequentialAudit(d, alpha=0.01).verdict(real).flagged
    assert calibrate(honest, list(HONEST), detector="greedy", null="worst-group", seed=0).verdict(real).flagged


def test_false_positive_rate_on_fresh_honest_batches(det):
    rng = np.random.default_rng(2)
    flagged = [det.verdict(stream("h2", 10, 0.02, 0.05, rng, start=10 * k)).flagged for k in range(300)]
    assert np.mean(flagged) <= 0.03  # target 0.01; 300 batches: 9 would be a 3x excess


def test_sequential_null_is_the_detectors(det):
    """The e-process bets on the calibrated configurations' own claim distribution, against the
    null the fixed-size test uses: a new configuration's prediction bound (or the worst one's)."""
    audit = SequentialAudit(det, alpha=0.01)
    per_group = np.stack([group_log_mgf(x, audit.lambdas) for x in det.sequential_blocks()])
    assert audit.null == "scaled" and audit.lambdas == det.SEQUENTIAL_LAMBDAS
    worst = SequentialAudit(det, alpha=0.01, null="worst-group")
    np.testing.assert_array_equal(worst.psi_LC, per_group.max(axis=0))
    # the worst configuration's event rate raised by the fixed-size test's allowance: its log-MGF
    # scaled by 1 + A L / m, never below the same mean moved up by A L
    shift, m = det.allowance() * CLAIM_LEN, max(float(np.mean(c)) for c in det.claim_sums_)
    assert det.sequential_scale() == pytest.approx([1 + shift / m])
    np.testing.assert_allclose(audit.psi_LC, worst.psi_LC * (1 + shift / m))
    assert (audit.psi_LC >= worst.psi_LC + np.asarray(audit.lambdas)[:, None] * shift - 1e-12).all()
    wider = SequentialAudit(det, alpha=0.01, null="predictive")   # each bet's own prediction bound
    assert (wider.psi_LC >= worst.psi_LC).all()


def test_a_null_without_mismatches_is_floored_not_refused():
    """Every honest run agrees exactly (the shipped testbed): the null gets b mismatching claims per
    configuration, so a vendor without mismatches passes and one mismatching in most claims is flagged."""
    rng = np.random.default_rng(3)
    exact = pa.concat_tables([stream("h1", 64, 0.0, 0.05, rng), stream("h2", 64, 0.0, 0.05, rng)])
    with pytest.raises(VerinferError, match="degenerate honest null"):  # the clipped mean refuses it
        calibrate(exact, ["h1", "h2"], detector="clipped-mean", seed=0)
    det = calibrate(exact, ["h1", "h2"], detector="greedy", seed=0)
    b = mismatch_floor(0.01)
    assert b == math.ceil(-math.log(0.001)) == 7 and det.floored_claims_ == [b, b] and det.allowance() == 0
    assert "floored" in det.summary() and any("fewer than 7 mismatching claims" in w for w in det.warnings_)
    assert not det.verdict(stream("v", 30, 0.0, 0.05, rng)).flagged
    bad = stream("v", 30, 0.05, 0.5, rng)   # ~2 mismatches per claim
    assert det.verdict(bad).flagged and SequentialAudit(det, alpha=0.01).verdict(bad).flagged
    one = stream("v", 30, 0.0, 0.05, rng)
    one = one.set_column(3, "exact_match", pa.array(np.arange(one.num_rows) != 5))  # one mismatch in 1,200 tokens
    assert not det.verdict(one).flagged


def test_floor_tops_up_each_group_to_b_mismatching_claims():
    w = np.zeros(12)
    w[0] = 0.7                                   # group 0, claim a: already mismatching
    labels = np.array([0] * 6 + [1] * 6)
    claims = np.array(list("aabbcc") + list("ddeeff"))
    out, added = floor_mismatches(w, labels, claims, 2)
    assert added == [1, 2] and out.tolist() == [0.7, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0]


def test_a_null_whose_margins_never_reach_twice_c_loads(tmp_path):
    """Honest near-ties bunched (no margin reaches 2c): the null's largest score is below the cap 1,
    and the file still loads; a floor edited in the file is refused."""
    rng = np.random.default_rng(5)
    t = pa.concat_tables([stream(h, 100, r, 0.05, rng) for h, r in HONEST.items()])
    t = t.set_column(2, "margin", pa.array(np.where(t["margin"].to_numpy() > 0, 0.1, 0.0)))
    det = calibrate(t, list(HONEST), detector="greedy", seed=0)
    assert det.null_sample_.max() < 1.0 and det.tie_clip_ == pytest.approx(0.1)
    det.save(tmp_path / "g.json")
    assert load_detector(tmp_path / "g.json").tie_clip_ == det.tie_clip_
    doc = json.loads((tmp_path / "g.json").read_text())
    doc["config"]["floor"] = 0.3
    (tmp_path / "g.json").write_text(json.dumps(doc))
    with pytest.raises(VerinferError, match="floor"):
        load_detector(tmp_path / "g.json")


def test_file_round_trip_and_edits_refused(det, tmp_path, honest):
    path = tmp_path / "greedy.json"
    det.save(path)
    back = load_detector(path)
    assert isinstance(back, GreedyDetector) and back.tie_clip_ == det.tie_clip_
    assert back.verdict(honest).to_dict() == det.verdict(honest).to_dict()
    doc = json.loads(path.read_text())
    for key, value in (("tie_clip_", -1.0), ("zero_null_floor_", 3), ("clip_", 2.0)):
        bad = json.loads(json.dumps(doc))
        bad["fitted"][key] = value
        path.write_text(json.dumps(bad))
        with pytest.raises(VerinferError, match="malformed detector|inconsistent detector"):
            load_detector(path)
    with pytest.raises(VerinferError, match="fixed"):
        make_detector("greedy", score_name="cross_entropy")
    assert isinstance(make_detector("greedy", floor=1.0), ClippedMeanDetector)


def test_fixed_size_tokens_to_flag_is_the_first_flagged_prefix(det):
    from verinfer.detect.metrics import fixed_tokens_to_flag

    rng = np.random.default_rng(4)
    vendor = pa.concat_tables([stream("h1", 20, 0.015, 0.05, rng, start=5000), stream("v", 40, 0.2, 1.0, rng)])
    tokens, claims = fixed_tokens_to_flag(det, vendor, (5, 10, 20, 25, 30, 40, 60))
    assert claims > 20 and tokens == claims * CLAIM_LEN            # not within the honest head
    assert det.verdict(vendor.slice(0, tokens)).flagged
    prev = max(k for k in (5, 10, 20, 25, 30, 40, 60) if k < claims)
    assert not det.verdict(vendor.slice(0, prev * CLAIM_LEN)).flagged
    assert fixed_tokens_to_flag(det, stream("h1", 20, 0.015, 0.05, rng, start=9000), (5, 10, 20)) == (None, None)
