"""benchmarks/kl_judge_audit.py with a feature-level head as the draft: a --quick run on the testbed
with a random head (written as a head directory) measures the KL-judge-on-the-head provider."""

import json

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.kl_judge_audit import main
from verinfer.errors import ModelError
from verinfer.models.llama import LlamaLM
from verinfer.models.testbed import TARGET_DIR
from verinfer.speculative import feature_head as fh


def test_quick_head_run_writes_the_head_stem(tmp_path):
    from tests.speculative.test_feature_head import _head

    torch.set_num_threads(1)
    target = LlamaLM.from_pretrained(TARGET_DIR)
    hdir = tmp_path / "target-head"
    hdir.mkdir()
    save_file({k: v.contiguous() for k, v in fh.trainable(_head(target).w).items()}, str(hdir / fh.HEAD_FILE))
    c = target.config
    (hdir / fh.HEAD_CONFIG).write_text(json.dumps({"hidden_size": c.hidden_size, "vocab_size": c.vocab_size}))
    res = main(["--quick", "--head-dir", str(hdir), "--threshold", "1.0", "--out", str(tmp_path)])
    back = json.loads((tmp_path / "kl_judge_audit_head_quick.json").read_text())
    assert (tmp_path / "kl_judge_audit_head_quick.md").is_file()
    assert back["draft_kind"] == "head" and back["draft_name"] == "target-head" and list(back["by_threshold"]) == ["1.0"]
    r = res["by_threshold"]["1.0"]
    h, k = r["honest_standard"], r["kl_claims_standard"]
    print({"tokens_to_detect": r["tokens_to_detect"], "honest": h, "kl": k})
    assert h["tokens"] > 8 * 8 and h["violations"] == 0 and h["accepted_fraction"] > 0.1
    assert k["mean_accept_nll"] > h["mean_accept_nll"] and k["accepted_fraction"] > h["accepted_fraction"]
    assert r["setup"]["threshold"] == 1.0 and r["setup"]["max_tokens"] == 16 and r["setup"]["prompts"] == 8


def test_head_without_a_built_head_says_how_to_build_it(tmp_path):
    """--head reads the target's shipped head (head_build.default_out); the testbed has none."""
    with pytest.raises(ModelError, match="no head.safetensors") as e:
        main(["--quick", "--head", "--threshold", "1.0", "--out", str(tmp_path)])
    assert "build-head" in e.value.fix
