"""Per-token Token-DiFR scores as plain arrays: the likelihood transform, a common
"divergence" orientation (higher = more suspicious), and a simple sigma estimate.

Score columns of a per-token score table (one row per claimed output token):

    margin         post-Gumbel logit margin delta >= 0 (DiFR eq. 1); +inf if the claimed token
                   was filtered out by top-k / top-p at verification time
    likelihood     log Phi(-delta / (sqrt(2) sigma)) <= 0 (DiFR appendix A); -inf possible
    exact_match    the replay sampled the claimed token (bool)
    cross_entropy  -log p_y under the verifier's filtered sampling distribution; +inf if filtered

DiFR section 5.2 multiplies features by -1 where needed so that higher = more divergent;
`divergence` does that: margin and cross_entropy as is, 1 - exact_match, -likelihood.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
from scipy.special import log_ndtr
from scipy.stats import norm

SCORES = ("margin", "likelihood", "exact_match", "cross_entropy")  # Token-DiFR family (one per token)
ACTIVATION_SCORES = ("fp_l2",)  # Activation-DiFR: one per logged token (NaN elsewhere)
ALL_SCORES = SCORES + ACTIVATION_SCORES


def likelihood_score(margin, sigma: float) -> np.ndarray:
    """log Phi(-margin / (sqrt(2) sigma)): the log-probability that Gaussian logit noise of std
    sigma on each of two logits closes a gap of `margin` (DiFR appendix A). 0 for margin 0,
    -inf for margin +inf; `log_ndtr` keeps large margins finite (about -z^2/2) instead of log(0)."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    m = np.asarray(margin, dtype=np.float64)
    return log_ndtr(-m / (np.sqrt(2.0) * sigma))


def score_column(table_or_dict, name: str) -> np.ndarray:
    if isinstance(table_or_dict, (pa.Table, pa.RecordBatch)):
        if name not in table_or_dict.column_names:
            raise KeyError(f"score column {name!r} not in table (columns: {', '.join(table_or_dict.column_names)})")
        col = table_or_dict[name]
        if col.null_count:
            raise ValueError(f"score column {name!r} has {col.null_count} null values")
        return np.asarray(col.to_numpy(), dtype=np.float64) if isinstance(col, pa.ChunkedArray) else \
            np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
    if isinstance(table_or_dict, Mapping):
        if name not in table_or_dict:
            raise KeyError(f"score column {name!r} not in columns {', '.join(map(str, table_or_dict))}")
        return np.asarray(table_or_dict[name], dtype=np.float64)
    raise TypeError(f"expected a pyarrow.Table or a dict of arrays, got {type(table_or_dict).__name__}")


def divergence(table_or_dict, score_name: str) -> np.ndarray:
    """The score column `score_name` as float64, oriented so that higher = more divergent from the
    honest reference: margin, cross_entropy as is; 1 - exact_match; -likelihood (so >= 0, +inf
    where the likelihood is -inf)."""
    if score_name not in ALL_SCORES:
        raise ValueError(f"unknown score {score_name!r}; choose one of {', '.join(ALL_SCORES)}")
    if score_name == "fp_l2":  # Activation-DiFR: only logged tokens carry a distance (null/NaN elsewhere)
        if isinstance(table_or_dict, (pa.Table, pa.RecordBatch)):
            if "fp_l2" not in table_or_dict.column_names:
                raise KeyError("score column 'fp_l2' not in table: the claims carried no fingerprints")
            v = table_or_dict["fp_l2"].drop_null().to_numpy().astype(np.float64)
        else:
            v = np.asarray(table_or_dict["fp_l2"], dtype=np.float64)
        return v[~np.isnan(v)]
    v = score_column(table_or_dict, score_name)
    if score_name == "exact_match":
        return 1.0 - v
    if score_name == "likelihood":
        return -v
    return v


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
