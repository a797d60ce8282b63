"""Every registered detector through the one protocol: fit on honest rows, audit honest (not
flagged) and shifted (flagged) rows, save / load_detector round trip, clear errors."""

import base64
import json
import math

import numpy as np
import pyarrow as pa
import pytest
from scipy.stats import norm

from verinfer.detect import DETECTORS, Detector, detector_class, load_detector, make_detector
from verinfer.errors import UnknownNameError, VerinferError

PROTOCOL_KEYS = {"flagged", "pooled", "threshold", "p_value", "n_tokens", "target_fpr", "threshold_fpr",
                 "more_tokens_needed", "decision", "score"}


def score_table(n: int, sigma: float, rng, columns) -> pa.Table:
    """Score rows under the perturbation model (a provider with noise sigma per logit; the
    verifier's pick leads by a ~ Exp(1)): every column a registered detector may read."""
    a = rng.exponential(1.0, n)
    flip = rng.random(n) < norm.cdf(-a / (math.sqrt(2) * sigma))
    d = np.where(flip, a, -a)
    cols = {"provider": ["p"] * n, "margin": np.maximum(d, 0.0), "exact_match": ~flip,
            "cross_entropy": np.where(flip, 1.0 + a, 0.1) + rng.exponential(0.1, n),
            "logit_gap": np.where(flip, rng.normal(0.0, 1.0, n), 0.0),
            # unseeded rows: the honest provider's PIT is uniform, a noisier one's is not
            "pit": rng.random(n) ** (sigma / 0.05), "entropy": np.full(n, 0.2)}
    for c in columns:
        if c.startswith(("gap", "env_gap")):
            cols[c] = d
        elif c.startswith("margin_"):  # an alternative's replay: flips other tokens
            cols[c] = np.where(rng.random(n) < 0.02, rng.exponential(0.3, n), 0.0)
    return pa.table(cols)


@pytest.fixture(scope="module", params=sorted(DETECTORS))
def fitted(request):
    name = request.param
    # two honest groups: the greedy detector's default allowance for a new configuration (a t quantile
    # with 1 degree of freedom) would hide the 3x shift; the protocol is checked on its worst-group null
    det = make_detector(name, n_null_batches=200, **({"null": "worst-group"} if name == "greedy" else {}))
    cols = set(det.columns()) | set(make_detector("glrt").columns())
    rng = np.random.default_rng(0)
    honest = score_table(20_000, 0.05, rng, cols)
    det.fit(honest, groups=np.arange(honest.num_rows) % 2)
    return name, det, cols


def test_registry_round_trip(fitted, tmp_path):
    name, det, cols = fitted
    assert isinstance(det, Detector) and detector_class(name) is type(det) and det.NAME == name
    rng = np.random.default_rng(1)
    honest, shifted = score_table(3000, 0.05, rng, cols), score_table(3000, 0.15, rng, cols)
    ok, bad = det.verdict(honest, max_tokens=1000), det.verdict(shifted, max_tokens=1000)
    assert set(ok.reported) >= PROTOCOL_KEYS and ok.n_tokens == bad.n_tokens == 1000
    assert not ok.flagged and bad.flagged and bad.p_value < 0.01 < ok.p_value
    assert bad.pooled == det.score(shifted, max_tokens=1000) > bad.threshold == det.threshold(1000)
    assert det.predict(shifted.slice(0, 1000)) and not det.predict(honest.slice(0, 1000))
    det.save(tmp_path / "d.json")
    with pytest.raises(VerinferError, match="records no calibration") as e:  # a fit in code: nothing to check against
        load_detector(tmp_path / "d.json")
    assert "--allow-unrecorded-calibration" in e.value.fix
    back = load_detector(tmp_path / "d.json", allow_unrecorded=True)
    assert type(back) is type(det) and back == det and back.config() == det.config() and back.unrecorded_
    for t in (honest, shifted):
        assert back.verdict(t, max_tokens=700) == det.verdict(t, max_tokens=700)
    assert json.loads((tmp_path / "d.json").read_text())["format"] == det.FORMAT
    with pytest.raises(Exception, match="config field"):
        det.target_fpr = 0.5  # config is fixed once constructed
    first = det.columns()[0]
    with pytest.raises(VerinferError, match=f"{first}.*{name} detector") as e:
        det.verdict(honest.drop_columns([first]))
    assert e.value.fix


