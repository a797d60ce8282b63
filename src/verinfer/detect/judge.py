"""A provider's scores judged: the verdicts and the numbers every audit reports beside them.

    provider_verdicts  one verdict per provider of a scores table (the demo, `verinfer audit`):
                       the detector's fixed-size test, or with sequential the anytime-valid audit
                       at alpha = its target FPR; each with its held-out FPR from calibration and,
                       where `truth` knows the provider, whether it is honest
    judge_vendor       one vendor's claims in order (the chat audits, audit-log): the anytime-valid
                       verdict (`SequentialAudit`) with the fixed-size one beside it, what deciding
                       took (tokens, requests), the summary and nearest band (`detect.summary`),
                       and the calibrated mismatch-rate test on the same claims (token-difr's
                       statistic with verinfer's pass line and null; sequential and fixed-size;
                       none for unseeded claims, which have no seeded sample to mismatch)
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from verinfer.detect.base import Detector, block_sizes
from verinfer.detect.sequential import SequentialAudit
from verinfer.detect.summary import margin_clip, nearest_band, summarize
from verinfer.detect.verdict import Verdict
from verinfer.scores import CLAIM_ID, CROSS_ENTROPY, EXACT_MATCH, MARGIN, PROVIDER


def provider_verdicts(table: pa.Table, detector: Detector, providers: list[str],
                      held_out: dict[str, pa.Table] | None = None, max_tokens: int | None = None,
                      sequential: bool = False, truth: dict[str, bool] | None = None) -> list[Verdict]:
    """Verdicts with confidence per provider (its held-out rows when given, else its rows of
    `table`; the first max_tokens tokens), with whom they judged, the detector's held-out FPR at
    calibration and `honest` = truth[name] (None for a provider truth does not know)."""
    judge = SequentialAudit(detector, alpha=detector.target_fpr) if sequential else detector
    held = getattr(detector, "calibration_", None) and detector.calibration_.heldout
    verdicts = []
    for name in providers:
        sub = held_out[name] if held_out and name in held_out else table.filter(pc.equal(table[PROVIDER], name))
        v = judge.verdict(sub, max_tokens=max_tokens).with_(provider=name)
        if held and held.batches:  # the FPR measured on held-out honest claims when it was calibrated
            v = v.with_(heldout_fpr=held.fpr, heldout_fpr_batch_tokens=held.batch_tokens)
        verdicts.append(v.with_(honest=(truth or {}).get(name)))
    return verdicts


def decided(tokens: int | None, claim_ends: np.ndarray) -> tuple[int | None, int | None]:
    """(tokens, requests) at which a sequential audit decided (None, None if it did not);
    claim_ends: the cumulative token count at the end of each claim."""
    if tokens is None:
        return None, None
    return int(tokens), int(np.searchsorted(claim_ends, tokens) + 1)


def judge_vendor(table: pa.Table, det: Detector, mismatch: Detector | None, *, alpha: float, bands: dict,
                 name: str, seed: int = 0, stopped_early: bool = False) -> dict:
    """One vendor's row from its scores (claims in the order they were collected): `verdict` (the
    anytime-valid one, `fixed_n` inside), `exact_match`, `margin` / `cross_entropy` / `mismatch`
    summaries, `nearest_band`, `tokens_to_decide` / `requests_to_decide`, `n_tokens` and
    `mismatch_test` (the `mismatch` detector's sequential and fixed-size verdicts on the same
    claims, sequential at the greedy detector's lambdas and null; `cut_short` when the requests
    stopped early, `stopped_early`, because the verdict flagged: the test then saw only those replies;
    None without a `mismatch` detector: unseeded claims). The sequential verdict uses the detector's
    own e-process (`SEQUENTIAL_NULL`: the unseeded detectors' per-token betting one)."""
    v = SequentialAudit(det, alpha=alpha).verdict(table)
    point = summarize(table, margin_clip(det), seed=seed)
    ends = np.cumsum(block_sizes(np.asarray(table[CLAIM_ID].to_pylist()), table.num_rows))
    tokens, requests = decided(v.extra.get("decided_at_tokens"), ends)
    row = {"verdict": v.with_(provider=name, fixed_n=det.verdict(table).to_dict()).to_dict(),
           "n_tokens": int(table.num_rows),
           "exact_match": float(np.mean(table[EXACT_MATCH].to_numpy(zero_copy_only=False))),
           "margin": point[MARGIN], "cross_entropy": point[CROSS_ENTROPY], "mismatch": point["mismatch"],
           "nearest_band": nearest_band(point, bands), "tokens_to_decide": tokens, "requests_to_decide": requests,
           "mismatch_test": None}
    if mismatch is None:
        return row
    mv = SequentialAudit(mismatch, alpha=alpha, lambdas=det.SEQUENTIAL_LAMBDAS, null=det.SEQUENTIAL_NULL).verdict(table)
    fixed = mismatch.verdict(table)
    m_tokens, m_requests = decided(mv.extra.get("decided_at_tokens"), ends)
    return {"verdict": v.with_(provider=name, fixed_n=det.verdict(table).to_dict()).to_dict(),
            "n_tokens": int(table.num_rows),
            "exact_match": float(np.mean(table[EXACT_MATCH].to_numpy(zero_copy_only=False))),
            "margin": point[MARGIN], "cross_entropy": point[CROSS_ENTROPY], "mismatch": point["mismatch"],
            "nearest_band": nearest_band(point, bands), "tokens_to_decide": tokens, "requests_to_decide": requests,
            "mismatch_test": {"flagged": mv.flagged, "p_value": mv.p_value, "tokens_to_decide": m_tokens,
                              "requests_to_decide": m_requests, "cut_short": bool(stopped_early and v.flagged),
                              "fixed_n": {"flagged": fixed.flagged, "p_value": fixed.p_value,
                                          "n_tokens": fixed.n_tokens}}}


__all__ = ["decided", "judge_vendor", "provider_verdicts"]
