"""The unseeded audit from the command line (issue 46): `verinfer generate --unseeded` writes honest
sampled claims without seeds, `calibrate --detector pit-uniformity` calibrates on them, `audit`
passes a held-out honest provider and flags one sampling at temperature 1.1 for 1.0 (both claimed
without seeds); --unseeded is refused where there is nothing sampled to strip."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from verinfer.claims import read_claims
from verinfer.cli.main import app

pytestmark = pytest.mark.slow  # four providers generated and scored (about 30 s on one core)

ARGS = ("--n", 48, "--max-tokens", 48, "--temperature", 1.0, "--top-p", 0.95)


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_generate_unseeded_calibrate_and_audit(tmp_path):
    scores = {}
    for provider, seed in [("honest-bf16-b8", 1), ("honest-fp32-b4", 2), ("honest-bf16-b1", 3), ("temp-1.1", 4)]:
        claims = tmp_path / f"{provider}.jsonl"
        r = run("generate", provider, "--out", claims, "--seed", seed, *ARGS, "--unseeded")
        assert r.exit_code == 0, r.output
        read = read_claims(claims)
        assert len(read) == 48 and all(c.sampling.unseeded and c.sampling.seed is None for c in read)
        raw = json.loads(claims.read_text().splitlines()[0])["sampling"]
        assert raw["seed"] is None and raw["noise"] is None and raw["temperature"] == 1.0
        scores[provider] = tmp_path / f"{provider}.parquet"
        r = run("score", claims, "--out", scores[provider])
        assert r.exit_code == 0, r.output
    det = tmp_path / "pit.json"
    r = run("calibrate", scores["honest-bf16-b8"], scores["honest-fp32-b4"], "--detector", "pit-uniformity", "--out", det)
    assert r.exit_code == 0, r.output
    r = run("audit", scores["honest-bf16-b1"], scores["temp-1.1"], "--detector", det, "--json", tmp_path / "v.json")
    assert r.exit_code == 1, r.output  # temp-1.1 flagged
    verdicts = {v["provider"]: v for v in json.loads((tmp_path / "v.json").read_text())}
    print({k: (v["flagged"], v["p_value"], v["n_tokens"]) for k, v in verdicts.items()})
    assert not verdicts["honest-bf16-b1"]["flagged"] and verdicts["honest-bf16-b1"]["p_value"] > 0.01, verdicts
    assert verdicts["temp-1.1"]["flagged"] and verdicts["temp-1.1"]["p_value"] < 1e-3, verdicts


def test_unseeded_is_refused_without_sampling(tmp_path):
    r = run("generate", "honest-bf16-b8", "--out", tmp_path / "g.jsonl", "--n", 2, "--temperature", 0, "--unseeded")
    assert r.exit_code == 2 and "--unseeded" in r.output and "--temperature > 0" in r.output, r.output
    assert not (tmp_path / "g.jsonl").exists()
