"""The draft distillation recipe (models/draft.py) on the shipped testbed target as the teacher
(the SmolLM2 draft is the same code on another target directory)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from verinfer.models import draft as D
from verinfer.models.llama import LlamaLM
from verinfer.models.testbed import TARGET_DIR


def test_distil_loss_is_the_cross_entropy_against_the_renormalized_top_k():
    g = torch.Generator().manual_seed(0)
    t_BTV, s_BTV = torch.randn(2, 3, 11, generator=g), torch.randn(2, 3, 11, generator=g)
    # k = V: the loss is the full cross-entropy H(p, q) = KL(p || q) + H(p)
    logp = torch.log_softmax(t_BTV, -1)
    got = D.distil_loss(s_BTV, *[x for x in logp.topk(11, -1)])
    p = logp.exp()
    ref = F.kl_div(torch.log_softmax(s_BTV, -1), p, reduction="none").sum(-1) - (p * logp).sum(-1)
    assert torch.allclose(got, ref.mean(), atol=1e-5)
    # k < V: the teacher's top-k renormalized
    lp, ix = logp.topk(4, -1)
    pk = torch.softmax(lp, -1)
    ref_k = -(pk * torch.log_softmax(s_BTV, -1).gather(-1, ix)).sum(-1).mean()
    assert torch.allclose(D.distil_loss(s_BTV, lp.half(), ix.int()), ref_k, atol=2e-3)


def test_student_starts_from_the_targets_embedding_on_its_principal_directions():
    s = D.make_student(TARGET_DIR, seed=0, arch=dict(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                                     num_key_value_heads=1, num_hidden_layers=1))
    E = D._target_embedding(TARGET_DIR)
    W = s.model.embed_tokens.weight.detach()
    assert W.shape == (E.shape[0], 64) and s.lm_head.weight is s.model.embed_tokens.weight
    # E V_64 keeps the largest share of E's energy any rank-64 projection can: the top-64 singular values
    sv = torch.linalg.svdvals(E)
    assert torch.allclose(W.pow(2).sum(), sv[:64].pow(2).sum(), rtol=1e-4)
    assert s.config.vocab_size == json.loads((TARGET_DIR / "config.json").read_text())["vocab_size"]


@pytest.mark.slow
def test_tiny_build_writes_a_loadable_draft_and_resumes(tmp_path):
    out, work = tmp_path / "draft", tmp_path / "work"
    info = D.build_draft(TARGET_DIR, seed=3, out_dir=out, budget="tiny", work=work, progress=False)
    m = LlamaLM.from_pretrained(out, dtype=torch.bfloat16)
    assert m.config.vocab_size == json.loads((TARGET_DIR / "config.json").read_text())["vocab_size"]
    assert (out / "MODEL_CARD.md").is_file() and json.loads((out / "build_info.json").read_text()) == info
    h = info["heldout"]
    assert 0 <= h["greedy_agreement"] <= 1 and 0 < h["mean_min_pq"] <= 1 and h["tokens"] == D.SEQ_LEN
    assert info["training_tokens"] == 4 * D.SEQ_LEN and info["parameters"] > 0
    counts = D.load_counts(out)  # the training stream's token counts, for the FR-Spec draft head
    assert len(counts) == m.config.vocab_size and int(counts.sum()) > 4 * D.SEQ_LEN
    shards = sorted((work / "teacher").glob("teacher_*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    again = D.build_draft(TARGET_DIR, seed=3, out_dir=tmp_path / "again", budget="tiny", work=work, progress=False)
    assert [p.stat().st_mtime_ns for p in shards] == stamps  # teacher shards reused
    assert again["weights_sha256"] == info["weights_sha256"]  # the finished checkpoint: same weights


@pytest.mark.slow
def test_a_larger_budget_reuses_the_smaller_ones_teacher_shards(tmp_path, monkeypatch):
    from dataclasses import replace

    monkeypatch.setattr(D, "SHARD", 2)
    monkeypatch.setitem(D.BUDGETS, "tiny6", replace(D.BUDGETS["tiny"], teacher_windows=6))
    work = tmp_path / "work"
    D.build_draft(TARGET_DIR, seed=1, out_dir=tmp_path / "a", budget="tiny", work=work, progress=False)
    first = {p.name: p.stat().st_mtime_ns for p in (work / "teacher").glob("teacher_*.safetensors")}
    assert len(first) == 2
    info = D.build_draft(TARGET_DIR, seed=1, out_dir=tmp_path / "b", budget="tiny6", work=work, progress=False)
    now = {p.name: p.stat().st_mtime_ns for p in (work / "teacher").glob("teacher_*.safetensors")}
    assert len(now) == 3 and all(now[k] == v for k, v in first.items())  # the 2 shards of "tiny" kept
    assert info["teacher_shards"] == {"total": 3, "computed_this_run": 1}
