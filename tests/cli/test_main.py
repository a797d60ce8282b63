"""The CLI end to end on the shipped testbed: generate -> score -> calibrate -> audit, and bad input."""

import importlib
import json
import re
import subprocess
import typing
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from verinfer.cli.main import app
from verinfer.core.completions import MODES
from verinfer.scores import ALL_SCORES
from verinfer.determinism.scheduler import POLICIES
from verinfer.models.testbed import BUDGETS, TARGET_DIR
from verinfer.providers.simulated import MISCONFIGURED
from verinfer.sampling.params import NOISE_BACKENDS
from verinfer.server.registry import DETERMINISTIC
from verinfer.speculative.rules import RULES

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built")
runner = CliRunner()
cli = importlib.import_module("verinfer.cli.main")  # the module (verinfer.cli.main is also its main function)


def run(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    out = {}
    for name, n, tokens in (("honest-bf16-b8", 24, 48), ("honest-fp32-b4", 24, 48), ("wrong-seed", 6, 24)):
        # honest: ~1.1k tokens each, so the null holds honest mismatches (6 x 24 tokens were all exact
        # matches: a degenerate null, refused since issue 15)
        r = run("generate", name, "--out", d / f"{name}.jsonl", "--n", n, "--max-tokens", tokens)
        assert r.exit_code == 0, r.output
        r = run("score", d / f"{name}.jsonl", "--out", d / f"{name}.parquet")
        assert r.exit_code == 0, r.output
        out[name] = d / f"{name}.parquet"
    return d, out


def test_generate_score_calibrate_audit(scored):
    d, p = scored
    r = run("calibrate", p["honest-bf16-b8"], p["honest-fp32-b4"], "--out", d / "det.json")
    assert r.exit_code == 0, r.output
    r = run("audit", p["wrong-seed"], "--detector", d / "det.json", "--json", d / "v.json")
    assert r.exit_code == 1  # flagged -> non-zero exit, like a failing check
    (v,) = json.loads((d / "v.json").read_text())
    assert v["provider"] == "wrong-seed" and v["flagged"] and v["n_tokens"] == 6 * 24 and v["p_value"] < 0.01
    claims = [json.loads(line) for line in (d / "wrong-seed.jsonl").read_text().splitlines()]
    assert all(c["model"] == claims[0]["model"] and "seed" in c["sampling"] for c in claims)


def test_degenerate_calibration_is_refused(scored, tmp_path):
    """Issue 15: with 16 calibration requests every honest margin was 0, the threshold became 0 and
    an honest server was flagged at p = 0. calibrate now refuses such a null, and too few tokens for
    the FPR asked, with what and the fix (exit 2), and writes no detector. (One request at a time:
    honest-bf16-b8's split-K batches leave a nonzero margin among 64 tokens.)"""
    d, _ = scored
    r = run("generate", "honest-bf16-b1", "--out", tmp_path / "few.jsonl", "--n", 4, "--max-tokens", 16)
    assert r.exit_code == 0, r.output
    assert run("score", tmp_path / "few.jsonl", "--out", tmp_path / "few.parquet").exit_code == 0
    r = run("calibrate", tmp_path / "few.parquet", "--out", tmp_path / "det.json", "--target-fpr", 0.05)
    assert r.exit_code == 2 and "degenerate honest null: all 64 honest margin values are 0" in r.output, r.output
    assert "more honest claims" in r.output and not (tmp_path / "det.json").exists()
    r = run("calibrate", tmp_path / "few.parquet", "--out", tmp_path / "det.json")
    assert r.exit_code == 2 and "only 64 scored tokens" in r.output and "1/FPR = 100" in r.output, r.output


def test_bad_claims_exit_2_with_file_line_field(scored, tmp_path):
    d, _ = scored
    lines = (d / "honest-bf16-b8.jsonl").read_text().splitlines()
    bad = json.loads(lines[1])
    bad["output_token_ids"][3] = 10**6
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join([lines[0], json.dumps(bad)]) + "\n")
    r = run("score", f, "--out", tmp_path / "s.parquet")
    assert r.exit_code == 2 and "outside the vocabulary" in r.output and not (tmp_path / "s.parquet").exists()
    bad = json.loads(lines[1])
    bad["model"] = "some-other-model"
    f.write_text(json.dumps(bad) + "\n")
    r = run("score", f, "--out", tmp_path / "s.parquet")
    assert r.exit_code == 2 and "some-other-model" in r.output
    f.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    r = run("score", f, "--out", tmp_path / "s.parquet")
    assert r.exit_code == 2 and f"{f}:2" in r.output and "truncated" in r.output
    (tmp_path / "t.parquet").write_bytes(b"PAR1garbage")
    r = run("audit", tmp_path / "t.parquet", "--detector", d / "det.json")
    assert r.exit_code == 2


