"""Issue 45: a detector file edited within the ranges each field accepts must not change a verdict.
Every test loads a detector `calibrate` wrote, edits its JSON as a user could, and asserts the load
refuses it naming the field (each failed before its fix: the edited file loaded and its verdict
changed, or a setting it ignores was accepted). An unedited file loads and judges identically."""

import copy
import json

import numpy as np
import pyarrow as pa
import pytest

from verinfer.detect.base import decode_f8, encode_f8
from verinfer.detect.calibrate import calibrate
from verinfer.detect import record
from verinfer.detect.registry import load_detector
from verinfer.errors import VerinferError

TOKENS = 25  # per claim


def _claims(rng, name: str, n_claims: int, scale: float) -> dict:
    """Margins of n_claims claims of TOKENS tokens (30% of tokens mismatch, exponential margins)."""
    n = n_claims * TOKENS
    m = rng.exponential(scale, n) * (rng.random(n) < 0.3)
    return {"claim_id": np.repeat([f"{name}-{c}" for c in range(n_claims)], TOKENS), "provider": [name] * n,
            "margin": m, "exact_match": m == 0, "cross_entropy": m + rng.exponential(1.0, n)}


def _table(groups: dict[str, tuple[int, float]], seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    parts = [_claims(rng, name, n, scale) for name, (n, scale) in groups.items()]
    return pa.table({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A clipped-mean detector calibrated on two honest configurations of 8 claims each (fewer than
    MIN_CLAIMS_FOR_DEFF: design effects 1 by construction), its file, and a shifted provider."""
    path = tmp_path_factory.mktemp("record") / "detector.json"
    det = calibrate(_table({"h-a": (8, 1.0), "h-b": (8, 1.05)}, seed=1), ["h-a", "h-b"], seed=0, fpr_batch_tokens=50)
    det.save(path)
    return det, path, _table({"bad": (24, 1.6)}, seed=2)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """Two honest configurations of 40 and 12 claims (design effects measured), its file."""
    path = tmp_path_factory.mktemp("record") / "detector.json"
    det = calibrate(_table({"h-a": (40, 1.0), "h-b": (12, 1.05)}, seed=3), ["h-a", "h-b"], seed=0,
                    fpr_batch_tokens=100)
    det.save(path)
    return det, path


def _edit(path, tmp_path, fn):
    d = json.loads(path.read_text())
    fn(d)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(d, indent=1))
    return out


def _refused(path, *fields, **kw):
    with pytest.raises(VerinferError) as e:
        load_detector(path, **kw)
    for f in fields:
        assert f in str(e.value), (f, str(e.value))
    assert str(path) in str(e.value) and e.value.fix
    return e.value


def test_an_unedited_detector_loads_and_judges_identically(small):
    det, path, bad = small
    back = load_detector(path)
    assert back.to_json() == det.to_json() and back.unrecorded_ is None
    assert back.verdict(bad) == det.verdict(bad) and det.verdict(bad).flagged


def test_design_effects_of_groups_under_10_claims_are_1(small, tmp_path):
    """a) 8 claims per group: the design effects are 1 by construction; [8, 8] turned the shifted
    provider's verdict from flagged to ok and loaded."""
    det, path, bad = small
    would = copy.deepcopy(det)
    would.set_null(det.null_sample_, det.null_group_sizes_, det.n_train_, det.clip_, design_effects=[8.0, 8.0])
    assert det.verdict(bad).flagged and not would.verdict(bad).flagged  # what the edit did
    edited = _edit(path, tmp_path, lambda d: d["fitted"].__setitem__("design_effects", [8.0, 8.0]))
    e = _refused(edited, "design_effects[0]", "8 claims", "fewer than 10")
    assert "verinfer calibrate" in e.fix


def test_design_effects_are_the_claims_own(uneven, tmp_path):
    """With claims of 25 tokens, Kish's bound (the longest claim) lets a design effect reach 25, which
    hides any shift; the claim sums and lengths the file keeps give each group's design effect, and
    any other value is refused."""
    det, path = uneven
    deff = list(det.design_effects_)
    for bad in ([deff[0], deff[1] * 1.5], [min(25.0, deff[0] * 10), deff[1]], [1.0, deff[1]]):
        if bad != deff:
            _refused(_edit(path, tmp_path, lambda d: d["fitted"].__setitem__("design_effects", bad)),
                     "design_effects[", "claim sums and lengths")
    _refused(_edit(path, tmp_path, lambda d: d["fitted"].pop("claim_lengths_f8_base64")), "claim_lengths")


def test_without_claim_lengths_design_effects_are_bounded_per_group(uneven, tmp_path):
    """A file without claim lengths (an older verinfer's, loaded with the flag): a group's design
    effect is at most its longest possible claim (tokens - claims + 1): h-b's 300 tokens in 12
    claims allow 289, however many tokens h-a holds."""
    det, path = uneven
    assert det.calibration_.claims == {"h-a": 40, "h-b": 12}
    deff = list(det.design_effects_)

    def older(values):
        def edit(d):
            d["calibration"].pop("config")
            d["fitted"].pop("claim_lengths_f8_base64")
            d["fitted"]["design_effects"] = values
        return edit
    load_detector(_edit(path, tmp_path, older([deff[0], 289.0])), allow_unrecorded=True)
    _refused(_edit(path, tmp_path, older([deff[0], 500.0])), "design_effects[1]", "h-b", "289", allow_unrecorded=True)


def test_claim_counts_must_agree_with_the_claim_sums(uneven, tmp_path):
    """The bound rests on the recorded claims: padding a group's claims (or its claim sums) is refused."""
    _, path = uneven
    _refused(_edit(path, tmp_path, lambda d: d["calibration"]["claims"].__setitem__("h-b", 6)), "claims", "h-b")

    def pad(*keys):
        def edit(d):
            for key in keys:
                x = d["fitted"][key]
                x[1] = encode_f8(np.r_[decode_f8(x[1]), np.ones(5)])
        return edit
    _refused(_edit(path, tmp_path, pad("claim_sums_f8_base64")), "claim_lengths", "claim_sums")
    _refused(_edit(path, tmp_path, pad("claim_sums_f8_base64", "claim_lengths_f8_base64")), "claims", "h-b")


def test_a_detector_without_its_calibration_record_needs_the_flag(small, tmp_path):
    """b) Deleting "calibration" switched every check against it off: [256, 256] then loaded and
    flagged honest providers. Now refused unless the caller allows it (the CLI flag named), and the
    detector says so; the checks that need no record still hold."""
    det, path, bad = small
    stripped = _edit(path, tmp_path, lambda d: d.pop("calibration"))
    e = _refused(stripped, "calibration")
    assert isinstance(e, record.UnrecordedCalibration) and record.ALLOW_UNRECORDED_CALIBRATION in e.fix
    back = load_detector(stripped, allow_unrecorded=True)
    assert record.ALLOW_UNRECORDED_CALIBRATION in back.unrecorded_ and back.verdict(bad) == det.verdict(bad)

    def deff(d):
        d.pop("calibration")
        d["fitted"]["design_effects"] = [256.0, 256.0]
    _refused(_edit(path, tmp_path, deff), "design_effects[0]", "8 claims", allow_unrecorded=True)
    old = _edit(path, tmp_path, lambda d: d["calibration"].pop("config"))  # an older verinfer's record
    assert isinstance(_refused(old, "calibration", "config"), record.UnrecordedCalibration)
    assert load_detector(old, allow_unrecorded=True).unrecorded_


@pytest.mark.parametrize("key, value", [("target_fpr", 0.5), ("clip_quantile", 0.9), ("n_null_batches", 50),
                                        ("random_state", 7), ("score", "cross_entropy")])
def test_a_config_other_than_the_calibrated_one_is_refused(small, tmp_path, key, value):
    """c, d) target_fpr edited to 0.5 loaded (the thresholds moved, the held-out FPR stayed);
    clip_quantile edited loaded and was ignored (clip_ is fitted). Every config field must be the
    one the calibration used."""
    _, path, _ = small
    e = _refused(_edit(path, tmp_path, lambda d: d["config"].__setitem__(key, value)), f"config.{key}")
    assert "verinfer calibrate" in e.fix


def test_the_recorded_config_cannot_be_edited_alone(small, tmp_path):
    """The record holds what the fit used: a recorded target_fpr that the fitted null cannot have
    come from (fewer than 1/FPR tokens per group) is refused too."""
    _, path, _ = small

    def both(d):
        d["config"]["target_fpr"] = d["calibration"]["config"]["target_fpr"] = 0.001
    _refused(_edit(path, tmp_path, both), "target_fpr", "1/FPR")


def test_an_edited_heldout_fpr_is_refused(uneven, tmp_path):
    """The held-out FPR a verdict reports must be the recorded count's."""
    _, path = uneven

    def fpr(d):
        h = d["calibration"]["heldout"]
        h["flagged"], h["fpr"] = 0, 0.5
    _refused(_edit(path, tmp_path, fpr), "heldout.fpr")


def test_greedy_config_edits_are_refused(tmp_path):
    """The greedy detector's tie_quantile (tie_clip_ is fitted) and null are checked the same way."""
    t = _table({"h-a": (12, 1.0), "h-b": (12, 1.05)}, seed=5)
    det = calibrate(t, ["h-a", "h-b"], detector="greedy", seed=0, fpr_batch_tokens=100)
    det.save(tmp_path / "g.json")
    assert load_detector(tmp_path / "g.json").to_json() == det.to_json()
    for key, value in (("tie_quantile", 0.5), ("null", "worst-group")):
        _refused(_edit(tmp_path / "g.json", tmp_path, lambda d: d["config"].__setitem__(key, value)), f"config.{key}")


def test_a_cached_detector_of_an_older_verinfer_is_fit_again(small, tmp_path):
    """An audit's own cache (`DetectorCache.get`): a saved detector without its calibration config
    (an older verinfer's) is fit again, as one made for other settings is; an edited one is an error."""
    from verinfer.detect.cache import DetectorCache

    det, path, _ = small
    cache = DetectorCache(tmp_path / "cached.json")
    cache.save(det, {"m": 1})
    assert cache.get({"m": 1}, fit=lambda: pytest.fail("refit")).to_json() == det.to_json()
    d = json.loads(cache.path.read_text())
    d["calibration"].pop("config")
    cache.path.write_text(json.dumps(d))
    assert cache.get({"m": 1}, fit=lambda: det) is det and json.loads(cache.path.read_text()) == det.to_json()
    d = det.to_json()
    d["fitted"]["design_effects"] = [8.0, 8.0]
    cache.path.write_text(json.dumps(d))
    with pytest.raises(VerinferError, match="design_effects"):
        cache.get({"m": 1}, fit=lambda: det)


def test_a_subsampled_groups_design_effect_is_checked_against_its_kept_null():
    """A group of more tokens than its null keeps: its design effect is measured against the kept
    values' spread (what the resampled null draws from), so a file can check it exactly; it stays
    within a few percent of the one measured on every token."""
    from verinfer.detect.clipped_mean import MAX_NULL_SAMPLE, ClippedMeanDetector, design_effect

    rng = np.random.default_rng(7)
    n_claims, length = 1100, 100  # 110,000 tokens per group, the null keeps 100,000
    level = np.exp(rng.normal(0.0, 0.7, 2 * n_claims))
    t = {"margin": np.repeat(level, length) * rng.exponential(1.0, 2 * n_claims * length),
         "claim_id": np.repeat(np.arange(2 * n_claims), length)}
    groups = np.repeat([0, 1], n_claims * length)
    det = ClippedMeanDetector(n_null_batches=100).fit(t, groups=groups)
    assert det.null_group_sizes_ == [MAX_NULL_SAMPLE // 2] * 2
    w = np.minimum(t["margin"], det.clip_)
    full = [design_effect(w[groups == k], t["claim_id"][groups == k]) for k in (0, 1)]
    assert det.design_effects_ == pytest.approx(full, rel=0.05) and min(full) > 3
    d = det.to_json()
    assert type(det).from_json(d).design_effects_ == det.design_effects_
    d["fitted"]["design_effects"] = [full[0] * 1.2, full[1]]
    with pytest.raises(VerinferError, match=r"design_effects\[0\].*claim sums and lengths of null group 0"):
        type(det).from_json(d)
