"""Clipped-mean batch detector, fit on honest per-token divergence scores only (DiFR 5.2).

    fit:        clip_ = q-quantile of the finite honest values of the score column (oriented higher =
                more divergent, `scores.divergence`); the winsorized honest values are the null
                sample (subsampled, deterministically, to at most 200k tokens)
    score:      mean of the winsorized scores of a batch (higher = more divergent)
    threshold:  (1 - target_fpr)-quantile of n_null_batches resampled honest batch means of the
                batch's size; flagged iff pooled > threshold, so the FPR on fresh honest batches
                is at most about target_fpr
    p_value:    tail probability of the pooled score under the honest null: resampled where at
                least MIN_RESAMPLED_HITS resampled batches reach the observed mean, beyond that the
                saddle-point tail of the same null (`detect.tail.mean_tail`, Lugannani-Rice on the
                null sample's empirical CGF), so p-values are resolved far below 1/(1 + B); the
                Chernoff bound of that tail (conservative) is reported beside it (`p_value_bound`)

Refused at fit (VerinferError): an honest null without spread (every winsorized honest value
equal, e.g. all margins 0: any deviation would flag) and an honest configuration with fewer than
1 / target_fpr tokens. Warned (`warnings_`, printed by `verinfer calibrate`): a clip quantile with
fewer than MIN_ABOVE_CLIP honest tokens above it, a null resting on fewer than MIN_ABOVE_CLIP
tokens off its mode.

Tokens of one claim are not independent (its prompt sets the level of its cross-entropy: a claim's
tokens share it), and audited batches are whole claims. Fit measures each honest group's design
effect from the `claim_id` column (Kish: the variance of a batch mean of whole claims over that of
as many independent tokens, by the ratio estimator deff = sum_c (S_c - m L_c)^2 / (sum_c L_c s^2),
S_c and L_c claim c's winsorized sum and length, m and s^2 the group's mean and variance; at least
1, and 1 without claim ids or with fewer than MIN_CLAIMS_FOR_DEFF claims), and every null
computation of a batch of n tokens uses n / deff effective tokens: the resampled batches, the
normal approximation, the saddle-point tail, tokens_to_flag and power. On the detection lab's
honest claims (64 tokens each) deff is 1.0-1.2 for margin and exact match and 14-16 for
cross-entropy, whose token-level null flagged 18% of held-out honest 1,000-token batches at a 1%
target (`benchmarks/calibration_fpr.py`).

Null batches are resampled from the null sample WITH replacement: audited batches are fresh
draws from the honest population, and drawing without replacement from a finite sample would
shrink the null spread (finite-population correction) and inflate the false-positive rate when
the batch is a sizeable fraction of the sample. Above `MAX_RESAMPLED_TOKENS` draws per threshold
the batch mean is taken as normal (CLT; its skewness shrinks as 1/sqrt(n)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from scipy.stats import norm

from verinfer.detect.clipping import clip_at_quantile, winsorize
from verinfer.scores import ALL_SCORES, ACTIVATION_SCORES, MARGIN, divergence
from verinfer.detect.base import (Detector, claim_labels, decision_text, decode_f8, encode_f8, group_labels, head,
                                  stratified_subsample)
from verinfer.detect.tail import MIN_RESAMPLED_HITS, chernoff_bound, compress, mean_tail, tilt
from verinfer.detect.verdict import Verdict
from verinfer.errors import VerinferError

MAX_NULL_SAMPLE = 200_000
MAX_RESAMPLED_TOKENS = 20_000_000  # n_null_batches * n_tokens above which threshold / p-value use the CLT
MIN_ABOVE_CLIP = 10      # honest tokens above the clip (and off the null's mode) below which fit warns
MIN_CLAIMS_FOR_DEFF = 10  # claims of an honest group below which its design effect is taken as 1 (with a warning)
POWER_EFFECT = 2.0       # the alternative an ok verdict states its power against: the honest mean x this
_CHUNK = 2_000_000  # indices drawn per chunk while resampling


class _Fitted(BaseModel):
    """The "fitted" part of a clipped-mean detector file, validated on load: every number finite
    and in range (scores are divergences, >= 0; the null sample lies in [0, clip_])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    CLIP_IS_A_SAMPLE_VALUE: ClassVar[bool] = True  # the fit clips at a value of its data (not a fixed cap)

    clip_: float = Field(gt=0)
    null_mean_: float = Field(ge=0)
    null_std_: float = Field(ge=0)
    n_train_: int = Field(ge=1)
    null_sample_size: int = Field(ge=1)
    null_group_sizes: list[int]
    design_effects: list[float]
    null_sample_f8_base64: str
    claim_sums_f8_base64: list[str] | None = None  # per group; absent in files fit without claim ids
    claim_lengths_f8_base64: list[str] | None = None  # per group, as the sums; absent in older files

    def claim_sums(self) -> list[np.ndarray] | None:
        if self.claim_sums_f8_base64 is None:
            return None
        out = [decode_f8(t) for t in self.claim_sums_f8_base64]
        if len(out) != len(self.null_group_sizes) or any(s.size == 0 or (s < 0).any() for s in out):
            raise ValueError(f"claim_sums must hold one non-empty list of sums >= 0 per null group "
                             f"({len(self.null_group_sizes)})")
        return out

    def claim_lengths(self, sums: list[np.ndarray] | None) -> list[np.ndarray] | None:
        """Each claim's tokens, per group (the claims of `sums`, in its order); a claim's sum is at
        most clip_ per token."""
        if self.claim_lengths_f8_base64 is None:
            return None
        out = [decode_f8(t) for t in self.claim_lengths_f8_base64]
        if sums is None or [x.size for x in out] != [x.size for x in sums]:
            raise ValueError("claim_lengths must hold one length per claim sum (claim_sums_f8_base64)")
        for g, (n, s) in enumerate(zip(out, sums)):
            if (n < 1).any() or (n != np.round(n)).any() or (s > self.clip_ * n * (1.0 + 1e-9)).any():
                raise ValueError(f"claim_lengths[{g}] must be whole numbers of tokens >= 1, each at least its claim's "
                                 "sum / clip_")
        return [n.astype(np.int64) for n in out]

    def sample(self) -> tuple[np.ndarray, list[int]]:
        s = decode_f8(self.null_sample_f8_base64)
        if s.size != self.null_sample_size:
            raise ValueError(f"null sample has {s.size} values, header says {self.null_sample_size}")
        if sum(self.null_group_sizes) != s.size or min(self.null_group_sizes) < 1:
            raise ValueError(f"null group sizes {self.null_group_sizes} do not add up to the {s.size} null values")
        if len(self.design_effects) != len(self.null_group_sizes) or not all(d >= 1.0 for d in self.design_effects):
            raise ValueError(f"design_effects {self.design_effects} must be one value >= 1 per null group "
                             f"({len(self.null_group_sizes)})")
        bad = ~((s >= 0) & (s <= self.clip_))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"null sample value {i} is {float(s[i])!r}, outside [0, clip_ = {self.clip_}]")
        if self.CLIP_IS_A_SAMPLE_VALUE and self.clip_ > s.max():  # a quantile of its data, which the null reaches
            raise ValueError(f"clip_ = {self.clip_!r} lies above every null value (largest {float(s.max())!r}): "
                             "a fit clips at a value of its own calibration data")
        if self.n_train_ < s.size:
            raise ValueError(f"n_train_ = {self.n_train_} is fewer than the {s.size} null values")
        if max(self.design_effects) > self.n_train_:  # Kish: deff <= the longest claim <= the tokens
            raise ValueError(f"design_effects {self.design_effects} exceed the {self.n_train_} calibration tokens "
                             "(a design effect is at most the longest claim's length)")
        for name, have, want in (("null_mean_", self.null_mean_, float(s.mean())),
                                 ("null_std_", self.null_std_, float(s.std(ddof=1)) if s.size > 1 else 0.0)):
            if not math.isclose(have, want, rel_tol=1e-9, abs_tol=1e-12):
                raise ValueError(f"{name} is {have!r}, the null sample's is {want!r}")
        return s, self.null_group_sizes


