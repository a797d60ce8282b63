"""detect/clipping.py: winsorizing, the clipping quantile, tail pooling and the likelihood's sigma."""

import numpy as np
import pytest

from verinfer.detect.clipping import clip_at_quantile, fit_sigma, tail_pool, winsorize


def test_winsorize_and_clip_quantile_handle_inf():
    w = winsorize([0.0, 2.0, 5.0, np.inf], 3.0)
    assert w.dtype == np.float64 and w.tolist() == [0.0, 2.0, 3.0, 3.0]
    # infinite values are excluded from the quantile
    assert clip_at_quantile([0, 1, 2, 3, 4, np.inf, np.inf], 1.0) == 4.0
    assert clip_at_quantile(np.arange(101.0), 0.9) == pytest.approx(90.0)
    with pytest.raises(ValueError):
        clip_at_quantile([np.inf], 0.5)


def test_tail_pool():
    x = tail_pool([0.1, 0.5, 2.0, 10.0, np.inf], clip_hi=5.0, zero_below=1.0)
    assert x.tolist() == [0.0, 0.0, 2.0, 5.0, 5.0]


def test_clip_never_collapses_every_score_to_one_constant():
    # 99.9% zeros: the plain quantile would be 0 and wipe out every mismatch
    v = np.r_[np.zeros(5000), [0.5, 2.0, np.inf]]
    assert clip_at_quantile(v, 0.999) == pytest.approx(np.quantile([0.5, 2.0], 0.999))
    assert clip_at_quantile(np.zeros(100), 0.999) == 1.0
    assert clip_at_quantile(np.r_[np.zeros(100), np.arange(1, 101.0)], 0.5) == pytest.approx(0.5)  # normal case untouched


def test_fit_sigma_recovers_the_half_normal_scale():
    rng = np.random.default_rng(0)
    margins = np.r_[np.zeros(50_000), np.abs(rng.normal(0, np.sqrt(2) * 0.2, 20_000)), [np.inf]]
    assert fit_sigma(margins) == pytest.approx(0.2, rel=0.03)
    assert fit_sigma(np.zeros(10), default=0.3) == 0.3
