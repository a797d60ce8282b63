import numpy as np
import pyarrow as pa
import pytest
from scipy.stats import beta

from verinfer.detect import make_detector
from verinfer.detect.calibrate import calibrate, claim_batches, claim_folds, split_claims
from verinfer.errors import ClaimError
from verinfer.scores import Provenance, provenance_metadata

PROV = Provenance(model="m", weights_sha256="ab", noise=("torch",), numerics={"dtype": "bf16"}, device="cpu")


def _table(rng, providers=(("h-a", 1.0), ("h-b", 1.05), ("bad", 2.0)), claims=40, tokens=25) -> pa.Table:
    cols = {"claim_id": [], "provider": [], "margin": [], "exact_match": [], "cross_entropy": []}
    for name, scale in providers:
        for c in range(claims):
            m = rng.exponential(scale, tokens) * (rng.random(tokens) < 0.3)
            cols["claim_id"] += [f"{name}-{c}"] * tokens
            cols["provider"] += [name] * tokens
            cols["margin"] += list(m)
            cols["exact_match"] += list(m == 0)
            cols["cross_entropy"] += list(m + rng.exponential(1.0, tokens))
    return pa.table(cols)


def test_claim_folds_deal_whole_claims_and_batches_read_them_in_order():
    t = pa.table({"claim_id": ["c", "a", "a", "b", "c", "a", "d", "b"]})
    fold, order = claim_folds(t, 3, np.random.default_rng(0))
    ids = np.asarray(t["claim_id"].to_pylist())
    for c in np.unique(ids):  # one fold per claim; its rows consecutive in `order`, in row order
        rows = np.flatnonzero(ids == c)
        assert len(set(fold[rows])) == 1 and (np.diff(order[rows]) == 1).all()
    assert sorted(order) == list(range(8)) and set(fold) <= {0, 1, 2}
    batches = claim_batches(np.arange(8), order, 3)
    assert [len(b) for b in batches] == [3, 3]  # the rest of 2 is dropped
    flat = np.concatenate(batches)
    assert (np.diff(order[flat]) == 1).all() and order[flat[0]] == 0  # read in order, disjoint


def test_split_claims_is_disjoint_and_whole():
    t = _table(np.random.default_rng(1))
    train, test = split_claims(t, ["h-a", "h-b"], frac=0.25, seed=3)
    for name in ("h-a", "h-b"):
        tr = {c for c, p in zip(train["claim_id"].to_pylist(), train["provider"].to_pylist()) if p == name}
        te = set(test[name]["claim_id"].to_pylist())
        assert not tr & te and len(tr) == 10 and len(tr | te) == 40
    assert train.num_rows == 2 * 10 * 25 and "bad" not in test
    again = split_claims(t, ["h-a", "h-b"], frac=0.25, seed=3)
    assert again[0].equals(train)
    with pytest.raises(ClaimError, match="no scored tokens for honest provider 'nope'"):
        split_claims(t, ["nope"])


def test_calibrate_records_size_heldout_fpr_and_provenance():
    t = _table(np.random.default_rng(2)).replace_schema_metadata(provenance_metadata(PROV))
    det = calibrate(t, ["h-a", "h-b"], seed=4, fpr_batch_tokens=100)
    cal, held = det.calibration_, det.calibration_.heldout
    assert cal.tokens == {"h-a": 1000, "h-b": 1000} and cal.claims == {"h-a": 40, "h-b": 40}
    assert cal.config == det.json_config() == det.to_json()["config"]  # what a loaded file's config is checked against
    assert det.provenance_ == PROV and det.to_json()["provenance"] == PROV.model_dump(mode="json")
    # 8 claims (200 tokens) per fold and provider: 2 batches of 100 each, 5 folds, 2 providers
    assert (held.folds, held.batch_tokens, held.batches) == (5, 100, 20) and held.fpr == held.flagged / 20
    assert held.fpr_upper95 == pytest.approx(beta.ppf(0.95, held.flagged + 1, 20 - held.flagged))
    # the final fit is the detector fit on every honest token, each provider one group
    ref = make_detector("clipped-mean", random_state=4).fit(t.slice(0, 2000), groups=np.repeat(["h-a", "h-b"], 1000))
    assert det.to_json()["fitted"] == ref.to_json()["fitted"]
    assert calibrate(t, ["h-a", "h-b"], seed=4, fpr_batch_tokens=100).to_json() == det.to_json()  # deterministic
    assert calibrate(t.replace_schema_metadata(None), ["h-a", "h-b"], seed=4).provenance_ is None


def test_calibrate_warns_without_a_heldout_fpr_and_refuses_a_missing_provider():
    t = _table(np.random.default_rng(3))
    det = calibrate(t, ["h-a", "h-b"], fpr_batch_tokens=10_000)
    assert det.calibration_.heldout.batches == 0 and det.calibration_.heldout.fpr is None
    assert any("no fold of an honest configuration holds 10000 tokens" in w for w in det.warnings_)
    with pytest.raises(ClaimError, match="no scored tokens for honest provider 'nope'"):
        calibrate(t, ["h-a", "nope"])


def test_the_record_is_set_by_fit_and_a_plain_refit_clears_it(tmp_path):
    """provenance_ / calibration_ / extra warnings come in through fit (detect.calibrate gives them);
    a fit in code records neither, and a refit does not keep a previous fit's record."""
    from verinfer.detect import load_detector
    from verinfer.detect.record import Calibration

    t = _table(np.random.default_rng(5)).slice(0, 2000)
    groups = np.repeat(["h-a", "h-b"], 1000)
    det = make_detector("clipped-mean", random_state=4)
    cal = Calibration(tokens={"h-a": 1000, "h-b": 1000}, claims={"h-a": 40, "h-b": 40}, config=det.json_config())
    assert det.fit(t, groups=groups, provenance=PROV, calibration=cal, warnings=["w"]) is det
    assert det.provenance_ == PROV and det.calibration_ == cal and det.warnings_[-1] == "w"
    d = det.to_json()
    assert d["provenance"] == PROV.model_dump(mode="json") and d["calibration"] == cal.model_dump(mode="json")
    det.save(tmp_path / "d.json")
    back = load_detector(tmp_path / "d.json")
    assert back.provenance_ == PROV and back.calibration_ == cal and back.to_json() == d
    det.fit(t, groups=groups)
    assert det.provenance_ is None and det.calibration_ is None and "w" not in det.warnings_
    assert set(det.to_json()) == {"format", "version", "config", "fitted"}
