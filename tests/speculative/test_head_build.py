"""The feature-level head's recipe (speculative/head_build.py) on the shipped testbed target: the loss is
EAGLE's (SmoothL1 on the next feature + W_CLS x cross-entropy against the target's distribution), and
a tiny build writes the head (bf16 safetensors, the head's own tensors only), its model card with the
acceptance per draft position, and resumes from its feature shards."""

import json

import torch
import torch.nn.functional as F

from verinfer.speculative import head_build as H
from verinfer.models.llama import LlamaLM
from verinfer.models.testbed import TARGET_DIR
from verinfer.speculative import feature_head as fh


def test_loss_is_smooth_l1_plus_weighted_cross_entropy():
    torch.set_num_threads(1)
    target = LlamaLM.from_pretrained(TARGET_DIR)
    head = fh.FeatureHead(fh.head_config(target.config), {**fh.trainable(fh.head_weights(target, 0)),
                                                          **{k: target.w[k] for k in fh.SHARED}})
    tokens = torch.randint(3, target.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    f = H.target_features(target, tokens[:, :-1])
    _, f_full = target(tokens[:, :-1], torch.arange(16)[None].expand(2, -1), hidden_layer=-1)
    torch.testing.assert_close(f, f_full, rtol=0, atol=0)  # every position's final-norm state
    E = target.w["lm_head.weight"][:50]
    loss, parts = H.head_loss(head, tokens, f, E, noise=0.0)
    _, fh_ = head(tokens[:, 1:-1], torch.arange(15)[None].expand(2, -1), hidden_layer=-1, features_BTD=f[:, :-1])
    reg = F.smooth_l1_loss(fh_, f[:, 1:])
    cls = -(torch.softmax(f[:, 1:] @ E.T, -1) * torch.log_softmax(fh_ @ E.T, -1)).sum(-1).mean()
    assert abs(float(loss) - float(reg + H.W_CLS * cls)) < 1e-4
    assert parts["reg"] == float(reg) and abs(parts["cls"] - float(cls)) < 1e-5


def test_tiny_build_writes_head_card_and_resumes(tmp_path):
    info = H.build_head(TARGET_DIR, 0, tmp_path / "head", budget="tiny", work=tmp_path / "work", progress=False)
    d = tmp_path / "head"
    assert {p.name for p in d.iterdir()} >= {fh.HEAD_FILE, fh.HEAD_CONFIG, "token_counts.json", "build_info.json",
                                             "MODEL_CARD.md"}
    from safetensors.torch import load_file

    w = load_file(str(d / fh.HEAD_FILE))
    assert not set(w) & set(fh.SHARED) and all(t.dtype == torch.bfloat16 for t in w.values())
    assert info["parameters"] == sum(t.numel() for t in w.values())
    h = info["heldout"]
    assert len(h["accept_at"]) == H.GAMMA and all(0.0 <= a <= 1.0 for a in h["accept_at"])
    assert h["accept_at"] == sorted(h["accept_at"], reverse=True)  # k drafts accepted needs k-1 before
    assert 1.0 <= h["mat"] <= 1 + H.GAMMA
    assert "accepted at draft position 1:" in (d / "MODEL_CARD.md").read_text()
    assert json.loads((d / "build_info.json").read_text())["feature_shards"]["computed_this_run"] >= 1
    again = H.build_head(TARGET_DIR, 0, tmp_path / "head2", budget="tiny", work=tmp_path / "work", progress=False)
    assert again["feature_shards"]["computed_this_run"] == 0   # the shards are reused
    assert again["final_loss"] == info["final_loss"]           # the finished checkpoint is reused too
