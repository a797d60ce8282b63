"""Batch-level detection metrics for per-token divergence scores (DiFR section 5.2, appendix E).

Protocol of `auc_vs_tokens` (the paper's "Verification Methodology"):

1. split each set's tokens 50/50 at the token level into train and test;
2. winsorize: clip at the q-quantile of the finite honest TRAIN values; +inf becomes that clip;
3. draw random batches of b tokens from each TEST split (without replacement within a batch)
   and take the batch mean;
4. the 1-D classifier on a batch mean is monotone in it, so the batch mean is the score:
   AUC@1%FPR = McClish-standardized partial AUC of honest-test vs misconfigured-test batch
   means, 0.5 if the misconfiguration is not more divergent on average (not penalized).

Tokens-to-detect = the smallest batch size whose AUC@1%FPR reaches 0.99.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from sklearn.metrics import roc_auc_score

from verinfer.detect.clipping import clip_at_quantile, tail_pool, winsorize
from verinfer.scores import CLAIM_ID


def auc_at_fpr(neg_scores, pos_scores, max_fpr: float = 0.01) -> float:
    """McClish-standardized partial ROC AUC over FPR in [0, max_fpr] of positives (misconfigured,
    label 1) vs negatives (honest, label 0), higher score = more divergent; via
    `sklearn.metrics.roc_auc_score(max_fpr=...)`. 0.5 = chance, 1 = perfect separation.

    Returns 0.5 when the positives are not more divergent on average than the negatives (mean
    pos <= mean neg): DiFR 5.2 does not penalize a configuration that looks *more* consistent
    with the reference than the honest pool."""
    neg = np.asarray(neg_scores, dtype=np.float64).ravel()
    pos = np.asarray(pos_scores, dtype=np.float64).ravel()
    if neg.size == 0 or pos.size == 0:
        raise ValueError(f"need negative and positive scores, got {neg.size} and {pos.size}")
    if np.isnan(neg).any() or np.isnan(pos).any():
        raise ValueError("scores contain NaN")
    if not pos.mean() > neg.mean():
        return 0.5
    y = np.r_[np.zeros(neg.size), np.ones(pos.size)]
    s = np.r_[neg, pos]
    return float(roc_auc_score(y, s, max_fpr=max_fpr))


def auc_at_fpr_bound(q: float, max_fpr: float = 0.01, q_honest: float | None = None) -> float:
    """The largest `auc_at_fpr` any detector can reach when, with probability q, a misconfigured
    batch carries no evidence: its observation is distributed as an honest batch's on the same
    event, which has probability q_honest (default q) for honest batches (e.g. no token of the
    batch is one where the two providers' samplers would choose differently).

    At false-positive rate x the detector flags at most a fraction min(1, x / q_honest) of the
    honest batches on that event, so its true-positive rate is at most (1 - q) + q min(1, x / q_honest)
    (= 1 - q + min(q, x) when q_honest = q); the partial area over [0, max_fpr] is standardized as
    McClish (as `auc_at_fpr`)."""
    qh = q if q_honest is None else float(q_honest)
    if not (0.0 <= q <= 1.0 and 0.0 <= qh <= 1.0):
        raise ValueError(f"q and q_honest must be in [0, 1], got {q}, {qh}")
    a = float(max_fpr)
    if qh <= 0.0:
        tail = q * a
    elif qh >= a:
        tail = q * a * a / (2 * qh)
    else:
        tail = q * (qh / 2 + (a - qh))
    pauc = a * (1.0 - q) + tail
    lo, hi = a * a / 2, a
    return 0.5 * (1.0 + (pauc - lo) / (hi - lo))


def batch_means(values, batch_size: int, n_batches: int, rng: np.random.Generator) -> np.ndarray:
    """Means of `n_batches` random batches of `batch_size` values. While a batch is at most a tenth
    of the values, its tokens are drawn without replacement (different batches may share tokens),
    as in the DiFR paper; larger batches are drawn with replacement (bootstrap), because without
    replacement the spread of the means would shrink by the finite-population factor (1 - b/n)
    and overstate separability (at b = n every batch would be the same set).
    Empty if batch_size > len(values)."""
    v = np.asarray(values, dtype=np.float64)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if batch_size > v.size or n_batches < 1:
        return np.empty(0)
    if batch_size == 1:
        return v[rng.integers(0, v.size, n_batches)]
    out = np.empty(n_batches)
    if batch_size * 10 <= v.size:
        for i in range(n_batches):
            out[i] = v[rng.choice(v.size, batch_size, replace=False, shuffle=False)].mean()
        return out
    per = max(1, (1 << 22) // batch_size)  # bounded memory: ~4M indices at a time
    for i in range(0, n_batches, per):
        k = min(per, n_batches - i)
        out[i : i + k] = v[rng.integers(0, v.size, (k, batch_size))].mean(axis=1)
    return out


def split_tokens(n: int, rng: np.random.Generator, frac: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """Token-level random train/test split of range(n): (train indices, test indices), each sorted,
    round(frac * n) train tokens."""
    perm = rng.permutation(n)
    k = int(round(frac * n))
    return np.sort(perm[:k]), np.sort(perm[k:])


def auc_vs_tokens(honest, misconf, batch_sizes: Iterable[int] = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000),
                  clip_q: float = 0.999, n_batches: int = 1000, rng: np.random.Generator | None = None, *,
                  tail_q: float | None = None, max_fpr: float = 0.01) -> dict[int, float | None]:
    """AUC@`max_fpr` of honest vs misconfigured batch means for each batch size (protocol in the
    module docstring). `honest` / `misconf` are per-token divergence scores (higher = more
    divergent, +inf allowed). A batch size larger than either test split maps to None.

    tail_q: if given, use the tail pooling of appendix E instead of the plain clipped mean:
    values below the tail_q-quantile of the honest train split are set to 0 (clip_q > tail_q)."""
    rng = rng if rng is not None else np.random.default_rng(0)
    h = np.asarray(honest, dtype=np.float64)
    m = np.asarray(misconf, dtype=np.float64)
    h_tr, h_te = split_tokens(h.size, rng)
    _, m_te = split_tokens(m.size, rng)  # the misconfigured train half is not needed: no fitted parameters
    clip = clip_at_quantile(h[h_tr], clip_q)
    if tail_q is None:
        h_test, m_test = winsorize(h[h_te], clip), winsorize(m[m_te], clip)
    else:
        lo = clip_at_quantile(h[h_tr], tail_q)
        h_test, m_test = tail_pool(h[h_te], clip, lo), tail_pool(m[m_te], clip, lo)
    out: dict[int, float | None] = {}
    for b in batch_sizes:
        b = int(b)
        if b > min(h_test.size, m_test.size):
            out[b] = None
            continue
        out[b] = auc_at_fpr(batch_means(h_test, b, n_batches, rng), batch_means(m_test, b, n_batches, rng), max_fpr)
    return out


def tokens_to_detect(auc_by_batch: Mapping, target: float = 0.99) -> int | None:
    """Smallest batch size (tokens) whose AUC reaches `target`; None if none does. Keys may be
    strings (curves read back from JSON); None values (batch size not evaluated) are skipped."""
    hits = [int(b) for b, auc in auc_by_batch.items() if auc is not None and auc >= target]
    return min(hits) if hits else None


def fixed_tokens_to_flag(det, table, claim_counts: Iterable[int]) -> tuple[int | None, int | None]:
    """(tokens, claims) of the first prefix of whole claims, in stream order, at which a fixed-size
    test flags (det.verdict of the first k claims, k in claim_counts ascending); (None, None) if
    none does. A measure of a fixed-size test's power at each size, not a stopping rule: looking
    at every size is not anytime-valid (`detect.sequential` is)."""
    ids = np.asarray(table[CLAIM_ID].to_pylist() if hasattr(table[CLAIM_ID], "to_pylist") else table[CLAIM_ID])
    ends = np.flatnonzero(np.r_[ids[1:] != ids[:-1], True]) + 1      # row index after each claim
    for k in sorted(set(int(c) for c in claim_counts)):
        if k > ends.size:
            break
        n = int(ends[k - 1])
        if det.verdict(table.slice(0, n) if hasattr(table, "slice") else {c: v[:n] for c, v in table.items()}).flagged:
            return n, k
    return None, None
