"""Binned likelihood-ratio detector combining Token-DiFR margin, exact match and cross-entropy.

Under a shared seed an honest provider reproduces almost every token (exact match); the evidence
is in the mismatches: how far the claimed token was from winning (margin) and how unlikely it is
under the verifier (cross-entropy). Each token falls in one bin:

    bin 0                    exact match (margin 0)
    bins 1 + 4 * i + j       mismatch with margin in band i and cross-entropy in band j
    margin bands i (7)       [0, q50) [q50, q90) [q90, q99) [q99, m] (m, 4m] (4m, inf) filtered-out,
                             q.. = quantiles of the honest train nonzero finite margins, m = their max
    cross-entropy bands j (4) [0, c50) [c50, c90) [c90, c_max] (c_max, inf],  quantiles of the honest
                             train mismatch cross-entropies

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

from verinfer.audit.claims import atomic_write_text
from verinfer.audit.detector import ClippedMeanDetector
from verinfer.audit.scores import _column
from verinfer.errors import VerinferError

FORMAT = "verinfer.LikelihoodRatioDetector"
FORMAT_VERSION = 1
N_MARGIN_BANDS, N_CE_BANDS = 7, 4
N_BINS = 1 + N_MARGIN_BANDS * N_CE_BANDS


def _arrays(table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m = _column(table, "margin")
    em = _column(table, "exact_match") > 0.5
    ce = _column(table, "cross_entropy")
    if np.isnan(m).any() or np.isnan(ce).any():
        raise ValueError("margin / cross_entropy contain NaN")
    return m, em, ce


def token_bins(margin, exact_match, cross_entropy, margin_edges, ce_edges) -> np.ndarray:
    """Bin index of every token (see the module docstring); vectorized."""
    m = np.asarray(margin, dtype=np.float64)
    em = np.asarray(exact_match, dtype=bool)
    ce = np.asarray(cross_entropy, dtype=np.float64)
    q50, q90, q99, mx = margin_edges
    band = np.searchsorted(np.array([q50, q90, q99]), m, side="right")   # 0..3 below / at m
    band = np.where(m > mx, 4, band)
    band = np.where(m > 4 * mx, 5, band)
    band = np.where(np.isinf(m), 6, band)
    c50, c90, cmx = ce_edges
    cband = np.searchsorted(np.array([c50, c90]), ce, side="right")
    cband = np.where(ce > cmx, 3, cband)
    return np.where(em, 0, 1 + band * N_CE_BANDS + cband).astype(np.int64)


def token_bins_loop(margin, exact_match, cross_entropy, margin_edges, ce_edges) -> np.ndarray:
    """Reference for `token_bins`, one token at a time."""
    q50, q90, q99, mx = margin_edges
    c50, c90, cmx = ce_edges
    out = []
    for m, em, ce in zip(margin, exact_match, cross_entropy):
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
        out.append(1 + i * N_CE_BANDS + j)
    return np.array(out, dtype=np.int64)


def _freq(bins: np.ndarray, alpha: float) -> np.ndarray:
    c = np.bincount(bins, minlength=N_BINS).astype(np.float64) + alpha
    return c / c.sum()


@dataclass(frozen=True)
class LikelihoodRatioDetector:
    """target_fpr: false-positive rate of `predict`; alpha: additive smoothing per bin (counts);
    generic_mismatch: mismatch mass of the honest-only alternative; n_null_batches / random_state:
    the resampled honest null (as ClippedMeanDetector)."""

    target_fpr: float = 0.01
    alpha: float = 0.5
    generic_mismatch: float = 0.05
    n_null_batches: int = 2000
    random_state: int = 0
    _null: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not 0.0 < self.target_fpr < 1.0:
            raise ValueError(f"target_fpr must be in (0, 1), got {self.target_fpr}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if not 0.0 < self.generic_mismatch < 1.0:
            raise ValueError(f"generic_mismatch must be in (0, 1), got {self.generic_mismatch}")

    # -- fitting ---------------------------------------------------------------------------------
    def fit(self, honest, alternatives=()) -> "LikelihoodRatioDetector":
        """Learn margin_edges_, ce_edges_, p0_, p1_, weights_ and the honest null from honest (train)
        tokens; `alternatives`: score tables of misconfigured train tokens (optional)."""
        m, em, ce = _arrays(honest)
        if m.size == 0:
            raise ValueError("honest is empty: no scored tokens")
        nz = m[~em & np.isfinite(m) & (m > 0)]
        if nz.size < 10:
            raise ValueError(f"only {nz.size} honest mismatches with a finite margin; need >= 10 to place "
                             "the margin bands (score more honest tokens)")
        margin_edges = tuple(float(x) for x in (*np.quantile(nz, [0.5, 0.9, 0.99]), nz.max()))
        cem = ce[~em & np.isfinite(ce)]
        ce_edges = tuple(float(x) for x in (*np.quantile(cem, [0.5, 0.9]), cem.max()))
        p0 = _freq(token_bins(m, em, ce, margin_edges, ce_edges), self.alpha)
        alts = [_freq(token_bins(*_arrays(a), margin_edges, ce_edges), self.alpha) for a in alternatives]
        if alts:
            p1 = np.mean(alts, axis=0)
        else:
            p1 = np.full(N_BINS, self.generic_mismatch / (N_BINS - 1))
            p1[0] = 1.0 - self.generic_mismatch
        self._set(margin_edges, ce_edges, p0, p1, n_alternatives_=len(alts))
        w = self.token_scores(honest)
        null = ClippedMeanDetector(score="margin", clip_quantile=1.0, target_fpr=self.target_fpr,
                                   n_null_batches=self.n_null_batches, random_state=self.random_state)
        null._set(clip_=float(np.inf), null_sample_=_subsample(w, self.random_state), null_mean_=float(w.mean()),
                  null_std_=float(w.std(ddof=1)) if w.size > 1 else 0.0, n_train_=int(w.size))
        self._null["det"] = null
        return self

    def _set(self, margin_edges, ce_edges, p0, p1, **extra) -> None:
        for k, v in dict(margin_edges_=tuple(margin_edges), ce_edges_=tuple(ce_edges), p0_=np.asarray(p0),
                         p1_=np.asarray(p1), weights_=np.log(np.asarray(p1) / np.asarray(p0)), **extra).items():
            object.__setattr__(self, k, v)

    def _check_fitted(self) -> None:
        if not hasattr(self, "weights_") or "det" not in self._null:
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) or load a detector file")

    # -- scoring ---------------------------------------------------------------------------------
    def token_scores(self, table) -> np.ndarray:
        """Per-token log-likelihood ratio log(p1/p0) of each token's bin."""
        if not hasattr(self, "weights_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) first")
        return self.weights_[token_bins(*_arrays(table), self.margin_edges_, self.ce_edges_)]

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
            det._set(f["margin_edges_"], f["ce_edges_"], f["p0_"], f["p1_"], n_alternatives_=int(f["n_alternatives_"]))
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

    @classmethod
    def load(cls, path: str | Path) -> "LikelihoodRatioDetector":
        p = Path(path)
        if not p.is_file():
            raise VerinferError("no such detector file", where=str(p), fix="fit one first")
        try:
            return cls.from_dict(json.loads(p.read_text(encoding="utf-8")), where=str(p))
        except json.JSONDecodeError as e:
            raise VerinferError(f"detector file is not valid JSON ({e})", where=str(p), fix="refit the detector") from e


def _subsample(w: np.ndarray, seed: int, cap: int = 200_000) -> np.ndarray:
    if w.size <= cap:
        return np.sort(w)
    return np.sort(np.random.default_rng(seed).choice(w, cap, replace=False))
