"""Behaviour is bitwise unchanged by the one-core refactor (issue 13): rerun
benchmarks/refactor_fixtures.py check against tests/fixtures/refactor/ (recorded before it).
Skips (with the reason) on a CPU / torch other than the recording's: bitwise results depend on them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "refactor_fixtures.py"


def run_check(*only: str) -> None:
    args = [a for p in only for a in ("--only", p)]
    r = subprocess.run([sys.executable, str(SCRIPT), "check", *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, f"refactor fixtures differ (exit {r.returncode}):\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"


def test_replay_logits_and_honest_tokens_unchanged():
    """Replay logits (bf16, bf16 with fp32 matmuls, fp32; padded and packed) and one provider's tokens."""
    run_check("replay/", "gen/honest-bf16-b8")


@pytest.mark.slow
def test_every_other_fixture_unchanged():
    """Every provider, noise backend, fingerprint, determinism policy, greedy speculative rule and
    score column: every item but the replay logits, which the test above checks (about a minute)."""
    from benchmarks.refactor_fixtures import items

    others = ("gen/", "det/", "spec/", "score/")
    assert all(it["name"].startswith(others) for it in items())  # a new kind of item is checked here too
    run_check(*others)
