"""Filters: vectorized vs a slow per-row reference (sorted Python lists) and vs vLLM's op order."""

import math

import numpy as np
import pytest
import torch

from verinfer.sampling import filters as filters_mod
from verinfer.sampling.filters import filter_logits, filter_mask

NEG_INF = float("-inf")


def _ref_row(logits: list[float], temp: float, k: int, p: float, min_p: float):
    """Slow reference for one row: returns (keep list, ambiguous flag). Ambiguous = some
    probability sits within 1e-5 of a threshold, where float32 vs float64 rounding may decide."""
    V = len(logits)
    t32 = np.float32(temp if temp != 0 else 1.0)
    x = [float(np.float32(v) / t32) for v in logits]  # fp32 division, like the filters
    keep, amb = [True] * V, False
    if min_p > 0:
        m = max(x)
        e = [math.exp(v - m) for v in x]
        z = sum(e)
        probs = [v / z for v in e]
        thr = max(probs) * float(np.float32(min_p))
        for i in range(V):
            if probs[i] < thr:
                keep[i] = False
            if 0 < abs(probs[i] - thr) <= 1e-5 * thr:  # (== is exact: the max itself at min_p = 1)
                amb = True
    masked = [x[i] if keep[i] else NEG_INF for i in range(V)]
    order = sorted(range(V), key=lambda i: (masked[i], i))  # ascending, ties by token id
    vals = [masked[i] for i in order]
    if 0 < k < V:
        kth = vals[V - k]
        for j in range(V):
            if vals[j] < kth:
                vals[j] = NEG_INF
                keep[order[j]] = False
    if p < 1:
        m = max(vals)
        e = [math.exp(v - m) if v != NEG_INF else 0.0 for v in vals]
        z = sum(e)
        cut = float(np.float32(1) - np.float32(p))
        c = 0.0
        for j in range(V - 1):  # the last (largest) is always kept
            c += e[j] / z
            if c <= cut:
                keep[order[j]] = False
            if abs(c - cut) < 1e-5:
                amb = True
    return keep, amb


def _rows(B, *vals):
    return [torch.tensor([v] * B) for v in vals]


@pytest.mark.parametrize("top_p_only_rows", [True, False])  # full-sort path / top-k shortcut path
def test_random_rows_match_the_slow_reference(top_p_only_rows):
    g = torch.Generator().manual_seed(0)
    B, V = 200, 40
    logits = torch.randn(B, V, generator=g) * 3
    logits[: B // 4] = torch.randint(-3, 4, (B // 4, V), generator=g).float()  # many exact ties
    temp = torch.tensor([[0.0, 0.7, 1.0, 1.3][i % 4] for i in range(B)])
    top_k = torch.tensor([[-1, 0, 1, 5, 17, V, V + 3][i % 7] for i in range(B)])
    top_p = torch.tensor([[1.0, 0.9, 0.5, 1e-6, 0.999][i % 5] for i in range(B)])
    min_p = torch.tensor([[0.0, 0.0, 0.05, 0.3, -0.0, 1.0][i % 6] for i in range(B)])
    if not top_p_only_rows:
        top_p = torch.where((top_k > 0) & (top_k < V), top_p, torch.ones_like(top_p))
    keep = filter_mask(logits, temp, top_k, top_p, min_p)
    checked = 0
    for b in range(B):
        ref, amb = _ref_row(logits[b].tolist(), temp[b].item(), top_k[b].item(), top_p[b].item(), min_p[b].item())
        if amb:
            continue
        checked += 1
        assert keep[b].tolist() == ref, f"row {b}"
    assert checked >= 0.9 * B
    assert keep.any(-1).all()  # never an empty row


def test_filter_logits_is_scaled_logits_on_the_kept_set():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 30, generator=g)
    temp = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.7, 0.0])
    args = (temp, torch.tensor([5, -1, 3, 0, 10, 2]), torch.tensor([0.8, 1.0, 1.0, 0.6, 0.95, 1.0]),
            torch.tensor([0.0, 0.1, 0.0, 0.0, 0.02, 0.0]))
    keep = filter_mask(logits, *args)
    out = filter_logits(logits, *args)
    t = torch.where(temp == 0, torch.ones_like(temp), temp)
    expect = torch.where(keep, logits / t[:, None], torch.full_like(logits, NEG_INF))
    assert torch.equal(out, expect)
    assert out.dtype == torch.float32
    # scalars broadcast like [B] tensors; bf16 logits are filtered in fp32
    assert torch.equal(filter_logits(logits, 0.5, -1, 1.0, 0.1), filter_logits(logits, *_rows(6, 0.5, -1, 1.0, 0.1)))
    assert filter_logits(logits.bfloat16(), *args).dtype == torch.float32


