"""The perturbation likelihood of a claimed token, the model the perturbation GLRT (`detect.glrt`,
the detection lab's `best`) tests against (DiFR appendix A, extended with outliers and temperature).

Shape key: N = tokens, T = signed-gap columns (claimed temperature first, then other
temperatures), G = alternatives.

    perturbation_loglik(d, sigma, eps, q)       log[(1 - eps) Phi(-d / (sqrt(2) sigma)) + eps q]:
                                                the claimed token wins under N(0, sigma^2) noise per
                                                logit, or is an outlier (probability eps, then q)
    fit_perturbation(d, q)                      (sigma, eps) by maximum likelihood on honest tokens
    perturbation_llr(d_NT, grid, theta0, q)     per-token log-likelihood ratios [N, G] of each
                                                alternative (temperature column, sigma, eps) vs theta0
    perturbation_llr_centered(...)              the same minus its expectation under theta0 given
                                                the token's pair gap

d is the signed post-Gumbel gap of the claimed token to its strongest competitor (the `gap`
columns of `verinfer.scores`). Reference loops: tests/detect/test_perturbation.py.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize
from scipy.special import log_ndtr

from verinfer.detect.clipping import fit_sigma


def perturbation_loglik(gap, sigma: float, eps: float = 0.0, outlier_p: float = 0.02) -> np.ndarray:
    """log[(1 - eps) Phi(-d / (sqrt(2) sigma)) + eps * outlier_p] per token, d = signed gap.

    Model: the provider's post-Gumbel scores are the verifier's plus independent N(0, sigma^2) per
    logit, so the claimed token beats its strongest competitor with probability
    Phi(-d / (sqrt(2) sigma)) (near 1 for a reproduced token with a wide runner-up gap, 1/2 at a
    tie, tiny for a large margin); with probability eps the token is an outlier that any of
    1 / outlier_p candidates could be (a sampling bug drawing from the top-k). d = +inf (claimed
    token filtered out) gives log(eps * outlier_p) (-inf if eps = 0); d = -inf (no competitor) 0."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    d = np.asarray(gap, dtype=np.float64)
    if np.isnan(d).any():
        raise ValueError("gap contains NaN (claims without Gumbel noise have no signed gap)")
    a = math.log1p(-eps) + log_ndtr(-d / (math.sqrt(2.0) * sigma))
    if eps == 0.0:
        return a
    return np.logaddexp(a, math.log(eps * outlier_p))


def fit_perturbation(gap, outlier_p: float = 0.02, min_eps: float = 1e-6) -> tuple[float, float]:
    """(sigma, eps) maximizing sum(perturbation_loglik(gap, sigma, eps, outlier_p)) over honest
    tokens (L-BFGS-B on log sigma and logit eps, from the half-normal sigma of `scores.fit_sigma`);
    eps >= min_eps so that a rare honest outlier the train set happened to lack keeps a finite cost."""
    d = np.asarray(gap, dtype=np.float64)
    d = d[~np.isnan(d)]
    if d.size == 0:
        raise ValueError("no signed gaps to fit the perturbation model on")
    s0 = fit_sigma(d[np.isfinite(d) & (d > 0)])
    e0 = max(min_eps, float(np.mean(np.isinf(d) & (d > 0))) + 1.0 / d.size)

    def nll(x):
        return -perturbation_loglik(d, math.exp(x[0]), min_eps + (1 - 2 * min_eps) / (1 + math.exp(-x[1])),
                                    outlier_p).sum() / d.size

    x0 = np.array([math.log(s0), math.log((e0 - min_eps) / (1 - e0 - min_eps) + 1e-300)])
    r = minimize(nll, x0, method="L-BFGS-B", bounds=[(math.log(s0) - 5, math.log(s0) + 5), (-30.0, 5.0)])
    return float(math.exp(r.x[0])), float(min_eps + (1 - 2 * min_eps) / (1 + math.exp(-r.x[1])))


def perturbation_llr(gaps_NT, grid, theta0, outlier_p: float = 0.02) -> np.ndarray:
    """[N, G] per-token log-likelihood ratios log L(theta_g) - log L(theta0). gaps_NT: signed gaps,
    column 0 at the claimed temperature, further columns at other temperatures; grid: G tuples
    (column, sigma, eps); theta0 = (sigma0, eps0) on column 0 (the honest fit)."""
    g = np.asarray(gaps_NT, dtype=np.float64)
    if g.ndim != 2:
        raise ValueError(f"gaps_NT must be 2-D [tokens, temperature columns], got shape {g.shape}")
    base = perturbation_loglik(g[:, 0], theta0[0], theta0[1], outlier_p)
    out = np.empty((g.shape[0], len(grid)))
    cache = {}
    for j, (col, s, e) in enumerate(grid):
        key = (int(col), float(s), float(e))
        if key not in cache:
            cache[key] = perturbation_loglik(g[:, int(col)], s, e, outlier_p) - base
        out[:, j] = cache[key]
    return out


def perturbation_llr_centered(gaps_NT, grid, theta0, outlier_p: float = 0.02) -> np.ndarray:
    """`perturbation_llr` minus its conditional expectation under theta0 given the token's pair gap
    a = |d| (columns at the claimed temperature; temperature columns are returned as is).

    Two-competitor picture: the verifier's pick leads its runner-up by a; under theta0 the provider
    claims the runner-up (d = +a) with probability p = exp(perturbation_loglik(+a; theta0)) and the
    pick (d = -a) otherwise, so E0[llr | a] = (1 - p) llr(-a) + p llr(+a). The centered column is
    ~0 on tokens whose outcome was never in doubt and carries the surprise of near ties and flips:
    a batch's sum no longer depends on how many near ties its prompts happened to contain."""
    g = np.asarray(gaps_NT, dtype=np.float64)
    raw = perturbation_llr(g, grid, theta0, outlier_p)
    a = np.abs(g[:, :1])
    pos = perturbation_llr(np.hstack([a, g[:, 1:]]), grid, theta0, outlier_p)
    neg = perturbation_llr(np.hstack([-a, g[:, 1:]]), grid, theta0, outlier_p)
    p = np.exp(perturbation_loglik(a[:, 0], theta0[0], theta0[1], outlier_p))[:, None]
    centered = raw - ((1.0 - p) * neg + p * pos)
    cols = np.array([int(c) == 0 for c, _, _ in grid])
    return np.where(cols[None, :], centered, raw)
