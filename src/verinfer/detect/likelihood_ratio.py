"""Binned likelihood-ratio detector combining Token-DiFR margin, exact match and cross-entropy.

Under a shared seed an honest provider reproduces almost every token (exact match); the evidence
is in the mismatches: how far the claimed token was from winning (margin) and how unlikely it is
under the verifier (cross-entropy). Each token falls in one bin:

    bin 0                    exact match (margin 0)
    bins 1 + 8 * i + 4 * k + j   mismatch with margin in band i, direction k and cross-entropy band j
    margin bands i (7)       [0, q50) [q50, q90) [q90, q99) [q99, m] (m, 4m] (4m, inf) filtered-out,
                             q.. = quantiles of the honest train nonzero finite margins, m = their max
    cross-entropy bands j (4) [0, c50) [c50, c90) [c90, c_max] (c_max, inf],  quantiles of the honest
                             train mismatch cross-entropies
    direction k (2)          1 if the claimed token's raw logit is below the replayed token's
                             (logit_gap > 0), else 0. A too-high temperature only ever flips towards
                             lower-logit tokens (too low: higher), honest noise flips both ways.
                             Column logit_gap; without it (use_direction=False) k = 0.

fit:     p0_ = honest bin frequencies (additive smoothing alpha per bin);
         p1_ = equal-weight mixture of the alternatives' bin frequencies (misconfigured train data,
         smoothed), or, with no alternatives, a generic one: every mismatch bin equally likely with
         total mismatch mass `generic_mismatch` (honest-only fit);
         weights_ = log(p1_ / p0_): the per-token log-likelihood ratio
pooled:  mean per-token weight of a batch (the log-likelihood ratio of the batch / n: the
         Neyman-Pearson statistic for i.i.d. tokens against the mixture alternative)
threshold / p-value / verdict: a `ClippedMeanDetector` null over the honest train weights
         (resampled honest batch means, normal beyond its resampling budget).

Inputs: a pyarrow score table (or dict of arrays) with columns margin, exact_match, cross_entropy.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from verinfer.io import atomic_write_text
from verinfer.detect.detectors import ClippedMeanDetector, ColumnStatistics, FittedDetector, read_detector_json
from verinfer.audit.scores import _column
from verinfer.errors import VerinferError

FORMAT = "verinfer.LikelihoodRatioDetector"
FORMAT_VERSION = 2
N_MARGIN_BANDS, N_DIRECTIONS, N_CE_BANDS = 7, 2, 4
N_BINS = 1 + N_MARGIN_BANDS * N_DIRECTIONS * N_CE_BANDS


def _arrays(table, use_direction: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    m = _column(table, "margin")
    em = _column(table, "exact_match") > 0.5
    ce = _column(table, "cross_entropy")
    if np.isnan(m).any() or np.isnan(ce).any():
        raise ValueError("margin / cross_entropy contain NaN")
    gap = _column(table, "logit_gap") if use_direction else np.zeros_like(m)
    return m, em, ce, gap


def token_bins(margin, exact_match, cross_entropy, margin_edges, ce_edges, logit_gap=None) -> np.ndarray:
    """Bin index of every token (see the module docstring); vectorized."""
    m = np.asarray(margin, dtype=np.float64)
    em = np.asarray(exact_match, dtype=bool)
    ce = np.asarray(cross_entropy, dtype=np.float64)
    k = (np.asarray(logit_gap, dtype=np.float64) > 0) if logit_gap is not None else np.zeros(m.shape, bool)
    q50, q90, q99, mx = margin_edges
    band = np.searchsorted(np.array([q50, q90, q99]), m, side="right")   # 0..3 below / at m
    band = np.where(m > mx, 4, band)
    band = np.where(m > 4 * mx, 5, band)
    band = np.where(np.isinf(m), 6, band)
    c50, c90, cmx = ce_edges
    cband = np.searchsorted(np.array([c50, c90]), ce, side="right")
    cband = np.where(ce > cmx, 3, cband)
    return np.where(em, 0, 1 + (band * N_DIRECTIONS + k) * N_CE_BANDS + cband).astype(np.int64)


def token_bins_loop(margin, exact_match, cross_entropy, margin_edges, ce_edges, logit_gap=None) -> np.ndarray:
    """Reference for `token_bins`, one token at a time."""
    q50, q90, q99, mx = margin_edges
    c50, c90, cmx = ce_edges
    out = []
    gaps = logit_gap if logit_gap is not None else [0.0] * len(margin)
    for m, em, ce, g in zip(margin, exact_match, cross_entropy, gaps):
        if em:
            out.append(0)
            continue
        if np.isinf(m):
            i = 6
        elif m > 4 * mx:
            i = 5
        elif m > mx:
            i = 4
        else:
            i = sum(m >= e for e in (q50, q90, q99))
        j = 3 if ce > cmx else sum(ce >= e for e in (c50, c90))
        out.append(1 + (i * N_DIRECTIONS + int(g > 0)) * N_CE_BANDS + j)
    return np.array(out, dtype=np.int64)


def _freq(bins: np.ndarray, alpha: float) -> np.ndarray:
    c = np.bincount(bins, minlength=N_BINS).astype(np.float64) + alpha
    return c / c.sum()


@dataclass(frozen=True)
class LikelihoodRatioDetector(FittedDetector):
    """target_fpr: false-positive rate of `predict`; alpha: additive smoothing per bin (counts);
    generic_mismatch: mismatch mass of the honest-only alternative; n_null_batches / random_state:
    the resampled honest null (as ClippedMeanDetector)."""

    REFIT = "refit the detector (benchmarks/detection_lab.py writes one)"

    target_fpr: float = 0.01
    alpha: float = 0.5
    generic_mismatch: float = 0.05
    use_direction: bool = True
    n_null_batches: int = 2000
    random_state: int = 0
    _null: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._check_null_parameters()
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if not 0.0 < self.generic_mismatch < 1.0:
            raise ValueError(f"generic_mismatch must be in (0, 1), got {self.generic_mismatch}")

    # -- fitting ---------------------------------------------------------------------------------
    def fit(self, honest, alternatives=()) -> "LikelihoodRatioDetector":
        """Learn margin_edges_, ce_edges_, p0_, p1_, weights_ and the honest null from honest (train)
        tokens; `alternatives`: score tables of misconfigured train tokens (optional)."""
        m, em, ce, gap = _arrays(honest, self.use_direction)
        if m.size == 0:
            raise ValueError("honest is empty: no scored tokens")
        nz = m[~em & np.isfinite(m) & (m > 0)]
        if nz.size < 10:
            raise ValueError(f"only {nz.size} honest mismatches with a finite margin; need >= 10 to place "
                             "the margin bands (score more honest tokens)")
        margin_edges = tuple(float(x) for x in (*np.quantile(nz, [0.5, 0.9, 0.99]), nz.max()))
        cem = ce[~em & np.isfinite(ce)]
        ce_edges = tuple(float(x) for x in (*np.quantile(cem, [0.5, 0.9]), cem.max()))
        p0 = _freq(token_bins(m, em, ce, margin_edges, ce_edges, gap), self.alpha)
        alts = [_freq(self._bins(a, margin_edges, ce_edges), self.alpha) for a in alternatives]
        if alts:
            p1 = np.mean(alts, axis=0)
        else:
            p1 = np.full(N_BINS, self.generic_mismatch / (N_BINS - 1))
            p1[0] = 1.0 - self.generic_mismatch
        self._set_bins(margin_edges, ce_edges, p0, p1, n_alternatives_=len(alts))
        w = self.token_scores(honest)
        null = ClippedMeanDetector(score="margin", clip_quantile=1.0, target_fpr=self.target_fpr,
                                   n_null_batches=self.n_null_batches, random_state=self.random_state)
        null._set(clip_=float(np.inf), null_sample_=_subsample(w, self.random_state), null_mean_=float(w.mean()),
                  null_std_=float(w.std(ddof=1)) if w.size > 1 else 0.0, n_train_=int(w.size))
        self._null["det"] = null
        return self

    def _set_bins(self, margin_edges, ce_edges, p0, p1, **extra) -> None:
        self._set(margin_edges_=tuple(margin_edges), ce_edges_=tuple(ce_edges), p0_=np.asarray(p0),
                  p1_=np.asarray(p1), weights_=np.log(np.asarray(p1) / np.asarray(p0)), **extra)

    def _bins(self, table, margin_edges=None, ce_edges=None) -> np.ndarray:
        m, em, ce, gap = _arrays(table, self.use_direction)
        return token_bins(m, em, ce, margin_edges or self.margin_edges_, ce_edges or self.ce_edges_, gap)

    def _check_fitted(self) -> None:
        if not hasattr(self, "weights_") or "det" not in self._null:
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) or load a detector file")

    # -- scoring ---------------------------------------------------------------------------------
    def token_scores(self, table) -> np.ndarray:
        """Per-token log-likelihood ratio log(p1/p0) of each token's bin."""
        if not hasattr(self, "weights_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) first")
        return self.weights_[self._bins(table)]

    def pooled(self, table) -> float:
        w = self.token_scores(table)
        if w.size == 0:
            raise ValueError("no scored tokens")
        return float(w.mean())

    def threshold(self, n_tokens: int) -> float:
        self._check_fitted()
        return self._null["det"].threshold(n_tokens)

    def predict(self, table) -> bool:
        w = self.token_scores(table)
        return bool(w.mean() > self.threshold(w.size))

    def score(self, table) -> float:
        """sklearn-style score: the pooled log-likelihood ratio per token (higher = more divergent)."""
        return self.pooled(table)

    def verdict(self, table) -> dict:
        """ClippedMeanDetector.verdict_from_pooled on the pooled log-likelihood ratio."""
        self._check_fitted()
        w = self.token_scores(table)
        if w.size == 0:
            raise ValueError("no scored tokens")
        d = self._null["det"].verdict_from_pooled(float(w.mean()), w.size)
        d["score"] = "likelihood-ratio(margin, exact_match, cross_entropy)"
        return d

    # -- persistence -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        self._check_fitted()
        s = np.ascontiguousarray(self._null["det"].null_sample_, dtype="<f8")
        return {"format": FORMAT, "version": FORMAT_VERSION,
                "config": {f.name: getattr(self, f.name) for f in fields(self) if f.init},
                "fitted": {"margin_edges_": list(self.margin_edges_), "ce_edges_": list(self.ce_edges_),
                           "p0_": self.p0_.tolist(), "p1_": self.p1_.tolist(),
                           "n_alternatives_": self.n_alternatives_,
                           "null_mean_": self._null["det"].null_mean_, "null_std_": self._null["det"].null_std_,
                           "n_train_": self._null["det"].n_train_,
                           "null_sample_f8_base64": base64.b64encode(s.tobytes()).decode("ascii")}}

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "<dict>") -> "LikelihoodRatioDetector":
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != FORMAT_VERSION:
            raise VerinferError(f"not a {FORMAT} version {FORMAT_VERSION} file", where=where,
                                fix="refit the detector (benchmarks/detection_lab.py writes one)")
        try:
            det = cls(**d["config"])
            f = d["fitted"]
            det._set_bins(f["margin_edges_"], f["ce_edges_"], f["p0_"], f["p1_"], n_alternatives_=int(f["n_alternatives_"]))
            s = np.frombuffer(base64.b64decode(f["null_sample_f8_base64"], validate=True), dtype="<f8").astype(np.float64)
            null = ClippedMeanDetector(score="margin", clip_quantile=1.0, target_fpr=det.target_fpr,
                                       n_null_batches=det.n_null_batches, random_state=det.random_state)
            null._set(clip_=float(np.inf), null_sample_=s, null_mean_=float(f["null_mean_"]),
                      null_std_=float(f["null_std_"]), n_train_=int(f["n_train_"]))
            det._null["det"] = null
        except (KeyError, TypeError, ValueError) as e:
            raise VerinferError(f"malformed detector ({type(e).__name__}: {e})", where=where,
                                fix="refit the detector") from e
        return det


