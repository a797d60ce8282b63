"""sampling/pit.py: the unseeded audit's per-token features against a sorted reference loop, their
exact uniformity under honest sampling, and the keyed uniforms."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from verinfer.sampling.filters import filter_mask
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.pit import pit_features, pit_key, pit_uniforms, unseeded_rows, xent_excess

PARAMS = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=None, unseeded=True)


def _reference(logits_V: torch.Tensor, x: int, params: SamplingParams, v: float) -> tuple[float, float, float]:
    """(u, log p_x, H) by sorting the filtered distribution (descending p, ties by id)."""
    keep = filter_mask(logits_V[None], params.temperature, params.top_k, params.top_p, params.min_p)[0]
    scaled = (logits_V.float() / np.float32(params.temperature)).double().masked_fill(~keep, -math.inf)
    p = torch.softmax(scaled, -1).tolist()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    before = 0.0
    for i in order:
        if i == x:
            break
        before += p[i]
    h = -sum(q * math.log(q) for q in p if q > 0)
    if p[x] == 0:
        return 1.0, -math.inf, h
    return before + v * p[x], math.log(p[x]), h


def test_features_match_a_sorted_reference_loop_with_ties_and_filtered_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 2
    logits[:, 10] = logits[:, 11]                 # exact ties: ordered by id
    x = torch.randint(0, 50, (64,), generator=g)  # many fall outside top-k 40 / top-p 0.9
    x[:8] = 11
    v = pit_uniforms("claim-a", 64)
    u, logp, h = pit_features(logits, x, PARAMS, v)
    filtered = 0
    for t in range(64):
        ru, rl, rh = _reference(logits[t], int(x[t]), PARAMS, float(v[t]))
        assert u[t].item() == pytest.approx(ru, abs=1e-12) and h[t].item() == pytest.approx(rh, abs=1e-9)
        assert (logp[t].item() == rl == -math.inf) or logp[t].item() == pytest.approx(rl, abs=1e-12)
        filtered += ru == 1.0
    assert filtered >= 5  # the out-of-support path is exercised: u = 1, log p = -inf, excess +inf
    assert torch.isinf(xent_excess(logp, h)[logp == -math.inf]).all()


def test_pit_of_honest_draws_is_uniform_and_the_excess_has_mean_zero():
    """Draws from the filtered distribution itself: u ~ U(0, 1) exactly (KS), E[-log p - H] = 0."""
    g = torch.Generator().manual_seed(1)
    N = 20_000
    logits = torch.randn(N, 30, generator=g) * 3  # peaked rows: most mass on few tokens (discrete u)
    params = [PARAMS] * N
    from verinfer.sampling.pit import filtered_probs
    _, p = filtered_probs(logits, params)
    x = torch.multinomial(p.float(), 1, generator=g)[:, 0]
    r = unseeded_rows(logits, x, params, pit_uniforms("honest", N))
    assert stats.kstest(r.pit.numpy(), "uniform").pvalue > 0.01
    ex = xent_excess(r.logp, r.entropy).numpy()
    assert abs(ex.mean()) < 4 * ex.std() / math.sqrt(N)
    assert r.kept.all() and (r.pit < 1).all()
    # the same tokens against a hotter claim: u leaves uniformity (toward the top ranks)
    hot = [SamplingParams(temperature=1.2, top_k=40, top_p=0.9, seed=None, unseeded=True)] * N
    u_hot = unseeded_rows(logits, x, hot, pit_uniforms("honest", N)).pit.numpy()
    assert stats.kstest(u_hot, "uniform").pvalue < 1e-6 and u_hot.mean() < 0.45


def test_uniforms_are_keyed_by_claim_and_position():
    a = pit_uniforms("c1", 100)
    assert torch.equal(a, pit_uniforms("c1", 100)) and torch.equal(a[40:], pit_uniforms("c1", 60, start=40))
    assert not torch.equal(a, pit_uniforms("c2", 100))
    assert ((a > 0) & (a < 1)).all() and pit_key("c1") == pit_key("c1") != pit_key("c2")
    assert stats.kstest(pit_uniforms("many", 20_000).numpy(), "uniform").pvalue > 0.01


def test_noise_free_margin_and_replay_of_unseeded_rows():
    logits = torch.tensor([[3.0, 1.0, 0.5, -9.0]])
    params = [SamplingParams(temperature=1.0, top_p=0.99, seed=None, unseeded=True)]
    for x, margin in ((0, 0.0), (1, 2.0), (3, math.inf)):
        r = unseeded_rows(logits, torch.tensor([x]), params, torch.tensor([0.5]))
        assert r.replay.item() == 0 and r.margin.item() == margin and r.kept.item() == (x != 3)
