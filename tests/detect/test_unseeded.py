"""Unseeded audits on the shipped testbed (issue 46 part 2): claims sampled by the testbed target
and claimed with `"seed": null`, scored by `audit.replay.score_chunk` (the PIT, the entropy and the
cross-entropy of every token), judged by the calibrated `pit-uniformity` and `xent-excess` detectors
and their betting e-processes. Data: tests/detect/unseeded_data.py (80 claims x 64 tokens = 5,120
tokens per provider; calibration on two honest configurations, bf16 split-K batches and fp32).

Measured (1% FPR): honest KS p 0.26 (T 1.0) and 0.37 (T 0.7); Neyman Psi^2 (6 components) honest
5.0 / 3.1 against a line of 16.7, temperature +0.1 164, top-p 0.9 112, the tuned draft 35 (its
cross-entropy excess z 0.96 against a line of |z| 2.66). Tokens to the first flagged prefix
(fixed-size / e-process): temperature +0.1 pit 512 / 1,829, xent 256 / 307; top-p 0.9 pit 1,280 /
1,999, xent 3,072 / 5,009; tuned draft pit 2,048 / not within 5,120 (sup E 7), xent never."""

import math

import numpy as np
import pyarrow as pa
import pytest
from scipy import stats

from tests.detect.unseeded_data import HONEST, unseeded_scores
from verinfer.detect.calibrate import calibrate
from verinfer.detect.registry import load_detector
from verinfer.detect.sequential import SequentialAudit
from verinfer.detect.unseeded import legendre_scores
from verinfer.errors import VerinferError
from verinfer.sampling.params import UNSEEDED
from verinfer.scores import MODE, PIT

ALPHA = 0.01
# The temperature-tuning attack (DiFR figure 2): the testbed's draft (a cheaper model; the testbed's
# int4 RTN moves the mean excess by only ~0.02 nats, nothing to tune away) sampling at the
# temperature where the cross-entropy detector's statistic matches honest (found by a sweep,
# see ATTACK_T's test).
ATTACK_T = 0.80


def u_of(table) -> np.ndarray:
    return np.asarray(table[PIT].to_numpy(), dtype=np.float64)


@pytest.fixture(scope="module")
def honest_cal() -> pa.Table:
    return pa.concat_tables([unseeded_scores(g, 1, numerics=n, calibration=True) for g, n in HONEST.items()])


@pytest.fixture(scope="module")
def pit_det(honest_cal):
    return calibrate(honest_cal, list(HONEST), detector="pit-uniformity")


@pytest.fixture(scope="module")
def xent_det(honest_cal):
    return calibrate(honest_cal, list(HONEST), detector="xent-excess")


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_pit_of_honest_claims_is_uniform(temperature):
    t = unseeded_scores("honest", 2, temperature=temperature)
    u = u_of(t)
    assert u.size >= 5000 and set(t[MODE].to_pylist()) == {UNSEEDED}
    p = stats.kstest(u, "uniform").pvalue
    assert p > 0.01, f"honest PIT at T={temperature}: KS p = {p:.3g} over {u.size} tokens"


def test_honest_claims_pass_both_detectors(pit_det, xent_det):
    # held-out honest batches of 250 tokens (5 folds): pit 0 of 40 flagged, xent 2 of 40 (the
    # excess's spread varies by prompt, which the token bootstrap of its null does not see)
    assert pit_det.calibration_.heldout.fpr <= 0.025 and xent_det.calibration_.heldout.fpr <= 0.05
    for temperature in (0.7, 1.0):
        t = unseeded_scores("honest", 2, temperature=temperature)
        for det in (pit_det, xent_det):
            v = det.verdict(t)
            assert not v.flagged, (det.NAME, temperature, v.pooled, v.threshold)
            assert v.n_tokens == t.num_rows and 0.0 < v.p_value <= 1.0