def claims_per_group(claims: np.ndarray, labels: np.ndarray) -> list[int]:
    return [int(np.unique(claims[labels == k]).size) for k in range(int(labels.max()) + 1)]


def claim_sums(w: np.ndarray, claims: np.ndarray) -> np.ndarray:
    """Each claim's sum of winsorized scores (claims in order of first appearance)."""
    _, first, inv = np.unique(claims, return_index=True, return_inverse=True)
    return np.bincount(inv.ravel(), weights=w)[np.argsort(first)]


def claim_lengths(claims: np.ndarray) -> np.ndarray:
    """Each claim's number of tokens (claims in order of first appearance, as `claim_sums`)."""
    _, first, inv = np.unique(claims, return_index=True, return_inverse=True)
    return np.bincount(inv.ravel())[np.argsort(first)]


def design_effect_of(sums: np.ndarray, lengths: np.ndarray, mean: float, var: float) -> float:
    """Kish's design effect of batch means of whole claims (module docstring) from the claims'
    sums S_c and lengths L_c: sum_c (S_c - m L_c)^2 / (sum_c L_c s^2), at least 1; 1 with fewer
    than MIN_CLAIMS_FOR_DEFF claims or no variance."""
    if sums.size < MIN_CLAIMS_FOR_DEFF or not var > 0:
        return 1.0
    return max(1.0, float(((sums - mean * lengths) ** 2).sum() / (lengths.sum() * var)))