def _subsample(w: np.ndarray, seed: int, cap: int = 200_000) -> np.ndarray:
    if w.size <= cap:
        return np.sort(w)
    return np.sort(np.random.default_rng(seed).choice(w, cap, replace=False))


@dataclass(frozen=True)
class ReplayLibraryDetector(ColumnStatistics):
    """Token-DiFR against a library of alternative configurations: a max-of-z (GLRT-style) test.

    Besides the honest verifier's margin b = min(margin, clip_), the claims are replayed under each
    alternative A of the library (e.g. 4-bit weights; temperature 0.9 / 1.1 rescoring) and
    column A holds `variants.alternative_evidence(margin, [margin_A], clip_)` = 2b - min(margin_A, clip_)
    (high when A's replay reproduces tokens the honest replay does not). Column 0 is b alone, so
    misconfigurations outside the library are still tested by the plain clipped margin.
    Batch statistic: max over columns of the z-score sqrt(n) (column mean - mu_c) / sd_c, with
    mu_c, sd_c from honest train tokens; threshold and tail probability from n_null_batches honest
    train batches resampled with replacement (the max of correlated columns has no closed form).
    Fit on honest tokens only."""

    alternatives: tuple = ("margin_int4", "margin_t0.9", "margin_t1.1")
    clip_quantile: float = 0.999
    target_fpr: float = 0.01
    n_null_batches: int = 2000
    random_state: int = 0
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def fit(self, honest, groups=None) -> "ReplayLibraryDetector":
        """Learn clip_, mu_, sd_, the null sample(s) and, with `groups` (one label per honest token,
        e.g. its honest configuration), the between-configuration spread tau_ of the column means.
        With groups the threshold guards a NEW honest configuration (random-effects null):
        max over groups of that group's resampled (1 - fpr)-quantile, plus z_{1-fpr} sqrt(n) max_c
        (tau_c / sd_c): honest configurations differ in their mean, and a pooled null would flag
        the noisier ones more and more often as batches grow."""
        from verinfer.detect.metrics import clip_at_quantile

        m = _column(honest, "margin")
        object.__setattr__(self, "clip_", clip_at_quantile(m, self.clip_quantile))
        x = self.token_columns(honest)
        object.__setattr__(self, "mu_", x.mean(axis=0))
        object.__setattr__(self, "sd_", np.maximum(x.std(axis=0, ddof=1), 1e-12))
        labels = np.zeros(len(x), np.int64) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
        if labels.size != len(x):
            raise ValueError(f"groups has {labels.size} labels for {len(x)} tokens")
        rng = np.random.default_rng(self.random_state)
        n_groups = int(labels.max()) + 1
        cap = max(1, 200_000 // n_groups)
        samples = []
        for g in range(n_groups):
            xg = x[labels == g]
            samples.append(xg[np.sort(rng.choice(len(xg), cap, replace=False))] if len(xg) > cap else xg)
        means = np.array([xg.mean(axis=0) for xg in samples])
        tau = means.std(axis=0, ddof=1) if n_groups > 1 else np.zeros(x.shape[1])
        object.__setattr__(self, "null_samples_", samples)
        object.__setattr__(self, "null_sample_", np.concatenate(samples))
        object.__setattr__(self, "tau_", tau)
        self._cache.clear()
        return self

    def _check_fitted(self) -> None:
        if not hasattr(self, "null_sample_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) first")

    def token_columns(self, table) -> np.ndarray:
        """[N, 1 + len(alternatives)] per-token evidence columns (see the class docstring)."""
        from verinfer.audit.variants import alternative_evidence
        from verinfer.detect.metrics import winsorize

        if not hasattr(self, "clip_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) first")
        m = _column(table, "margin")
        cols = [winsorize(m, self.clip_)] + [alternative_evidence(m, [_column(table, a)], self.clip_)
                                             for a in self.alternatives]
        return np.stack(cols, axis=1)

    def statistic_of_means(self, means_BC: np.ndarray, n_tokens: int) -> np.ndarray:
        """max over columns of sqrt(n) (mean - mu_) / sd_, for rows of column means."""
        return (np.sqrt(n_tokens) * (np.asarray(means_BC) - self.mu_) / self.sd_).max(axis=-1)

    def null_statistics(self, n_tokens: int) -> np.ndarray:
        """Resampled honest batch statistics of the group whose (1 - fpr)-quantile is highest,
        shifted by the between-group allowance (0 without groups)."""
        self._check_fitted()
        n = int(n_tokens)
        if n not in self._cache:
            from scipy.stats import norm

            rng = np.random.default_rng([self.random_state, n])
            per = [self.batch_statistics(xg, n, self.n_null_batches, rng) for xg in self.null_samples_]
            worst = per[int(np.argmax([np.quantile(p, 1.0 - self.target_fpr) for p in per]))]
            allowance = float(norm.isf(self.target_fpr) * np.sqrt(n) * np.max(self.tau_ / self.sd_))
            self._cache[n] = worst + allowance
        return self._cache[n]

    def threshold(self, n_tokens: int) -> float:
        return float(np.quantile(self.null_statistics(n_tokens), 1.0 - self.target_fpr))

    def token_scores(self, table) -> np.ndarray:
        """The evidence columns (for batch statistics use `batch_statistics` / `statistic`)."""
        return self.token_columns(table)

    def predict(self, table) -> bool:
        x = self.token_columns(table)
        return bool(self.statistic_of_means(x.mean(axis=0), len(x)) > self.threshold(len(x)))

    def score(self, table) -> float:
        return self.statistic(table)

    def verdict(self, table) -> dict:
        """flagged, the statistic and threshold, the FPR the threshold was set at and its rate on
        the resampled honest null, the tail probability (p-value) under the honest null, and, when
        not flagged, the tokens a decision would need if the per-token excess persisted (z grows as
        sqrt(n): n* = n (threshold / statistic)^2; None when the statistic is <= 0)."""
        x = self.token_columns(table)
        n = len(x)
        if n == 0:
            raise ValueError("no scored tokens")
        stat = float(self.statistic_of_means(x.mean(axis=0), n))
        null = self.null_statistics(n)
        thr = float(np.quantile(null, 1.0 - self.target_fpr))
        k = int(np.count_nonzero(null >= stat))
        p = (k + 1) / (null.size + 1)
        flagged = stat > thr
        more = None
        if not flagged and stat > 0 and thr > 0:
            more = max(1, int(np.ceil(n * (thr / stat) ** 2)) - n)
        decision = ("flagged: inconsistent with honest inference" if flagged else
                    "not flagged: no excess over honest" if more is None else
                    f"not flagged: not enough evidence yet (~{more} more tokens if the excess persists)")
        return {"flagged": bool(flagged), "pooled": stat, "threshold": thr, "p_value": p, "tail_probability": p,
                "p_value_method": "resampled", "n_tokens": n, "target_fpr": self.target_fpr,
                "threshold_fpr": float(np.mean(null > thr)), "more_tokens_needed": more, "decision": decision,
                "score": "replay-library max-z(" + ", ".join(("margin", *self.alternatives)) + ")"}