def test_ties_top_k_one_and_tiny_top_p():
    x = torch.tensor([[5.0, 1.0, 5.0, 3.0, 5.0, 2.0]])
    off = dict(temperature_B=torch.tensor([1.0]), top_p_B=torch.tensor([1.0]), min_p_B=torch.tensor([0.0]))
    # top-k keeps every token tied with the k-th largest value
    for k in (1, 2, 3):
        assert filter_mask(x, top_k_B=torch.tensor([k]), **off)[0].tolist() == [True, False, True, False, True, False]
    assert filter_mask(x, top_k_B=torch.tensor([4]), **off)[0].tolist() == [True, False, True, True, True, False]
    # top_k = 1 with a unique max keeps exactly the argmax
    y = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    assert filter_mask(y, top_k_B=torch.tensor([1]), **off)[0].tolist() == [False, True, False, False]
    # a tiny top_p keeps one token: the max; among tied maxima the highest id (stable ascending sort)
    tiny = dict(temperature_B=torch.tensor([1.0]), top_k_B=torch.tensor([-1]), min_p_B=torch.tensor([0.0]),
                top_p_B=torch.tensor([1e-6]))
    assert filter_mask(y, **tiny)[0].tolist() == [False, True, False, False]
    assert filter_mask(x, **tiny)[0].tolist() == [False, False, False, False, True, False]
    # top_p keeps the smallest top set whose mass reaches p: probs 0.5, 0.25, 0.125, 0.125
    # (at p = 0.8 the two tied 0.125 tokens straddle the cut: the lower id goes first)
    z = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]]))
    for p, expect in [(0.5, [False, True, False, False]), (0.6, [False, True, False, True]),
                      (0.75, [False, True, False, True]), (0.8, [False, True, True, True]),
                      (0.9, [True, True, True, True])]:
        got = filter_mask(z, torch.tensor([1.0]), torch.tensor([-1]), torch.tensor([p]), torch.tensor([0.0]))
        assert got[0].tolist() == expect, p


def test_min_p_uses_temperature_scaled_probabilities():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # T = 1: p ratios e^-1, e^-2, e^-3 of the max; min_p = 0.2 keeps ratios >= 0.2 -> first two
    keep1 = filter_mask(x, torch.tensor([1.0]), torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([0.2]))
    assert keep1[0].tolist() == [True, True, False, False]
    # T = 2 flattens: ratios e^-0.5, e^-1, e^-1.5 = 0.61, 0.37, 0.22 -> all kept
    keep2 = filter_mask(x, torch.tensor([2.0]), torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([0.2]))
    assert keep2[0].tolist() == [True, True, True, True]
    # min_p = 1 keeps only the max (and exact ties with it)
    keep3 = filter_mask(torch.tensor([[1.0, 3.0, 3.0]]), torch.tensor([1.0]), torch.tensor([-1]),
                        torch.tensor([1.0]), torch.tensor([1.0]))
    assert keep3[0].tolist() == [False, True, True]


def _vllm_order(logits, temp, k, p, min_p):
    """vLLM v1's op sequence written out step by step (apply_temperature, MinPLogitsProcessor,
    apply_top_k_top_p with sort / gather / masked_fill / softmax / cumsum / scatter)."""
    x = logits.to(torch.float32)
    x = x / torch.where(temp < 1e-5, torch.ones_like(temp), temp)[:, None]
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p[:, None], NEG_INF)
    srt, idx = x.sort(dim=-1, descending=False)
    kth = srt.gather(1, (srt.shape[1] - k)[:, None])
    srt = srt.masked_fill(srt < kth, NEG_INF)
    cum = torch.softmax(srt, dim=-1).cumsum(dim=-1)
    m = cum <= 1 - p[:, None]
    m[:, -1] = False
    srt = srt.masked_fill(m, NEG_INF)
    return srt.scatter(-1, idx, srt)


@pytest.mark.parametrize("some_rows_top_p_only", [False, True])  # the top-k-only path and the full sort
def test_equals_vllm_op_sequence_bit_for_bit(some_rows_top_p_only):
    g = torch.Generator().manual_seed(2)
    B, V = 64, 300
    logits = torch.randn(B, V, generator=g) * 2.5  # continuous: no ties, so sort stability is moot
    temp = torch.rand(B, generator=g) * 1.5 + 0.2
    k = torch.randint(1, V, (B,), generator=g)
    if some_rows_top_p_only:
        k[::5] = V
    p = torch.rand(B, generator=g) * 0.99 + 0.01
    min_p = torch.where(torch.rand(B, generator=g) < 0.5, torch.rand(B, generator=g) * 0.2, torch.zeros(B))
    assert torch.equal(filter_logits(logits, temp, k, p, min_p), _vllm_order(logits, temp, k, p, min_p))


def test_top_k_shortcut_equals_the_full_sort():
    g = torch.Generator().manual_seed(4)
    B, V = 300, 64
    xs = torch.randn(B, V, generator=g) * 2
    xs[: B // 2] = torch.randint(-4, 4, (B // 2, V), generator=g).float()  # heavy ties
    xs[::7, ::3] = NEG_INF                                                  # min-p drops
    k = torch.randint(1, V + 4, (B,), generator=g)
    k[::11] = -1
    topk_on = (k > 0) & (k < V)
    p = torch.tensor([[0.3, 0.9, 1.0, 1e-6, 0.99][i % 5] for i in range(B)])
    p = torch.where(topk_on, p, torch.ones_like(p))  # the shortcut's precondition: top-p rows have top-k
    args = (xs, k, topk_on, p, p < 1)
    assert torch.equal(filters_mod._top_k_top_p_within_top_k(*args), filters_mod._top_k_top_p_full_sort(*args))


def test_all_filters_off_keeps_everything():
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    keep = filter_mask(x, torch.tensor([1.0, 0.5, 0.0]), torch.tensor([-1, 0, 50]), torch.tensor([1.0] * 3),
                       torch.tensor([0.0] * 3))
    assert keep.all()


def test_rejects_non_2d_logits():
    with pytest.raises(ValueError, match="2-D"):
        filter_mask(torch.zeros(5), 1.0, -1, 1.0, 0.0)
