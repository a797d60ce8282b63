"""Per-token clipping of honest and audited scores before they are pooled (DiFR section 5.2,
appendix E), and the noise scale of the likelihood score (appendix A).

    winsorize(v, clip)               min(v, clip); +inf (claimed token filtered out) -> clip
    clip_at_quantile(honest, q)      the clip: q-quantile of the finite honest train values
    tail_pool(v, clip_hi, zero_below) clip at clip_hi, zero below zero_below (tail-focused pooling)
    fit_sigma(honest_margins)        sigma of `scores.likelihood_score` from honest margins
"""

from __future__ import annotations

import numpy as np
from scipy.stats import norm


def winsorize(values, clip: float) -> np.ndarray:
    """min(values, clip) as float64; +inf (claimed token filtered out) becomes `clip`."""
    return np.minimum(np.asarray(values, dtype=np.float64), float(clip))


def clip_at_quantile(honest_train, q: float) -> float:
    """The q-quantile of the finite honest train values (DiFR 5.2: infinite values are excluded
    when computing percentiles, then clipped to the threshold)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    v = np.asarray(honest_train, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        raise ValueError("no finite honest values to take a clipping quantile of")
    clip = float(np.quantile(v, q))
    lo = float(v.min())
    if clip <= lo:
        # Degenerate: (almost) every finite honest value sits at the minimum (e.g. a small honest
        # set whose finite margins are all 0), so clipping there would map every score to one
        # constant and the detector could see nothing. Clip at the q-quantile of the values above
        # the minimum instead, or one unit above it when there are none.
        above = v[v > lo]
        clip = float(np.quantile(above, q)) if above.size else lo + 1.0
    return clip


def tail_pool(values, clip_hi: float, zero_below: float) -> np.ndarray:
    """Tail-focused per-token transform of DiFR appendix E: clip at `clip_hi` (+inf -> clip_hi),
    then set values below `zero_below` to 0. The batch statistic is the mean of the result
    (e.g. `batch_means(tail_pool(v, ...), ...)`); the paper uses the honest 99.999th percentile
    for clip_hi and the 99.99th for zero_below, which concentrates weight on rare large deviations."""
    x = winsorize(values, clip_hi)
    x[x < zero_below] = 0.0
    return x


def fit_sigma(honest_margins, default: float = 0.1) -> float:
    """Noise scale sigma for `likelihood_score`, from honest Token-DiFR margins.

    Model (DiFR appendix A): each of the two competing logits carries independent N(0, sigma^2)
    noise, so their difference has std sqrt(2) sigma. An honest nonzero margin is a near tie that
    this noise flipped, so the nonzero finite honest margins are roughly half-normal with scale
    s = sqrt(2) sigma. We use the robust half-normal scale s = median / Phi^-1(3/4), hence
    sigma = median(nonzero finite margins) / (Phi^-1(3/4) sqrt(2)). Returns `default` when the
    honest runs have no nonzero finite margin (every token reproduced exactly)."""
    m = np.asarray(honest_margins, dtype=np.float64)
    m = m[np.isfinite(m) & (m > 0)]
    if m.size == 0:
        return float(default)
    return float(np.median(m) / (norm.ppf(0.75) * np.sqrt(2.0)))
