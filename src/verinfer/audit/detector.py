"""Clipped-mean batch detector, fit on honest per-token divergence scores only (DiFR 5.2).

    fit:        clip_ = q-quantile of the finite honest values; the winsorized honest values are
                the null sample (subsampled, deterministically, to at most 200k tokens)
    pooled:     mean of the winsorized scores of a batch (higher = more divergent)
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

import base64
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
from scipy.stats import norm

from verinfer.audit.claims import atomic_write_text
from verinfer.audit.metrics import clip_at_quantile, winsorize
from verinfer.audit.scores import ALL_SCORES as SCORES
from verinfer.errors import VerinferError

FORMAT = "verinfer.ClippedMeanDetector"
FORMAT_VERSION = 1
MAX_NULL_SAMPLE = 200_000
MAX_RESAMPLED_TOKENS = 20_000_000  # n_null_batches * n_tokens above which threshold / p-value use the CLT
_CHUNK = 2_000_000  # indices drawn per chunk while resampling


@dataclass(frozen=True)
class ClippedMeanDetector:
    """Winsorized-mean detector with a resampled honest null.

    score: name of the per-token score (bookkeeping; values passed in must already be oriented
        higher = more divergent, see `scores.divergence`); clip_quantile: honest quantile to clip at;
    target_fpr: false-positive rate of `predict`; n_null_batches: resampled honest batches per
    batch size; random_state: seed of the subsampling and the resampling (results are deterministic).
    """

    score: str = "margin"
    clip_quantile: float = 0.999
    target_fpr: float = 0.01
    n_null_batches: int = 2000
    random_state: int = 0
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"unknown score {self.score!r}; choose one of {', '.join(SCORES)}")
        if not 0.0 < self.clip_quantile <= 1.0:
            raise ValueError(f"clip_quantile must be in (0, 1], got {self.clip_quantile}")
        if not 0.0 < self.target_fpr < 1.0:
            raise ValueError(f"target_fpr must be in (0, 1), got {self.target_fpr}")
        if self.n_null_batches < 10:
            raise ValueError(f"n_null_batches must be >= 10, got {self.n_null_batches}")

    # -- fitting ---------------------------------------------------------------------------------
    def _set(self, **learned) -> None:
        for k, v in learned.items():
            object.__setattr__(self, k, v)
        self._cache.clear()

    def fit(self, honest_values, groups=None) -> "ClippedMeanDetector":
        """Learn clip_, null_sample_, null_group_sizes_, null_mean_, null_std_, n_train_ from honest
        (train) scores. `groups` (one label per value, e.g. the honest configuration) makes the
        null stratified: each honest configuration keeps its own resampled null, and the threshold
        and p-value take the worst one, so no honest configuration is flagged more often than
        target_fpr (a pooled null understates the variation *between* honest configurations)."""
        v = _as_values(honest_values, "honest_values")
        clip = clip_at_quantile(v, self.clip_quantile)
        w = winsorize(v, clip)
        labels = np.zeros(v.size, dtype=np.int64) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
        if labels.size != v.size:
            raise ValueError(f"groups has {labels.size} labels for {v.size} values")
        rng = np.random.default_rng(self.random_state)
        n_groups = int(labels.max()) + 1
        cap = max(1, MAX_NULL_SAMPLE // n_groups)
        parts = []
        for g in range(n_groups):
            wg = w[labels == g]
            parts.append(np.sort(rng.choice(wg, cap, replace=False)) if wg.size > cap else wg)
        sample = np.concatenate(parts)
        self._set(clip_=clip, null_sample_=sample, null_group_sizes_=[int(p.size) for p in parts],
                  null_mean_=float(sample.mean()), null_std_=float(sample.std(ddof=1)) if sample.size > 1 else 0.0,
                  n_train_=int(v.size))
        return self

    def _groups(self) -> list[np.ndarray]:
        sizes = getattr(self, "null_group_sizes_", None) or [self.null_sample_.size]
        return np.split(self.null_sample_, np.cumsum(sizes)[:-1])

    def _check_fitted(self) -> None:
        if not hasattr(self, "null_sample_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_values) or load a detector file")

    # -- scoring ---------------------------------------------------------------------------------
    def pooled(self, values) -> float:
        """Mean of the scores winsorized at clip_ (+inf -> clip_)."""
        self._check_fitted()
        return float(winsorize(_as_values(values, "values"), self.clip_).mean())

    def _normal_approx(self, n_tokens: int) -> bool:
        return self.n_null_batches * n_tokens > MAX_RESAMPLED_TOKENS

    def null_means(self, n_tokens: int) -> np.ndarray:
        """n_null_batches honest batch means of n_tokens tokens, resampled (with replacement) from
        null_sample_; deterministic in (random_state, n_tokens) and cached. With a stratified
        null, the means of the honest group whose (1 - target_fpr)-quantile is highest."""
        return self._group_means(n_tokens)[self._worst_group(n_tokens)]

    def _group_means(self, n_tokens: int) -> list[np.ndarray]:
        self._check_fitted()
        n = int(n_tokens)
        if n < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        if n not in self._cache:
            rng = np.random.default_rng([self.random_state, n])
            per_chunk = max(1, _CHUNK // n)
            out = []
            for s in self._groups():
                means = []
                for start in range(0, self.n_null_batches, per_chunk):
                    k = min(per_chunk, self.n_null_batches - start)
                    means.append(s[rng.integers(0, s.size, (k, n))].mean(axis=1))
                out.append(np.concatenate(means))
            self._cache[n] = out
        return self._cache[n]

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

    def p_value(self, values) -> float:
        """P(honest batch mean >= observed pooled score) for a batch of len(values) tokens:
        (1 + #resampled means >= observed) / (1 + n_null_batches); when no resampled mean reaches
        the observed one (beyond the resolution 1/(1+B)), or above MAX_RESAMPLED_TOKENS, the normal
        tail with mean null_mean_ and std null_std_/sqrt(n) (capped at 1/(1+B)).
        `verdict` says which was used ("resampled" or "normal")."""
        v = _as_values(values, "values")
        return self._p_value(self.pooled(v), v.size)[0]

    def predict(self, values) -> bool:
        """True (flagged as misconfigured) iff pooled(values) > threshold(len(values))."""
        v = _as_values(values, "values")
        return bool(self.pooled(v) > self.threshold(v.size))

    _BASIC = ("flagged", "pooled", "threshold", "p_value", "p_value_method", "n_tokens", "target_fpr", "score")

    def verdict(self, values, confidence: bool = False) -> dict:
        """Everything a report states about one batch of tokens; with confidence=True also the
        threshold's FPR on the honest null, the tail probability and how many more tokens a
        decision would need (see `verdict_from_pooled`)."""
        v = _as_values(values, "values")
        d = self.verdict_from_pooled(self.pooled(v), v.size)
        if not confidence:
            d = {k: d[k] for k in self._BASIC}
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
        if flagged:
            decision = "flagged: inconsistent with honest inference"
        elif more is None:
            decision = "not flagged: no excess over honest"
        else:
            decision = f"not flagged: not enough evidence yet (~{more} more tokens if the excess persists)"
        return {"flagged": flagged, "pooled": float(pooled), "threshold": thr, "p_value": p,
                "tail_probability": p, "p_value_method": method, "n_tokens": n, "target_fpr": self.target_fpr,
                "threshold_fpr": self.threshold_fpr(n), "more_tokens_needed": more,
                "detectable_excess": float(thr - self.null_mean_), "decision": decision, "score": self.score}

    # -- persistence -----------------------------------------------------------------------------
    def config(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def to_dict(self) -> dict:
        self._check_fitted()
        s = np.ascontiguousarray(self.null_sample_, dtype="<f8")
        return {"format": FORMAT, "version": FORMAT_VERSION, "config": self.config(),
                "fitted": {"clip_": self.clip_, "null_mean_": self.null_mean_, "null_std_": self.null_std_,
                           "n_train_": self.n_train_, "null_sample_size": int(s.size),
                           "null_group_sizes": list(getattr(self, "null_group_sizes_", None) or [int(s.size)]),
                           "null_sample_f8_base64": base64.b64encode(s.tobytes()).decode("ascii")}}

    def save(self, path: str | Path) -> None:
        """Write the detector as JSON (atomically: temp file + os.replace). No pickle."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "<dict>") -> "ClippedMeanDetector":
        def bad(what: str) -> VerinferError:
            return VerinferError(what, where=where, fix="refit the detector with `verinfer calibrate`")

        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise bad(f"not a verinfer detector file (expected \"format\": \"{FORMAT}\")")
        if d.get("version") != FORMAT_VERSION:
            raise bad(f"detector format version {d.get('version')!r}; this verinfer reads version {FORMAT_VERSION}")
        try:
            det = cls(**d["config"])
            f = d["fitted"]
            s = np.frombuffer(base64.b64decode(f["null_sample_f8_base64"], validate=True), dtype="<f8")
            if s.size != f["null_sample_size"] or s.size == 0:
                raise ValueError(f"null sample has {s.size} values, header says {f['null_sample_size']}")
            sizes = [int(x) for x in f.get("null_group_sizes", [s.size])]
            if sum(sizes) != s.size or min(sizes) < 1:
                raise ValueError(f"null group sizes {sizes} do not add up to the {s.size} null values")
            det._set(clip_=float(f["clip_"]), null_sample_=s.astype(np.float64), null_group_sizes_=sizes,
                     null_mean_=float(f["null_mean_"]), null_std_=float(f["null_std_"]), n_train_=int(f["n_train_"]))
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"malformed detector ({type(e).__name__}: {e})") from e
        return det

    @classmethod
    def load(cls, path: str | Path) -> "ClippedMeanDetector":
        p = Path(path)
        if not p.is_file():
            raise VerinferError("no such detector file", where=str(p), fix="fit one with `verinfer calibrate`")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise VerinferError(f"detector file is not valid JSON ({e}); it is probably truncated or corrupt",
                                where=str(p), fix="refit the detector with `verinfer calibrate`") from e
        return cls.from_dict(d, where=str(p))


def _as_values(values, name: str) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0:
        raise ValueError(f"{name} is empty: no scored tokens")
    if np.isnan(v).any():
        raise ValueError(f"{name} contains NaN scores")
    return v
