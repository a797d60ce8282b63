import torch

from verinfer.engine.engine import Request
from verinfer.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _prompts(n, seed, lo=3, hi=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2000, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _reqs(prompts):
    return [Request(str(i), p, GREEDY) for i, p in enumerate(prompts)]


def test_prefill_and_decode_bitwise_equal_for_batch_sizes_1_to_32(det_engine):
    target = _prompts(1, seed=0)[0]
    alone = det_engine.prefill(_reqs([target]))
    ref_prefill = alone.logits_BV[0].clone()
    det_engine.decode_step(alone)
    det_engine.decode_step(alone)
    ref_decode = alone.logits_BV[0].clone()
    others = _prompts(32, seed=1, hi=12)
    for B in range(2, 33):
        pos = B // 2  # the protected request sits in the middle, among different neighbours
        prompts = others[:B - 1]
        prompts.insert(pos, target)
        batch = det_engine.prefill(_reqs(prompts))
        assert torch.equal(batch.logits_BV[pos], ref_prefill), f"prefill differs at batch size {B}"
        if B in (2, 32):
            det_engine.decode_step(batch)
            det_engine.decode_step(batch)
            assert torch.equal(batch.logits_BV[pos], ref_decode), f"decode differs at batch size {B}"


def test_other_cobatched_requests_do_not_change_bits(det_engine):
    target = _prompts(1, seed=3)[0]
    outs = []
    for seed in (4, 5, 6):
        batch = det_engine.prefill(_reqs([target] + _prompts(9, seed=seed)))
        for _ in range(3):
            det_engine.decode_step(batch)
        outs.append(batch.logits_BV[0].clone())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_whole_chunked_and_token_by_token_prefill_agree(det_engine, bf16_model):
    model = det_engine.model
    seq = _prompts(1, seed=7, lo=30, hi=31)[0]
    T = len(seq)
    tokens = torch.tensor([seq])
    cache = model.new_cache(1, 513)
    whole, _ = model(tokens, torch.arange(T)[None], cache)
    cache2 = model.new_cache(1, 513)
    parts = []
    for c0, c1 in ((0, 7), (7, 8), (8, 23), (23, T)):
        lg, _ = model(tokens[:, c0:c1], torch.arange(c0, c1)[None], cache2)
        parts.append(lg)
    assert torch.equal(torch.cat(parts, 1), whole)
