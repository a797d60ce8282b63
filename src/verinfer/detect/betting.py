"""A betting e-process over bounded per-token evidence whose conditional mean is bounded.

Shape key: N = tokens in stream order, C = evidence columns, L = bet fractions.

For evidence x_tc >= lo_c (a known lower bound) with E[x_tc | every earlier token] <= b_c under
the null, and bets lambda_lc = f_l / (b_c - lo_c), f_l in (0, 1):

    E_t = 1/(C L) sum_{c,l} prod_{s <= t} (1 + lambda_lc (x_sc - b_c))

Each factor is >= 1 - f_l > 0 and has conditional mean <= 1, so each product is a nonnegative
supermartingale starting at 1, so is their average, and by Ville's inequality
P(sup_t E_t >= 1/alpha) <= alpha: flagging at the first token where E_t >= 1/alpha keeps the
false-positive rate at most alpha however long the audit runs and whenever it stops
(Waudby-Smith & Ramdas 2024, "Estimating means of bounded random variables by betting", JRSS-B
86(1); Ramdas et al. 2023, Statist. Sci. 38(4)). Unlike `detect.sequential`'s claim-block
log-MGF allowance, the guarantee is per token: it needs only the conditional-mean bound, which the
unseeded audit's features have by construction (sampling/pit.py: honest PIT values are uniform
given the past, so every Legendre score has conditional mean 0; b_c adds what the calibration's
honest replays show, detect/unseeded.py). Tokens of one claim may be dependent in any other way.

A component whose column's mean exceeds b_c by delta grows like exp(t (lambda delta - lambda^2
var / 2)) at best; the mixture over fractions costs log(C L) nats against the best single bet.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import logsumexp

FRACTIONS = tuple(2.0 ** -k for k in range(1, 10))  # f_l: 1/2 .. 1/512 of the largest safe bet
CHUNK = 8192  # tokens per block of the running sums


def bets(lower_C: np.ndarray, allowance_C: np.ndarray, fractions=FRACTIONS) -> np.ndarray:
    """[L, C] lambda_lc = f_l / (b_c - lo_c)."""
    span = np.asarray(allowance_C, np.float64) - np.asarray(lower_C, np.float64)
    if not (span > 0).all():
        raise ValueError(f"every column's allowance must exceed its lower bound, got spans {span}")
    return np.asarray(fractions, np.float64)[:, None] / span[None, :]


def betting_log_e(x_NC: np.ndarray, lower_C: np.ndarray, allowance_C: np.ndarray, fractions=FRACTIONS) -> np.ndarray:
    """[N] log E_t after each token (module docstring). Evidence below its lower bound is an error
    (the bet would not be safe)."""
    x = np.asarray(x_NC, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    lo, b = np.asarray(lower_C, np.float64), np.asarray(allowance_C, np.float64)
    if (x < lo - 1e-12).any():
        raise ValueError("evidence below its column's lower bound: the bets are not safe")
    lam_LC = bets(lo, b, fractions)
    k = lam_LC.size
    total = np.zeros(k)
    out = []
    for s in range(0, len(x), CHUNK):
        step_NK = np.log1p((lam_LC[None] * (x[s:s + CHUNK, None, :] - b)).reshape(-1, k))
        cum_NK = total + np.cumsum(step_NK, axis=0)
        total = cum_NK[-1]
        out.append(logsumexp(cum_NK, axis=1) - math.log(k))
    return np.concatenate(out) if out else np.zeros(0)
