"""Frequency-ranked draft vocabulary (speculative/draft_vocab.py): the ranking rule, the cut head
against the full head, and the decoder with a restricted draft: greedy output is the target's,
sampling passes the chi-square test even when the target's likeliest tokens are outside the draft's
vocabulary (the residual returns their mass)."""

import json

import pytest
import torch

from verinfer.models.draft import load_counts, save_counts, token_counts
from verinfer.models.llama import LlamaLM
from verinfer.models.load import load_tokenizer
from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR, TOKENIZER_DIR
from verinfer.speculative import draft_vocab as dv
from verinfer.speculative.decoder import SpeculativeDecoder, autoregressive
from verinfer.speculative.lossless import two_token_chi_square
from verinfer.speculative.ngram import NgramDraft
from verinfer.speculative.rules import Rule


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return LlamaLM.from_pretrained(TARGET_DIR), LlamaLM.from_pretrained(DRAFT_DIR), load_tokenizer(TOKENIZER_DIR)


def test_ranking_coverage_and_size_rule():
    counts = torch.tensor([5, 0, 9, 5, 1, 80])
    assert dv.ranking(counts).tolist() == [5, 2, 0, 3, 4, 1]  # ties (ids 0 and 3): lower id first
    assert dv.coverage(counts, 1) == pytest.approx(80 / 100)
    assert dv.coverage(counts, 3) == pytest.approx(94 / 100)
    # smallest power of two reaching the coverage: 1 -> 0.80, 2 -> 0.89, 4 -> 0.99
    assert dv.choose_size(counts, 0.8) == 1 and dv.choose_size(counts, 0.85) == 2 and dv.choose_size(counts, 0.99) == 4
    assert dv.choose_size(counts, 1.0) == 6  # capped at V
    assert dv.top_ids(counts, 3).tolist() == [0, 2, 5]  # ascending: the cut head's row order
    with pytest.raises(ValueError, match="between 1 and 6"):
        dv.top_ids(counts, 0)
    with pytest.raises(ValueError, match="empty"):
        dv.coverage(torch.zeros(4, dtype=torch.long), 2)


def test_counts_file_round_trip_and_errors(tmp_path):
    c = token_counts(torch.tensor([3, 3, 1, 7, 3]), 10)
    assert c.tolist() == [0, 1, 0, 3, 0, 0, 0, 1, 0, 0]
    save_counts(tmp_path, c)
    assert torch.equal(load_counts(tmp_path), c)
    assert dv.draft_vocab(tmp_path, 2).tolist() == [1, 3]
    with pytest.raises(ValueError, match="outside"):
        token_counts(torch.tensor([3, 12]), 10)
    (tmp_path / "token_counts.json").write_text(json.dumps({"counts": {}}))
    with pytest.raises(ValueError, match="not a token-counts file"):
        load_counts(tmp_path)
    with pytest.raises(FileNotFoundError, match="build-draft"):
        load_counts(tmp_path / "nowhere")


def test_cut_head_equals_the_full_heads_rows(models):
    _, draft, tok = models
    ids = torch.tensor([0, 3, 17, 200, draft.config.vocab_size - 1])
    cut = dv.restrict_head(draft, ids)
    x = torch.tensor([tok.encode("import os\nimport ", add_special_tokens=False)])
    pos = torch.arange(x.shape[1])[None]
    full, _ = draft(x, pos)
    part, _ = cut(x, pos)
    assert part.shape[-1] == 5
    # the same dot products; a GEMM of another width may sum in another order (fp32 rounding)
    torch.testing.assert_close(part, full[..., ids], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="distinct token ids"):
        dv.restrict_head(draft, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="distinct token ids"):
        dv.restrict_head(draft, torch.tensor([draft.config.vocab_size]))


def _vocab_without(target, tok, prompt: str, k: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """Every token id except the target's k likeliest next tokens after `prompt`."""
    p = tok.encode(prompt, add_special_tokens=False)
    lg, _ = target(torch.tensor([p]), torch.arange(len(p))[None])
    top = lg[0, -1].topk(k).indices
    keep = torch.ones(target.config.vocab_size, dtype=torch.bool)
    keep[top] = False
    return keep.nonzero().flatten(), top.tolist(), p


def test_greedy_with_a_restricted_vocabulary_is_the_targets_output(models):
    target, draft, tok = models
    texts = ["Q: 37+45=\nA: ", "import os\nimport ", "    def __init__(self", "class A:\n    def "]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    ref = autoregressive(target, prompts, 16, batch_size=4)
    full = SpeculativeDecoder(target, draft, Rule("standard"), gamma=4).generate(prompts, 16, batch_size=4)
    counts = token_counts(torch.tensor([t for p in prompts for t in p] + [o for r in ref for o in r.output_token_ids]),
                          target.config.vocab_size)
    small = dv.top_ids(counts, 24)  # only tokens of these prompts and answers: the draft still proposes well
    ids, removed, _ = _vocab_without(target, tok, texts[1], 3)
    for vocab in (small, ids):
        outs = SpeculativeDecoder(target, draft, Rule("standard"), gamma=4, draft_vocab=vocab).generate(
            prompts, 16, batch_size=4)
        assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
    # tokens outside the vocabulary are never drafted: an accepted draft token is in it
    outs = SpeculativeDecoder(target, draft, Rule("standard"), gamma=4, draft_vocab=small).generate(prompts, 16)
    allowed = set(small.tolist())
    for o in outs:
        assert all(t in allowed for t, e in zip(o.output_token_ids, o.events) if e == "a")
    assert sum(o.accepted for o in full) > 0


@pytest.mark.slow  # 13.5 s wall in the fast tier, 10.4 s CPU (2 cores, 2026-11-26)
def test_sampling_with_the_targets_top_tokens_removed_is_lossless(models):
    """The draft cannot propose the target's 3 likeliest tokens; standard speculative sampling must
    still give the target's distribution (the residual supplies them): chi-square on 2,000 draws."""
    target, draft, tok = models
    ids, removed, prompt = _vocab_without(target, tok, "    def __init__(self", 3)
    n = 2000
    dec = SpeculativeDecoder(target, draft, Rule("standard"), gamma=3, temperature=1.0, draft_vocab=ids)
    outs = dec.generate([prompt] * n, max_tokens=2, seeds=list(range(n)), batch_size=n)
    stat, pval, bins = two_token_chi_square(target, [tuple(o.output_token_ids[:2]) for o in outs], prompt)
    assert bins >= 20 and pval > 1e-3, (stat, pval, bins)
    first = [o.output_token_ids[0] for o in outs]
    assert sum(t in removed for t in first) > 0.2 * n  # the removed tokens still come out, from the residual
    assert all(o.events[0] != "a" for o, t in zip(outs, first) if t in removed)


def test_restricted_vocabulary_refuses_rules_that_read_q(models):
    target, draft, _ = models
    ids = torch.arange(100)
    for rule in (Rule("kl", 0.5), Rule("draft_entropy", 1.0)):
        with pytest.raises(ValueError, match="whole distribution"):
            SpeculativeDecoder(target, draft, rule, draft_vocab=ids)
    SpeculativeDecoder(target, draft, Rule("topk", 2), draft_vocab=ids)  # reads p and x only: allowed
    with pytest.raises(ValueError, match="n-gram"):
        SpeculativeDecoder(target, NgramDraft(), Rule("standard"), draft_vocab=ids)
