"""The Fused kernel strategy (q/k/v and gate/up as one GEMM each; numerics/kernels.py) against
LlamaLM's default Native kernels and transformers: logits of a fused prefill-verification and of
cached decode steps on mixed-length rows, greedy tokens of target-only and speculative decoding,
the greedy draft cut at stop tokens. (Was the test of speculative/fast.py's FastLM, whose cached
path the Fused kernels reproduce bit for bit.)"""

import pytest
import torch

from verinfer.models.llama import LlamaLM
from verinfer.models.load import load_tokenizer
from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR, TOKENIZER_DIR
from verinfer.numerics.kernels import Fused
from verinfer.engine.engine import Engine, Request
from verinfer.sampling.params import SamplingParams
from verinfer.speculative.decoder import SpeculativeDecoder, autoregressive
from verinfer.speculative.rules import Rule


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return LlamaLM.from_pretrained(TARGET_DIR), LlamaLM.from_pretrained(DRAFT_DIR), load_tokenizer(TOKENIZER_DIR)


def _prompts(tok):
    texts = ["Q: 37+45=\nA: ", "Q: 123*4=\nA: ", "import os\nimport ", "    def __init__(self"]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@torch.no_grad()
def test_fused_forward_matches_native_and_transformers(models):
    from transformers import AutoModelForCausalLM

    target, _, tok = models
    fast = target.with_kernels(Fused())
    assert fast.kernels.name == "fused" and fast.w is target.w   # the same weight tensors, no copy
    hf = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    prompts = _prompts(tok)
    app = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]])
    reqs = [Request(str(i), p, SamplingParams(temperature=0.0, max_tokens=8)) for i, p in enumerate(prompts)]
    s_ref, lg_ref, h_ref = Engine(target, lean_prefill=True).prefill_extend(reqs, app, extra_slots=8, hidden_layer=-1)
    s_fast, lg_fast, h_fast = Engine(fast, lean_prefill=True).prefill_extend(reqs, app, extra_slots=8, hidden_layer=-1)
    assert lg_fast.shape == (4, 4, target.config.vocab_size)
    assert (lg_fast - lg_ref).abs().max() < 2e-5 and (h_fast - h_ref).abs().max() < 2e-5
    # two decode steps on top of the caches (rows at different lengths), against full HF forwards
    seqs = [p + a.tolist() for p, a in zip(prompts, app)]
    for step in range(2):
        nxt = torch.tensor([[20 + step + b] for b in range(4)])
        pos = torch.tensor([[len(s)] for s in seqs])
        a, _ = target(nxt, pos, s_ref.cache)
        b, _ = fast(nxt, pos, s_fast.cache)
        assert (a - b).abs().max() < 2e-5
        for r in range(4):
            seqs[r].append(int(nxt[r]))
            ref = hf(torch.tensor([seqs[r]])).logits[0, -1]
            assert (b[r, 0] - ref).abs().max() < 1e-4


def test_fused_applies_to_eager_bf16_and_cache_free_forwards(models):
    """Unlike FastLM (fp32 sdpa cached decode only), the Fused strategy runs on every path: eager
    attention, bf16, cache-free replay; within rounding of Native there."""
    target, _, _ = models
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]])
    pos = torch.arange(8).expand(2, -1)
    eager = LlamaLM(target.config, target.w, attn="eager")
    bf16 = LlamaLM(target.config, {k: t.bfloat16() for k, t in target.w.items()})
    with torch.no_grad():
        bf16_noise = (bf16(ids, pos)[0] - target(ids, pos)[0]).abs().max()  # bf16 against fp32: ~0.1
        for native, bound in ((target, 2e-5), (eager, 2e-5), (bf16, bf16_noise / 8)):
            a, _ = native(ids, pos)
            b, _ = native.with_kernels(Fused())(ids, pos)
            assert (a - b).abs().max() < bound


def test_greedy_tokens_fused_equal_native(models):
    """Target-only and speculative greedy decoding give the same tokens with Fused-kernel models,
    and the greedy draft cut (drafting stops once every row drafted a stop token) changes no token."""
    target, draft, tok = models
    ft, fd = target.with_kernels(Fused()), draft.with_kernels(Fused())
    nl = tuple(i for i in range(len(tok)) if "\n" in tok.decode([i]))
    prompts = _prompts(tok)
    ref = autoregressive(target, prompts, 12, stop_token_ids=nl, batch_size=4)
    out = autoregressive(ft, prompts, 12, stop_token_ids=nl, batch_size=4)
    assert [o.output_token_ids for o in out] == [o.output_token_ids for o in ref]
    for rule in (Rule("standard"), Rule("kl", 0.3)):
        for bs in (1, 4):
            a = SpeculativeDecoder(target, draft, rule, gamma=4, stop_token_ids=nl).generate(prompts, 12, batch_size=bs)
            b = SpeculativeDecoder(ft, fd, rule, gamma=4, stop_token_ids=nl).generate(prompts, 12, batch_size=bs)
            assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
            assert [o.events for o in a] == [o.events for o in b]
            if rule.name == "standard":
                assert [o.output_token_ids for o in a] == [o.output_token_ids for o in ref]
    # the cut: an arithmetic answer is short, so some round drafts fewer than gamma tokens
    outs = SpeculativeDecoder(ft, fd, Rule("kl", 1.0), gamma=6, stop_token_ids=nl).generate(prompts[:2], 12, batch_size=1)
    assert any(o.drafted < 6 * o.target_forwards for o in outs)
    for o in outs:
        assert o.accepted <= o.drafted and o.output_token_ids[-1] in nl


def test_split_k_matches_the_library_kernel_for_one_row_and_many_and_a_reference_sum_between():
    """matmul='split-k' (CUTLASS's serial split-K): one row and 16+ rows are the library GEMM bit for
    bit; 2..15 rows equal the serial epilogue written out by hand, and a
    row's bits then depend on how many rows share the GEMM (what makes batching visible on CPUs whose
    bf16 GEMMs are row-invariant)."""
    import torch.nn.functional as F

    from verinfer.numerics.kernels import split_k_linear, split_k_parts

    assert [split_k_parts(m) for m in (1, 2, 7, 8, 15, 16, 300)] == [1, 4, 4, 2, 2, 1, 1]
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    b = (torch.randn(96, generator=g) * 0.1).bfloat16()
    x = torch.randn(16, 64, generator=g).bfloat16()
    k = LlamaLM.from_pretrained(TARGET_DIR, dtype=torch.bfloat16, matmul="split-k").kernels
    k.w, k.wsplit = {"w.weight": W, "w.bias": b}, {"w.weight": W.float(), "w.bias": b.float()}
    assert torch.equal(k.linear(x[:1], "w.weight"), F.linear(x[:1], W, b))
    assert torch.equal(k.linear(x, "w.weight"), F.linear(x, W, b))
    eight = k.linear(x[:8], "w.weight")
    by_hand = (x[:8].float()[:, :32] @ W.float()[:, :32].T + b.float()).bfloat16()
    by_hand = (by_hand.float() + x[:8].float()[:, 32:] @ W.float()[:, 32:].T).bfloat16()
    assert torch.equal(eight, by_hand)
    assert torch.equal(split_k_linear(x[:8], W.float(), b.float(), 2), eight)
    alone = torch.cat([k.linear(x[i : i + 1], "w.weight") for i in range(8)])
    assert 0 < (eight != alone).float().mean().item() < 0.5
