"""benchmarks/verdicts.py: the power table and its monotonicity check, claim streams, and the
committed results on the detection lab's data (issue 15: power never decreases with tokens; the
sequential audit's false-positive rate and tokens to flag)."""

import json

import numpy as np
import pytest

from benchmarks import verdicts
from verinfer.detect.glrt import PerturbationGLRTDetector


def test_power_table_thresholds_and_monotone_check():
    rng = np.random.default_rng(0)
    honest = [rng.normal(0.0, 1.0, 20_000), rng.normal(0.05, 1.0, 20_000)]
    shifted = rng.normal(0.08, 1.0, 40_000)
    t = verdicts.power_table({"mean": (honest, {"m": shifted, "same": rng.normal(0.0, 1.0, 40_000)})}, ["m", "same"],
                             sizes=(1000, 4000, 16000))
    m = t["mean"]["m"]
    assert m[1000] < m[4000] < m[16000] and m[16000] > 0.9          # mean 0.03 above the worst group's
    assert max(t["mean"]["same"].values()) <= 0.02                   # below the worst group: ~never
    assert verdicts.monotone_violations(t) == []
    bad = {"d": {"m": {1000: 0.5, 2000: 0.4, 4000: 0.9}}}
    assert verdicts.monotone_violations(bad) == ["d/m: 0.500 at 1000 -> 0.400 at 2000"]
    assert verdicts.monotone_violations(bad, slack=0.15) == []


def test_streams_are_whole_claims_up_to_the_token_budget():
    starts = np.array([0, 3, 10, 12])                                 # claims of 3, 7, 2 tokens
    ev = np.arange(12.0)[:, None]
    rng = np.random.default_rng(1)
    for _ in range(20):
        x, claims = verdicts.stream(ev, starts, rng, tokens=25)
        s = x[:, 0]
        assert len(s) == 25 and len(claims) == 25 and claims[0] == 0 and (np.diff(claims) >= 0).all()
        for c in np.unique(claims)[:-1]:                              # one label per whole claim drawn
            assert np.isin(s[claims == c], ev[:, 0]).all() and len(s[claims == c]) in (2, 3, 7)
        runs = np.split(s, np.flatnonzero(np.diff(s) != 1) + 1)       # each run: consecutive tokens of claims
        for r in runs[:-1]:
            assert r[0] in (0, 3, 10) and r[-1] in (2, 9, 11)


def test_power_table_uses_a_fitted_detectors_own_threshold():
    rng = np.random.default_rng(2)

    def gaps(n, s):
        a = rng.exponential(1.0, n)
        d = np.where(rng.random(n) < 0.5 * np.exp(-a / s), a, -a)
        return {"gap_0": d, "gapT_1.1": d}

    det = PerturbationGLRTDetector(temperature_factors=(1.1,), top_p_slack=0.0, envelope=False, n_null_batches=200)
    det.fit({k: np.concatenate([gaps(20_000, s)[k] for s in (0.04, 0.05, 0.06)]) for k in ("gap_0", "gapT_1.1")},
            groups=np.repeat([0, 1, 2], 20_000))
    bad = det.token_scores(gaps(30_000, 0.2))
    t = verdicts.power_table({"glrt": (det, {"m": bad})}, ["m"], sizes=(1000, 2000))
    assert t["glrt"]["m"] == {1000: 1.0, 2000: 1.0}


def _committed():
    path = verdicts.RESULTS / "verdicts.json"
    if not path.is_file():
        pytest.skip("benchmarks/results/verdicts.json not generated yet (python benchmarks/verdicts.py)")
    return json.loads(path.read_text())


def test_committed_results_power_never_decreases():
    """The committed run on the lab's data: for every detector and misconfiguration, power at 1k,
    2k, 4k, 8k and 16k tokens never decreases by more than the Monte-Carlo error of 1,000 resampled
    batches (0.01: three standard errors of a difference of two estimates at power <= 0.01, where
    cross-entropy, which cannot see int4 or fp8-kv, moves 0.001 -> 0.000)."""
    r = _committed()
    assert set(r["power"]) >= {"best", "glrt_single_replay", "margin_clip99.9", "lr_combined"}
    for by in r["power"].values():
        for curve in by.values():
            assert list(curve) == [str(n) for n in verdicts.POWER_SIZES]
    table = {k: {m: {int(n): p for n, p in c.items()} for m, c in v.items()} for k, v in r["power"].items()}
    assert verdicts.monotone_violations(table, slack=0.01) == []
    assert all(p >= 0.98 for m in ("int4", "fp8-kv") for p in r["power"]["best"][m].values())


def test_committed_sequential_audit_holds_its_alpha():
    """Claim-level e-process (issue 15 item 6): at most alpha over >= 1,000 held-out honest 20k-token
    streams (measured 0 of 1,002; the token-level one flagged 6.3%), and at most 0.6 of the fixed
    test's tokens on int4 and fp8-kv (measured 0.37 and 0.30)."""
    s = _committed()["sequential"]
    assert s["honest_audits"] >= 1000 and s["honest_fpr"] <= s["alpha"]
    for m in ("int4", "fp8-kv"):
        assert s["misconfigured"][m]["ratio_to_fixed_0.99"] <= 0.6