@pytest.mark.slow  # the whole demo twice: 12.6 s wall in the fast tier, 15.5 s CPU (2 cores, 2026-11-26)
def test_demo_small(tmp_path):
    # 16 requests: half of each honest provider's 256 tokens calibrate (>= 1/FPR = 100 tokens each)
    r = run("demo", "--out", tmp_path / "demo", "--n", 16, "--max-tokens", 16, "--quiet", "--audit-tokens", 48)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "demo" / "report.html").is_file()
    verdicts = json.loads((tmp_path / "demo" / "verdicts.json").read_text())
    assert len(verdicts) == 10 and {v["provider"] for v in verdicts} >= {"int4", "honest-bf16-b8"}
    from verinfer.models.load import model_info

    info, html = model_info(TARGET_DIR), (tmp_path / "demo" / "report.html").read_text()
    assert f'id="model">{info.name}<' in html and f'id="weights">{info.weights_sha256}<' in html
    assert 'id="sampling">temperature 1.0, top_k 50, top_p 0.95, min_p 0.0, noise vllm-cpu, max_tokens 16, seed 0<' in html
    flagged = sum(v["flagged"] for v in verdicts if not v["honest"])
    assert f"{flagged} of 5 audited providers flagged" in html
    # the run's settings are recorded; a rerun with others is refused before any work (not mixed in)
    assert json.loads((tmp_path / "demo" / "demo.json").read_text()) == dict(
        model=info.name, weights_sha256=info.weights_sha256, n=16, max_tokens=16, seed=0)
    r = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo"), "--n", "8", "--max-tokens", "16", "--quiet"])
    assert r.exit_code == 2 and "a demo run with other settings (different n)" in r.output, r.output
    # resuming with the same settings recomputes nothing: the claims stay as they were
    before = (tmp_path / "demo" / "claims" / "int4.jsonl").stat().st_mtime_ns
    r = run("demo", "--out", tmp_path / "demo", "--n", 16, "--max-tokens", 16, "--quiet", "--audit-tokens", 48)
    assert r.exit_code == 0 and (tmp_path / "demo" / "claims" / "int4.jsonl").stat().st_mtime_ns == before


def test_demo_model_option_takes_a_directory_and_refuses_a_missing_one(tmp_path):
    r = runner.invoke(app, ["demo", "--out", str(tmp_path / "d"), "--model", str(tmp_path / "nope"), "--quiet"])
    assert r.exit_code == 2 and "nope" in r.output
    assert not (tmp_path / "d").exists()


def test_fingerprints_generate_calibrate_and_combined_audit(tmp_path):
    """generate --fingerprint, score (fp_l2), calibrate --score fp_l2, audit with Token-DiFR and
    Activation-DiFR detectors combined."""
    p = {}
    for name in ("honest-bf16-b8", "honest-bf16-b1", "int4"):
        # 26 requests: 208 logged positions per honest file, >= 1/FPR for the fp_l2 detector at 0.005
        r = run("generate", name, "--out", tmp_path / f"{name}.jsonl", "--n", 26 if name != "int4" else 4,
                "--max-tokens", 16, "--fingerprint", "k=8,stride=2")
        assert r.exit_code == 0, r.output
        r = run("score", tmp_path / f"{name}.jsonl", "--out", tmp_path / f"{name}.parquet")
        assert r.exit_code == 0, r.output
        p[name] = tmp_path / f"{name}.parquet"
    c = json.loads((tmp_path / "int4.jsonl").read_text().splitlines()[0])
    assert c["activations"]["k"] == 8 and c["activations"]["positions"] == list(range(0, 16, 2))
    honest = [p["honest-bf16-b8"], p["honest-bf16-b1"]]
    assert run("calibrate", *honest, "--out", tmp_path / "tok.json", "--target-fpr", 0.005).exit_code == 0
    r = run("calibrate", *honest, "--out", tmp_path / "fp.json", "--score", "fp_l2", "--target-fpr", 0.005)
    assert r.exit_code == 0, r.output
    r = run("audit", p["int4"], "-d", tmp_path / "tok.json", "-d", tmp_path / "fp.json", "--json", tmp_path / "v.json")
    assert r.exit_code == 1, r.output
    v = {d["provider"]: d for d in json.loads((tmp_path / "v.json").read_text())}
    assert v["int4 [fp_l2]"]["flagged"] and v["int4 [fp_l2]"]["n_tokens"] == 4 * 8
    assert v["int4 [combined]"]["flagged"] and v["int4 [combined]"]["target_fpr"] == pytest.approx(0.01)
    r = run("generate", "int4", "--out", tmp_path / "x.jsonl", "--fingerprint", "k=8,strid=2")
    assert r.exit_code == 2 and "unknown key" in r.output


