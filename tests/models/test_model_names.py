"""Claims name models their own way: the names a checkpoint records (model_info aliases) and the
ones a user vouches for (--model-name) are accepted; any other name is still refused."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from verinfer.errors import ModelError
from verinfer.models.load import model_info
from verinfer.models.testbed import TARGET_DIR

runner = CliRunner()


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_model_info_aliases_are_the_name_then_what_the_checkpoint_records(tiny_llama_dir, tmp_path):
    assert model_info(tiny_llama_dir).aliases == (tiny_llama_dir.name,)
    assert model_info(TARGET_DIR).aliases == ("verinfer-testbed-target",)
    d = _with_config(tiny_llama_dir, tmp_path / "m", verinfer_name="mine", _name_or_path="Org/Base-1B",
                     verinfer_aliases=["Org/Chat-1B", "mine"])
    info = model_info(d)
    assert info.name == "mine" and info.aliases == ("mine", "Org/Chat-1B", "Org/Base-1B")
    d = _with_config(tiny_llama_dir, tmp_path / "p", _name_or_path="/some/local/path")
    assert model_info(d).aliases == ("p",)  # a local path is not a name
    d = _with_config(tiny_llama_dir, tmp_path / "bad", verinfer_aliases="Org/Chat-1B")
    with pytest.raises(ModelError, match="`verinfer_aliases` must be a list"):
        model_info(d)


@pytest.fixture(scope="module")
def served_claims(tmp_path_factory):
    """Testbed claims as an endpoint serving the target under another name would return them."""
    from verinfer.cli.main import app

    d = tmp_path_factory.mktemp("names")
    r = runner.invoke(app, ["generate", "honest-bf16-b8", "-o", str(d / "c.jsonl"), "--n", "2", "--max-tokens", "8"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in (d / "c.jsonl").read_text().splitlines()]
    assert {c["model"] for c in lines} == {"verinfer-testbed-target"}
    (d / "served.jsonl").write_text("".join(json.dumps({**c, "model": "acme/served-7b"}) + "\n" for c in lines))
    return d


def test_score_accepts_a_vouched_name_and_refuses_others(served_claims, tmp_path):
    from verinfer.cli.main import app

    claims = served_claims / "served.jsonl"
    r = runner.invoke(app, ["score", str(claims), "-o", str(tmp_path / "a.parquet")])
    assert r.exit_code == 2 and not (tmp_path / "a.parquet").exists()
    assert "'acme/served-7b' but the verifier loaded 'verinfer-testbed-target'" in r.output
    assert "--model-name 'acme/served-7b'" in r.output
    r = runner.invoke(app, ["score", str(claims), "-o", str(tmp_path / "b.parquet"), "--model-name", "other",
                            "--model-name", "acme/served-7b"])
    assert r.exit_code == 0, r.output
    assert "scored 16 tokens" in r.output


def test_score_accepts_the_aliases_a_checkpoint_records(served_claims, tmp_path):
    from verinfer.cli.main import app

    d = _with_config(TARGET_DIR, tmp_path / "target", verinfer_aliases=["acme/served-7b"])
    r = runner.invoke(app, ["score", str(served_claims / "served.jsonl"), "-o", str(tmp_path / "s.parquet"),
                            "--model", str(d)])
    assert r.exit_code == 0, r.output
    # the testbed's own name is still accepted by the copy (it keeps verinfer_name)
    r = runner.invoke(app, ["score", str(served_claims / "c.jsonl"), "-o", str(tmp_path / "t.parquet"),
                            "--model", str(d)])
    assert r.exit_code == 0, r.output
