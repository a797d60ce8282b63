import json

import numpy as np
import pytest

from verinfer.detect.base import decision_text
from verinfer.detect.clipped_mean import ClippedMeanDetector
from verinfer.detect.verdict import FIELDS, Verdict, combine_verdicts


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.default_rng(0)
    det = ClippedMeanDetector(n_null_batches=300).fit({"margin": rng.exponential(1.0, 20_000)})
    return det, rng


def _old_dict(det: ClippedMeanDetector, pooled: float, n: int) -> dict:
    """The dict `ClippedMeanDetector.verdict` returned before verdicts were typed (its literal)."""
    thr, (p, method) = det.threshold(n), det._p_value(pooled, n)
    flagged = bool(pooled > thr)
    n_star = None if flagged else det.tokens_to_flag(pooled, n)
    more = None if n_star is None else max(1, n_star - n)
    power = None if flagged else det.power(n)
    return {"flagged": flagged, "pooled": float(pooled), "threshold": thr, "p_value": p,
            "tail_probability": p, "p_value_method": method, "p_value_bound": det.p_value_bound(pooled, n),
            "n_tokens": n, "target_fpr": det.target_fpr, "threshold_fpr": det.threshold_fpr(n),
            "more_tokens_needed": more, "detectable_excess": float(thr - det.null_mean_), "power": power,
            "decision": decision_text(flagged, more, power), "score": det.score_name, "clip": det.clip_}


@pytest.mark.parametrize("rate", [1.0, 1.02, 1.5])
def test_to_dict_is_the_old_dict_and_round_trips(fitted, rate):
    det, rng = fitted
    batch = {"margin": rng.exponential(rate, 1000)}
    v = det.verdict(batch)
    old = _old_dict(det, det.score(batch), 1000)
    assert v.to_dict() == old and list(v.to_dict()) == list(old)  # same values, same key order
    assert json.dumps(v.to_dict(), default=float) == json.dumps(old, default=float)
    assert Verdict.from_dict(v.to_dict()) == v and Verdict.from_dict(json.loads(json.dumps(v.to_dict()))) == v
    assert v.extra == {k: old[k] for k in old if k not in FIELDS}
    assert v.p_value == old["p_value"] and v.get("clip") == det.clip_ and v.get("nope", "-") == "-"


def test_with_adds_at_the_end_and_without_drops():
    v = Verdict(flagged=False, pooled=0.1, threshold=0.2, p_value=0.3, n_tokens=10, target_fpr=0.01,
                decision="ok", more_tokens_needed=None, extra={"clip": 1.5})
    assert v.reported == ("flagged", "pooled", "threshold", "p_value", "n_tokens", "target_fpr", "decision", "clip")
    w = v.with_(provider="a", pooled=0.15, more_tokens_needed=None, power={"probability": 0.5})
    assert list(w.to_dict()) == [*v.reported, "provider", "more_tokens_needed", "power"]
    assert w.pooled == 0.15 and w.provider == "a" and w.to_dict()["more_tokens_needed"] is None and v.pooled == 0.1
    assert w.without("power", "provider", "more_tokens_needed").to_dict() == {**v.to_dict(), "pooled": 0.15}
    with pytest.raises(ValueError, match="always reports flagged"):
        w.without("flagged")
    with pytest.raises(ValueError, match="are Verdict fields"):
        Verdict(flagged=True, pooled=1.0, threshold=0.5, p_value=0.0, n_tokens=1, target_fpr=0.01, decision="d",
                extra={"score": "x"})
    with pytest.raises(TypeError, match="missing 5 required"):
        Verdict.of(flagged=True, pooled=1.0)
    with pytest.raises(ValueError, match=r"missing \['pooled'"):
        Verdict(**{k: getattr(v, k) for k in FIELDS}, reported=("flagged",))
    with pytest.raises(AttributeError):
        v.flagged = True  # frozen


def test_combine_verdicts_union_bound_and_bonferroni():
    def verdict(provider, score, flagged, p, n=100):
        return Verdict.of(flagged=flagged, pooled=0.5, threshold=0.1, p_value=p, n_tokens=n, target_fpr=0.005,
                          threshold_fpr=0.004, more_tokens_needed=None, decision="d", score=score, power=None,
                          provider=provider, heldout_fpr=0.01, honest=False)

    tok = [verdict("a", "margin", False, 0.04), verdict("b", "margin", True, 1e-6, n=90)]
    act = [verdict("a", "fp_l2", False, 0.3), verdict("b", "fp_l2", False, 0.2)]
    assert combine_verdicts([tok]) == tok
    rows = combine_verdicts([tok, act])
    assert [r.provider for r in rows] == ["a [margin]", "a [fp_l2]", "a [combined]", "b [margin]", "b [fp_l2]",
                                          "b [combined]"]
    a, b = rows[2], rows[5]
    assert not a.flagged and a.p_value == 0.08 and a.target_fpr == 0.01 and a.get("scores") == ["margin", "fp_l2"]
    assert b.flagged and b.p_value == 2e-6 and b.n_tokens == 100 and b.score == "margin"
    assert list(a.to_dict()) == ["flagged", "pooled", "threshold", "p_value", "n_tokens", "target_fpr", "decision",
                                 "score", "provider", "honest", "scores"]
