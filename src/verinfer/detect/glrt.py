"""Token-DiFR as a likelihood-ratio test on the perturbation scale (max-z / max-LLR GLRT).

Per token, d = signed gap of the claimed token's post-Gumbel score to its strongest competitor
(`variants.temperature_gaps`; > 0: the Token-DiFR margin of a token the replay does not reproduce,
< 0: minus the runner-up gap of one it does). Model H(sigma, eps, r): the provider's scores are
the verifier's at r times the claimed temperature plus N(0, sigma^2) per logit, and a fraction eps
of tokens are outliers (`variants.perturbation_loglik`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm

from verinfer.audit.scores import score_column
from verinfer.audit.replay import gap_column, temperature_column
from verinfer.audit.variants import fit_perturbation, perturbation_llr, perturbation_llr_centered
from verinfer.detect.base import (ColumnStatistics, column_names, decode_groups, encode_f8, group_labels,
                                  stratified_subsample)
from verinfer.errors import VerinferError


def gap_columns(table, temperature_factors=(), top_p_slack: float = 0.0) -> np.ndarray:
    """[N, 1 + len(temperature_factors)] signed gaps: column 0 at the claimed temperature (`gap_0`
    of a features table, or `gap` of a score table), then `gapT_{r}` per factor r; with a top-p
    slack tau the columns suffixed `_s{tau}` (`variants.block_gaps(..., top_p_slack=tau)`)."""
    return np.stack([score_column(table, c) for c in _gap_names(column_names(table), temperature_factors, top_p_slack)],
                    axis=1)


def _gap_names(names, temperature_factors, top_p_slack: float) -> tuple[str, ...]:
    first = gap_column(top_p_slack)
    if first not in names:
        first = "gap" + first[len("gap_0"):]
    return (first, *(temperature_column(r, top_p_slack) for r in temperature_factors))


@dataclass(eq=True)
class PerturbationGLRTDetector(ColumnStatistics):
    """fit: (sigma0_, eps0_) by maximum likelihood on honest tokens; the alternatives `grid_` are a
    larger noise scale (sigma0 * sigma_factors: quantization, KV-cache precision), more outliers
    (eps0 * eps_factors: sampling bugs, rare large margins) and another temperature (r in
    temperature_factors, read from the gapT_{r} columns). Column g of the per-token evidence is
    log L(theta_g) - log L(theta0): reproduced tokens with wide gaps carry ~0, near ties and flips
    carry the evidence, and an honest flip at a near tie costs little while a wide-margin flip
    counts heavily (capped by the outlier term). No alternative uses a misconfigured provider's kernel.

    Batch statistic: combine="maxz": max over columns of sqrt(n) (column mean - mu_g) / sd_g with
    mu_, sd_ from honest train tokens; "maxllr": max over columns of n * column mean. Threshold and
    tail probability: n_null_batches honest batches resampled with replacement per honest group
    (e.g. configuration); the worst group's (1 - fpr)-quantile plus a random-effects allowance
    (`allowance`) from tau_ = spread of the group means, so a NEW honest configuration keeps the
    target FPR (as `ClippedMeanDetector`'s stratified null). Fit on honest tokens only.

    Input: a table / dict with the signed-gap columns (`gap_0` or `gap`, and gapT_{r}), written by
    `verinfer score --gaps`.
    """

    NAME = "glrt"
    FORMAT = "verinfer.PerturbationGLRTDetector"
    FORMAT_VERSION = 1
    requires_gaps = True
    REFIT = "refit the detector with `verinfer calibrate --detector glrt`"
    COLUMNS_FIX = ("rescore the claims with `verinfer score --gaps` (or pass the claims JSONL to `verinfer audit`, "
                   "which rescores them)")

    sigma_factors: tuple = (1.5, 2.0, 3.0, 5.0)
    eps_factors: tuple = (10.0, 100.0)
    temperature_factors: tuple = (0.8, 0.9, 1.1, 1.2)
    outlier_p: float = 0.02
    top_p_slack: float = 0.01
    center: bool = True
    combine: str = "maxllr"
    max_null_tokens: int = 200_000

    def __post_init__(self):
        super().__post_init__()
        if any(f <= 1.0 for f in (*self.sigma_factors, *self.eps_factors)):
            raise ValueError("sigma_factors and eps_factors must be > 1 (alternatives beyond the honest fit)")
        if any(r <= 0 or r == 1.0 for r in self.temperature_factors):
            raise ValueError("temperature_factors must be > 0 and != 1")
        if self.combine not in ("maxz", "maxllr"):
            raise ValueError(f"combine must be maxz or maxllr, got {self.combine!r}")

    def columns(self, table=None) -> tuple[str, ...]:
        return _gap_names(column_names(table) if table is not None else (), self.temperature_factors, self.top_p_slack)

    # -- fitting ---------------------------------------------------------------------------------
    def fit(self, table, groups=None) -> "PerturbationGLRTDetector":
        """Learn sigma0_, eps0_, grid_, mu_, sd_, tau_ and the per-group null samples from honest
        (train) tokens; `groups`: one label per token (its honest configuration) for the
        random-effects null."""
        g = self._gaps(table)
        if len(g) < 100:
            raise ValueError(f"only {len(g)} honest tokens; need >= 100 to fit the perturbation model")
        s0, e0 = fit_perturbation(g[:, 0], self.outlier_p)
        grid = [(0, s0 * f, e0) for f in self.sigma_factors] + [(0, s0, e0 * f) for f in self.eps_factors]
        grid += [(j + 1, s0, e0) for j in range(len(self.temperature_factors))]
        eps_max = max(e for _, _, e in grid)
        if eps_max >= 1.0:
            raise ValueError(f"eps0 * max(eps_factors) = {eps_max:.3g} >= 1: honest tokens look like outliers")
        self.sigma0_, self.eps0_ = s0, e0
        self.grid_ = [(int(c), float(s), float(e)) for c, s, e in grid]
        samples = stratified_subsample(g, group_labels(groups, len(g)), self.max_null_tokens, self.random_state)
        self._set_null(samples, n_train=len(g))
        return self

    def _set_null(self, gap_samples: list, n_train: int) -> None:
        xs = [self._llr(s) for s in gap_samples]
        x = np.concatenate(xs)
        means = np.array([xg.mean(axis=0) for xg in xs])
        self.null_gaps_ = gap_samples
        self.null_samples_ = xs
        self.mu_ = x.mean(axis=0)
        self.sd_ = np.maximum(x.std(axis=0, ddof=1), 1e-12)
        self.tau_ = means.std(axis=0, ddof=1) if len(xs) > 1 else np.zeros(x.shape[1])
        self.n_train_ = int(n_train)
        self._cache.clear()

    def _gaps(self, table) -> np.ndarray:
        self.require_columns(table)
        g = gap_columns(table, self.temperature_factors, self.top_p_slack)
        if np.isnan(g).any():
            raise ValueError("signed-gap columns contain NaN: the perturbation GLRT needs Gumbel-noise claims "
                             "(greedy and inverse-cdf claims have no post-Gumbel gap)")
        return g

    def _llr(self, gaps_NC: np.ndarray) -> np.ndarray:
        f = perturbation_llr_centered if self.center else perturbation_llr
        return f(gaps_NC, self.grid_, (self.sigma0_, self.eps0_), self.outlier_p)

    # -- scoring ---------------------------------------------------------------------------------
    def token_scores(self, table) -> np.ndarray:
        """[N, G] per-token log-likelihood ratios of the alternatives against the honest fit."""
        if not hasattr(self, "grid_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) or load a detector file")
        return self._llr(self._gaps(table))

    token_columns = token_scores

    def statistic_of_means(self, means_BC: np.ndarray, n_tokens: int) -> np.ndarray:
        """For rows of column means: combine="maxz": max over columns of sqrt(n) (mean - mu_) / sd_;
        "maxllr": max over columns of n * mean (the GLRT: the batch log-likelihood ratio of the
        best alternative)."""
        if self.combine == "maxllr":
            return (n_tokens * np.asarray(means_BC)).max(axis=-1)
        return (np.sqrt(n_tokens) * (np.asarray(means_BC) - self.mu_) / self.sd_).max(axis=-1)

    def allowance(self, n_tokens: int) -> float:
        """Random-effects allowance for a new honest configuration: z_{1-fpr} sqrt(n) max(tau/sd)
        in z units (maxz), z_{1-fpr} n max(tau) in log-likelihood-ratio units (maxllr)."""
        if self.combine == "maxllr":
            return float(norm.isf(self.target_fpr) * n_tokens * np.max(self.tau_))
        return float(norm.isf(self.target_fpr) * math.sqrt(n_tokens) * np.max(self.tau_ / self.sd_))

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

    def _more_tokens(self, stat: float, thr: float, n_tokens: int) -> int | None:
        n_star = self.tokens_to_flag(stat, n_tokens)
        return None if n_star is None else max(1, n_star - n_tokens)

    def _verdict_extra(self, x: np.ndarray) -> dict:
        n = len(x)
        top = int(np.argmax(np.sqrt(n) * (x.mean(axis=0) - self.mu_) / self.sd_))
        return {"strongest_alternative": self.describe(top), "score": "perturbation-glrt"}

    def describe(self, g: int) -> str:
        """The alternative of column g in words."""
        c, s, e = self.grid_[g]
        if c > 0:
            return f"temperature x{self.temperature_factors[c - 1]:g}"
        if s != self.sigma0_:
            return f"noise sigma x{s / self.sigma0_:.3g}"
        return f"outliers eps x{e / self.eps0_:.3g}"

    def summary(self) -> str:
        return f"perturbation GLRT, sigma0 {self.sigma0_:.4g}, eps0 {self.eps0_:.3g}, FPR {self.target_fpr}"

    # -- persistence -----------------------------------------------------------------------------
    def _fitted_json(self) -> dict:
        """The null is stored as the honest tokens' signed gaps (the log-likelihood-ratio columns are
        recomputed on load)."""
        self._check_fitted()
        return {"sigma0_": self.sigma0_, "eps0_": self.eps0_, "grid_": [list(t) for t in self.grid_],
                "n_train_": self.n_train_, "n_columns": int(self.null_gaps_[0].shape[1]),
                "null_gaps_f8_base64": [encode_f8(s) for s in self.null_gaps_]}

    def _load_fitted(self, f: dict) -> None:
        c = int(f["n_columns"])
        if c != 1 + len(self.temperature_factors):
            raise ValueError(f"{c} gap columns for {len(self.temperature_factors)} temperature factors")
        gaps = decode_groups(f["null_gaps_f8_base64"], c)
        self.sigma0_, self.eps0_ = float(f["sigma0_"]), float(f["eps0_"])
        self.grid_ = [(int(a), float(b), float(e)) for a, b, e in f["grid_"]]
        self._set_null(gaps, n_train=int(f["n_train_"]))