def test_gaps_declared():
    assert {n for n, c in DETECTORS.items() if c.requires_gaps} == {"glrt"}


def test_load_detector_errors(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps({"format": "verinfer.Nope", "version": 1}))
    with pytest.raises(VerinferError, match="not a verinfer detector file.*verinfer.Nope") as e:
        load_detector(p)
    assert str(p) in str(e.value) and "verinfer calibrate --detector" in e.value.fix
    p.write_text('{"format": "verinfer.ClippedMeanDetector", ')
    with pytest.raises(VerinferError, match="not valid JSON"):
        load_detector(p)
    p.write_bytes(b"\xff\xfe{}")
    with pytest.raises(VerinferError, match="not valid JSON"):
        load_detector(p)
    p.write_text("[1, 2]")
    with pytest.raises(VerinferError, match="not a verinfer detector file"):
        load_detector(p)
    with pytest.raises(VerinferError, match="no such detector file"):
        load_detector(tmp_path / "missing.json")
    p.write_text(json.dumps({"format": "verinfer.PerturbationGLRTDetector", "version": 1, "config": {}}))
    with pytest.raises(VerinferError, match="version 1; this verinfer reads version 3"):  # the null before issue 15
        load_detector(p)
    p.write_text(json.dumps({"format": "verinfer.PerturbationGLRTDetector", "version": 3, "config": {}}))
    with pytest.raises(VerinferError, match="malformed detector"):
        load_detector(p)


def test_make_detector_errors():
    with pytest.raises(UnknownNameError, match="unknown detector 'nope'") as e:
        make_detector("nope")
    assert e.value.fix == "choose one of clipped-mean, greedy, glrt, likelihood-ratio, xent-excess, pit-uniformity"
    with pytest.raises(UnknownNameError, match="unknown detector 'nope'"):
        detector_class("nope")
    with pytest.raises(VerinferError, match="takes no option score_name"):
        make_detector("glrt", score_name="fp_l2")
    with pytest.raises(VerinferError, match="clip_quantile"):
        make_detector("clipped-mean", clip_quantile=2.0)


def test_a_nan_in_any_stored_array_is_refused(fitted, tmp_path):
    """Every detector's stored float64 arrays (null samples, gaps) are checked on load: one value
    edited to NaN makes the file malformed, named."""
    name, det, _ = fitted
    det.save(tmp_path / "d.json")
    d = json.loads((tmp_path / "d.json").read_text())
    key = next(k for k in d["fitted"] if k.endswith("_f8_base64"))
    texts = d["fitted"][key] if isinstance(d["fitted"][key], list) else [d["fitted"][key]]
    a = np.frombuffer(base64.b64decode(texts[0]), dtype="<f8").copy()
    a[len(a) // 2] = np.nan
    texts[0] = base64.b64encode(a.tobytes()).decode()
    d["fitted"][key] = texts if isinstance(d["fitted"][key], list) else texts[0]
    (tmp_path / "d.json").write_text(json.dumps(d))
    with pytest.raises(VerinferError, match=f"malformed detector.*{key}.*NaN"):
        load_detector(tmp_path / "d.json")


def test_p_values_are_not_floored_at_one_over_the_resamples(fitted):
    """Issue 15: p-values stopped at 1/(1 + B). Every detector resolves a strong deviation far
    below it (saddle-point tails beyond the resampling), and keeps resampled p-values where the
    resampling resolves them. The unseeded detectors' Neyman sum takes the tail of a scaled
    chi-square fit to the resampled null instead (a union of saddle points is loose for a sum)."""
    name, det, cols = fitted
    rng = np.random.default_rng(5)
    bad = det.verdict(score_table(3000, 0.3, rng, cols), max_tokens=1000)
    far = ("saddle-point", "scaled chi-square")
    assert bad.flagged and bad.p_value < 1e-12 and bad.p_value_method.startswith(far)  # 0: < 1e-300
    ok = det.verdict(score_table(3000, 0.05, rng, cols), max_tokens=1000)
    resolved = ok.p_value >= 11 / (det.n_null_batches + 1)  # >= 10 resampled statistics reach it
    assert ok.p_value_method.startswith("resampled" if resolved else far), ok
