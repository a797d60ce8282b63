"""benchmarks/honest_quirks.py's pure parts and verinfer.detect.widened: held-out batching, the
Clopper-Pearson bound, the widening rule, and the tail check against a fitted greedy detector
(synthetic scores: an honest-like server passes, a heavier-tailed one fails and its required
allowance makes the widened detector's bounds hold)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from benchmarks.honest_quirks import clopper_pearson, config_conversations, fpr_row, split_batches, widening
from verinfer.detect.greedy import GreedyDetector
from verinfer.detect.widened import NullBounds, check_assumption, claim_sums_of, exceedances, log_mgf, widen


def table(rng, n_claims: int, mismatch: float, big: float = 0.0, length: int = 40, group: str = "g") -> pa.Table:
    """Token rows of n_claims claims: a token mismatches with probability `mismatch`, its margin a
    near-tie (0.05) or, with probability `big`, far beyond (3 logits)."""
    rows = {"claim_id": [], "provider": [], "position": [], "margin": [], "exact_match": []}
    for c in range(n_claims):
        for p in range(length):
            miss = rng.random() < mismatch
            rows["claim_id"].append(f"{group}-{c}")
            rows["provider"].append(group)
            rows["position"].append(p)
            rows["margin"].append((3.0 if rng.random() < big else 0.05 + 0.01 * rng.random()) if miss else 0.0)
            rows["exact_match"].append(not miss)
    return pa.table(rows)


@pytest.fixture(scope="module")
def det():
    rng = np.random.default_rng(0)
    honest = pa.concat_tables([table(rng, 120, r, group=f"h{k}") for k, r in enumerate((0.015, 0.018, 0.02, 0.017))])
    return GreedyDetector(target_fpr=0.01).fit(honest, groups=honest["provider"].to_pylist())


def test_split_batches_disjoint_and_drops_partial():
    ids = [f"c{i}" for i in range(64 + 8 * 5 + 3)]
    tail, batches = split_batches(ids, 64, 8)
    assert tail == ids[:64] and len(batches) == 5 and all(len(b) == 8 for b in batches)
    flat = [c for b in batches for c in b]
    assert len(set(flat)) == len(flat) and not set(flat) & set(tail) and flat == ids[64:104]


def test_clopper_pearson_matches_closed_forms():
    lo, hi = clopper_pearson(0, 500)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 500), rel=1e-9)   # ~3.69/n
    assert hi == pytest.approx(3.69 / 500, rel=0.01)
    lo, hi = clopper_pearson(500, 500)
    assert hi == 1.0 and lo == pytest.approx(0.025 ** (1 / 500), rel=1e-9)
    lo, hi = clopper_pearson(5, 500)
    assert lo < 0.01 < hi < 0.025
    assert fpr_row([False] * 199 + [True]) == {"rate": 0.005, "upper95": clopper_pearson(1, 200)[1], "batches": 200,
                                                "flagged": 1}


def test_widening_rule_only_when_a_check_fails():
    ok = {"a": {"holds": True, "required_allowance": 0.004}, "b": {"holds": True, "required_allowance": 0.003}}
    assert widening(ok, 0.002) == {**widening(ok, 0.002), "allowance": 0.002, "widened": False, "failed": []}
    bad = {**ok, "c": {"holds": False, "required_allowance": 0.0035}}
    w = widening(bad, 0.002)
    assert w["failed"] == ["c"] and w["allowance"] == 0.004 and w["widened"]   # the largest over all samples


def test_conversations_distinct_within_a_configuration():
    pool = [[{"role": "user", "content": str(i)}] for i in range(100)]
    for name in ("honest-b64", "honest-b1"):
        conv = config_conversations(pool, name, 100)
        assert len({c[0]["content"] for c in conv}) == 100
    with pytest.raises(ValueError):
        config_conversations(pool, "honest-b8", 101)


def test_log_mgf_and_claim_sums(det):
    t = table(np.random.default_rng(1), 10, 0.05)
    x, n = claim_sums_of(det, t)
    assert n.tolist() == [40] * 10 and x.sum() == pytest.approx(det.values(t).sum())
    assert log_mgf(np.zeros(4), [0.5, 1.0]) == pytest.approx([0.0, 0.0])
    assert log_mgf(np.array([0.0, 2.0]), [1.0])[0] == pytest.approx(np.log((1 + np.e ** 2) / 2))


def test_tail_check_passes_honest_fails_heavy_and_widening_covers_it(det):
    rng = np.random.default_rng(2)
    honest = check_assumption(det, table(rng, 200, 0.017, group="v"))
    assert honest["holds"] and not honest["failing"]
    heavy_t = table(rng, 200, 0.04, big=0.3, group="w")
    heavy = check_assumption(det, heavy_t)
    assert not heavy["holds"] and "mean" in heavy["failing"]
    assert heavy["required_allowance"] > det.allowance()
    wide = widen(det, heavy["required_allowance"])
    assert det.allowance() < wide.allowance() == pytest.approx(heavy["required_allowance"])
    assert wide.sequential_scale()[0] > det.sequential_scale()[0] and wide.threshold(300) > det.threshold(300)
    after = check_assumption(wide, heavy_t)
    assert np.all(np.asarray(after["log_mgf_upper"]) <= np.asarray(after["log_mgf_bound"]) + 1e-12)
    assert after["mean_upper"] <= after["mean_bound"] + 1e-12
    assert NullBounds.of(wide).scale == pytest.approx(wide.sequential_scale()[0])


def test_exceedances_one_sided():
    calib = np.r_[np.zeros(900), np.ones(90), np.full(10, 5.0)]
    e = exceedances(np.r_[np.zeros(80), np.full(20, 5.0)], calib, qs=(0.99,))["0.99"]
    assert e["sample"] == 0.2 and e["calibration"] == 0.01 and e["p_value"] < 1e-6
    assert exceedances(np.zeros(100), calib, qs=(0.99,))["0.99"]["p_value"] == 1.0