def design_effect(w: np.ndarray, claims: np.ndarray) -> float:
    """`design_effect_of` the claims of w (m and s^2: w's mean and variance)."""
    _, inv = np.unique(claims, return_inverse=True)
    return design_effect_of(np.bincount(inv, weights=w), np.bincount(inv), w.mean(), float(w.var()))


def kept_design_effect(kept: np.ndarray, sums: np.ndarray, lengths: np.ndarray) -> float:
    """The design effect of a group whose null keeps a subsample `kept` of its values: m from the
    claims (every value), s^2 the kept values' spread around it, which is what the resampled null
    draws from (and what a loaded file can check it against)."""
    mean = float(sums.sum() / lengths.sum())
    return design_effect_of(sums, lengths, mean, float(np.mean((kept - mean) ** 2)))


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
    FORMAT_VERSION = 2  # 2: design_effects (issue 15)
    COLUMNS_FIX = ("rescore the claims with `verinfer score` (fp_l2 needs claims generated with "
                   "`verinfer generate --fingerprint`)")
    JSON_NAMES = {"score_name": "score"}
    FITTED_MODEL = _Fitted

    score_name: str = MARGIN
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
    def _fit(self, table, groups=None) -> None:
        """Learn clip_, null_sample_, null_group_sizes_, null_mean_, null_std_, n_train_ from honest
        (train) rows. `groups` (one label per token row, e.g. the honest configuration) makes the
        null stratified: each honest configuration keeps its own resampled null, and the threshold
        and p-value take the worst one, so no honest configuration is flagged more often than
        target_fpr (a pooled null understates the variation *between* honest configurations)."""
        v = self.values(table)
        if v.size == 0:
            raise ValueError("the honest table is empty: no scored tokens")
        labels = group_labels(groups, v.size)
        sizes = np.bincount(labels)
        need = math.ceil(1.0 / self.target_fpr)
        if sizes.min() < need:
            raise VerinferError(f"an honest configuration has only {int(sizes.min())} scored tokens: too few for a "
                                f"false-positive rate of {self.target_fpr:g} (need >= 1/FPR = {need} per "
                                "configuration)", fix="score more honest claims, or ask for a larger --target-fpr")
        clip = clip_at_quantile(v, self.clip_quantile)
        w = winsorize(v, clip)
        if not w.max() > w.min():
            raise VerinferError(f"degenerate honest null: all {w.size} honest {self.score_name} values are "
                                f"{w.min():g}, so any deviation would be flagged (p = 0) and nothing is calibrated",
                                fix="calibrate on more honest claims (the null needs honest tokens that differ)")
        claims = claim_labels(self.token_rows(table), v.size)
        self.fit_null(w, groups, clip, claims=claims)
        self.warnings_ = self._fit_warnings(v, w, clip)
        if claims is not None:
            few = [k for k, c in enumerate(claims_per_group(claims, labels)) if c < MIN_CLAIMS_FOR_DEFF]
            if few:
                self.warnings_.append(f"{len(few)} honest group(s) hold fewer than {MIN_CLAIMS_FOR_DEFF} claims: their "
                                      "tokens are treated as independent (design effect 1), which understates the "
                                      "spread of whole-claim batches; calibrate on more claims")

    def _fit_warnings(self, v: np.ndarray, w: np.ndarray, clip: float) -> list[str]:
        out = []
        above = int(np.count_nonzero(v > clip))
        if above < MIN_ABOVE_CLIP:
            out.append(f"the clip ({clip:.4g}, the {self.clip_quantile:g} quantile of {v.size} honest tokens) rests "
                       f"on {above} tokens above it (< {MIN_ABOVE_CLIP}): it is poorly estimated; calibrate on "
                       f"more honest tokens (~{math.ceil(MIN_ABOVE_CLIP / max(1e-12, 1 - self.clip_quantile))})")
        vals, counts = np.unique(w, return_counts=True)
        off_mode = int(w.size - counts.max())
        if off_mode < MIN_ABOVE_CLIP:
            out.append(f"only {off_mode} honest tokens differ from the most common value {vals[counts.argmax()]:g}: "
                       "the null's spread rests on them; calibrate on more honest tokens")
        return out

    def fit_null(self, w: np.ndarray, groups, clip: float, claims: np.ndarray | None = None) -> None:
        """The null from winsorized honest values w: per group (one label per value; None: one
        group), its values, or a sorted random subsample of MAX_NULL_SAMPLE / groups of them, and
        its design effect from `claims` (one claim label per value; None: 1; `kept_design_effect`
        for a subsampled group), with its claims' sums and lengths (what a file checks it by)."""
        labels = group_labels(groups, w.size)
        parts = stratified_subsample(w, labels, MAX_NULL_SAMPLE, self.random_state, sort_values=True)
        deff, self.claim_sums_, self.claim_lengths_ = None, None, None
        if claims is not None:
            ks = range(len(parts))
            self.claim_sums_ = [claim_sums(w[labels == k], claims[labels == k]) for k in ks]
            self.claim_lengths_ = [claim_lengths(claims[labels == k]) for k in ks]
            whole = [parts[k].size == np.count_nonzero(labels == k) for k in ks]
            deff = [design_effect(w[labels == k], claims[labels == k]) if whole[k]
                    else kept_design_effect(parts[k], self.claim_sums_[k], self.claim_lengths_[k]) for k in ks]
        self.set_null(np.concatenate(parts), [int(p.size) for p in parts], n_train=int(w.size), clip=clip,
                      design_effects=deff)

    def set_null(self, sample: np.ndarray, group_sizes: list[int], n_train: int, clip: float,
                 mean: float | None = None, std: float | None = None,
                 design_effects: list[float] | None = None) -> None:
        """Set the learned null (fit, load, and detectors that pool their own per-token scores)."""
        self.clip_ = clip
        self.null_sample_ = sample
        self.null_group_sizes_ = group_sizes
        self.design_effects_ = [1.0] * len(group_sizes) if design_effects is None else [float(d) for d in design_effects]
        self.null_mean_ = float(sample.mean()) if mean is None else mean
        self.null_std_ = (float(sample.std(ddof=1)) if sample.size > 1 else 0.0) if std is None else std
        self.n_train_ = n_train
        self._cache.clear()

    def null_shift(self) -> float:
        """What the null's batch means are moved up by before the threshold is taken (0 here; the
        greedy detector's allowance for a new honest configuration)."""
        return 0.0

    def _n_eff(self, n_tokens: float, group: int) -> float:
        """The effective number of independent tokens in a batch of n_tokens tokens of whole
        claims of honest group `group`: n / its design effect, at least 1."""
        return max(1.0, float(n_tokens) / self.design_effects_[group])

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
            out = []
            for g, s in enumerate(self._groups()):
                m = max(1, round(self._n_eff(n, g)))
                per_chunk = max(1, _CHUNK // m)
                means = []
                for start in range(0, self.n_null_batches, per_chunk):
                    k = min(per_chunk, self.n_null_batches - start)
                    means.append(s[rng.integers(0, s.size, (k, m))].mean(axis=1))
                out.append(np.concatenate(means))
            return out

        return self._per_batch_size(n_tokens, compute)

    def _group_stats(self) -> list[tuple[float, float]]:
        return [(float(s.mean()), float(s.std(ddof=1)) if s.size > 1 else 0.0) for s in self._groups()]

    def _worst_group(self, n_tokens: int) -> int:
        n = int(n_tokens)
        if self._normal_approx(n):
            z = norm.isf(self.target_fpr)
            return int(np.argmax([m + z * sd / math.sqrt(self._n_eff(n, g))
                                  for g, (m, sd) in enumerate(self._group_stats())]))
        return int(np.argmax([np.quantile(g, 1.0 - self.target_fpr) for g in self._group_means(n)]))

    def threshold(self, n_tokens: int) -> float:
        """(1 - target_fpr)-quantile of honest batch means of n_tokens tokens (resampled; the
        normal approximation N(mean, std^2 / n) beyond MAX_RESAMPLED_TOKENS); with a stratified
        null, the highest over the honest groups."""
        self._check_fitted()
        n = int(n_tokens)
        if self._normal_approx(n):
            g = self._worst_group(n)
            m, sd = self._group_stats()[g]
            return float(m + norm.isf(self.target_fpr) * sd / math.sqrt(self._n_eff(n, g)))
        return float(np.quantile(self.null_means(n), 1.0 - self.target_fpr))

    def _distributions(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each honest group's null sample as (distinct values, shares) for `detect.tail`; cached."""
        if "dist" not in self._cache:
            self._cache["dist"] = [compress(g) for g in self._groups()]
        return self._cache["dist"]

    def _p_value(self, pooled: float, n: int) -> tuple[float, str]:
        """The largest tail probability over the honest groups (one group unless stratified):
        resampled where at least MIN_RESAMPLED_HITS resampled means reach `pooled`, else the
        saddle-point tail of that group's null sample (no floor at 1 / (1 + B))."""
        best = (-1.0, "saddle-point")
        resampled = [None] * len(self._groups()) if self._normal_approx(n) else self._group_means(n)
        for g, ((values, shares), null) in enumerate(zip(self._distributions(), resampled)):
            k = -1 if null is None else int(np.count_nonzero(null >= pooled))
            if k >= MIN_RESAMPLED_HITS:
                cand = ((k + 1) / (null.size + 1), "resampled")
            else:
                cand = (mean_tail(values, shares, self._n_eff(n, g), pooled), "saddle-point")
            best = max(best, cand, key=lambda t: t[0])
        return best

    def p_value_bound(self, pooled: float, n_tokens: int) -> float:
        """The Chernoff bound of the tail (largest over the honest groups): P(honest batch mean >=
        pooled) <= this, for every batch size; conservative where the saddle-point value is not."""
        self._check_fitted()
        return max(chernoff_bound(v, s, self._n_eff(n_tokens, g), pooled)
                   for g, (v, s) in enumerate(self._distributions()))

    def p_value(self, table) -> float:
        """P(honest batch mean >= observed pooled score) for a batch of the table's tokens:
        (1 + #resampled means >= observed) / (1 + n_null_batches) when at least MIN_RESAMPLED_HITS
        resampled means reach the observed one; beyond that resolution, or above
        MAX_RESAMPLED_TOKENS, the saddle-point tail (`detect.tail.mean_tail`) of the null sample.
        `verdict` says which was used ("resampled" or "saddle-point")."""
        x = self.evidence(table)
        return self._p_value(self.statistic_of(x), x.size)[0]

    def verdict(self, table, max_tokens: int | None = None) -> Verdict:
        """`verdict_from_pooled` of the first max_tokens tokens, and the clip."""
        x = self.evidence(table, max_tokens)
        return self.verdict_from_pooled(self.statistic_of(x), x.size).with_(clip=self.clip_)

    def threshold_fpr(self, n_tokens: int) -> float:
        """False-positive rate of threshold(n) on the honest null: the fraction of resampled honest
        batch means above it (the normal tail beyond MAX_RESAMPLED_TOKENS)."""
        thr = self.threshold(n_tokens) - self.null_shift()
        if self._normal_approx(int(n_tokens)):
            g = self._worst_group(n_tokens)
            m, sd = self._group_stats()[g]
            se = sd / math.sqrt(self._n_eff(n_tokens, g))
            return float(norm.sf(thr, m, se)) if se > 0 else 0.0
        return float(max(np.mean(g > thr) for g in self._group_means(n_tokens)))

    def tokens_to_flag(self, pooled: float, n_tokens: int) -> int | None:
        """Batch size at which a per-token mean of `pooled` would cross the threshold, by the normal
        approximation n* = (z_{1-fpr} sigma / (pooled - null_mean))^2; None if pooled <= null_mean
        (no excess over honest: more tokens would not flag it)."""
        self._check_fitted()
        g = self._worst_group(n_tokens)  # the honest group setting the threshold
        m, sd = self._group_stats()[g]
        excess = pooled - m
        if not excess > 0:
            return None
        if sd == 0:
            return int(n_tokens)
        n_star = math.ceil(self.design_effects_[g] * (norm.isf(self.target_fpr) * sd / excess) ** 2)
        # the resampled threshold can sit above the normal one: never claim fewer tokens than used
        return max(int(n_tokens) + 1, n_star)

    def power(self, n_tokens: int, effect: float = POWER_EFFECT) -> dict | None:
        """What a batch of n_tokens can catch: the probability that it is flagged when the provider
        deviates by `effect`, defined as the honest group that sets the threshold with its per-token
        distribution exponentially tilted to `effect` times its mean (`detect.tail.tilt`: the
        alternative closest to honest with that mean, so more and larger divergent tokens, as a
        misconfiguration gives); P(tilted batch mean > threshold(n)) by the saddle point. 1.0 when
        the tilted mean is out of the null's range (the threshold is then below it). None when the
        honest mean is not positive (a log-likelihood-ratio null: "x times" it states nothing)."""
        n = int(n_tokens)
        thr = self.threshold(n)
        g = self._worst_group(n)
        values, shares = self._distributions()[g]
        mean = float(shares @ values)
        if not mean > 0:
            return None
        alt = {"alternative": f"{effect:g}x the honest mean {self.score_name}", "effect": effect, "n_tokens": n}
        if not values[0] < effect * mean < values[-1]:
            return {**alt, "probability": 1.0 if effect * mean >= values[-1] > thr else 0.0}
        return {**alt, "probability": mean_tail(values, tilt(values, shares, effect * mean), self._n_eff(n, g), thr)}

    def verdict_from_pooled(self, pooled: float, n_tokens: int) -> Verdict:
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
        more, power = None, None
        if not flagged:
            n_star = self.tokens_to_flag(pooled, n)
            more = None if n_star is None else max(1, n_star - n)
            power = self.power(n)
        return Verdict.of(flagged=flagged, pooled=float(pooled), threshold=thr, p_value=p,
                          tail_probability=p, p_value_method=method, p_value_bound=self.p_value_bound(pooled, n),
                          n_tokens=n, target_fpr=self.target_fpr,
                          threshold_fpr=self.threshold_fpr(n), more_tokens_needed=more,
                          detectable_excess=float(thr - self.null_mean_), power=power,
                          decision=decision_text(flagged, more, power),
                          score=self.score_name)

    def summary(self) -> str:
        deff = max(self.design_effects_)
        return (f"{self.score_name}, clip {self.clip_:.4g} at q={self.clip_quantile}, FPR {self.target_fpr}"
                + (f", design effect up to {deff:.3g} (tokens of a claim are correlated: {deff:.3g} of them count as "
                   "one)" if deff > 1.0 else ""))

    # -- sequential (detect.sequential) ----------------------------------------------------------
    def sequential_blocks(self) -> list[np.ndarray]:
        """Per honest group, [n_claims_k, 1] sums over each claim of its winsorized scores in units
        of the clip (each token in [0, 1], the scale of the e-process's bets): the blocks whose
        log-moment generating function bounds the e-process of `detect.sequential` (claims, not
        tokens: a claim's tokens are dependent)."""
        self._check_fitted()
        if getattr(self, "claim_sums_", None) is None:
            raise VerinferError("this clipped-mean detector holds no per-claim honest sums (fit without claim ids, "
                                "or by an older verinfer): a sequential audit cannot bound its honest claims",
                                fix="recalibrate it with `verinfer calibrate` on scored claims")
        return [c[:, None] / self.clip_ for c in self.claim_sums_]

    def sequential_evidence(self, table, max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """The winsorized scores of the first max_tokens token rows in units of the clip ([N, 1])
        and their claim labels."""
        t = head(self.token_rows(table), max_tokens)
        x = self.token_scores(t)
        if len(x) == 0:
            raise ValueError("the batch is empty: no scored tokens")
        return x[:, None] / self.clip_, claim_labels(t, len(x))

    # -- persistence -----------------------------------------------------------------------------
    def _fitted_json(self) -> dict:
        self._check_fitted()
        n = int(self.null_sample_.size)
        return {"clip_": self.clip_, "null_mean_": self.null_mean_, "null_std_": self.null_std_,
                "n_train_": self.n_train_, "null_sample_size": n,
                "null_group_sizes": list(getattr(self, "null_group_sizes_", None) or [n]),
                "design_effects": list(self.design_effects_),
                "null_sample_f8_base64": encode_f8(self.null_sample_),
                **({} if getattr(self, "claim_sums_", None) is None
                   else {"claim_sums_f8_base64": [encode_f8(c) for c in self.claim_sums_]}),
                **({} if getattr(self, "claim_lengths_", None) is None
                   else {"claim_lengths_f8_base64": [encode_f8(n) for n in self.claim_lengths_]})}

    def _load_fitted(self, f: dict) -> None:
        """Validated (`_Fitted`): a field that is missing, NaN, infinite or out of range is refused."""
        try:
            fitted = self.FITTED_MODEL.model_validate(f)
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"field {'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r})") from None
        s, sizes = fitted.sample()
        self.set_null(s, sizes, n_train=fitted.n_train_, clip=fitted.clip_, mean=fitted.null_mean_,
                      std=fitted.null_std_, design_effects=fitted.design_effects)
        self.claim_sums_ = fitted.claim_sums()
        self.claim_lengths_ = fitted.claim_lengths(self.claim_sums_)

    def _check_record(self) -> None:
        """Against the recorded calibration (`_check_calibration`) and the claims' sums and lengths
        (`_check_design_effects`)."""
        if self.calibration_ is not None:
            self._check_calibration(self.calibration_)
        self._check_design_effects()

    def _check_calibration(self, cal) -> None:
        """Its honest configurations are the null's groups (in order), each one's claims are its
        claim sums, its tokens reach 1/target_fpr (fit refuses fewer) and hold its null sample, and
        they add up to n_train_."""
        groups, sums = cal.groups(), getattr(self, "claim_sums_", None)
        if len(groups) != len(self.null_group_sizes_):
            raise ValueError(f"the calibration records {len(groups)} honest configurations "
                             f"({', '.join(k for k, _, _ in groups)}), the null has {len(self.null_group_sizes_)} "
                             "groups (null_group_sizes)")
        need = math.ceil(1.0 / self.target_fpr)
        cap = max(1, MAX_NULL_SAMPLE // len(groups))
        for g, (name, tokens, claims) in enumerate(groups):
            if sums is not None and sums[g].size != claims:
                raise ValueError(f"calibration.claims[{name!r}] = {claims}, but its claim sums "
                                 f"(claim_sums_f8_base64[{g}]) hold {sums[g].size} claims")
            if tokens < need:
                raise ValueError(f"calibration.tokens[{name!r}] = {tokens} is fewer than 1/FPR = {need} for "
                                 f"target_fpr {self.target_fpr:g}: a fit at that target_fpr refuses it")
            size = self.null_group_sizes_[g]
            if size > tokens or (tokens <= cap and size != tokens):
                raise ValueError(f"null_group_sizes[{g}] = {size}, but calibration.tokens[{name!r}] = {tokens} "
                                 f"(the null keeps every token of a configuration, or {cap} of them)")
        if self.score_name not in ACTIVATION_SCORES and sum(cal.tokens.values()) != self.n_train_:
            raise ValueError(f"n_train_ = {self.n_train_} but the recorded calibration has "
                             f"{sum(cal.tokens.values())} tokens")

    def _check_design_effects(self) -> None:
        """Each group's design effect is the one its claims' sums and lengths give (`design_effect_of`;
        `kept_design_effect` where the null subsamples the group), the lengths add up to its tokens
        and the sums to its null sample's where it keeps every token. A file without the lengths
        (an older verinfer's, loaded with the flag): at most `design_effect_bounds`."""
        cal = self.calibration_
        sums, lengths = getattr(self, "claim_sums_", None), getattr(self, "claim_lengths_", None)
        if lengths is None:
            if sums is not None and self.unrecorded_ is None:  # a file of this verinfer: deleted
                raise ValueError("claim_lengths_f8_base64 is missing beside claim_sums_f8_base64 (the design effects "
                                 "are checked by both)")
            for g, (deff, (bound, why)) in enumerate(zip(self.design_effects_, self.design_effect_bounds())):
                if deff > bound * (1.0 + 1e-9):
                    raise ValueError(f"design_effects[{g}] = {deff!r} exceeds {bound}: {why}")
            return
        if sum(int(n.sum()) for n in lengths) != self.n_train_:
            raise ValueError(f"the claim lengths add up to {sum(int(n.sum()) for n in lengths)} tokens, "
                             f"n_train_ = {self.n_train_}")
        names = [k for k, _, _ in cal.groups()] if cal is not None else [None] * len(lengths)
        for g, (deff, kept, s, n, name) in enumerate(zip(self.design_effects_, self._groups(), sums, lengths, names)):
            what = f"{name!r}" if name is not None else f"null group {g}"
            tokens = int(n.sum())
            if kept.size > tokens or (cal is not None and tokens != cal.tokens[name]):
                raise ValueError(f"the claim lengths of {what} (claim_lengths_f8_base64[{g}]) add up to {tokens} "
                                 f"tokens, its null keeps {kept.size}"
                                 + (f" and calibration.tokens records {cal.tokens[name]}" if cal is not None else ""))
            whole = kept.size == tokens
            if whole and not math.isclose(float(s.sum()), float(kept.sum()), rel_tol=1e-9, abs_tol=1e-9):
                raise ValueError(f"the claim sums of {what} (claim_sums_f8_base64[{g}]) add up to "
                                 f"{float(s.sum())!r}, its null sample to {float(kept.sum())!r}")
            want = design_effect_of(s, n, float(kept.mean()), float(kept.var())) if whole else \
                kept_design_effect(kept, s, n)
            if not math.isclose(deff, want, rel_tol=1e-9):
                few = f", fewer than {MIN_CLAIMS_FOR_DEFF}: 1 by construction" if s.size < MIN_CLAIMS_FOR_DEFF else ""
                raise ValueError(f"design_effects[{g}] = {deff!r}, but the claim sums and lengths of {what} give "
                                 f"{want!r} (Kish's design effect of its {s.size} claims{few})")

    def design_effect_bounds(self) -> list[tuple[int, str]]:
        """Per null group, the largest design effect its calibration can produce, and why: 1 for a
        group of fewer than MIN_CLAIMS_FOR_DEFF claims (`design_effect` takes it as 1); else its
        longest possible claim, tokens - claims + 1 (Kish's design effect of batches of whole claims
        is at most the longest claim's length, by Cauchy-Schwarz). Claims: the claim sums' count,
        else the recorded calibration's; tokens: the recorded calibration's, else what n_train_
        leaves beside the other groups' null samples."""
        cal, sums, sizes = self.calibration_, getattr(self, "claim_sums_", None), self.null_group_sizes_
        groups = cal.groups() if cal is not None else [(None, None, None)] * len(sizes)
        out = []
        for g, (name, tokens, claims) in enumerate(groups):
            what = f"honest configuration {name!r}" if name is not None else f"null group {g}"
            claims = sums[g].size if sums is not None else claims
            if tokens is None:
                tokens = self.n_train_ - (sum(sizes) - sizes[g])
            if claims is not None and claims < MIN_CLAIMS_FOR_DEFF:
                out.append((1, f"{what} has {claims} claims, fewer than {MIN_CLAIMS_FOR_DEFF}: its design effect is 1 "
                               "by construction"))
            else:
                longest = max(1, tokens - (claims or 1) + 1)
                n_claims = claims or "an unrecorded number of"
                out.append((longest, f"{what} holds {tokens} tokens in {n_claims} claims, so no claim longer than "
                                     f"{longest} tokens, and a design effect is at most the longest claim's length"))
        return out
