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
threshold / p-value / verdict: a `ClippedMeanDetector` null (`null_`) over the honest train weights
         (resampled honest batch means, normal beyond its resampling budget; stratified by
         `groups` when fit is given them).

Inputs: a pyarrow score table (or dict of arrays) with columns margin, exact_match, cross_entropy
(and logit_gap with use_direction, written by the detection lab's features table
(benchmarks/difr_variants.py), not by `verinfer score`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verinfer.scores import CROSS_ENTROPY, EXACT_MATCH, LIKELIHOOD, LOGIT_GAP, MARGIN, score_column
from verinfer.detect.base import Detector, decode_f8, encode_f8
from verinfer.detect.clipped_mean import ClippedMeanDetector
from verinfer.detect.verdict import Verdict
from verinfer.errors import VerinferError

N_MARGIN_BANDS, N_DIRECTIONS, N_CE_BANDS = 7, 2, 4
N_BINS = 1 + N_MARGIN_BANDS * N_DIRECTIONS * N_CE_BANDS


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


def _freq(bins: np.ndarray, alpha: float) -> np.ndarray:
    c = np.bincount(bins, minlength=N_BINS).astype(np.float64) + alpha
    return c / c.sum()


@dataclass(eq=True)
class LikelihoodRatioDetector(Detector):
    """target_fpr: false-positive rate of `predict`; alpha: additive smoothing per bin (counts);
    generic_mismatch: mismatch mass of the honest-only alternative; use_direction: split mismatch
    bins by the logit direction (column logit_gap); n_null_batches / random_state: the resampled
    honest null (as ClippedMeanDetector)."""

    NAME = "likelihood-ratio"
    FORMAT = "verinfer.LikelihoodRatioDetector"
    FORMAT_VERSION = 2
    REFIT = "refit the detector (`verinfer calibrate --detector likelihood-ratio`, or benchmarks/detection_lab.py)"
    COLUMNS_FIX = ("rescore the claims with `verinfer score`; logit_gap comes from the variant features "
                   "(benchmarks/difr_variants.py), or use a detector with use_direction=False")

    alpha: float = 0.5
    generic_mismatch: float = 0.05
    use_direction: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if not 0.0 < self.generic_mismatch < 1.0:
            raise ValueError(f"generic_mismatch must be in (0, 1), got {self.generic_mismatch}")

    def columns(self, table=None) -> tuple[str, ...]:
        return (MARGIN, EXACT_MATCH, CROSS_ENTROPY) + ((LOGIT_GAP,) if self.use_direction else ())

    # -- fitting ---------------------------------------------------------------------------------
    def _fit(self, table, groups=None, alternatives=()) -> None:
        """Learn margin_edges_, ce_edges_, p0_, p1_, weights_ and the honest null null_ from honest
        (train) tokens; `alternatives`: score tables of misconfigured train tokens (optional);
        `groups`: one label per honest token for a stratified null (None: one pooled null)."""
        m, em, ce, gap = self._arrays(table)
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
        self._set_bins(margin_edges, ce_edges, p0, p1)
        self.n_alternatives_ = len(alts)
        w = self.token_scores(table)
        self.null_ = self._null_detector()
        if groups is None:
            s = _subsample(w, self.random_state)
            self.null_.set_null(s, [int(s.size)], n_train=int(w.size), clip=float(np.inf), mean=float(w.mean()),
                                std=float(w.std(ddof=1)) if w.size > 1 else 0.0)
        else:
            self.null_.fit_null(w, groups, clip=float(np.inf))

    def _null_detector(self) -> ClippedMeanDetector:
        return ClippedMeanDetector(score_name=LIKELIHOOD, clip_quantile=1.0, target_fpr=self.target_fpr,
                                   n_null_batches=self.n_null_batches, random_state=self.random_state)

    def _set_bins(self, margin_edges, ce_edges, p0, p1) -> None:
        self.margin_edges_, self.ce_edges_ = tuple(margin_edges), tuple(ce_edges)
        self.p0_, self.p1_ = np.asarray(p0), np.asarray(p1)
        self.weights_ = np.log(self.p1_ / self.p0_)

    def _arrays(self, table) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        self.require_columns(table)
        m = score_column(table, MARGIN)
        em = score_column(table, EXACT_MATCH) > 0.5
        ce = score_column(table, CROSS_ENTROPY)
        if np.isnan(m).any() or np.isnan(ce).any():
            raise ValueError("margin / cross_entropy contain NaN")
        gap = score_column(table, LOGIT_GAP) if self.use_direction else np.zeros_like(m)
        return m, em, ce, gap

    def _bins(self, table, margin_edges=None, ce_edges=None) -> np.ndarray:
        m, em, ce, gap = self._arrays(table)
        return token_bins(m, em, ce, margin_edges or self.margin_edges_, ce_edges or self.ce_edges_, gap)

    def _check_fitted(self) -> None:
        if not hasattr(self, "weights_") or not hasattr(self, "null_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) or load a detector file")

    # -- scoring ---------------------------------------------------------------------------------
    def token_scores(self, table) -> np.ndarray:
        """Per-token log-likelihood ratio log(p1/p0) of each token's bin."""
        if not hasattr(self, "weights_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) first")
        return self.weights_[self._bins(table)]

    def statistic_of(self, evidence: np.ndarray) -> float:
        return float(evidence.mean())

    def pooled(self, table) -> float:
        """The mean per-token log-likelihood ratio (= score)."""
        return self.score(table)

    def threshold(self, n_tokens: int) -> float:
        self._check_fitted()
        return self.null_.threshold(n_tokens)

    def verdict(self, table, max_tokens: int | None = None) -> Verdict:
        """ClippedMeanDetector.verdict_from_pooled on the pooled log-likelihood ratio."""
        self._check_fitted()
        w = self.evidence(table, max_tokens)
        return self.null_.verdict_from_pooled(self.statistic_of(w), w.size).with_(
            score="likelihood-ratio(margin, exact_match, cross_entropy)")

    def summary(self) -> str:
        return f"likelihood ratio over {N_BINS} bins, {self.n_alternatives_} alternatives, FPR {self.target_fpr}"

    # -- persistence -----------------------------------------------------------------------------
    def _fitted_json(self) -> dict:
        self._check_fitted()
        return {"margin_edges_": list(self.margin_edges_), "ce_edges_": list(self.ce_edges_),
                "p0_": self.p0_.tolist(), "p1_": self.p1_.tolist(), "n_alternatives_": self.n_alternatives_,
                "null_mean_": self.null_.null_mean_, "null_std_": self.null_.null_std_,
                "n_train_": self.null_.n_train_, "null_sample_f8_base64": encode_f8(self.null_.null_sample_),
                **({"null_group_sizes": self.null_.null_group_sizes_} if len(self.null_.null_group_sizes_) > 1 else {})}

    def _load_fitted(self, f: dict) -> None:
        self._set_bins(f["margin_edges_"], f["ce_edges_"], f["p0_"], f["p1_"])
        self.n_alternatives_ = int(f["n_alternatives_"])
        s = decode_f8(f["null_sample_f8_base64"])
        sizes = [int(x) for x in f.get("null_group_sizes", [s.size])]
        if sum(sizes) != s.size or min(sizes) < 1:
            raise ValueError(f"null group sizes {sizes} do not add up to the {s.size} null values")
        self.null_ = self._null_detector()
        self.null_.set_null(s, sizes, n_train=int(f["n_train_"]), clip=float(np.inf),
                            mean=float(f["null_mean_"]), std=float(f["null_std_"]))


def _subsample(w: np.ndarray, seed: int, cap: int = 200_000) -> np.ndarray:
    if w.size <= cap:
        return np.sort(w)
    return np.sort(np.random.default_rng(seed).choice(w, cap, replace=False))