def test_glrt_detector_calibrate_and_audit(scored, tmp_path):
    """The detection lab's `best` (perturbation GLRT) through the CLI: score --gaps, calibrate
    --detector glrt, audit of claims JSONL (rescored with gaps) with the verdict's confidence fields."""
    d, _ = scored
    honest = []
    for name in ("honest-bf16-b8", "honest-fp32-b4"):
        r = run("score", d / f"{name}.jsonl", "--out", tmp_path / f"{name}.parquet", "--gaps")
        assert r.exit_code == 0, r.output
        honest.append(tmp_path / f"{name}.parquet")
    r = run("calibrate", *[d / "honest-bf16-b8.parquet"], "--out", tmp_path / "nogap.json", "--detector", "glrt")
    assert r.exit_code == 2 and "--gaps" in r.output                     # scores without the gap columns
    r = run("calibrate", *honest, "--out", tmp_path / "glrt.json", "--detector", "glrt")
    assert r.exit_code == 0 and "perturbation GLRT on the honest-reference envelope" in r.output, r.output
    assert "warning: the GLRT null rests on 2 honest configuration(s)" in r.output     # fewer than 3
    assert json.loads((tmp_path / "glrt.json").read_text())["format"] == "verinfer.PerturbationGLRTDetector"
    import shutil

    shutil.copy(d / "wrong-seed.jsonl", tmp_path / "wrong-seed.jsonl")
    r = run("audit", tmp_path / "wrong-seed.jsonl", "--detector", tmp_path / "glrt.json", "--json", tmp_path / "v.json")
    assert r.exit_code == 1, r.output
    (v,) = json.loads((tmp_path / "v.json").read_text())
    assert v["flagged"] and v["n_tokens"] == 6 * 24 and v["p_value"] < 0.01 and v["target_fpr"] == 0.01
    assert 0 <= v["threshold_fpr"] <= 0.011 and v["more_tokens_needed"] is None and v["score"] == "perturbation-glrt"
    r = run("audit", honest[0], "--detector", tmp_path / "glrt.json", "--json", tmp_path / "h.json", "--max-tokens", 20)
    (h,) = json.loads((tmp_path / "h.json").read_text())
    assert r.exit_code == (1 if h["flagged"] else 0) and h["n_tokens"] == 20 and 0 < h["tail_probability"] <= 1
    assert "more_tokens_needed" in h
    # the anytime-valid audit: decides on the stream, says after how many tokens
    r = run("audit", tmp_path / "wrong-seed.scores.parquet", "--detector", tmp_path / "glrt.json", "--sequential",
            "--json", tmp_path / "s.json")
    (s,) = json.loads((tmp_path / "s.json").read_text())
    assert r.exit_code == 1 and s["flagged"] and s["score"] == "sequential-e-process", r.output
    assert 1 <= s["decided_at_tokens"] == s["n_tokens"] < 6 * 24 and s["pooled"] >= 100 and s["p_value"] <= 0.01


