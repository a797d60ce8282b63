"""The honest-quirks battery on `verinfer serve` (benchmarks/quirks_battery.py, issue 45): the shipped
testbed served honestly, audited at temperature 0 with each quirk a vendor's serving layer adds (a
proxy strips whitespace or caps max_tokens; stop strings, which verinfer serve refuses with HTTP 400;
neutral penalties; a reasoning block) and the request fields the chat contract refuses: none is
flagged, the refused ones say why."""

from __future__ import annotations

import pytest

from benchmarks.quirks_battery import QUIRK_KINDS, QUIRKS, run
from verinfer.models.testbed import TARGET_DIR

pytestmark = pytest.mark.slow


def test_no_honest_quirk_is_flagged_on_verinfer_serve(tmp_path):
    rows = run(TARGET_DIR, tmp_path, engine="verinfer", n=20, calib_n=20, max_tokens=32,
               served_name="verinfer-testbed-target")
    served = {q for q, k in QUIRKS.items() if not k.vllm_only}
    assert set(rows) == served | {f"kind:{k}" for k in QUIRK_KINDS[1:]}
    assert [q for q, r in rows.items() if r["flagged"]] == []
    refused = {q: r["reason"] for q, r in rows.items() if r["refused"]}
    assert set(refused) == {"stop-strings", "stop-kept-in-text", "unknown-field", "reasoning-block"}, refused
    assert "stop sequences are not supported" in refused["stop-strings"]   # the server's own 400, named
    assert "vendor_beam_boost" in refused["unknown-field"] and "no reasoning segment" in refused["reasoning-block"]
    assert rows["stripped-whitespace"]["requests"] == 20 and rows["short-max-tokens"]["cut_by_length"] == 20
