"""Calibration of MarginGate's tau (determinism/tau.py) on the shipped testbed."""

from verinfer.determinism.tau import calibrate, calibration_requests
from verinfer.models.testbed import TARGET_DIR


def test_tau_calibration_reports_progress_in_every_phase():
    """`determinism calibrate` reports each finished request of its reference, eps_pert and sweep
    runs (it was silent through reference and eps_pert, then counted sweep points): the count is
    (2 + sweep points) x prompts, `calibration_requests` when the sweep is not widened."""
    done = []
    rec = calibrate(TARGET_DIR, n=2, max_tokens=(6, 6), max_batch=2, points=2, progress=done.append)
    assert sum(done) == (2 + len(rec["sweep"])) * 2 >= calibration_requests(2, points=2)