def test_calibrate_and_audit_go_through_the_detector_registry(scored, tmp_path):
    """Every registered detector is a `--detector` choice; options a detector does not take, unknown
    names, missing columns and files of an unknown format exit 2 with what / where / fix."""
    d, _ = scored
    h = d / "honest-bf16-b8.parquet"
    r = run("calibrate", h, "--out", tmp_path / "x.json", "--detector", "nope")
    assert r.exit_code == 2 and "'nope' is not one of" in r.output and "clipped-mean" in r.output  # a usage error
    r = run("calibrate", h, "--out", tmp_path / "x.json", "--detector", "glrt", "--score", "fp_l2")
    assert r.exit_code == 2 and "takes no option score_name" in r.output
    r = run("calibrate", h, "--out", tmp_path / "x.json", "--detector", "likelihood-ratio")
    assert r.exit_code == 2 and "logit_gap" in r.output and "likelihood-ratio detector" in r.output
    (tmp_path / "bad.json").write_text('{"format": "verinfer.Nope"}')
    r = run("audit", h, "--detector", tmp_path / "bad.json")
    assert r.exit_code == 2 and "not a verinfer detector file" in r.output and "verinfer.Nope" in r.output


def test_unwritable_outputs_fail_before_any_compute(scored, tmp_path):
    """Every command refuses an output path that is a directory or lies under a file with exit 2
    and what/where/fix, before computing (calibrate, report, audit --json, determinism calibrate
    and audit-api raised tracebacks; audit --json after printing its verdicts, exit 1)."""
    d, p = scored
    (tmp_path / "f").write_text("a file")
    (tmp_path / "d").mkdir()
    claims = tmp_path / "c.jsonl"
    claims.write_text(json.dumps({"id": "a", "model": TARGET_DIR.name, "prompt_token_ids": [1, 2],
                                  "output_token_ids": [3], "sampling": {"temperature": 0.0}}) + "\n")
    det = tmp_path / "det.json"
    assert run("calibrate", p["honest-bf16-b8"], "--out", det).exit_code == 0
    dead = ("audit-api", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--mode", "seeded")
    for bad in (tmp_path / "d", tmp_path / "f" / "x.json"):
        for args in (("generate", "honest-bf16-b8", "--out", bad),
                     ("generate", "--deterministic", "best", "--out", bad),
                     ("generate", "--speculative", "standard", "--out", bad),
                     ("score", claims, "--out", bad),
                     ("calibrate", p["honest-bf16-b8"], "--out", bad),
                     ("audit", p["honest-bf16-b8"], "-d", det, "--json", bad),
                     ("determinism", "calibrate", "--out", bad),
                     (*dead, "--out", tmp_path / "aa", "--detector", bad)):
            r = run(*args)  # catch_exceptions=False: a traceback fails the test
            assert r.exit_code == 2, (args, r.output)
            assert ("lies under a file" in r.output or "is a directory" in r.output) and str(bad) in r.output, r.output
            assert "DiFR verdicts" not in r.output and "->" in r.output  # no verdicts printed first; a fix
    for bad in (tmp_path / "f", tmp_path / "f" / "sub"):  # directory outputs: a file, or under one
        for args in (("report", p["honest-bf16-b8"], "--out", bad), (*dead, "--out", bad)):
            r = run(*args)
            assert r.exit_code == 2 and str(bad) in r.output, (args, r.output)
            assert "is a file, not a directory" in r.output or "lies under a file" in r.output, r.output


def test_calibrate_help_names_every_registered_detector():
    from verinfer.detect import DETECTORS

    r = run("calibrate", "--help")
    assert all(name in r.output for name in DETECTORS), r.output


def test_ctrl_c_says_what_is_kept_and_how_to_resume_then_the_rerun_resumes(tmp_path, monkeypatch):
    """Ctrl-C during `score` (after its first part): exit 130 and a line saying finished parts
    are kept and to rerun the same command (it printed an empty line); the rerun resumes, scoring
    only what was not finished."""
    import functools

    from verinfer.audit import score_file
    from verinfer.audit import replay

    claims, out = tmp_path / "c.jsonl", tmp_path / "s.parquet"
    assert run("generate", "honest-bf16-b8", "--out", claims, "--n", 4, "--max-tokens", 4).exit_code == 0
    monkeypatch.setattr(score_file, "score_claims", functools.partial(replay.score_claims, chunk_claims=2))
    real, calls = replay.score_chunk, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(replay, "score_chunk", interrupted)
    r = run("score", claims, "--out", out)
    assert r.exit_code == 130
    assert "interrupted" in r.output and "finished work is kept" in r.output and "run the same command again" in r.output
    assert len(list(out.with_name(out.name + ".parts").glob("part-*.parquet"))) == 1 and not out.exists()
    calls.clear()
    r = run("score", claims, "--out", out)
    assert r.exit_code == 0 and len(calls) == 1 and out.is_file()


def test_report_and_audit_read_scores_with_and_without_gaps_together(scored, tmp_path):
    """`verinfer report *.parquet` over files scored with and without --gaps (it failed with a raw
    pyarrow schema dump): the rows of both, on their shared columns; a detector that needs the
    gap columns names them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verinfer.scores import load_score_tables

    d, out = scored
    gaps = tmp_path / "wrong-seed-gaps.parquet"
    assert run("score", d / "wrong-seed.jsonl", "--out", gaps, "--gaps").exit_code == 0
    plain = out["honest-bf16-b8"]
    t = load_score_tables([plain, gaps])
    assert t.num_rows == pq.read_metadata(plain).num_rows + pq.read_metadata(gaps).num_rows
    assert t.column_names == pq.read_schema(plain).names
    r = run("report", plain, gaps, "--out", tmp_path / "report")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "report" / "index.html").is_file() or list((tmp_path / "report").glob("*.html"))
    odd = tmp_path / "odd.parquet"  # a column of another type: an error naming the file
    pq.write_table(pq.read_table(plain).set_column(5, "margin", pa.array(["x"] * pq.read_metadata(plain).num_rows)), odd)
    r = run("report", plain, odd, "--out", tmp_path / "report2")
    assert r.exit_code == 2 and str(odd) in r.output and "column margin: string, not a number" in r.output


def test_report_names_the_model_given_and_says_not_recorded_otherwise(scored, tmp_path):
    """Scores files do not record the model: `verinfer report --model` names it (and its weights
    hash) on the page; without it the page says so rather than leaving the model out."""
    from verinfer.models.load import model_info

    _, out = scored
    files = [out["honest-bf16-b8"], out["wrong-seed"]]
    r = run("report", *files, "--out", tmp_path / "named", "--model", TARGET_DIR)
    assert r.exit_code == 0, r.output
    info, html = model_info(TARGET_DIR), (tmp_path / "named" / "report.html").read_text()
    assert f'id="model">{info.name}<' in html and f'id="weights">{info.weights_sha256}<' in html
    assert "AUC@1%FPR reaches 0.99 for wrong-seed" in html
    r = run("report", *files, "--out", tmp_path / "plain")
    assert r.exit_code == 0, r.output
    assert 'id="model">not recorded<' in (tmp_path / "plain" / "report.html").read_text()


def _commands(group, path=()):
    """(command path, click command) of every command and group of the CLI."""
    yield path, group
    for name, cmd in getattr(group, "commands", {}).items():
        yield from _commands(cmd, (*path, name))


def test_help_shows_no_bool_type_and_every_option_has_help():
    """Flags showed `<bool>` in help (typer's rendering) and many options had no help text."""
    root = typer.main.get_command(app)
    missing = []
    for path, cmd in _commands(root):
        r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0 and "<bool>" not in r.output, (path, r.output)
        missing += [f"{' '.join(path)} {p.opts[0]}" for p in cmd.params
                    if p.param_type_name == "option" and not p.help and p.name != "help"]
    assert not missing, missing


def test_option_choices_are_the_librarys_values_and_others_exit_2():
    from verinfer.cli.options import choices_of
    from verinfer.detect import DETECTORS
    from verinfer.models.draft import BUDGETS as DRAFT_BUDGETS
    from verinfer.numerics.config import VERIFIER_MATMULS

    values = lambda command, param: set(choices_of(command, param).choices)  # noqa: E731
    assert values("generate", "noise") == set(NOISE_BACKENDS) - {"speculative-keyed"}  # its own stream, not a claim's
    assert values("generate", "deterministic") == set(POLICIES) and values("generate", "speculative") == set(RULES)
    assert values("audit-api", "mode") == set(MODES) and values("serve", "misconfig") == set(MISCONFIGURED)
    assert values("calibrate", "score_name") == set(ALL_SCORES) and values("calibrate", "kind") == set(DETECTORS)
    assert values("serve", "deterministic") == set(DETERMINISTIC) and values("build", "budget") == set(BUDGETS)
    assert values("build-draft", "budget") == set(DRAFT_BUDGETS) and values("score", "matmul") == set(VERIFIER_MATMULS)
    r = runner.invoke(app, ["generate", "-o", "c.jsonl", "--noise", "speculative-keyed"])
    assert r.exit_code == 2 and "vllm-cpu" in r.output
    r = runner.invoke(app, ["score", "x.jsonl", "-o", "y.parquet", "--matmul", "fp16"])
    assert r.exit_code == 2 and "fp16" in r.output and "native" in r.output and "fp32" in r.output
    r = runner.invoke(app, ["calibrate", "--help"], env={"COLUMNS": "200"})
    assert "margin|likelihood|exact_match|cross_entropy|fp_l2" in r.output


README = Path(__file__).resolve().parents[2] / "README.md"


def test_help_agrees_with_the_readme():
    """testbed build said 15 minutes (README: ~10); --matmul promised "1.5x faster" replay, which
    measured slower than native on real claims on another CPU (the README: time both)."""
    readme = README.read_text()
    minutes = re.search(r"verinfer testbed build .*~(\d+) min", readme).group(1)
    r = runner.invoke(app, ["testbed", "build", "--help"], env={"COLUMNS": "200"})
    assert f"about {minutes} minutes" in r.output, r.output
    for cmd in ("score", "audit-api"):
        r = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
        flat = " ".join(r.output.replace("│", " ").split())  # the text, whatever the help's line wrapping
        assert "--matmul" in flat and "faster replay" not in flat and "1.5x" not in flat
        assert "depends on the CPU" in flat


def test_readme_quick_start_puts_verinfer_on_the_path():
    """The quick start never activated the venv, though every later command is a bare `verinfer`."""
    quick = README.read_text().split("## Quick start", 1)[1].split("## ", 1)[0]
    block = quick.split("```bash", 1)[1].split("```", 1)[0]
    assert ". .venv/bin/activate" in block
    assert not re.search(r"(^|[;&|]\s*)verinfer ", block, re.M)  # inside the block: .venv/bin/verinfer


def test_readme_says_where_chat_responses_put_prompt_token_ids():
    server = README.read_text().split("## Serving and auditing real endpoints", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"`prompt_token_ids`[^.]*for chat, at the top level of the\s+response", server), server


def test_testbed_checkpoints_are_ignored_by_git():
    """`testbed build` leaves a 46 MB .ckpt/ in the testbed directory that git did not ignore."""
    repo = README.parent
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    ckpt = TARGET_DIR.parent / ".ckpt" / "target.safetensors"
    r = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", str(ckpt)])
    assert r.returncode == 0


def test_audit_inputs_are_keyed_per_file(scored, tmp_path):
    """Issue 15 item 5: the same file twice and a claim in two files are errors (they counted twice:
    p 4e-130 -> 7e-258); claims without a provider take the file's stem (or --provider) instead of
    merging into one `unknown` row; a provider in two files gets a row per file unless --merge."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    d, p = scored
    det = tmp_path / "det.json"
    assert run("calibrate", p["honest-bf16-b8"], p["honest-fp32-b4"], "--out", det).exit_code == 0

    def audit(*inputs, **opts):
        extra = [a for k, v in opts.items() for a in ((f"--{k}", v) if v is not True else (f"--{k}",))]
        r = runner.invoke(app, ["audit", *map(str, inputs), "-d", str(det), "--json", str(tmp_path / "v.json"),
                                *map(str, extra)])
        rows = json.loads((tmp_path / "v.json").read_text()) if r.exit_code in (0, 1) else None
        (tmp_path / "v.json").unlink(missing_ok=True)
        return r, rows

    r, _ = audit(p["wrong-seed"], p["wrong-seed"])
    assert r.exit_code == 2 and "given twice" in r.output
    copy = tmp_path / "copy.parquet"
    copy.write_bytes(p["wrong-seed"].read_bytes())
    r, _ = audit(p["wrong-seed"], copy)
    assert r.exit_code == 2 and "also in" in r.output and "count twice" in r.output

    t = pq.read_table(p["wrong-seed"])
    ids = sorted(set(t["claim_id"].to_pylist()))
    halves = [t.filter(pc.is_in(t["claim_id"], pa.array(ids[:3]))), t.filter(pc.is_in(t["claim_id"], pa.array(ids[3:])))]
    a, b = tmp_path / "batch-a.parquet", tmp_path / "batch-b.parquet"
    for path, h in zip((a, b), halves):
        pq.write_table(h, path)
    r, rows = audit(a, b)
    assert sorted(v["provider"] for v in rows) == ["wrong-seed (batch-a)", "wrong-seed (batch-b)"]
    assert [v["n_tokens"] for v in rows] == [3 * 24, 3 * 24]
    r, rows = audit(a, b, merge=True)
    assert [(v["provider"], v["n_tokens"]) for v in rows] == [("wrong-seed", 6 * 24)]

    for path, h in zip((a, b), halves):  # claims that name no provider
        pq.write_table(h.set_column(h.column_names.index("provider"), "provider",
                                    pa.array(["unknown"] * h.num_rows)), path)
    r, rows = audit(a, b)
    assert sorted(v["provider"] for v in rows) == ["batch-a", "batch-b"]
    r, rows = audit(a, b, provider="acme")
    assert sorted(v["provider"] for v in rows) == ["acme (batch-a)", "acme (batch-b)"]


def test_help_documents_the_exit_codes():
    out = " ".join(run("--help").output.split())
    assert "Exit codes: 0 ok; 1 flagged" in out and "2 error" in out


def test_provenance_is_recorded_and_another_models_detector_or_scores_are_refused(scored, tmp_path):
    """Issue 15 item 4: scores and detectors record which model (weights, tokenizer), noise backend,
    verifier numerics and device produced them; a detector calibrated on the draft testbed model
    flagged an honest target provider at p < 1e-300. audit now refuses it, naming both models, and
    target scores are refused by it the other way round."""
    from verinfer.scores import scores_provenance
    from verinfer.models.load import model_info
    from verinfer.models.testbed import DRAFT_DIR

    d, p = scored
    target, draft = model_info(TARGET_DIR), model_info(DRAFT_DIR)
    prov = scores_provenance(p["honest-bf16-b8"])
    assert (prov.model, prov.weights_sha256, prov.tokenizer_sha256) == (target.name, target.weights_sha256,
                                                                         target.tokenizer_sha256)
    assert prov.noise == ("vllm-cpu",) and prov.numerics["dtype"] == "bf16" and prov.device == "cpu"
    assert prov.verinfer_version
    det = tmp_path / "target.json"
    assert run("calibrate", p["honest-bf16-b8"], p["honest-fp32-b4"], "--out", det).exit_code == 0
    saved = json.loads(det.read_text())
    assert saved["provenance"]["weights_sha256"] == target.weights_sha256
    assert saved["calibration"]["tokens"] == {"honest-bf16-b8": pq.read_metadata(p["honest-bf16-b8"]).num_rows,
                                              "honest-fp32-b4": pq.read_metadata(p["honest-fp32-b4"]).num_rows}

    for name in ("honest-bf16-b8", "honest-fp32-b4"):
        r = run("generate", name, "--model", DRAFT_DIR, "--out", tmp_path / f"draft-{name}.jsonl", "--n", 40,
                "--max-tokens", 48)
        assert r.exit_code == 0, r.output
        r = run("score", tmp_path / f"draft-{name}.jsonl", "--model", DRAFT_DIR, "--out", tmp_path / f"draft-{name}.parquet")
        assert r.exit_code == 0, r.output
    drafts = [tmp_path / f"draft-{n}.parquet" for n in ("honest-bf16-b8", "honest-fp32-b4")]
    r = run("calibrate", *drafts, "--out", tmp_path / "draft.json")
    assert r.exit_code == 0, r.output
    r = run("audit", p["honest-bf16-b8"], "-d", tmp_path / "draft.json")
    assert r.exit_code == 2 and f"scores of model {target.name}" in r.output and f"on model {draft.name}" in r.output
    assert "weights_sha256" in r.output and str(tmp_path / "draft.json") in r.output, r.output
    r = run("audit", drafts[0], "-d", det)
    assert r.exit_code == 2 and f"scores of model {draft.name}" in r.output and f"on model {target.name}" in r.output
    r = run("calibrate", p["honest-bf16-b8"], drafts[0], "--out", tmp_path / "mixed.json")
    assert r.exit_code == 2 and "replayed with other settings" in r.output and str(p["honest-bf16-b8"]) in r.output
