"""Tail probabilities of a batch mean under an empirical honest null, resolved far past resampling.

A detector's null is a sample w_1..w_N of honest per-token values (winsorized margins,
per-token log-likelihood ratios: bounded); an honest batch of n tokens is modelled as n draws
with replacement from it, which is what the resampled null simulates, at a resolution of
1 / (resamples + 1). Here the same probability, P(mean of n draws >= x), comes from the sample's
empirical cumulant generating function

    K(t) = log (1/N) sum_i exp(t w_i)        (the mean of n draws has CGF n K(t / n))

and the saddle point t of K'(t) = x (brentq on the monotone K'), with r and u

    r = sign(t) sqrt(2 n (t x - K(t))),   u = t sqrt(n K''(t))

    P(mean >= x) ~ 1 - Phi(r) + phi(r) (1/u - 1/r)            (Lugannani & Rice, 1980)

`mean_tail` returns this: its relative error is O(1/n) uniformly in x, out to the sample's
maximum, so 1e-12 or 1e-100 is as resolved as 0.3 (the resampled p-value's floor is 0.0005 at
2,000 resamples). It is an approximation, not a bound: `chernoff_bound` is the conservative
exp(-n (t x - K(t))) = exp(-r^2 / 2) >= P(mean >= x) for every n (Chernoff), larger than the
saddle-point value by about r sqrt(2 pi) in the far tail. Verdicts report the saddle-point value
(accurate, and checked against resampling where resampling resolves: tests/detect/test_tail.py)
and the bound beside it.

Where a batch holds only a few draws off the null's mode (n = 10 margins at 0.4% mismatches),
the mean is a jump process and the formula can be off by a factor of 2 or more: the reported value
is then never above the Chernoff bound, and detectors use resampling wherever it resolves the
tail (`ClippedMeanDetector`: at least 10 resampled batches beyond the observed mean).

Special cases: at x >= max(w) the mean reaches x only if every draw is the maximum:
P = (share of the maximum)^n at x == max(w), 0 above. A sample of two distinct values is a scaled
Bernoulli: the mean is a scaled binomial, and its exact tail (scipy's binom.sf) is used instead
(the continuous formula is off by the lattice's half step there). Within 0.02 standard errors of
the null mean (r -> 0, where the formula is 0/0) the normal tail is used.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.special import logsumexp
from scipy.stats import binom, norm

MIN_RESAMPLED_HITS = 10  # resampled batches at or beyond the observed statistic for a resampled p-value


def compress(sample, weights=None) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values in increasing order, their shares) of a finite sample (each value weighted
    by `weights`, default 1): the empirical distribution in the form `mean_tail` takes (a null
    sample of margins is mostly zeros: this makes it cheap)."""
    v, inv = np.unique(np.asarray(sample, dtype=np.float64), return_inverse=True)
    if v.size == 0 or not np.isfinite(v).all():
        raise ValueError("a null sample must be non-empty and finite")
    c = np.bincount(inv.ravel(), weights=weights, minlength=v.size)
    return v, c / c.sum()


def _moments(t: float, z: np.ndarray, logp: np.ndarray) -> tuple[float, float, float]:
    """(log E exp(t z), E_t z, Var_t z) under the exponentially tilted distribution."""
    a = t * z + logp
    lse = float(logsumexp(a))
    q = np.exp(a - lse)
    m1 = float(q @ z)
    return lse, m1, max(float(q @ (z - m1) ** 2), 0.0)


def _saddle(values: np.ndarray, shares: np.ndarray, x: float) -> tuple[float, float, float]:
    """(t, t x - K(t), K''(t)) at the saddle point K'(t) = x, for min(values) < x < max(values)."""
    z = values - x  # K_z(t) = K(t) - t x: the root of E_t z = 0 is the saddle point
    logp = np.log(shares)
    mean = float(shares @ z)
    step = 1.0 / max(float(np.sqrt(shares @ (z - mean) ** 2)), 1e-300)
    sign = 1.0 if mean < 0 else -1.0
    hi = step
    while _moments(sign * hi, z, logp)[1] * sign < 0:
        hi *= 4.0
        if hi > 1e300:
            raise ValueError("saddle point not bracketed")
    t = brentq(lambda s: _moments(s, z, logp)[1], 0.0, sign * hi) if sign > 0 else \
        brentq(lambda s: _moments(s, z, logp)[1], sign * hi, 0.0)
    lse, _, var = _moments(t, z, logp)
    return t, max(-lse, 0.0), var


def mean_tail(values: np.ndarray, shares: np.ndarray, n: float, x: float) -> float:
    """P(mean of n draws >= x) from the distribution {values: shares} (`compress`): saddle point
    (module docstring), exact at and beyond the maximum, exact binomial for two values. n may be
    fractional (a batch of tokens counted in claims: `ClippedMeanDetector`)."""
    n = float(n)
    if not n > 0:
        raise ValueError(f"n must be > 0, got {n}")
    lo, hi = float(values[0]), float(values[-1])
    if x > hi:
        return 0.0
    if x == hi:
        return float(math.exp(n * math.log(shares[-1])))
    if x <= lo:
        return 1.0
    if values.size == 2:  # scaled binomial: k draws of the maximum give mean lo + k (hi - lo) / n
        m = max(1, round(n))
        k = math.ceil(m * (x - lo) / (hi - lo) - 1e-9)
        return float(binom.sf(k - 1, m, shares[1]))
    mean = float(shares @ values)
    sd = math.sqrt(max(float(shares @ (values - mean) ** 2), 0.0))
    zscore = (x - mean) * math.sqrt(n) / sd
    if abs(zscore) < 0.02:
        return float(norm.sf(zscore))
    t, rate, k2 = _saddle(values, shares, x)
    r = math.copysign(math.sqrt(2.0 * n * rate), t)
    u = t * math.sqrt(n * k2)
    if r == 0.0 or u == 0.0:
        return float(norm.sf(zscore))
    p = float(norm.sf(r) + norm.pdf(r) * (1.0 / u - 1.0 / r))
    bound = math.exp(-n * rate) if t > 0 else 1.0
    # a batch holding only a few non-modal draws is a jump process the formula can miss badly
    # (even below 0): never report more evidence than the Chernoff bound allows
    return min(p, bound) if 0.0 < p <= 1.0 else bound


def chernoff_bound(values: np.ndarray, shares: np.ndarray, n: float, x: float) -> float:
    """exp(-n sup_t (t x - K(t))) >= P(mean of n draws >= x) (1 when x <= the null mean)."""
    n = float(n)
    mean = float(shares @ values)
    hi = float(values[-1])
    if x <= mean:
        return 1.0
    if x > hi:
        return 0.0
    if x == hi:
        return float(math.exp(n * math.log(shares[-1])))
    return float(math.exp(-n * _saddle(values, shares, x)[1]))


def tilt(values: np.ndarray, shares: np.ndarray, mean: float) -> np.ndarray:
    """The shares of the exponential tilt of {values: shares} whose mean is `mean`
    (q_i ~ shares_i exp(t values_i), the t of `_saddle`): the alternative closest to the null
    (in Kullback-Leibler divergence) with that mean. min(values) < mean < max(values)."""
    t, _, _ = _saddle(values, shares, mean)
    a = t * values + np.log(shares)
    return np.exp(a - logsumexp(a))

