"""Acceptance rules: vectorized functions against plain loops / scipy, and their definitions."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import entropy as scipy_entropy

from verinfer.sampling.noise import speculative_noise
from verinfer.sampling.sampler import sample_probs
from verinfer.speculative.rules import (CONFIDENT_TOP1, Rule, accept_mask, entropy, kl_divergence,
                                        leading_accepted, residual, verify)


def _dists(B, G, V, seed, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(sharp * torch.randn(B, G, V, generator=g), -1)
    q = torch.softmax(sharp * torch.randn(B, G, V, generator=g), -1)
    return p, q, g


def test_kl_and_entropy_match_scipy():
    p, q, _ = _dists(3, 4, 50, 0)
    kl = kl_divergence(p, q)
    h = entropy(p)
    for b in range(3):
        for i in range(4):
            assert kl[b, i].item() == pytest.approx(scipy_entropy(p[b, i].numpy(), q[b, i].numpy()), rel=1e-5)
            assert h[b, i].item() == pytest.approx(scipy_entropy(p[b, i].numpy()), rel=1e-5)
    assert kl_divergence(p, p).abs().max() < 1e-6


def test_leading_accepted_counts_up_to_first_rejection():
    acc = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert leading_accepted(acc).tolist() == [2, 0, 4, 1]


def test_kl_rule_definition_and_confidence_mask():
    # row 0: close distributions, target uncertain -> KL accepts a token the target dislikes
    p = torch.tensor([[[0.5, 0.4, 0.1]], [[0.95, 0.04, 0.01]]])
    q = torch.tensor([[[0.45, 0.45, 0.1]], [[0.90, 0.05, 0.05]]])
    x = torch.tensor([[2], [2]])
    u = torch.tensor([[0.999], [0.999]])  # the standard rule would reject both (p/q = 1 and 0.2 ... u=0.999)
    std = accept_mask(Rule("standard"), p, q, x, u, greedy=False)
    kl = accept_mask(Rule("kl", 0.05), p, q, x, u, greedy=False)
    assert not std[1, 0]
    assert kl[0, 0]                         # KL(p||q) ~ 0.006 < 0.05, top-1 0.5 <= 0.9
    assert not kl[1, 0]                     # top-1 0.95 > CONFIDENT_TOP1: standard rule only
    assert p[1, 0].max() > CONFIDENT_TOP1
    # greedy: standard = argmax match
    assert accept_mask(Rule("standard"), p, q, torch.tensor([[0], [1]]), None, greedy=True).tolist() == [[True], [False]]


def test_baseline_rules():
    p, q, _ = _dists(2, 5, 30, 1)
    x = q.argmax(-1)
    ranks = (p > p.gather(-1, x[..., None])).sum(-1)  # 0-based rank of x under p
    topk = accept_mask(Rule("topk", 3), p, q, x, None, greedy=True)
    assert torch.equal(topk, ranks < 3)
    te = accept_mask(Rule("target_entropy", 1.0), p, q, x, None, greedy=True)
    assert torch.equal(te, (x == p.argmax(-1)) | (entropy(p) > 1.0))
    de = accept_mask(Rule("draft_entropy", 1.0), p, q, x, None, greedy=True)
    assert torch.equal(de, (x == p.argmax(-1)) | (entropy(q) < 1.0))
    with pytest.raises(ValueError, match="unknown acceptance rule"):
        Rule("nope")
    with pytest.raises(ValueError, match="trained judge"):
        accept_mask(Rule("autojudge", 0.5), p, q, x, None, greedy=True)


def _gumbel_max_loop(dist, noise):
    """Reference Gumbel-max draw: the first v maximizing log(dist_v) + G_v over dist_v > 0."""
    G = noise.gumbel_all().tolist()
    best, arg = -math.inf, None
    for v, pv in enumerate(dist.tolist()):
        if pv > 0 and math.log(pv) + G[v] > best:
            best, arg = math.log(pv) + G[v], v
    return arg


def _verify_loop(rule, p, q, x, u, noises):
    """Textbook speculative sampling, one row and one position at a time (reference)."""
    B, G = x.shape
    n_out, nxt = [], []
    for b in range(B):
        n = G
        for i in range(G):
            ok = bool(u[b, i].to(p.dtype) * q[b, i, x[b, i]] < p[b, i, x[b, i]])
            if rule.name == "kl":
                ok = ok or (kl_divergence(p[b, i], q[b, i]).item() < rule.threshold and p[b, i].max() <= CONFIDENT_TOP1)
            if not ok:
                n = i
                break
        dist = p[b, G] if n == G else residual(p[b, n].double(), q[b, n].double())
        n_out.append(n)
        nxt.append(_gumbel_max_loop(dist.double(), noises[b]))
    return n_out, nxt


@pytest.mark.parametrize("rule", [Rule("standard"), Rule("kl", 0.3)])
def test_verify_matches_reference_loop(rule):
    B, G, V = 6, 4, 40
    p, q, g = _dists(B, G + 1, V, 2, sharp=1.0)
    q = q[:, :G]
    spec = [speculative_noise(10 + b, V) for b in range(B)]
    x = torch.tensor([[sample_probs(q[b, i].double(), spec[b].draft(3, i)) for i in range(G)] for b in range(B)])
    assert x.tolist() == [[_gumbel_max_loop(q[b, i].double(), spec[b].draft(3, i)) for i in range(G)] for b in range(B)]
    u = torch.stack([s.accept_uniforms(3, G) for s in spec])
    noises = [s.token(3) for s in spec]
    n, nxt, _ = verify(rule, p, q, x, False, u, noises)
    n_ref, nxt_ref = _verify_loop(rule, p, q, x, u, noises)
    assert n.tolist() == n_ref and nxt.tolist() == nxt_ref
    assert 0 < sum(n_ref) < B * G   # both accepted and rejected drafts


def test_one_step_lossless_exact_marginal():
    """Standard rule, G=1: P(first emitted token = v) = q(v) min(1, p/q) + P(reject) residual(v) = p(v)."""
    p, q, _ = _dists(1, 1, 12, 3, sharp=1.5)
    p, q = p[0, 0].double(), q[0, 0].double()
    acc = q * torch.minimum(torch.ones_like(p), p / q)
    total = acc + (1 - acc.sum()) * residual(p, q)
    assert torch.allclose(total, p, atol=1e-12)


def test_verify_needs_the_noise_when_sampling():
    p, q, _ = _dists(2, 2, 5, 4)
    with pytest.raises(ValueError, match="acceptance uniforms"):
        verify(Rule(), p, q[:, :1], torch.zeros(2, 1, dtype=torch.long), False, None)
