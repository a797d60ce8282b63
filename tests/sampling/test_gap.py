"""The gap formulas (sampling/gap.py) against per-element Python loops, and the margin's
max-of-differences against the difference-of-max it replaced (bit for bit)."""

import math

import torch

from verinfer.sampling.gap import competitor_gaps, signed_gaps, token_difr_margin


def _inputs(N=40, K=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    l_NK = (torch.randn(N, K, generator=g) * 3).to(torch.bfloat16).float()   # bf16: ties
    G_NK = -torch.log(-torch.log(torch.rand(N, K, generator=g, dtype=torch.float64)))
    y_N = torch.randint(0, K, (N,), generator=g)
    temp_N = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    valid_NK = torch.rand(N, K, generator=g) < 0.7
    return l_NK, G_NK, y_N, temp_N, valid_NK


def test_signed_gaps_equal_the_formula_elementwise():
    l_NK, G_NK, y_N, temp_N, _ = _inputs()
    d = signed_gaps(l_NK, G_NK, l_NK.gather(1, y_N[:, None])[:, 0], G_NK.gather(1, y_N[:, None])[:, 0], temp_N)
    for n in range(l_NK.shape[0]):
        t, y = float(temp_N[n]), int(y_N[n])
        s_y = float(l_NK[n, y]) + t * float(G_NK[n, y])
        for c in range(l_NK.shape[1]):
            assert float(d[n, c]) == (float(l_NK[n, c]) + t * float(G_NK[n, c])) - s_y
        assert float(d[n, y]) == 0.0
    greedy = signed_gaps(l_NK, None, l_NK[:, 0], None, 0.0)
    assert torch.equal(greedy, l_NK.double() - l_NK[:, :1].double())


def test_margin_is_the_difference_of_the_max_bit_for_bit():
    """max_c (s_c - s_y) == max_c s_c - s_y exactly (rounding is monotone), as the pre-gap.py code
    computed it; 0 where replayed, +inf where filtered out, >= 0 otherwise."""
    l_NK, G_NK, y_N, temp_N, valid_NK = _inputs(N=500, seed=1)
    valid_NK[:, 0] = True
    s_NK = l_NK.double() + temp_N[:, None] * G_NK
    s_y = l_NK.gather(1, y_N[:, None])[:, 0].double() + temp_N * G_NK.gather(1, y_N[:, None])[:, 0]
    d = signed_gaps(l_NK, G_NK, l_NK.gather(1, y_N[:, None])[:, 0], G_NK.gather(1, y_N[:, None])[:, 0], temp_N)
    replayed = torch.rand(500, generator=torch.Generator().manual_seed(2)) < 0.3
    kept = valid_NK.gather(1, y_N[:, None])[:, 0]
    m = token_difr_margin(d, valid_NK, replayed, kept)
    old = (s_NK.masked_fill(~valid_NK, -math.inf).amax(-1) - s_y).clamp_min(0.0)
    old = old.masked_fill(replayed, 0.0).masked_fill(~kept, math.inf)
    assert torch.equal(m, old)
    assert (m[replayed & kept] == 0).all() and torch.isinf(m[~kept]).all() and (m >= 0).all()


def test_competitor_gaps_equal_a_loop():
    l_NK, G_NK, y_N, temp_N, valid_NK = _inputs(N=60, K=9, seed=3)
    d = signed_gaps(l_NK, G_NK, l_NK.gather(1, y_N[:, None])[:, 0], G_NK.gather(1, y_N[:, None])[:, 0], temp_N)
    comp_NK = valid_NK & (torch.arange(9)[None] != y_N[:, None])
    kept = valid_NK.gather(1, y_N[:, None])[:, 0]
    for k in (1, 4, 12):
        out = competitor_gaps(d, comp_NK, kept, k)
        assert out.shape == (60, k)
        for n in range(60):
            if not kept[n]:
                assert torch.isinf(out[n]).all() and (out[n] > 0).all()
                continue
            ref = sorted((float(d[n, c]) for c in range(9) if comp_NK[n, c]), reverse=True)[:k]
            ref += [-math.inf] * (k - len(ref))
            assert out[n].tolist() == ref


def test_unseeded_claims_have_no_gap():
    """An unseeded claim (`"seed": null`) has no noise to regenerate: block_gaps (and its loop
    reference) give its rows NaN, as greedy ones, and leave the seeded claims' rows as alone; the
    single-claim functions and score_claimed refuse it with what to use instead."""
    import numpy as np
    import pytest

    from verinfer.sampling.gap import block_gaps, block_gaps_loop, postgumbel_gaps, postgumbel_margin, score_claimed
    from verinfer.sampling.params import SamplingParams

    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(5, 64, generator=g) * 3 for _ in range(3)]
    claimed = [torch.randint(0, 64, (5,), generator=g) for _ in range(3)]
    seeded = [SamplingParams(1.0, 8, 0.95, 0.0, 7 + i, 5) for i in range(2)]
    unseeded = SamplingParams(1.0, 8, 0.95, 0.0, None, 5, unseeded=True)
    for fn in (block_gaps, block_gaps_loop):
        mixed = fn(logits, claimed, [seeded[0], unseeded, seeded[1]], [3, 3, 3], (1.0, 0.9))
        alone = fn(logits[::2], claimed[::2], seeded, [3, 3], (1.0, 0.9))
        assert mixed[5:10].isnan().all()
        np.testing.assert_array_equal(torch.cat([mixed[:5], mixed[10:]]).numpy(), alone.numpy())
    for call in (lambda: postgumbel_gaps(logits[1], claimed[1], unseeded, 3),
                 lambda: postgumbel_margin(logits[1], claimed[1], unseeded, 3),
                 lambda: score_claimed(logits, claimed, [seeded[0], unseeded, seeded[1]], [3, 3, 3])):
        with pytest.raises(ValueError, match=r"unseeded.*sampling\.pit"):
            call()
