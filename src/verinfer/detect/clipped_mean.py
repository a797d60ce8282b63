"""Clipped-mean batch detector, fit on honest per-token divergence scores only (DiFR 5.2).

    fit:        clip_ = q-quantile of the finite honest values of the score column (oriented higher =
                more divergent, `scores.divergence`); the winsorized honest values are the null
                sample (subsampled, deterministically, to at most 200k tokens)
    score:      mean of the winsorized scores of a batch (higher = more divergent)
    threshold:  (1 - target_fpr)-quantile of n_null_batches resampled honest batch means of the
                batch's size; flagged iff pooled > threshold, so the FPR on fresh honest batches
                is at most about target_fpr
    p_value:    tail probability of the pooled score under the honest null

Null batches are resampled from the null sample WITH replacement: audited batches are fresh
draws from the honest population, and drawing without replacement from a finite sample would
shrink the null spread (finite-population correction) and inflate the false-positive rate when
the batch is a sizeable fraction of the sample. Above `MAX_RESAMPLED_TOKENS` draws per threshold
the batch mean is taken as normal (CLT; its skewness shrinks as 1/sqrt(n)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from scipy.stats import norm

from verinfer.audit.scores import ALL_SCORES, ACTIVATION_SCORES, clip_at_quantile, divergence, winsorize
from verinfer.detect.base import Detector, decision_text, decode_f8, encode_f8, group_labels, stratified_subsample
from verinfer.errors import VerinferError

MAX_NULL_SAMPLE = 200_000
MAX_RESAMPLED_TOKENS = 20_000_000  # n_null_batches * n_tokens above which threshold / p-value use the CLT
_CHUNK = 2_000_000  # indices drawn per chunk while resampling


@dataclass(eq=True)
class ClippedMeanDetector(Detector):
    """Winsorized-mean detector with a resampled honest null.

    score_name: the per-token score column (`scores.ALL_SCORES`, read oriented higher = more
    divergent; "score" in the JSON); clip_quantile: honest quantile to clip at; target_fpr:
    false-positive rate of `predict`; n_null_batches: resampled honest batches per batch size;
    random_state: seed of the subsampling and the resampling (results are deterministic).
    """

    NAME = "clipped-mean"
    FORMAT = "verinfer.ClippedMeanDetector"
    FORMAT_VERSION = 1
    COLUMNS_FIX = ("rescore the claims with `verinfer score` (fp_l2 needs claims generated with "
                   "`verinfer generate --fingerprint`)")
    JSON_NAMES = {"score_name": "score"}

    score_name: str = "margin"
    clip_quantile: float = 0.999

    def __post_init__(self):
        super().__post_init__()
        if self.score_name not in ALL_SCORES:
            raise ValueError(f"unknown score {self.score_name!r}; choose one of {', '.join(ALL_SCORES)}")
        if not 0.0 < self.clip_quantile <= 1.0:
            raise ValueError(f"clip_quantile must be in (0, 1], got {self.clip_quantile}")

    def columns(self, table=None) -> tuple[str, ...]:
        return (self.score_name,)

    def token_rows(self, table):
        """Every row, except for an Activation-DiFR score: the logged tokens (non-null, non-NaN)."""
        self.require_columns(table)
        if self.score_name not in ACTIVATION_SCORES:
            return table
        if isinstance(table, (pa.Table, pa.RecordBatch)):
            col = table[self.score_name]
            return table.filter(pc.and_(pc.is_valid(col), pc.invert(pc.is_nan(col))))
        keep = ~np.isnan(np.asarray(table[self.score_name], dtype=np.float64))
        return {k: np.asarray(v)[keep] for k, v in table.items()}

    def values(self, table) -> np.ndarray:
        """The score column of the token rows, oriented higher = more divergent (+inf kept)."""
        v = divergence(self.token_rows(table), self.score_name)
        if np.isnan(v).any():
            raise ValueError(f"score column {self.score_name!r} contains NaN scores")
        return v

    # -- fitting ---------------------------------------------------------------------------------
    def fit(self, table, groups=None) -> "ClippedMeanDetector":
        """Learn clip_, null_sample_, null_group_sizes_, null_mean_, null_std_, n_train_ from honest
        (train) rows. `groups` (one label per token row, e.g. the honest configuration) makes the
        null stratified: each honest configuration keeps its own resampled null, and the threshold
        and p-value take the worst one, so no honest configuration is flagged more often than
        target_fpr (a pooled null understates the variation *between* honest configurations)."""
        v = self.values(table)
        if v.size == 0:
            raise ValueError("the honest table is empty: no scored tokens")
        clip = clip_at_quantile(v, self.clip_quantile)
        self.fit_null(winsorize(v, clip), groups, clip)
        return self

    def fit_null(self, w: np.ndarray, groups, clip: float) -> None:
        """The null from winsorized honest values w: per group (one label per value; None: one
        group), its values, or a sorted random subsample of MAX_NULL_SAMPLE / groups of them."""
        parts = stratified_subsample(w, group_labels(groups, w.size), MAX_NULL_SAMPLE, self.random_state,
                                     sort_values=True)
        self.set_null(np.concatenate(parts), [int(p.size) for p in parts], n_train=int(w.size), clip=clip)

    def set_null(self, sample: np.ndarray, group_sizes: list[int], n_train: int, clip: float,
                 mean: float | None = None, std: float | None = None) -> None:
        """Set the learned null (fit, load, and detectors that pool their own per-token scores)."""
        self.clip_ = clip
        self.null_sample_ = sample
        self.null_group_sizes_ = group_sizes
        self.null_mean_ = float(sample.mean()) if mean is None else mean
        self.null_std_ = (float(sample.std(ddof=1)) if sample.size > 1 else 0.0) if std is None else std
        self.n_train_ = n_train
        self._cache.clear()

    def _groups(self) -> list[np.ndarray]:
        sizes = getattr(self, "null_group_sizes_", None) or [self.null_sample_.size]
        return np.split(self.null_sample_, np.cumsum(sizes)[:-1])

    def _check_fitted(self) -> None:
        if not hasattr(self, "null_sample_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) or load a detector file")

    # -- scoring ---------------------------------------------------------------------------------
    def token_scores(self, table) -> np.ndarray:
        """The scores winsorized at clip_ (+inf -> clip_)."""
        self._check_fitted()
        return winsorize(self.values(table), self.clip_)

    def statistic_of(self, evidence: np.ndarray) -> float:
        return float(evidence.mean())

    def _normal_approx(self, n_tokens: int) -> bool:
        return self.n_null_batches * n_tokens > MAX_RESAMPLED_TOKENS

    def null_means(self, n_tokens: int) -> np.ndarray:
        """n_null_batches honest batch means of n_tokens tokens, resampled (with replacement) from
        null_sample_; deterministic in (random_state, n_tokens) and cached. With a stratified
        null, the means of the honest group whose (1 - target_fpr)-quantile is highest."""
        return self._group_means(n_tokens)[self._worst_group(n_tokens)]

    def _group_means(self, n_tokens: int) -> list[np.ndarray]:
        def compute(n: int, rng: np.random.Generator) -> list[np.ndarray]:
            per_chunk = max(1, _CHUNK // n)
            out = []
            for s in self._groups():
                means = []
                for start in range(0, self.n_null_batches, per_chunk):
                    k = min(per_chunk, self.n_null_batches - start)
                    means.append(s[rng.integers(0, s.size, (k, n))].mean(axis=1))
                out.append(np.concatenate(means))
            return out

        return self._per_batch_size(n_tokens, compute)

    def _group_stats(self) -> list[tuple[float, float]]:
        return [(float(s.mean()), float(s.std(ddof=1)) if s.size > 1 else 0.0) for s in self._groups()]

    def _worst_group(self, n_tokens: int) -> int:
        n = int(n_tokens)
        if self._normal_approx(n):
            z = norm.isf(self.target_fpr) / math.sqrt(n)
            return int(np.argmax([m + z * sd for m, sd in self._group_stats()]))
        return int(np.argmax([np.quantile(g, 1.0 - self.target_fpr) for g in self._group_means(n)]))

    def threshold(self, n_tokens: int) -> float:
        """(1 - target_fpr)-quantile of honest batch means of n_tokens tokens (resampled; the
        normal approximation N(mean, std^2 / n) beyond MAX_RESAMPLED_TOKENS); with a stratified
        null, the highest over the honest groups."""
        self._check_fitted()
        n = int(n_tokens)
        if self._normal_approx(n):
            m, sd = self._group_stats()[self._worst_group(n)]
            return float(m + norm.isf(self.target_fpr) * sd / math.sqrt(n))
        return float(np.quantile(self.null_means(n), 1.0 - self.target_fpr))

    def _p_value(self, pooled: float, n: int) -> tuple[float, str]:
        """The largest tail probability over the honest groups (one group unless stratified)."""
        best = (-1.0, "normal")
        for (m, sd), null in zip(self._group_stats(), [None] * len(self._groups()) if self._normal_approx(n)
                                 else self._group_means(n)):
            se = sd / math.sqrt(n)
            p_norm = float(norm.sf(pooled, loc=m, scale=se)) if se > 0 else (0.0 if pooled > m else 1.0)
            if null is None:
                cand = (p_norm, "normal")
            else:
                k = int(np.count_nonzero(null >= pooled))
                # beyond every resampled mean the resampling only says p < 1/(B+1): refine with the CLT
                cand = ((k + 1) / (null.size + 1), "resampled") if k > 0 else (min(p_norm, 1.0 / (null.size + 1)), "normal")
            best = max(best, cand, key=lambda t: t[0])
        return best

    def p_value(self, table) -> float:
        """P(honest batch mean >= observed pooled score) for a batch of the table's tokens:
        (1 + #resampled means >= observed) / (1 + n_null_batches); when no resampled mean reaches
        the observed one (beyond the resolution 1/(1+B)), or above MAX_RESAMPLED_TOKENS, the normal
        tail with mean null_mean_ and std null_std_/sqrt(n) (capped at 1/(1+B)).
        `verdict` says which was used ("resampled" or "normal")."""
        x = self.evidence(table)
        return self._p_value(self.statistic_of(x), x.size)[0]

    def verdict(self, table, max_tokens: int | None = None) -> dict:
        """`verdict_from_pooled` of the first max_tokens tokens, and the clip."""
        x = self.evidence(table, max_tokens)
        d = self.verdict_from_pooled(self.statistic_of(x), x.size)
        d["clip"] = self.clip_
        return d

    def threshold_fpr(self, n_tokens: int) -> float:
        """False-positive rate of threshold(n) on the honest null: the fraction of resampled honest
        batch means above it (the normal tail beyond MAX_RESAMPLED_TOKENS)."""
        thr = self.threshold(n_tokens)
        if self._normal_approx(int(n_tokens)):
            m, sd = self._group_stats()[self._worst_group(n_tokens)]
            se = sd / math.sqrt(n_tokens)
            return float(norm.sf(thr, m, se)) if se > 0 else 0.0
        return float(max(np.mean(g > thr) for g in self._group_means(n_tokens)))

    def tokens_to_flag(self, pooled: float, n_tokens: int) -> int | None:
        """Batch size at which a per-token mean of `pooled` would cross the threshold, by the normal
        approximation n* = (z_{1-fpr} sigma / (pooled - null_mean))^2; None if pooled <= null_mean
        (no excess over honest: more tokens would not flag it)."""
        self._check_fitted()
        m, sd = self._group_stats()[self._worst_group(n_tokens)]  # the honest group setting the threshold
        excess = pooled - m
        if not excess > 0:
            return None
        if sd == 0:
            return int(n_tokens)
        n_star = math.ceil((norm.isf(self.target_fpr) * sd / excess) ** 2)
        # the resampled threshold can sit above the normal one: never claim fewer tokens than used
        return max(int(n_tokens) + 1, n_star)

    def verdict_from_pooled(self, pooled: float, n_tokens: int) -> dict:
        """Verdict with confidence for a pooled score over n_tokens tokens: flagged, threshold, the
        FPR the threshold was set at (target) and its FPR on the honest null, the tail probability
        (p-value) of the pooled score under the honest null, and, when not flagged, how many more
        tokens would be needed to flag it if the observed per-token excess persisted
        (`more_tokens_needed`; None = no excess over honest) and the smallest per-token excess this
        batch size can detect."""
        n = int(n_tokens)
        thr = self.threshold(n)
        p, method = self._p_value(pooled, n)
        flagged = bool(pooled > thr)
        more = None
        if not flagged:
            n_star = self.tokens_to_flag(pooled, n)
            more = None if n_star is None else max(1, n_star - n)
        return {"flagged": flagged, "pooled": float(pooled), "threshold": thr, "p_value": p,
                "tail_probability": p, "p_value_method": method, "n_tokens": n, "target_fpr": self.target_fpr,
                "threshold_fpr": self.threshold_fpr(n), "more_tokens_needed": more,
                "detectable_excess": float(thr - self.null_mean_), "decision": decision_text(flagged, more),
                "score": self.score_name}

    def summary(self) -> str:
        return f"{self.score_name}, clip {self.clip_:.4g} at q={self.clip_quantile}, FPR {self.target_fpr}"

    # -- persistence -----------------------------------------------------------------------------
    def _fitted_json(self) -> dict:
        self._check_fitted()
        n = int(self.null_sample_.size)
        return {"clip_": self.clip_, "null_mean_": self.null_mean_, "null_std_": self.null_std_,
                "n_train_": self.n_train_, "null_sample_size": n,
                "null_group_sizes": list(getattr(self, "null_group_sizes_", None) or [n]),
                "null_sample_f8_base64": encode_f8(self.null_sample_)}

    def _load_fitted(self, f: dict) -> None:
        s = decode_f8(f["null_sample_f8_base64"])
        if s.size != f["null_sample_size"] or s.size == 0:
            raise ValueError(f"null sample has {s.size} values, header says {f['null_sample_size']}")
        sizes = [int(x) for x in f.get("null_group_sizes", [s.size])]
        if sum(sizes) != s.size or min(sizes) < 1:
            raise ValueError(f"null group sizes {sizes} do not add up to the {s.size} null values")
        self.set_null(s, sizes, n_train=int(f["n_train_"]), clip=float(f["clip_"]),
                      mean=float(f["null_mean_"]), std=float(f["null_std_"]))
