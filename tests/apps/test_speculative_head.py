"""`generate --speculative` and `score` with a feature-level draft head directory as the draft
(apps/speculative.load_draft): honest standard claims verify with no violation, and a KL-judge
provider claiming standard scores a larger mean accept_nll."""

import json

import torch

from verinfer.apps.speculative import generate_claims_file, load_draft, score_file
from verinfer.io import atomic_save_safetensors
from verinfer.models.llama import LlamaLM
from verinfer.models.testbed import TARGET_DIR
from verinfer.speculative import feature_head as fh


def _head_dir(tmp_path):
    target = LlamaLM.from_pretrained(TARGET_DIR)
    g = torch.Generator().manual_seed(3)
    w = {k: (v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v)
         for k, v in fh.trainable(fh.head_weights(target, 0)).items()}
    d = tmp_path / "testbed-head"
    d.mkdir()
    atomic_save_safetensors({k: v.contiguous() for k, v in w.items()}, d / fh.HEAD_FILE)
    (d / fh.HEAD_CONFIG).write_text(json.dumps({"hidden_size": target.config.hidden_size,
                                                "vocab_size": target.config.vocab_size}))
    return d


def test_generate_and_score_with_a_head_directory(tmp_path):
    torch.set_num_threads(1)
    d = _head_dir(tmp_path)
    draft, name = load_draft(d, LlamaLM.from_pretrained(TARGET_DIR))
    assert isinstance(draft, fh.FeatureHead) and name == "testbed-head"
    out = {}
    for rule in ("standard", "kl"):
        cl = generate_claims_file(TARGET_DIR, d, tmp_path / f"{rule}.jsonl", rule=rule, threshold=1e9, n=6,
                                  max_tokens=16, claimed="standard", show_progress=False)
        assert all(c.extra["spec"]["events"][0] == "t" and c.extra["spec"]["draft"] == "testbed-head" for c in cl)
        out[rule] = score_file(tmp_path / f"{rule}.jsonl", TARGET_DIR, d, tmp_path / f"{rule}.parquet",
                               show_progress=False)
    assert out["standard"]["violations"] == 0 and out["standard"]["replay_match"] == 1.0
    assert out["kl"]["mean_accept_nll"] > out["standard"]["mean_accept_nll"]
