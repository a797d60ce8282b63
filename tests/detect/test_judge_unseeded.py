"""A vendor judged unseeded (`detect.judge.judge_vendor` with the pit-uniformity detector and no
mismatch-rate test): the row the chat audits write, on synthetic PIT values (uniform = honest)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from verinfer.detect.judge import judge_vendor
from verinfer.detect.registry import make_detector
from verinfer.detect.summary import UNSEEDED_MARGIN_CLIP, margin_clip
from verinfer.scores import CLAIM_ID, CROSS_ENTROPY, ENTROPY, EXACT_MATCH, MARGIN, MODE, PIT


def table(u: np.ndarray, claim_tokens: int = 20) -> pa.Table:
    n = len(u)
    margin = np.where(u >= 1.0, np.inf, 3.0 * u)  # u = 1: outside the kept set (infinite noise-free margin)
    return pa.table({CLAIM_ID: [f"c{i // claim_tokens:04d}" for i in range(n)], PIT: u, MARGIN: margin,
                     CROSS_ENTROPY: np.where(u >= 1.0, np.inf, 1.0 + u), ENTROPY: np.full(n, 1.5),
                     EXACT_MATCH: u < 0.3, MODE: ["unseeded"] * n})


def test_an_unseeded_vendor_gets_a_verdict_without_a_mismatch_test():
    rng = np.random.default_rng(0)
    honest = table(rng.uniform(size=1200))
    det = make_detector("pit-uniformity", random_state=0).fit(honest, groups=np.repeat([0, 1, 2], 400))
    assert margin_clip(det) == UNSEEDED_MARGIN_CLIP == 10.0
    ok = judge_vendor(table(rng.uniform(size=400)), det, None, alpha=0.01, bands={}, name="ok")
    assert ok["mismatch_test"] is None and not ok["verdict"]["flagged"] and ok["tokens_to_decide"] is None
    assert ok["verdict"]["score"] == "sequential-e-process" and ok["verdict"]["fixed_n"]["score"] == "pit-uniformity"
    # too probable tokens (u skewed toward 0: a colder sampler), and a few outside the kept set: flagged by the
    # per-token betting e-process, deciding inside a claim; the margin summary clipped at 10 logits
    u = rng.uniform(size=400) ** 2.0
    u[::50] = 1.0
    bad = judge_vendor(table(u), det, None, alpha=0.01, bands={}, name="cold")
    assert bad["verdict"]["flagged"] and bad["verdict"]["fixed_n"]["flagged"], bad["verdict"]
    assert bad["tokens_to_decide"] < 400 and bad["requests_to_decide"] == -(-bad["tokens_to_decide"] // 20)
    assert bad["margin"]["mean"] <= UNSEEDED_MARGIN_CLIP and np.isfinite(bad["margin"]["mean"])
