"""The draft/verify loop on the shipped testbed: lossless (chi-square), batched == batch-1,
greedy standard speculative decoding == transformers' greedy generate of the target."""

import re

import pytest
import torch

from verinfer.models.llama import LlamaLM
from verinfer.models.load import load_tokenizer
from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR, TOKENIZER_DIR
from verinfer.speculative.decoder import SpeculativeDecoder, autoregressive
from verinfer.speculative.lossless import two_token_chi_square
from verinfer.speculative.rules import Rule


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return LlamaLM.from_pretrained(TARGET_DIR), LlamaLM.from_pretrained(DRAFT_DIR), load_tokenizer(TOKENIZER_DIR)


def _chi2(target, outs, prompt, n):
    stat, pval, bins = two_token_chi_square(target, [tuple(o.output_token_ids[:2]) for o in outs], prompt)
    return (stat, pval), bins


PROMPT = "    def __init__(self"


@pytest.mark.slow
def test_standard_speculative_sampling_is_lossless(models):
    """Chi-square of the first two sampled tokens against the exact target distribution; the KL
    judge (lossy) on the same draws must be rejected by the same test (the test has power)."""
    target, draft, tok = models
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    n = 2000
    res = {}
    for name, rule, conf in [("standard", Rule("standard"), 0.0), ("kl", Rule("kl", 2.0), 0.0),
                             ("standard_cut", Rule("standard"), 0.5)]:
        dec = SpeculativeDecoder(target, draft, rule, gamma=3, temperature=1.0, draft_confidence=conf)
        outs = dec.generate([prompt] * n, max_tokens=2, seeds=list(range(n)), batch_size=n)
        (stat, pval), bins = _chi2(target, outs, prompt, n)
        res[name] = (stat, pval, bins, sum(o.accepted for o in outs) / sum(o.drafted for o in outs))
    assert res["standard"][2] >= 20  # enough bins to be a real test
    print(res)
    assert res["standard"][1] > 1e-3, res
    assert res["kl"][1] < 1e-6, res
    assert res["kl"][3] > res["standard"][3]  # and the lossy rule accepts more
    # dynamic draft length: the first token's block is often cut to 1, so the second token is the
    # target's bonus draw there (not a residual draw): still the target's distribution
    assert res["standard_cut"][1] > 1e-3, res


def test_target_only_sampler_is_the_target_distribution(models):
    target, _, tok = models
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    n = 2000
    outs = autoregressive(target, [prompt] * n, 2, temperature=1.0, seeds=list(range(n)), batch_size=n)
    (_, pval), _ = _chi2(target, outs, prompt, n)
    assert pval > 1e-3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("rule", [Rule("standard"), Rule("kl", 0.5)])
def test_batched_loop_equals_batch1_loop(models, temperature, rule):
    target, draft, tok = models
    texts = ["Q: 37+45=\nA: ", "import os\nimport ", "Q: 7*245=\nA: ", "    return self._", "class A:\n    def "]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    dec = SpeculativeDecoder(target, draft, rule, gamma=3, temperature=temperature)
    seeds = [11, 12, 13, 14, 15]
    one = dec.generate(prompts, 12, seeds=seeds, batch_size=1)
    many = dec.generate(prompts, 12, seeds=seeds, batch_size=5)
    assert [o.output_token_ids for o in one] == [o.output_token_ids for o in many]
    assert [o.events for o in one] == [o.events for o in many]
    assert [o.target_forwards for o in one] == [o.target_forwards for o in many]
    for o in many:
        assert len(o.events) == len(o.output_token_ids) == 12
        assert o.target_forwards == o.events.count("r") + o.events.count("b") + (o.events[-1] == "a")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_confidence_cuts_each_rows_block(models, temperature):
    """Dynamic draft length (draft_confidence): each row's block ends after its first token drafted
    below the bound, batched == batch-1 (a row's cut is its own), greedy output is the target's, and
    a bound no draft probability falls below changes nothing."""
    target, draft, tok = models
    texts = ["Q: 37+45=\nA: ", "import os\nimport ", "Q: 7*245=\nA: ", "    return self._", "class A:\n    def "]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    seeds = [11, 12, 13, 14, 15]
    full = SpeculativeDecoder(target, draft, gamma=4, temperature=temperature).generate(prompts, 16, seeds=seeds)
    cut = SpeculativeDecoder(target, draft, gamma=4, temperature=temperature, draft_confidence=0.6)
    one, many = (cut.generate(prompts, 16, seeds=seeds, batch_size=bs) for bs in (1, 5))
    assert [o.output_token_ids for o in one] == [o.output_token_ids for o in many]
    assert [o.events for o in one] == [o.events for o in many]
    assert sum(o.drafted for o in many) < 4 * sum(o.target_forwards for o in many)  # blocks were cut
    assert any(re.search(r"(^|[rb])a{0,3}b", o.events) for o in many)  # a cut block fully accepted
    for o in many:
        assert sum(o.accepted_at) == o.accepted and o.drafted == sum(o.proposed_at)
    if temperature == 0:
        ref = autoregressive(target, prompts, 16, batch_size=5)
        assert [o.output_token_ids for o in many] == [r.output_token_ids for r in ref]
    tiny = SpeculativeDecoder(target, draft, gamma=4, temperature=temperature, draft_confidence=1e-12)
    same = tiny.generate(prompts, 16, seeds=seeds, batch_size=5)
    assert [o.events for o in same] == [o.events for o in full]
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="draft_confidence"):
            SpeculativeDecoder(target, draft, draft_confidence=bad)


