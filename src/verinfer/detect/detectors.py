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

from verinfer.io import atomic_write_text
from verinfer.detect.metrics import clip_at_quantile, winsorize
from verinfer.audit.scores import ALL_SCORES as SCORES
from verinfer.errors import VerinferError

FORMAT = "verinfer.ClippedMeanDetector"
FORMAT_VERSION = 1
MAX_NULL_SAMPLE = 200_000
MAX_RESAMPLED_TOKENS = 20_000_000  # n_null_batches * n_tokens above which threshold / p-value use the CLT
_CHUNK = 2_000_000  # indices drawn per chunk while resampling


def read_detector_json(path: str | Path, fix: str = "refit the detector with `verinfer calibrate`") -> dict:
    """A detector file's JSON, or a VerinferError naming the file and what to do."""
    p = Path(path)
    if not p.is_file():
        raise VerinferError("no such detector file", where=str(p), fix="fit one with `verinfer calibrate`")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VerinferError(f"detector file is not valid JSON ({e}); it is probably truncated or corrupt",
                            where=str(p), fix=fix) from e


class FittedDetector:
    """What the frozen, sklearn-style detectors share: `_set` stores learned attributes (trailing
    underscore) once fit() or load() has them, the checks of their common parameters, and
    `load` (their `from_dict` over a detector file; REFIT says how to make a new one)."""

    REFIT = "refit the detector with `verinfer calibrate`"

    @classmethod
    def load(cls, path: str | Path):
        return cls.from_dict(read_detector_json(path, fix=cls.REFIT), where=str(path))

    def _set(self, **learned) -> None:
        for k, v in learned.items():
            object.__setattr__(self, k, v)
        cache = getattr(self, "_cache", None)
        if cache is not None:
            cache.clear()

    def _check_null_parameters(self) -> None:
        if not 0.0 < self.target_fpr < 1.0:
            raise ValueError(f"target_fpr must be in (0, 1), got {self.target_fpr}")
        if self.n_null_batches < 10:
            raise ValueError(f"n_null_batches must be >= 10, got {self.n_null_batches}")


@dataclass(frozen=True)
class ClippedMeanDetector(FittedDetector):
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
        self._check_null_parameters()

    # -- fitting ---------------------------------------------------------------------------------

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



def _as_values(values, name: str) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0:
        raise ValueError(f"{name} is empty: no scored tokens")
    if np.isnan(v).any():
        raise ValueError(f"{name} contains NaN scores")
    return v


# --- the `best` detector: perturbation GLRT ---------------------------------------------------------
GLRT_FORMAT = "verinfer.PerturbationGLRTDetector"
GLRT_FORMAT_VERSION = 1


def gap_columns(table, temperature_factors=(), top_p_slack: float = 0.0) -> np.ndarray:
    """[N, 1 + len(temperature_factors)] signed gaps: column 0 at the claimed temperature (`gap_0`
    of a features table, or `gap` of a score table), then `gapT_{r}` per factor r; with a top-p
    slack tau the columns suffixed `_s{tau}` (`variants.block_gaps(..., top_p_slack=tau)`)."""
    from verinfer.audit.scores import _column
    from verinfer.audit.variants import gap_column, temperature_column

    names = table.column_names if hasattr(table, "column_names") else list(table)
    first = gap_column(top_p_slack)
    if first not in names:
        first = "gap" + first[len("gap_0"):]
    cols = [_column(table, first)] + [_column(table, temperature_column(r, top_p_slack)) for r in temperature_factors]
    return np.stack(cols, axis=1)


