"""Token-DiFR against a library of alternative configurations: a max-of-z (GLRT-style) test.

Besides the honest verifier's margin b = min(margin, clip_), the claims are replayed under each
alternative A of the library (e.g. 4-bit weights; temperature 0.9 / 1.1 rescoring) and column A
holds `difr_variants.alternative_evidence(margin, [margin_A], clip_)` = 2b - min(margin_A, clip_) (high
when A's replay reproduces tokens the honest replay does not). Column 0 is b alone, so
misconfigurations outside the library are still tested by the plain clipped margin.
Batch statistic: max over columns of the z-score sqrt(n) (column mean - mu_c) / sd_c, with mu_c,
sd_c from honest train tokens; threshold and tail probability from n_null_batches honest train
batches resampled with replacement (the max of correlated columns has no closed form). Fit on
honest tokens only. Research code of the detection lab: no verinfer command writes the margin_A
columns, so it is not in the detector registry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import norm

from benchmarks.difr_variants import alternative_evidence
from verinfer.detect.clipping import clip_at_quantile, winsorize
from verinfer.scores import score_column
from verinfer.detect.base import ColumnStatistics, decode_groups, encode_f8, group_labels, stratified_subsample
from verinfer.errors import VerinferError


@dataclass(eq=True)
class ReplayLibraryDetector(ColumnStatistics):
    """alternatives: the margin columns of the library's replays; clip_quantile: honest quantile of
    the margin to clip at; target_fpr, n_null_batches, random_state: the resampled null."""

    NAME = "replay-library"
    FORMAT = "verinfer.ReplayLibraryDetector"
    FORMAT_VERSION = 1
    COLUMNS_FIX = ("add one margin column per alternative: the claims replayed under that configuration "
                   "(no verinfer command writes them yet)")

    alternatives: tuple = ("margin_int4", "margin_t0.9", "margin_t1.1")
    clip_quantile: float = 0.999

    def columns(self, table=None) -> tuple[str, ...]:
        return ("margin", *self.alternatives)

    def fit(self, table, groups=None) -> "ReplayLibraryDetector":
        """Learn clip_, mu_, sd_, the null samples and, with `groups` (one label per honest token,
        e.g. its honest configuration), the between-configuration spread tau_ of the column means.
        With groups the threshold guards a NEW honest configuration (random-effects null):
        max over groups of that group's resampled (1 - fpr)-quantile, plus z_{1-fpr} sqrt(n) max_c
        (tau_c / sd_c): honest configurations differ in their mean, and a pooled null would flag
        the noisier ones more and more often as batches grow."""
        self.require_columns(table)
        self.clip_ = clip_at_quantile(score_column(table, "margin"), self.clip_quantile)
        x = self.token_scores(table)
        self.mu_ = x.mean(axis=0)
        self.sd_ = np.maximum(x.std(axis=0, ddof=1), 1e-12)
        samples = stratified_subsample(x, group_labels(groups, len(x)), 200_000, self.random_state)
        means = np.array([xg.mean(axis=0) for xg in samples])
        self.null_samples_ = samples
        self.tau_ = means.std(axis=0, ddof=1) if len(samples) > 1 else np.zeros(x.shape[1])
        self._cache.clear()
        return self

    def token_scores(self, table) -> np.ndarray:
        """[N, 1 + len(alternatives)] per-token evidence columns (see the module docstring)."""
        if not hasattr(self, "clip_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) first")
        self.require_columns(table)
        m = score_column(table, "margin")
        cols = [winsorize(m, self.clip_)] + [alternative_evidence(m, [score_column(table, a)], self.clip_)
                                             for a in self.alternatives]
        return np.stack(cols, axis=1)

    token_columns = token_scores

    def statistic_of_means(self, means_BC: np.ndarray, n_tokens: int) -> np.ndarray:
        """max over columns of sqrt(n) (mean - mu_) / sd_, for rows of column means."""
        return (np.sqrt(n_tokens) * (np.asarray(means_BC) - self.mu_) / self.sd_).max(axis=-1)

    def allowance(self, n_tokens: int) -> float:
        """z_{1-fpr} sqrt(n) max(tau_ / sd_): the between-group allowance (0 without groups)."""
        return float(norm.isf(self.target_fpr) * np.sqrt(n_tokens) * np.max(self.tau_ / self.sd_))

    def _more_tokens(self, stat: float, thr: float, n_tokens: int) -> int | None:
        """z grows as sqrt(n): n* = n (threshold / statistic)^2; None when the statistic is <= 0."""
        if stat > 0 and thr > 0:
            return max(1, int(np.ceil(n_tokens * (thr / stat) ** 2)) - n_tokens)
        return None

    def _verdict_extra(self, x: np.ndarray) -> dict:
        return {"score": "replay-library max-z(" + ", ".join(("margin", *self.alternatives)) + ")"}

    def summary(self) -> str:
        return f"replay library ({', '.join(self.alternatives)}), clip {self.clip_:.4g}, FPR {self.target_fpr}"

    # -- persistence -----------------------------------------------------------------------------
    def _fitted_json(self) -> dict:
        self._check_fitted()
        return {"clip_": self.clip_, "mu_": self.mu_.tolist(), "sd_": self.sd_.tolist(), "tau_": self.tau_.tolist(),
                "n_columns": int(self.mu_.size), "null_samples_f8_base64": [encode_f8(s) for s in self.null_samples_]}

    def _load_fitted(self, f: dict) -> None:
        c = int(f["n_columns"])
        if c != 1 + len(self.alternatives):
            raise ValueError(f"{c} evidence columns for {len(self.alternatives)} alternatives")
        samples = decode_groups(f["null_samples_f8_base64"], c)
        self.clip_ = float(f["clip_"])
        self.mu_, self.sd_, self.tau_ = (np.array(f[k], dtype=np.float64) for k in ("mu_", "sd_", "tau_"))
        if not self.mu_.size == self.sd_.size == self.tau_.size == c:
            raise ValueError(f"mu_, sd_, tau_ must have {c} values")
        self.null_samples_ = samples
        self._cache.clear()