def test_greedy_standard_equals_transformers_greedy_target(models):
    """Lossless in the greedy limit, against the reference implementation (HF generate)."""
    from transformers import AutoModelForCausalLM

    target, draft, tok = models
    hf = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    texts = ["Q: 37+45=\nA: ", "import os\nimport ", "    def __init__(self"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    for g in (1, 4):
        outs = SpeculativeDecoder(target, draft, Rule("standard"), gamma=g).generate(prompts, 16, batch_size=3)
        for p, o in zip(prompts, outs):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            assert o.output_token_ids == ref
            assert o.mat >= 1.0


def test_stop_tokens_and_errors(models):
    target, draft, tok = models
    nl = tuple(i for i in range(len(tok)) if "\n" in tok.decode([i]))
    p = tok.encode("Q: 9-7=\nA: ", add_special_tokens=False)
    o = SpeculativeDecoder(target, draft, Rule("kl", 1.0), gamma=4, stop_token_ids=nl).generate([p], 20)[0]
    assert o.finish_reason == "stop" and o.output_token_ids[-1] in nl
    assert not any(t in nl for t in o.output_token_ids[:-1])
    with pytest.raises(ValueError, match="at least 2"):
        SpeculativeDecoder(target, draft).generate([[5]], 4)
    with pytest.raises(ValueError, match="one seed per prompt"):
        SpeculativeDecoder(target, draft, temperature=1.0).generate([p], 4)
    with pytest.raises(ValueError, match="gamma"):
        SpeculativeDecoder(target, draft, gamma=0)


# --- n-gram prompt lookup (speculative/ngram.py): the baseline with no draft model; `propose`
# itself: tests/speculative/test_ngram.py

NGRAM_TEXTS = ["    def __init__(self, x):\n        self.x = x\n    def __init__(self",
               "import os\nimport sys\nimport os\nimport ", "Q: 37+45=\nA: 82\nQ: 37+45=\nA: "]


def test_ngram_greedy_equals_target_only_and_skips_target_forwards(models):
    from verinfer.speculative.ngram import NgramDraft

    target, _, tok = models
    prompts = [tok.encode(t, add_special_tokens=False) for t in NGRAM_TEXTS]
    ref = autoregressive(target, prompts, 16, batch_size=3)
    for g, bs in ((1, 1), (4, 3)):
        outs = SpeculativeDecoder(target, NgramDraft(1, 3), Rule("standard"), gamma=g).generate(prompts, 16, batch_size=bs)
        assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
        assert all(o.draft_forwards == 0 for o in outs)
        if g == 4:  # repeated code: lookups are accepted, fewer target forwards than tokens
            assert sum(o.accepted for o in outs) > 0
            assert sum(o.target_forwards for o in outs) < sum(len(o.output_token_ids) for o in outs)
    with pytest.raises(ValueError, match="standard"):
        SpeculativeDecoder(target, NgramDraft(), Rule("kl", 0.5))


@pytest.mark.slow  # 2000 samples: 14.2 s wall in the fast tier, 10.1 s CPU (2 cores, 2026-11-26)
def test_ngram_speculative_sampling_is_lossless(models):
    """One-hot q at the looked-up token: accept with p(x), else sample p without x. Chi-square of
    the first two tokens against the exact target distribution, on a prompt whose suffix recurs."""
    from verinfer.speculative.ngram import NgramDraft

    target, _, tok = models
    prompt = tok.encode(NGRAM_TEXTS[0], add_special_tokens=False)
    n = 2000
    dec = SpeculativeDecoder(target, NgramDraft(1, 3), Rule("standard"), gamma=3, temperature=1.0)
    outs = dec.generate([prompt] * n, max_tokens=2, seeds=list(range(n)), batch_size=n)
    (_, pval), bins = _chi2(target, outs, prompt, n)
    assert bins >= 10 and pval > 1e-3
    assert sum(o.accepted for o in outs) > 0.1 * n  # the lookups were tried and often accepted
