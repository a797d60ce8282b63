"""apps/speculative.py: `verinfer speculative train-autojudge` trains the head `generate --speculative
autojudge --judge` reads."""

import json

import pytest
from typer.testing import CliRunner

from verinfer.cli.main import app
from verinfer.models.corpus import train_problems
from verinfer.models.testbed import TARGET_DIR
from verinfer.speculative.autojudge import Judge

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built")


@pytest.mark.slow  # mining re-decodes after every mismatch: ~5 s per problem on a busy 2-core machine
def test_train_autojudge_then_generate_with_it(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["speculative", "train-autojudge", "--out", str(tmp_path / "j.json"), "--n", "6"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    n = len(train_problems(6, seed=1))                   # the held-out questions are left out
    assert 0 < n <= 6 and f"mismatches on {n} problems" in r.output
    judge = Judge.from_json(tmp_path / "j.json")
    d = json.loads((tmp_path / "j.json").read_text())
    assert len(d["mean"]) == len(d["coef"]) == judge.coef_D.numel() > 0
    r = runner.invoke(app, ["generate", "--speculative", "autojudge", "--judge", str(tmp_path / "j.json"), "--out",
                            str(tmp_path / "c.jsonl"), "--n", "2", "--max-tokens", "8"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    claims = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert len(claims) == 2 and all(c["spec"]["method"] == "autojudge" for c in claims)


def test_train_autojudge_refuses_an_existing_directory_as_output(tmp_path):
    r = CliRunner().invoke(app, ["speculative", "train-autojudge", "--out", str(tmp_path), "--n", "2"])
    assert r.exit_code == 2