@pytest.mark.parametrize("name,served", [
    ("temperature +0.1", dict(served_temperature=1.1)),
    ("top-p 0.9 served for 0.95", dict(served_top_p=0.9)),
])
def test_misconfigured_sampling_is_flagged(pit_det, xent_det, name, served):
    t = unseeded_scores("misconfigured", 3, **served)
    u = u_of(t)
    assert stats.kstest(u, "uniform").pvalue < 0.01
    outside = float(np.mean(u == 1.0))
    if "top-p" in name:
        assert outside == 0.0  # a smaller nucleus never yields a token outside the claimed one
        assert np.mean(u > 0.95) < 0.03  # and thins the PIT's last ranks (honest: 5%; only the token
        # that crosses the 0.9 cut reaches past 0.9)
    else:
        assert outside > 0.005  # a hotter sampler yields tokens outside the claimed top-p nucleus
    for det in (pit_det, xent_det):
        v = det.verdict(t)
        assert v.flagged and v.p_value < ALPHA, (name, det.NAME, v.pooled, v.threshold)


def test_temperature_tuned_attack_passes_cross_entropy_but_not_uniformity(pit_det, xent_det):
    """The attacker's temperature makes the cross-entropy excess honest; the shape of u is not."""
    t = unseeded_scores("attack", 3, served_temperature=ATTACK_T, model="draft")
    x = xent_det.verdict(t)
    honest = xent_det.verdict(unseeded_scores("honest", 2))
    assert not x.flagged and abs(x.get("column_z")[0]) < 2.0, (x.pooled, x.threshold)
    p = pit_det.verdict(t)
    assert p.flagged and p.p_value < ALPHA, (p.pooled, p.threshold)
    z = legendre_scores(u_of(t), pit_det.degree).mean(axis=0) * math.sqrt(t.num_rows)
    assert abs(z[0]) < 2.0  # the mean of u (the direction cross-entropy reads) did not move,
    assert (z[1:] ** 2).sum() > stats.chi2.isf(ALPHA, pit_det.degree - 1)  # its shape (L2..L6) did
    assert honest.pooled < x.threshold


def test_attack_temperature_matches_honest_cross_entropy(xent_det):
    """ATTACK_T is where the draft's clipped excess crosses the honest center: a colder draft is
    below it, a hotter one above (the attacker's bisection, two points of it)."""
    z = {T: xent_det.verdict(unseeded_scores("attack", 3, served_temperature=T, model="draft")).get("column_z")[0]
         for T in (ATTACK_T - 0.06, ATTACK_T + 0.06)}
    assert z[ATTACK_T - 0.06] < 0 < z[ATTACK_T + 0.06]


def test_sequential_e_process_stays_under_one_over_alpha_on_honest_streams(pit_det, xent_det):
    """Real honest streams (4 providers x 10 streams of 512 tokens) and exact-null streams (1,000
    streams of 2,000 uniform PIT values): the count crossing 1/alpha stays within alpha's binomial
    bound; a misconfigured stream crosses."""
    honest = [unseeded_scores("honest", 2, temperature=T) for T in (0.7, 1.0)]
    honest += [unseeded_scores(g, 1, numerics=n, calibration=True) for g, n in HONEST.items()]
    for det in (pit_det, xent_det):
        audit = SequentialAudit(det, alpha=ALPHA)
        crossed = [audit.verdict(t.slice(s, 512)).flagged for t in honest for s in range(0, t.num_rows, 512)]
        assert len(crossed) == 40 and sum(crossed) <= 1, (det.NAME, sum(crossed))
    rng = np.random.default_rng(0)
    audit = SequentialAudit(pit_det, alpha=ALPHA)
    exact = sum(audit.verdict({PIT: rng.random(2000)}).flagged for _ in range(1000))
    assert exact <= stats.binom.ppf(0.999, 1000, ALPHA), exact
    for det in (pit_det, xent_det):
        v = SequentialAudit(det, alpha=ALPHA).verdict(unseeded_scores("misconfigured", 3, served_temperature=1.1))
        assert v.flagged and v.get("decided_at_tokens") <= 5120


def test_detector_files_round_trip_and_refuse_seeded_rows(pit_det, xent_det, tmp_path):
    t = unseeded_scores("honest", 2)
    for det in (pit_det, xent_det):
        det.save(tmp_path / f"{det.NAME}.json")
        back = load_detector(tmp_path / f"{det.NAME}.json")
        assert back.verdict(t).to_dict() == det.verdict(t).to_dict()
    seeded = t.set_column(t.column_names.index(MODE), MODE, pa.array(["seeded"] * t.num_rows))
    with pytest.raises(VerinferError, match="none of the scored tokens was scored in unseeded mode"):
        pit_det.verdict(seeded)
