import json

import numpy as np
import pytest

from benchmarks.replay_library import ReplayLibraryDetector
from verinfer.errors import VerinferError


def test_replay_library_detector_separates_the_alternative():
    rng = np.random.default_rng(4)

    def claims(n, produced_by_alt):
        # honest verifier margin and alternative-replay margin: the producer's replay reproduces it
        flip = lambda r: np.where(rng.random(n) < r, rng.exponential(0.3, n), 0.0)  # noqa: E731
        own, other = flip(0.003), flip(0.02)
        m, a = (other, own) if produced_by_alt else (own, other)
        return {"margin": m, "margin_alt": a}

    det = ReplayLibraryDetector(alternatives=("margin_alt",), n_null_batches=500).fit(claims(50_000, False))
    assert det.clip_ > 0
    x = det.token_columns(claims(1000, False))
    np.testing.assert_allclose(det.statistic_of_means(x.mean(0), 1000),
                               max(np.sqrt(1000) * (x[:, c].mean() - det.mu_[c]) / det.sd_[c] for c in range(2)))
    honest_flags = [det.predict(claims(300, False)) for _ in range(100)]
    alt_flags = [det.predict(claims(1000, True)) for _ in range(100)]
    assert np.mean(honest_flags) <= 0.05 and np.mean(alt_flags) >= 0.9
    v = det.verdict(claims(300, True))
    assert set(v.reported) >= {"flagged", "threshold_fpr", "tail_probability", "more_tokens_needed"}


def test_replay_library_groups_guard_a_noisier_new_honest_config():
    rng = np.random.default_rng(6)

    def honest(n, rate):
        return {"margin": np.where(rng.random(n) < rate, rng.exponential(0.3, n), 0.0),
                "margin_alt": np.where(rng.random(n) < 0.02, rng.exponential(0.3, n), 0.0)}

    parts = [honest(20_000, r) for r in (0.002, 0.003, 0.006)]
    pooled = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    groups = np.repeat([0, 1, 2], 20_000)
    plain = ReplayLibraryDetector(alternatives=("margin_alt",), n_null_batches=300).fit(pooled)
    strat = ReplayLibraryDetector(alternatives=("margin_alt",), n_null_batches=300).fit(pooled, groups=groups)
    assert strat.tau_[0] > 0 and strat.threshold(5000) > plain.threshold(5000)
    new = honest(20_000, 0.007)          # an honest config noisier than any calibration one
    x = strat.token_columns(new)
    stats = strat.batch_statistics(x, 5000, 200, rng)
    assert np.mean(stats > strat.threshold(5000)) <= 0.05 < np.mean(stats > plain.threshold(5000))


def test_replay_library_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(8)
    t = {"margin": np.where(rng.random(20_000) < 0.01, rng.exponential(0.3, 20_000), 0.0),
         "margin_alt": np.where(rng.random(20_000) < 0.02, rng.exponential(0.3, 20_000), 0.0)}
    det = ReplayLibraryDetector(alternatives=("margin_alt",), n_null_batches=200).fit(t, groups=np.arange(20_000) % 2)
    det.save(tmp_path / "r.json")
    back = ReplayLibraryDetector.load(tmp_path / "r.json")
    for k in ("mu_", "sd_", "tau_"):
        np.testing.assert_array_equal(getattr(back, k), getattr(det, k))
    assert back.clip_ == det.clip_ and back.verdict(t, max_tokens=500) == det.verdict(t, max_tokens=500)
    d = json.loads((tmp_path / "r.json").read_text())
    d["fitted"]["n_columns"] = 3
    (tmp_path / "r.json").write_text(json.dumps(d))
    with pytest.raises(VerinferError, match="malformed detector"):
        ReplayLibraryDetector.load(tmp_path / "r.json")

