"""A demo provider sampling with vLLM Model Runner V2's keyed Gumbel noise (issue 36), through the
CLI on the shipped testbed: `verinfer generate --noise vllm-mrv2-gumbel-fp32` (vLLM's default, fp32),
`score --gaps`, `calibrate --detector glrt` on two honest providers, `audit --sequential` of the
wrong-seed twin. Honest claims replay at exact match >= 0.99; the wrong seed is flagged by the
anytime-valid e-process within 30 tokens."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from verinfer.cli.main import app
from verinfer.claims import read_claims
from verinfer.models.testbed import TARGET_DIR

# generates ~2.4k tokens with three providers and replays them with gaps (~3 minutes on 2 cores)
pytestmark = [pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built"),
              pytest.mark.slow]
NOISE = "vllm-mrv2-gumbel-fp32"


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    d = tmp_path_factory.mktemp("mrv2")
    for name, n, tokens in (("honest-bf16-b8", 24, 48), ("honest-fp32-b4", 24, 48), ("wrong-seed", 6, 24)):
        r = run("generate", name, "--out", d / f"{name}.jsonl", "--n", n, "--max-tokens", tokens, "--noise", NOISE)
        assert r.exit_code == 0, r.output
        r = run("score", d / f"{name}.jsonl", "--out", d / f"{name}.parquet", "--gaps")
        assert r.exit_code == 0, r.output
    return d


def test_honest_mrv2_claims_replay_exactly(scored):
    for name in ("honest-bf16-b8", "honest-fp32-b4"):
        claims = read_claims(scored / f"{name}.jsonl")
        assert {c.sampling.noise for c in claims} == {NOISE}
        exact = pq.read_table(scored / f"{name}.parquet")["exact_match"].to_numpy(zero_copy_only=False)
        print(f"{name}: honest exact match {exact.mean():.4f} over {exact.size} tokens")
        assert exact.size >= 1000 and exact.mean() >= 0.99, (name, exact.mean())


def test_wrong_seed_mrv2_twin_is_flagged_within_30_tokens(scored, tmp_path):
    honest = [scored / "honest-bf16-b8.parquet", scored / "honest-fp32-b4.parquet"]
    r = run("calibrate", *honest, "--out", tmp_path / "glrt.json", "--detector", "glrt")
    assert r.exit_code == 0, r.output
    wrong = pq.read_table(scored / "wrong-seed.parquet")["exact_match"].to_numpy(zero_copy_only=False)
    assert wrong.mean() < 0.8
    r = run("audit", scored / "wrong-seed.parquet", "--detector", tmp_path / "glrt.json", "--sequential",
            "--json", tmp_path / "s.json")
    (s,) = json.loads((tmp_path / "s.json").read_text())
    assert r.exit_code == 1 and s["flagged"], r.output
    assert 1 <= s["decided_at_tokens"] <= 30, s
    for h in honest:  # and the honest providers are not flagged on their own stream
        r = run("audit", h, "--detector", tmp_path / "glrt.json", "--sequential", "--json", tmp_path / "h.json")
        (v,) = json.loads((tmp_path / "h.json").read_text())
        assert r.exit_code == 0 and not v["flagged"], r.output
    print(f"wrong-seed flagged at {s['decided_at_tokens']} tokens; wrong-seed exact match {np.mean(wrong):.3f}")
