"""apps/files.py: the file jobs behind `verinfer score / calibrate / audit / report`."""

import json

import pyarrow.parquet as pq
import pytest

from verinfer import claims as claims_mod
from verinfer.apps.files import audit_files, calibrate_files, score_file
from verinfer.apps.pipeline import generate
from verinfer.errors import ClaimError
from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR
from verinfer.scores import SCORE_SCHEMA, scores_provenance

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built")


@pytest.fixture(scope="module")
def claims_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    generate("honest-bf16-b8", TARGET_DIR, d / "h.jsonl", n=12, max_tokens=24, show_progress=False)
    return d / "h.jsonl"


def test_score_parses_every_claim_once(claims_file, tmp_path, monkeypatch):
    parsed = []
    real = claims_mod.parse_claim
    monkeypatch.setattr(claims_mod, "parse_claim", lambda obj, where: parsed.append(where) or real(obj, where))
    r = score_file(claims_file, TARGET_DIR, tmp_path / "s.parquet", draft_dir=DRAFT_DIR, show_progress=False)
    n_lines = len(claims_file.read_text().splitlines())
    assert len(parsed) == n_lines == 12 and len(set(parsed)) == n_lines  # each line parsed exactly once
    assert r.scored.claims == 12 and r.speculative is None
    t = pq.read_table(r.out)
    assert t.num_rows == r.scored.tokens and t.schema.names[:len(SCORE_SCHEMA)] == SCORE_SCHEMA.names
    prov = scores_provenance(r.out)
    assert prov.noise == ("vllm-cpu",) and prov.numerics["dtype"] == "bf16"  # provenance always recorded


def test_a_bad_claim_late_in_the_file_stops_the_run_and_keeps_the_finished_parts(claims_file, tmp_path):
    lines = claims_file.read_text().splitlines()
    bad = json.loads(lines[-1])
    bad["output_token_ids"][0] = 10**9                         # outside the vocabulary
    good = [json.loads(line) for line in lines * 6]
    for k, c in enumerate(good + [bad]):
        c["id"] = f"c{k}"
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in good + [bad]) + "\n")  # 72 good claims, then the bad one
    out = tmp_path / "s.parquet"
    with pytest.raises(ClaimError, match="outside the vocabulary"):
        score_file(path, TARGET_DIR, out, draft_dir=DRAFT_DIR, show_progress=False)
    parts = list(out.with_name(out.name + ".parts").glob("part-*.parquet"))
    assert len(parts) == 1 and not out.exists()               # the first 64 claims' part is kept


def test_mixed_speculative_and_plain_claims_are_refused(claims_file, tmp_path):
    lines = claims_file.read_text().splitlines()
    spec = json.loads(lines[0])
    spec["id"] = "speculative-0"
    spec["spec"] = {"method": "standard", "threshold": 0.0, "gamma": 4, "draft": "d",
                    "events": "a" * len(spec["output_token_ids"])}
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines + [json.dumps(spec)]) + "\n")
    with pytest.raises(ClaimError, match="a speculative claim"):
        score_file(path, TARGET_DIR, tmp_path / "s.parquet", draft_dir=DRAFT_DIR, show_progress=False)


def test_calibrate_then_audit_files(claims_file, tmp_path):
    generate("wrong-seed", TARGET_DIR, tmp_path / "w.jsonl", n=6, max_tokens=24, show_progress=False)
    honest = score_file(claims_file, TARGET_DIR, tmp_path / "h.parquet", draft_dir=DRAFT_DIR, show_progress=False)
    # the greedy detector: on machines where the verifier replays these claims exactly (no honest
    # margin above 0) its null is floored, where the clipped mean's is degenerate (an error)
    res = calibrate_files([honest.out], tmp_path / "det.json", detector="greedy", fpr_batch_tokens=50)
    assert res.honest == ["honest-bf16-b8"] and (tmp_path / "det.json").is_file()
    out = audit_files([tmp_path / "w.jsonl"], [tmp_path / "det.json"], model_dir=TARGET_DIR,
                      json_out=tmp_path / "v.json")
    assert out.flagged and out.notes == []
    assert (tmp_path / "w.scores.parquet").is_file()          # a claims input is scored next to it
    (v,) = json.loads((tmp_path / "v.json").read_text())
    assert v["provider"] == "wrong-seed" and v["n_tokens"] == 6 * 24


def test_a_missing_scores_file_is_an_error_not_a_crash(tmp_path):
    from typer.testing import CliRunner

    from verinfer.cli.main import app
    from verinfer.errors import VerinferError

    with pytest.raises(VerinferError, match="no such scores file"):
        calibrate_files([tmp_path / "none.parquet"], tmp_path / "d.json")
    r = CliRunner().invoke(app, ["calibrate", str(tmp_path / "none.parquet"), "-o", str(tmp_path / "d.json")])
    assert r.exit_code == 2 and "no such scores file" in r.output   # 1 would mean "flagged"


def test_audit_refuses_a_detector_without_its_calibration_unless_allowed(claims_file, tmp_path):
    """Issue 45 through the CLI: a detector whose calibration block was deleted is an error (exit 2)
    naming the flag; with the flag every verdict says the calibration was not checked."""
    from typer.testing import CliRunner

    from verinfer.cli.main import app

    honest = score_file(claims_file, TARGET_DIR, tmp_path / "h.parquet", draft_dir=DRAFT_DIR, show_progress=False)
    calibrate_files([honest.out], tmp_path / "det.json", detector="greedy", fpr_batch_tokens=50)
    d = json.loads((tmp_path / "det.json").read_text())
    d.pop("calibration")
    (tmp_path / "stripped.json").write_text(json.dumps(d))
    run = lambda *a: CliRunner().invoke(app, ["audit", str(honest.out), "-d", *map(str, a)])  # noqa: E731
    r = run(tmp_path / "stripped.json")
    assert r.exit_code == 2 and "records no calibration" in r.output and "--allow-unrecorded-calibration" in r.output
    r = run(tmp_path / "stripped.json", "--allow-unrecorded-calibration", "--json", tmp_path / "v.json")
    assert r.exit_code == 0 and "calibration unchecked (--allow-unrecorded-calibration)" in " ".join(r.output.split())
    (v,) = json.loads((tmp_path / "v.json").read_text())
    assert v["calibration"] == "unchecked (--allow-unrecorded-calibration)"
    r = run(tmp_path / "det.json", "--json", tmp_path / "v.json")
    assert r.exit_code == 0 and "calibration" not in json.loads((tmp_path / "v.json").read_text())[0]
