"""Sequential, anytime-valid audits: a test supermartingale (e-process) over a provider's tokens.

Shape key: N = tokens in stream order, C = evidence columns of the detector, L = bets lambda.

For a fitted `ColumnStatistics` detector (the glrt: per token t, x_tc = the log-likelihood ratio
of alternative c against the honest fit, `token_scores`) and bets lambda_l in `lambdas`:

    E_t = 1/(C L) sum_{c,l} prod_{s <= t} exp(lambda_l x_sc - psi_c(lambda_l))

psi_c(lambda) is a per-token allowance on the log-moment-generating-function scale: each honest
calibration group k gives psi_kc(lambda) = log mean_s exp(lambda x_sc) over its tokens, and psi_c
is `glrt.honest_allowance` of those K values at level alpha (max(max_k, the one-sided prediction
bound of a new honest configuration's value from the K groups)): the composite null is "any honest
configuration", not their pool.

Validity (Ville 1939; Ramdas, Gruenwald, Vovk & Shafer 2023, "Game-theoretic statistics and safe
anytime-valid inference", Statist. Sci. 38(4)): if a provider's tokens are independent given the
past with log E exp(lambda x_c) <= psi_c(lambda) for every c and l, every product is a
nonnegative supermartingale starting at 1, so is their average, and
P(sup_t E_t >= 1/alpha) <= alpha. The audit flags at the first t with E_t >= 1/alpha: its false-
positive rate is at most alpha whenever the auditor stops (after any number of tokens, chosen by
looking at the data). 1 / sup E_t is an anytime-valid p-value. The assumption is on the honest
configurations (tokens independent, log-MGF within the allowance); benchmarks/verdicts.py measures
the rate on held-out honest configurations streamed claim by claim (within-claim dependence kept).

The mixture over C L components costs log(C L) nats against the best single one; a provider
whose evidence exceeds the allowance in some column makes that component grow exponentially.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.special import logsumexp

from verinfer.detect.base import ColumnStatistics, Detector
from verinfer.detect.glrt import honest_allowance
from verinfer.errors import VerinferError

LAMBDAS = (0.0625, 0.125, 0.25, 0.5, 1.0)
CHUNK = 4096  # tokens per block of the running sums (bounds memory at CHUNK x L x C)


def group_log_mgf(evidence_NC: np.ndarray, lambdas) -> np.ndarray:
    """[L, C] log mean_s exp(lambda_l x_sc) of one group's tokens."""
    x = np.asarray(evidence_NC, dtype=np.float64)
    lam = np.asarray(lambdas, dtype=np.float64)[:, None, None]
    return logsumexp(lam * x[None], axis=1) - math.log(len(x))


@dataclass(eq=False)
class SequentialAudit:
    """The e-process of a fitted detector: `log_e_values` (running log E_t), `verdict` (decision,
    tokens at which it decided, anytime-valid p-value)."""

    detector: Detector
    alpha: float = 0.01
    lambdas: tuple = LAMBDAS
    psi_LC: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.detector, ColumnStatistics):
            raise VerinferError(f"a sequential audit needs a detector with per-token evidence columns; the "
                                f"{self.detector.NAME} detector has none",
                                fix="calibrate with `verinfer calibrate --detector glrt` for --sequential")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if not self.lambdas or any(not 0.0 < lam <= 1.0 for lam in self.lambdas):
            raise ValueError(f"lambdas must be in (0, 1], got {self.lambdas}")
        groups = self.detector.group_evidence()
        per_group = np.stack([group_log_mgf(x, self.lambdas) for x in groups])  # [K, L, C]
        k, n_l, n_c = per_group.shape
        self.psi_LC = honest_allowance(per_group.reshape(k, n_l * n_c), self.alpha).reshape(n_l, n_c)

    @property
    def log_threshold(self) -> float:
        return math.log(1.0 / self.alpha)

    def log_e_values(self, evidence_NC: np.ndarray) -> np.ndarray:
        """[N] log E_t after each token of the stream (evidence in stream order)."""
        x = np.asarray(evidence_NC, dtype=np.float64)
        if x.ndim == 1:
            x = x[:, None]
        lam_K = np.repeat(np.asarray(self.lambdas, dtype=np.float64), x.shape[1])   # K = L x C components
        psi_K = self.psi_LC.reshape(-1)
        total_K = np.zeros(lam_K.size)
        out = []
        for s in range(0, len(x), CHUNK):
            cum_NK = total_K + np.cumsum(np.tile(x[s : s + CHUNK], len(self.lambdas)) * lam_K - psi_K, axis=0)
            total_K = cum_NK[-1]
            top_N = cum_NK.max(axis=1)
            out.append(top_N + np.log(np.exp(cum_NK - top_N[:, None]).mean(axis=1)))
        return np.concatenate(out) if out else np.zeros(0)

    def stopping_time(self, evidence_NC: np.ndarray) -> int | None:
        """Tokens at which the audit flags (the first t with E_t >= 1/alpha), None if it does not."""
        return self.stopping_time_of(self.log_e_values(evidence_NC))

    def verdict(self, table, max_tokens: int | None = None) -> dict:
        """The audit of a provider's tokens in stream order (its rows' order): flagged, the tokens at
        which it decided (`decided_at_tokens`, None if undecided), the e-value there (`pooled`) and
        its threshold 1/alpha, the anytime-valid p-value min(1, 1 / sup E_t) over the tokens seen."""
        log_e = self.log_e_values(self.detector.evidence(table, max_tokens))
        t = self.stopping_time_of(log_e)
        seen = log_e if t is None else log_e[:t]
        sup = float(seen.max())
        p = float(min(1.0, math.exp(-sup)))
        decision = (f"flagged after {t} tokens: inconsistent with honest inference (anytime-valid)" if t is not None
                    else f"ok: consistent with honest inference over {len(log_e)} tokens (anytime-valid; the audit "
                         f"may continue)")
        return {"flagged": t is not None, "pooled": math.exp(min(sup, 700.0)), "threshold": 1.0 / self.alpha,
                "p_value": p, "tail_probability": p, "p_value_method": "anytime-valid e-value (1 / sup E)",
                "n_tokens": int(len(seen)), "target_fpr": self.alpha, "decided_at_tokens": t,
                "tokens_available": int(len(log_e)), "decision": decision, "score": "sequential-e-process"}

    def stopping_time_of(self, log_e: np.ndarray) -> int | None:
        """The first t (1-based) with log_e[t - 1] >= log(1/alpha), None if none."""
        hit = np.flatnonzero(log_e >= self.log_threshold)
        return int(hit[0]) + 1 if hit.size else None
