"""Sequential, anytime-valid audits: a test supermartingale (e-process) over a provider's tokens.

Shape key: N = tokens in stream order, B = blocks (claims) in stream order, C = evidence columns
of the detector, L = bets lambda.

For a fitted detector with per-token evidence columns (the glrt: per token, x_c = the log-likelihood ratio of
alternative c against the honest fit, uncapped: `sequential_evidence`) the stream is cut into
blocks, one per claim (consecutive rows of one claim_id; one per token without claim ids), X_bc =
the block's summed evidence, and with bets lambda_l in `lambdas`:

    E_b = 1/(C L) sum_{c,l} prod_{j <= b} exp(lambda_l X_jc - psi_c(lambda_l))

psi_c(lambda) is a per-block allowance on the log-moment-generating-function scale: each honest
calibration group k gives psi_kc(lambda) = log mean_j exp(lambda X_jc) over its claims
(`sequential_blocks`), and psi_c
is `glrt.honest_allowance` of those K values at level alpha (max(max_k, the one-sided prediction
bound of a new honest configuration's value from the K groups)): the composite null is "any honest
configuration", not their pool.

Validity (Ville 1939; Ramdas, Gruenwald, Vovk & Shafer 2023, "Game-theoretic statistics and safe
anytime-valid inference", Statist. Sci. 38(4)): if a provider's claims are independent given the
past with log E exp(lambda X_c) <= psi_c(lambda) for every c and l, every product is a
nonnegative supermartingale starting at 1, so is their average, and
P(sup_t E_t >= 1/alpha) <= alpha. The audit flags at the first t with E_t >= 1/alpha: its false-
positive rate is at most alpha whenever the auditor stops (after any number of claims, chosen by
looking at the data). 1 / sup E is an anytime-valid p-value. The decision is taken at claim ends
(`decided_at_tokens` counts the tokens up to the end of the deciding claim). The assumption is on
the honest configurations (claims independent: seeds and prompts differ; log-MGF within the
allowance), not on tokens: a claim's tokens are dependent, and a per-token e-process flagged 6-7%
of held-out honest streams at alpha 1% on the detection lab; benchmarks/verdicts.py measures the
rate on held-out honest configurations streamed claim by claim.

The mixture over C L components costs log(C L) nats against the best single one; a provider
whose evidence exceeds the allowance in some column makes that component grow exponentially.

null="worst-group" (a detector's `SEQUENTIAL_NULL`): psi_c(lambda) =
max_k psi_kc(lambda), the worst calibrated honest configuration's own log-MGF, the composite
null its fixed-size test uses (flagged above the worst group's quantile). The guarantee is then
stated for providers whose claims' log-MGF is at most the worst calibrated configuration's at
every bet, no wider: the e-process bets on the honest null's own shape (each component is the
likelihood ratio of that null exponentially tilted by lambda against it), and its power comes
close to the fixed-size test's at the same tokens. A detector may also name its bets
(`SEQUENTIAL_LAMBDAS`, on the scale of a claim's summed evidence).

null="scaled" (the greedy detector's default): psi_c(lambda) = f_c max_k psi_kc(lambda), f_c =
`detector.sequential_scale()`, the factor by which a new honest configuration may raise the
worst calibrated one's rate of evidence events (1 + the fixed-size test's between-configuration
allowance over the worst configuration's mean). For claims whose evidence is a compound Poisson
sum of rare events (a greedy claim's near-ties) that is the worst configuration with its event
rate raised by f_c, and it bounds every mean shift of the same size (log-MGF >= lambda x mean);
the guarantee holds for providers whose claims' log-MGF is at most f_c psi_worst at every bet.
"predictive" bounds each bet's log-MGF by its own prediction bound over the groups instead.

null="betting" (the unseeded detectors', `detect.unseeded`): no log-MGF; the per-token betting
e-process of `detect.betting` on the detector's bounded columns (`betting_lower()`) with its
calibrated conditional-mean allowance (`betting_allowance_`), bets `lambdas` read as fractions of
each column's largest safe bet (default `betting.FRACTIONS`). Valid token by token, so the
decision may fall inside a claim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.special import logsumexp

from verinfer.detect.base import Detector, block_sizes
from verinfer.detect.betting import FRACTIONS, betting_log_e
from verinfer.detect.glrt import honest_allowance
from verinfer.detect.verdict import Verdict
from verinfer.errors import VerinferError

LAMBDAS = tuple(2.0 ** -k for k in range(9, -1, -1))  # 1/512 .. 1: a claim's sum is ~its length x a token's
NULLS = ("predictive", "worst-group", "scaled", "betting")
MAX_LAMBDA = 4.0
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
    lambdas: tuple | None = None      # None: the detector's SEQUENTIAL_LAMBDAS, else LAMBDAS
    null: str | None = None           # None: the detector's SEQUENTIAL_NULL, else "predictive"
    psi_LC: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        if not hasattr(self.detector, "sequential_blocks"):
            raise VerinferError(f"a sequential audit needs a detector with per-token evidence columns; the "
                                f"{self.detector.NAME} detector has none",
                                fix="calibrate with `verinfer calibrate --detector glrt` (or clipped-mean) for "
                                    "--sequential")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.null is None:
            self.null = getattr(self.detector, "SEQUENTIAL_NULL", "predictive")
        if self.lambdas is None:
            self.lambdas = FRACTIONS if self.null == "betting" else \
                tuple(getattr(self.detector, "SEQUENTIAL_LAMBDAS", LAMBDAS))
        if not self.lambdas or any(not 0.0 < lam <= MAX_LAMBDA for lam in self.lambdas):
            raise ValueError(f"lambdas must be in (0, {MAX_LAMBDA:g}], got {self.lambdas}")
        if self.null not in NULLS:
            raise ValueError(f"null must be one of {NULLS}, got {self.null!r}")
        if self.null == "betting":
            if not hasattr(self.detector, "betting_lower") or any(lam >= 1.0 for lam in self.lambdas):
                raise ValueError("null 'betting' needs a detector with bounded columns (betting_lower) and bet "
                                 f"fractions in (0, 1), got {self.lambdas}")
            self.psi_LC = np.zeros((len(self.lambdas), 0))
            return
        groups = self.detector.sequential_blocks()
        per_group = np.stack([group_log_mgf(x, self.lambdas) for x in groups])  # [K, L, C]
        k, n_l, n_c = per_group.shape
        if self.null == "worst-group":
            self.psi_LC = per_group.max(axis=0)
        elif self.null == "scaled":
            self.psi_LC = per_group.max(axis=0) * np.asarray(self.detector.sequential_scale(), np.float64)
        else:
            self.psi_LC = honest_allowance(per_group.reshape(k, n_l * n_c), self.alpha).reshape(n_l, n_c)

    @property
    def log_threshold(self) -> float:
        return math.log(1.0 / self.alpha)

    def log_e_values(self, evidence_NC: np.ndarray, claims: np.ndarray | None = None) -> np.ndarray:
        """[N] log E after each token of the stream (evidence in stream order): the value after the
        last completed block (claims: one label per token; None: every token a block), so it moves
        only at a claim's last token."""
        x = np.asarray(evidence_NC, dtype=np.float64)
        if x.ndim == 1:
            x = x[:, None]
        if self.null == "betting":  # valid token by token: E moves at every token
            return betting_log_e(x, self.detector.betting_lower(), self.detector.betting_allowance_, self.lambdas)
        sizes = block_sizes(claims, len(x))
        ends = np.cumsum(sizes)
        block_e = self._log_e_blocks(np.add.reduceat(x, ends - sizes, axis=0) if len(x) else x)
        block_N = np.repeat(np.arange(len(sizes)), sizes)
        before_N = np.concatenate([[0.0], block_e])[block_N]           # E before the token's block
        out = before_N.copy()
        out[ends - 1] = block_e                                        # updated at the block's last token
        return out

    def _log_e_blocks(self, x: np.ndarray) -> np.ndarray:
        """[B] log E after each block of [B, C] block sums."""
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

    def stopping_time(self, evidence_NC: np.ndarray, claims: np.ndarray | None = None) -> int | None:
        """Tokens at which the audit flags (the end of the first claim after which E >= 1/alpha),
        None if it does not."""
        return self.stopping_time_of(self.log_e_values(evidence_NC, claims))

    def verdict(self, table, max_tokens: int | None = None) -> Verdict:
        """The audit of a provider's tokens in stream order (its rows' order): flagged, the tokens at
        which it decided (`decided_at_tokens`, None if undecided), the e-value there (`pooled`) and
        its threshold 1/alpha, the anytime-valid p-value min(1, 1 / sup E_t) over the tokens seen."""
        log_e = self.log_e_values(*self.detector.sequential_evidence(table, max_tokens))
        t = self.stopping_time_of(log_e)
        seen = log_e if t is None else log_e[:t]
        sup = float(seen.max())
        p = float(min(1.0, math.exp(-sup)))
        decision = (f"flagged after {t} tokens: inconsistent with honest inference (anytime-valid)" if t is not None
                    else f"ok: consistent with honest inference over {len(log_e)} tokens (anytime-valid; the audit "
                         f"may continue)")
        return Verdict.of(flagged=t is not None, pooled=math.exp(min(sup, 700.0)), threshold=1.0 / self.alpha,
                          p_value=p, tail_probability=p, p_value_method="anytime-valid e-value (1 / sup E)",
                          n_tokens=int(len(seen)), target_fpr=self.alpha, decided_at_tokens=t,
                          tokens_available=int(len(log_e)), decision=decision, score="sequential-e-process")

    def stopping_time_of(self, log_e: np.ndarray) -> int | None:
        """The first t (1-based) with log_e[t - 1] >= log(1/alpha), None if none."""
        hit = np.flatnonzero(log_e >= self.log_threshold)
        return int(hit[0]) + 1 if hit.size else None