class ColumnStatistics:
    """Detectors whose per-token evidence is a few columns (token_columns) and whose batch
    statistic is a function of the column means (statistic_of_means)."""

    def statistic(self, table) -> float:
        x = self.token_columns(table)
        if len(x) == 0:
            raise ValueError("no scored tokens")
        return float(self.statistic_of_means(x.mean(axis=0), len(x)))

    def batch_statistics(self, columns_NC: np.ndarray, n_tokens: int, n_batches: int,
                         rng: np.random.Generator) -> np.ndarray:
        """Statistics of n_batches batches of n_tokens rows drawn with replacement from columns_NC."""
        x = np.asarray(columns_NC, dtype=np.float64)
        n = int(n_tokens)
        per = max(1, 4_000_000 // (n * x.shape[1]))
        out = []
        for s in range(0, n_batches, per):
            k = min(per, n_batches - s)
            out.append(self.statistic_of_means(x[rng.integers(0, len(x), (k, n))].mean(axis=1), n))
        return np.concatenate(out)


@dataclass(frozen=True)
class PerturbationGLRTDetector(ColumnStatistics, FittedDetector):
    """Token-DiFR as a likelihood-ratio test on the perturbation scale (max-z GLRT).

    Per token, d = signed gap of the claimed token's post-Gumbel score to its strongest competitor
    (`variants.temperature_gaps`; > 0: the Token-DiFR margin of a token the replay does not
    reproduce, < 0: minus the runner-up gap of one it does). Model H(sigma, eps, r): the provider's
    scores are the verifier's at r times the claimed temperature plus N(0, sigma^2) per logit, and a
    fraction eps of tokens are outliers (`variants.perturbation_loglik`). fit: (sigma0_, eps0_) by
    maximum likelihood on honest tokens; the alternatives `grid_` are a larger noise scale
    (sigma0 * sigma_factors: quantization, KV-cache precision), more outliers (eps0 * eps_factors:
    sampling bugs, rare large margins) and another temperature (r in temperature_factors, read from
    the gapT_{r} columns). Column g of the per-token evidence is log L(theta_g) - log L(theta0):
    reproduced tokens with wide gaps carry ~0, near ties and flips carry the evidence, and an
    honest flip at a near tie costs little while a wide-margin flip counts heavily (capped by the
    outlier term). No alternative uses a misconfigured provider's kernel.

    Batch statistic: max over columns of sqrt(n) (column mean - mu_g) / sd_g with mu_, sd_ from
    honest train tokens. Threshold and tail probability: n_null_batches honest batches resampled
    with replacement per honest group (e.g. configuration); the worst group's (1 - fpr)-quantile
    plus a random-effects allowance z_{1-fpr} sqrt(n) max_g(tau_g / sd_g), tau_g = spread of the
    group means, so a NEW honest configuration keeps the target FPR (as `ClippedMeanDetector`'s
    stratified null, in z units). Fit on honest tokens only.

    Input: a table / dict with the signed-gap columns (`gap_0` or `gap`, and gapT_{r}).
    """

    REFIT = "refit the detector with `verinfer calibrate --detector glrt`"

    sigma_factors: tuple = (1.5, 2.0, 3.0, 5.0)
    eps_factors: tuple = (10.0, 100.0)
    temperature_factors: tuple = (0.8, 0.9, 1.1, 1.2)
    outlier_p: float = 0.02
    top_p_slack: float = 0.01
    center: bool = True
    combine: str = "maxllr"
    target_fpr: float = 0.01
    n_null_batches: int = 2000
    random_state: int = 0
    max_null_tokens: int = 200_000
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._check_null_parameters()
        if any(f <= 1.0 for f in (*self.sigma_factors, *self.eps_factors)):
            raise ValueError("sigma_factors and eps_factors must be > 1 (alternatives beyond the honest fit)")
        if any(r <= 0 or r == 1.0 for r in self.temperature_factors):
            raise ValueError("temperature_factors must be > 0 and != 1")
        if self.combine not in ("maxz", "maxllr"):
            raise ValueError(f"combine must be maxz or maxllr, got {self.combine!r}")

    # -- fitting ---------------------------------------------------------------------------------
    def fit(self, honest, groups=None) -> "PerturbationGLRTDetector":
        """Learn sigma0_, eps0_, grid_, mu_, sd_, tau_ and the per-group null samples from honest
        (train) tokens; `groups`: one label per token (its honest configuration) for the
        random-effects null."""
        from verinfer.audit.variants import fit_perturbation

        g = self._gaps(honest)
        if len(g) < 100:
            raise ValueError(f"only {len(g)} honest tokens; need >= 100 to fit the perturbation model")
        s0, e0 = fit_perturbation(g[:, 0], self.outlier_p)
        grid = [(0, s0 * f, e0) for f in self.sigma_factors] + [(0, s0, e0 * f) for f in self.eps_factors]
        grid += [(j + 1, s0, e0) for j in range(len(self.temperature_factors))]
        eps_max = max(e for _, _, e in grid)
        if eps_max >= 1.0:
            raise ValueError(f"eps0 * max(eps_factors) = {eps_max:.3g} >= 1: honest tokens look like outliers")
        self._set(sigma0_=s0, eps0_=e0, grid_=[(int(c), float(s), float(e)) for c, s, e in grid])
        labels = np.zeros(len(g), np.int64) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
        if labels.size != len(g):
            raise ValueError(f"groups has {labels.size} labels for {len(g)} tokens")
        rng = np.random.default_rng(self.random_state)
        n_groups = int(labels.max()) + 1
        cap = max(1, self.max_null_tokens // n_groups)
        samples = []
        for k in range(n_groups):
            gk = g[labels == k]
            samples.append(gk[np.sort(rng.choice(len(gk), cap, replace=False))] if len(gk) > cap else gk)
        self._set_null(samples, n_train=len(g))
        return self

    def _set_null(self, gap_samples: list, n_train: int) -> None:
        xs = [self._llr(s) for s in gap_samples]
        x = np.concatenate(xs)
        means = np.array([xg.mean(axis=0) for xg in xs])
        self._set(null_gaps_=gap_samples, null_samples_=xs, mu_=x.mean(axis=0),
                    sd_=np.maximum(x.std(axis=0, ddof=1), 1e-12),
                    tau_=means.std(axis=0, ddof=1) if len(xs) > 1 else np.zeros(x.shape[1]), n_train_=int(n_train))

    def _check_fitted(self) -> None:
        if not hasattr(self, "null_samples_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) or load a detector file")

    def _gaps(self, table) -> np.ndarray:
        g = gap_columns(table, self.temperature_factors, self.top_p_slack)
        if np.isnan(g).any():
            raise ValueError("signed-gap columns contain NaN: the perturbation GLRT needs Gumbel-noise claims "
                             "(greedy and inverse-cdf claims have no post-Gumbel gap)")
        return g

    def _llr(self, gaps_NC: np.ndarray) -> np.ndarray:
        from verinfer.audit.variants import perturbation_llr, perturbation_llr_centered

        f = perturbation_llr_centered if self.center else perturbation_llr
        return f(gaps_NC, self.grid_, (self.sigma0_, self.eps0_), self.outlier_p)

    # -- scoring ---------------------------------------------------------------------------------
    def token_columns(self, table) -> np.ndarray:
        """[N, G] per-token log-likelihood ratios of the alternatives against the honest fit."""
        if not hasattr(self, "grid_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) or load a detector file")
        return self._llr(self._gaps(table))

    token_scores = token_columns

    def statistic_of_means(self, means_BC: np.ndarray, n_tokens: int) -> np.ndarray:
        """For rows of column means: combine="maxz": max over columns of sqrt(n) (mean - mu_) / sd_;
        "maxllr": max over columns of n * mean (the GLRT: the batch log-likelihood ratio of the
        best alternative)."""
        if self.combine == "maxllr":
            return (n_tokens * np.asarray(means_BC)).max(axis=-1)
        return (np.sqrt(n_tokens) * (np.asarray(means_BC) - self.mu_) / self.sd_).max(axis=-1)

    score = ColumnStatistics.statistic

    def allowance(self, n_tokens: int) -> float:
        """Random-effects allowance for a new honest configuration: z_{1-fpr} sqrt(n) max(tau/sd)
        in z units (maxz), z_{1-fpr} n max(tau) in log-likelihood-ratio units (maxllr)."""
        if self.combine == "maxllr":
            return float(norm.isf(self.target_fpr) * n_tokens * np.max(self.tau_))
        return float(norm.isf(self.target_fpr) * math.sqrt(n_tokens) * np.max(self.tau_ / self.sd_))

    def null_statistics(self, n_tokens: int) -> np.ndarray:
        """Resampled honest batch statistics of the group whose (1 - fpr)-quantile is highest,
        shifted by `allowance(n)` (0 without groups). Deterministic in (random_state, n); cached."""
        self._check_fitted()
        n = int(n_tokens)
        if n < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        if n not in self._cache:
            rng = np.random.default_rng([self.random_state, n])
            per = [self.batch_statistics(xg, n, self.n_null_batches, rng) for xg in self.null_samples_]
            worst = per[int(np.argmax([np.quantile(p, 1.0 - self.target_fpr) for p in per]))]
            self._cache[n] = worst + self.allowance(n)
        return self._cache[n]

    def threshold(self, n_tokens: int) -> float:
        return float(np.quantile(self.null_statistics(n_tokens), 1.0 - self.target_fpr))

    def predict(self, table) -> bool:
        x = self.token_columns(table)
        return bool(self.statistic_of_means(x.mean(axis=0), len(x)) > self.threshold(len(x)))

    def tokens_to_flag(self, stat: float, n_tokens: int) -> int | None:
        """Tokens at which a batch with the same per-token excess would be flagged. maxz: the
        statistic grows as c sqrt(n) (c = stat / sqrt(n_tokens)), the threshold as q + b sqrt(n)
        (b sqrt(n) = `allowance`, q = the rest at n_tokens), so n* = (q / (c - b))^2. maxllr: the
        statistic grows as c n, the threshold as a sqrt(n) + b n, so n* = (a / (c - b))^2.
        None if c <= b (more tokens would not flag it)."""
        n = int(n_tokens)
        b = self.allowance(1)
        rest = max(self.threshold(n) - self.allowance(n), 0.0)
        if self.combine == "maxllr":
            c, q = stat / n, rest / math.sqrt(n)
        else:
            c, q = stat / math.sqrt(n), rest
        if not c > b:
            return None
        return max(n + 1, int(math.ceil((q / (c - b)) ** 2)))

    def verdict(self, table) -> dict:
        """flagged, the statistic and threshold, the FPR the threshold was set at and its rate on the
        resampled honest null, the tail probability under the honest null (resampled, worst group
        plus allowance), and, when not flagged, how many more tokens a decision would need if the
        per-token excess persisted (`tokens_to_flag`; None = no excess over honest)."""
        x = self.token_columns(table)
        n = len(x)
        if n == 0:
            raise ValueError("no scored tokens")
        stat = float(self.statistic_of_means(x.mean(axis=0), n))
        null = self.null_statistics(n)
        thr = float(np.quantile(null, 1.0 - self.target_fpr))
        p = (int(np.count_nonzero(null >= stat)) + 1) / (null.size + 1)
        flagged = stat > thr
        more = None
        if not flagged:
            n_star = self.tokens_to_flag(stat, n)
            more = None if n_star is None else max(1, n_star - n)
        decision = ("flagged: inconsistent with honest inference" if flagged else
                    "not flagged: no excess over honest" if more is None else
                    f"not flagged: not enough evidence yet (~{more} more tokens if the excess persists)")
        top = int(np.argmax(np.sqrt(n) * (x.mean(axis=0) - self.mu_) / self.sd_))
        return {"flagged": bool(flagged), "pooled": stat, "threshold": thr, "p_value": p, "tail_probability": p,
                "p_value_method": "resampled", "n_tokens": n, "target_fpr": self.target_fpr,
                "threshold_fpr": float(np.mean(null > thr)), "more_tokens_needed": more, "decision": decision,
                "strongest_alternative": self.describe(top), "score": "perturbation-glrt"}

    def describe(self, g: int) -> str:
        """The alternative of column g in words."""
        c, s, e = self.grid_[g]
        if c > 0:
            return f"temperature x{self.temperature_factors[c - 1]:g}"
        if s != self.sigma0_:
            return f"noise sigma x{s / self.sigma0_:.3g}"
        return f"outliers eps x{e / self.eps0_:.3g}"

    # -- persistence -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        self._check_fitted()
        enc = lambda a: base64.b64encode(np.ascontiguousarray(a, dtype="<f8").tobytes()).decode("ascii")  # noqa: E731
        cfg = {f.name: (list(getattr(self, f.name)) if isinstance(getattr(self, f.name), tuple) else getattr(self, f.name))
               for f in fields(self) if f.init}
        return {"format": GLRT_FORMAT, "version": GLRT_FORMAT_VERSION, "config": cfg,
                "fitted": {"sigma0_": self.sigma0_, "eps0_": self.eps0_, "grid_": [list(t) for t in self.grid_],
                           "n_train_": self.n_train_, "n_columns": int(self.null_gaps_[0].shape[1]),
                           "null_gaps_f8_base64": [enc(s) for s in self.null_gaps_]}}

    def save(self, path: str | Path) -> None:
        """Write the detector as JSON (atomically). The null is stored as the honest tokens' signed
        gaps (the log-likelihood-ratio columns are recomputed on load)."""
        atomic_write_text(path, json.dumps(self.to_dict()) + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "<dict>") -> "PerturbationGLRTDetector":
        if not isinstance(d, dict) or d.get("format") != GLRT_FORMAT or d.get("version") != GLRT_FORMAT_VERSION:
            raise VerinferError(f"not a {GLRT_FORMAT} version {GLRT_FORMAT_VERSION} file", where=where,
                                fix="refit the detector with `verinfer calibrate --detector glrt`")
        try:
            cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in d["config"].items()}
            det = cls(**cfg)
            f = d["fitted"]
            c = int(f["n_columns"])
            if c != 1 + len(det.temperature_factors):
                raise ValueError(f"{c} gap columns for {len(det.temperature_factors)} temperature factors")
            gaps = [np.frombuffer(base64.b64decode(s, validate=True), dtype="<f8").astype(np.float64).reshape(-1, c)
                    for s in f["null_gaps_f8_base64"]]
            if not gaps or min(len(x) for x in gaps) < 1:
                raise ValueError("empty null sample")
            det._set(sigma0_=float(f["sigma0_"]), eps0_=float(f["eps0_"]),
                       grid_=[(int(a), float(b), float(e)) for a, b, e in f["grid_"]])
            det._set_null(gaps, n_train=int(f["n_train_"]))
        except (KeyError, TypeError, ValueError) as e:
            raise VerinferError(f"malformed detector ({type(e).__name__}: {e})", where=where,
                                fix="refit the detector with `verinfer calibrate --detector glrt`") from e
        return det
