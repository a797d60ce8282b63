"""Where a provider's scores sit, beside the verdict: its summary point and the nearest reference band.

Every audit (audit-api, the chat audits, audit-log, the wild-vendor benchmark) reports, next to
its calibrated verdict, three means over the provider's tokens, each with a 95% bootstrap interval
over claims (claims are the independent units: a claim's tokens are not):

    margin         mean of min(margin, clip): clip = `margin_clip(detector)` (a greedy detector's
                   near-tie cap, another detector's clip), so one wild token cannot move the mean;
    cross_entropy  mean over finite values (a claimed token the reference's filters exclude scores
                   +inf; `n_filtered_out` counts them);
    mismatch       the share of tokens that are not the reference's.

and the reference band nearest to it: each band is the same summary of one known configuration
(bf16, fp8 KV cache, int4, ...) run locally on the provider's own prompts; the nearest is the
closest in (margin, cross_entropy), each axis scaled by the spread of the bands' means. A band
says what a provider resembles, never whether it is honest: that is the verdict's job.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from verinfer.scores import CLAIM_ID, CROSS_ENTROPY, EXACT_MATCH, MARGIN, divergence

SUMMARY_AXES = (MARGIN, CROSS_ENTROPY)  # the axes of `nearest_band`


UNSEEDED_MARGIN_CLIP = 10.0  # logits: where an unseeded audit's summary clips the noise-free margin


def margin_clip(detector) -> float:
    """Where a summary clips margins: the greedy detector's near-tie cap, another detector's clip;
    an unseeded detector's (no margin of its own: its rows' margin is the noise-free one, the gap to
    the reference's argmax) UNSEEDED_MARGIN_CLIP."""
    if getattr(detector, "UNSEEDED_ROWS", False):
        return UNSEEDED_MARGIN_CLIP
    return getattr(detector, "tie_clip_", None) or detector.clip_


def summarize(table: pa.Table, clip: float, n_boot: int = 1000, seed: int = 0) -> dict:
    """{n_tokens, n_claims, n_filtered_out, margin, cross_entropy, mismatch}: each score's mean and
    its 95% bootstrap interval over claims (`n_boot` resamples of the claims, `seed`)."""
    ids = np.asarray(table[CLAIM_ID].to_pylist())
    xent = divergence(table, CROSS_ENTROPY)
    finite = np.isfinite(xent)
    cols = {MARGIN: (np.minimum(divergence(table, MARGIN), clip), None),
            CROSS_ENTROPY: (np.where(finite, xent, 0.0), finite.astype(np.float64)),
            "mismatch": (divergence(table, EXACT_MATCH), None)}
    _, inv = np.unique(ids, return_inverse=True)
    k = int(inv.max()) + 1
    picks = np.random.default_rng(seed).integers(0, k, (n_boot, k))
    out = {"n_tokens": int(len(ids)), "n_claims": k, "n_filtered_out": int((~finite).sum())}
    for name, (v, w) in cols.items():
        sums, counts = np.bincount(inv, v, k), np.bincount(inv, w, k)
        boots = sums[picks].sum(axis=1) / np.maximum(counts[picks].sum(axis=1), 1)
        out[name] = {"mean": float(sums.sum() / max(counts.sum(), 1)),
                     "ci95": [float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))]}
    return out


def interval(point: dict, axis: str) -> str:
    """'mean [lo, hi]' of one axis of a summary, for the reports."""
    a = point[axis]
    return f"{a['mean']:.4g} [{a['ci95'][0]:.3g}, {a['ci95'][1]:.3g}]"


def nearest_band(point: dict, bands: dict) -> str | None:
    """The band closest to a summary `point` in (mean clipped margin, mean cross-entropy), each axis
    scaled by the spread of the bands' means (None without bands)."""
    if not bands:
        return None
    scale = {a: max(np.ptp([b[a]["mean"] for b in bands.values()]), 1e-9) for a in SUMMARY_AXES}
    return min(bands, key=lambda b: sum(((bands[b][a]["mean"] - point[a]["mean"]) / scale[a]) ** 2
                                        for a in SUMMARY_AXES))