class StreamingAudit:
    """The stop rule of a collection (`collect_claims` of audit-api, `collect_vendor` of the chat
    audits): `new_rows(claims)` gives the score rows of the claims it has not given before, and the
    e-process over every row so far says whether the audit has reached 1/alpha (anytime-valid).

    `new_rows` is the audit's one replay of the growing claims file (`audit.replay.StreamRows`): the
    final verdict reads the same parts, so every claim is replayed once. every: replay and decide
    once `every` new claims have arrived (a batch of claims replays in about the time of one on a
    CPU; a stopping rule that looks less often keeps the guarantee)."""

    def __init__(self, audit: SequentialAudit, new_rows, every: int = 1):
        self.audit, self.new_rows, self.every = audit, new_rows, max(1, int(every))
        self.seen, self.evidence, self.claims, self.n_claims, self.decided = 0, [], [], 0, False

    def __call__(self, claims: list) -> bool:
        if len(claims) - self.seen < self.every:
            return self.decided
        self.seen = len(claims)
        table = self.new_rows(claims)
        if table is not None and table.num_rows:
            x, labels = self.audit.detector.sequential_evidence(table)
            labels = np.zeros(len(x), dtype=np.int64) if labels is None else labels
            self.evidence.append(x)
            self.claims.append(labels + self.n_claims)  # labels unique across calls
            self.n_claims += int(labels.max(initial=-1)) + 1
        if self.evidence:
            self.decided = self.audit.stopping_time(np.concatenate(self.evidence),
                                                    np.concatenate(self.claims)) is not None
        return self.decided
