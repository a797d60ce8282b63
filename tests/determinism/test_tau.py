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


def test_tau_files_keep_each_gated_policy_and_margingate_decodes_at_the_safety_factor(tmp_path):
    import pytest

    from verinfer.determinism.tau import CONTRACT_SAFETY, read_tau, write_tau

    p = tmp_path / "tau.json"
    write_tau(p, {"model": "m", "dtype": "bf16", "policy": "margingate", "tau": 0.25})
    assert read_tau(p, "m", policy="margingate") == CONTRACT_SAFETY * 0.25 == 0.5
    assert read_tau(p, "m") == 0.5  # margingate, the paper's method, is the default
    with pytest.raises(ValueError, match="policy margingate_live_cache"):
        read_tau(p, "m", policy="margingate_live_cache")  # another policy's tau is never read
    write_tau(p, {"model": "m", "dtype": "bf16", "tau": 8.0})  # a record without a policy: the ablation's (old files)
    assert read_tau(p, "m", policy="margingate_live_cache") == read_tau(p, "m", policy="gated_llm42") == 8.0
    assert read_tau(p, "m", policy="margingate") == 0.5
    with pytest.warns(DeprecationWarning):
        assert read_tau(p, "m", policy="margingate_contract") == 0.5


def test_a_tau_file_written_before_the_rename_gives_each_policy_its_own_tau(tmp_path):
    """Before the rename `margingate_contract` (now margingate) was kept under bf16/margingate_contract
    and the live-cache ablation, then called margingate, under bf16."""
    import json

    from verinfer.determinism.tau import CONTRACT_SAFETY, read_tau

    p = tmp_path / "tau.json"
    p.write_text(json.dumps({"m": {"bf16": {"policy": "margingate", "tau": 8.0},
                                   "bf16/margingate_contract": {"policy": "margingate_contract", "tau": 0.25}}}))
    assert read_tau(p, "m", policy="margingate") == CONTRACT_SAFETY * 0.25
    assert read_tau(p, "m", policy="margingate_live_cache") == 8.0
