"""The perturbation likelihood (detect/perturbation.py) against one-token-at-a-time reference loops."""

import math

import numpy as np
import pytest
from scipy.stats import norm

from verinfer.detect.perturbation import fit_perturbation, perturbation_llr, perturbation_loglik


# -- reference loops ------------------------------------------------------------------------------
def perturbation_loglik_loop(gap, sigma: float, eps: float = 0.0, outlier_p: float = 0.02) -> np.ndarray:
    """Reference for `perturbation_loglik`, one token at a time with math.erfc."""
    out = []
    for d in np.asarray(gap, dtype=np.float64).ravel():
        p = (1.0 - eps) * 0.5 * math.erfc(d / (2.0 * sigma)) + eps * outlier_p
        out.append(math.log(p) if p > 0 else -math.inf)
    return np.array(out)


def perturbation_llr_loop(gaps_NT, grid, theta0, outlier_p: float = 0.02) -> np.ndarray:
    """Reference for `perturbation_llr`: one token and one alternative at a time."""
    g = np.asarray(gaps_NT, dtype=np.float64)
    out = np.empty((g.shape[0], len(grid)))
    for i in range(g.shape[0]):
        b = perturbation_loglik_loop(g[i, :1], theta0[0], theta0[1], outlier_p)[0]
        for j, (col, s, e) in enumerate(grid):
            out[i, j] = perturbation_loglik_loop(g[i, int(col) : int(col) + 1], s, e, outlier_p)[0] - b
    return out


def perturbation_llr_centered_loop(gaps_NT, grid, theta0, outlier_p: float = 0.02) -> np.ndarray:
    """Reference for `perturbation_llr_centered`, one token and one alternative at a time."""
    g = np.asarray(gaps_NT, dtype=np.float64)
    out = np.empty((g.shape[0], len(grid)))
    s0, e0 = theta0
    for i in range(g.shape[0]):
        d = g[i, 0]
        a = abs(d)
        p = math.exp(perturbation_loglik_loop([a], s0, e0, outlier_p)[0])
        for j, (col, s, e) in enumerate(grid):
            llr = lambda x: (perturbation_loglik_loop([x], s, e, outlier_p)[0]  # noqa: E731
                             - perturbation_loglik_loop([x], s0, e0, outlier_p)[0])
            if int(col) == 0:
                out[i, j] = llr(d) - ((1 - p) * llr(-a) + p * llr(a))
            else:
                out[i, j] = (perturbation_loglik_loop(g[i, int(col) : int(col) + 1], s, e, outlier_p)[0]
                             - perturbation_loglik_loop([d], s0, e0, outlier_p)[0])
    return out


def test_perturbation_loglik_vectorized_equals_loop_and_values():
    d = np.array([-3.0, -0.1, 0.0, 0.05, 0.4, 2.0, np.inf, -np.inf])
    for sigma, eps in ((0.05, 0.0), (0.05, 1e-3), (0.3, 0.02)):
        fast = perturbation_loglik(d, sigma, eps, 0.02)
        slow = perturbation_loglik_loop(d, sigma, eps, 0.02)
        fin = np.isfinite(slow)
        np.testing.assert_allclose(fast[fin], slow[fin], rtol=1e-9, atol=1e-12)
        assert np.array_equal(np.isinf(fast), np.isinf(slow))
    # a tie is a coin flip; a filtered-out token is an outlier; no competitor means a sure win
    assert perturbation_loglik(np.array([0.0]), 0.1)[0] == pytest.approx(math.log(0.5))
    assert perturbation_loglik(np.array([np.inf]), 0.1, 1e-3, 0.02)[0] == pytest.approx(math.log(2e-5))
    assert perturbation_loglik(np.array([-np.inf]), 0.1)[0] == 0.0
    # far tails stay finite where the loop underflows (log_ndtr)
    assert np.isfinite(perturbation_loglik(np.array([50.0]), 0.05)).all()
    with pytest.raises(ValueError, match="NaN"):
        perturbation_loglik(np.array([np.nan]), 0.1)


def test_fit_perturbation_recovers_sigma_and_eps():
    rng = np.random.default_rng(0)
    # exact model: d ~ the verifier's gap; the claimed token won under noise of std sqrt(2) sigma
    n, sigma, eps = 400_000, 0.08, 2e-3
    gap = rng.normal(0, 1.0, n)                               # verifier's signed gap of a random competitor
    win = rng.random(n) < norm.cdf(-gap / (math.sqrt(2) * sigma))
    d = np.where(win, gap, -gap)                              # otherwise the competitor is the claimed token
    out = rng.random(n) < eps
    d[out] = 3.0 + rng.exponential(1.0, out.sum())
    s, e = fit_perturbation(d, 0.02)
    assert s == pytest.approx(sigma, rel=0.05)
    assert e == pytest.approx(eps, rel=0.15)


def test_perturbation_llr_vectorized_equals_loop():
    rng = np.random.default_rng(2)
    g = rng.normal(-1, 0.5, (300, 3))
    g[rng.random(g.shape) < 0.05] = 0.3
    g[5, 0] = np.inf
    g[6, 1] = np.inf
    grid = [(0, 0.1, 1e-3), (0, 0.05, 1e-2), (1, 0.05, 1e-3), (2, 0.05, 1e-3)]
    fast = perturbation_llr(g, grid, (0.05, 1e-3))
    np.testing.assert_allclose(fast, perturbation_llr_loop(g, grid, (0.05, 1e-3)), rtol=1e-9, atol=1e-12)
    assert fast[5, 1] == pytest.approx(math.log(10))       # an outlier under 10x the outlier rate
    assert fast[5, 0] == pytest.approx(0.0)                 # filtered out: sigma alone cannot explain it
    assert (fast[:, 2][np.isfinite(g[:, 1]) & (g[:, 1] == g[:, 0])] == 0).all()
