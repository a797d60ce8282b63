import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from benchmarks.difr_variants import MC_EPS, fit_ipt_sigma, gap_args, ipt_difr, ipt_distance, mc_difr
from verinfer.detect.clipping import tail_pool, winsorize
from verinfer.sampling import gap
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.gap import postgumbel_gaps, postgumbel_margin



# -- reference loops ------------------------------------------------------------------------------
def mc_difr_loop(gaps_NK, sigma: float, n_trials: int, rng: np.random.Generator, eps: float = MC_EPS) -> np.ndarray:
    """Reference for `mc_difr`: one token and one trial at a time, drawing the same normals in the
    same order (so equal to mc_difr with chunk >= N and the same rng state)."""
    g = np.asarray(gaps_NK, dtype=np.float64)
    N, K = g.shape
    z_all = rng.standard_normal((N, n_trials, K + 1))
    out = np.empty(N)
    for i in range(N):
        wins = 0
        for t in range(n_trials):
            z_y = z_all[i, t, 0]
            best = -math.inf
            for k in range(K):
                best = max(best, g[i, k] + sigma * (z_all[i, t, k + 1] - z_y))
            wins += best < 0
        out[i] = -math.log((wins + eps) / (n_trials + eps))
    return out


# --- one replay -> every feature --------------------------------------------------------------------


def alternative_evidence_loop(margin, alt_margins, clip: float) -> np.ndarray:
    """Reference for `alternative_evidence`, one token at a time."""
    out = []
    for i, m in enumerate(margin):
        b = min(m, clip)
        out.append(b + sum(b - min(a[i], clip) for a in alt_margins))
    return np.array(out)


# --- perturbation likelihood ----------------------------------------------------------------------


def temperature_gaps_loop(claims, replays, factors, k: int | None = None) -> np.ndarray:
    """Reference for `temperature_gaps` ([N, F]; with k: `block_gaps`, [N, F, k]):
    `sampling.gap.block_gaps_loop` (full-vocabulary filter per claim and factor)."""
    out = gap.block_gaps_loop(*gap_args(claims, replays), factors, k or 1).numpy()
    return out if k else out[:, :, 0]


def test_mc_difr_vectorized_equals_loop():
    rng = np.random.default_rng(0)
    g = rng.normal(-1.0, 1.0, (40, 5))
    g[3] = -np.inf          # no competitor: always wins
    g[4, 2:] = -np.inf      # padding
    g[5] = np.inf           # filtered out: never wins
    fast = mc_difr(g, 0.5, 30, np.random.default_rng(1), chunk=1000)
    slow = mc_difr_loop(g, 0.5, 30, np.random.default_rng(1))
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)
    assert fast[3] == pytest.approx(0.0) and fast[5] == pytest.approx(-math.log(1 / 31))


def test_mc_difr_frequency_matches_the_gaussian_probability():
    # one competitor at gap d: P(win) = P(d + sigma (Z1 - Z0) < 0) = Phi(-d / (sqrt(2) sigma))
    d, sigma, n = 0.3, 0.4, 200_000
    s = mc_difr(np.array([[d]]), sigma, n, np.random.default_rng(2))
    p = (math.exp(-s[0]) * (n + 1)) - 1
    assert p / n == pytest.approx(norm.cdf(-d / (math.sqrt(2) * sigma)), abs=3e-3)


def test_ipt_difr_values_and_sigma():
    lo, hi = np.array([0.2, 0.2, 0.5, 0.3]), np.array([0.4, 0.4, 0.5, 0.6])
    u = np.array([0.3, 0.41, 0.5, 0.9])
    s = ipt_difr(lo, hi, u, 0.01)
    assert s[0] == pytest.approx(-math.log(norm.cdf(10) - norm.cdf(-10) + 1e-12))
    assert s[1] == pytest.approx(-math.log(norm.cdf(-1) - norm.cdf(-21) + 1e-12))
    assert s[2] == pytest.approx(-math.log(1e-12))          # empty interval: filtered out
    assert s[3] > s[1] > s[0]
    np.testing.assert_allclose(ipt_distance(lo, hi, u), [0, 0.01, 0, 0.3], atol=1e-15)
    d = np.abs(np.random.default_rng(0).normal(0, 0.02, 10_000))
    assert fit_ipt_sigma(np.zeros_like(d), np.zeros_like(d), d) == pytest.approx(0.02, rel=0.05)
    with pytest.raises(ValueError, match="sigma"):
        ipt_difr(lo, hi, u, 0.0)


def test_tail_pooled_and_clip():
    v = np.array([0.0, 0.5, 2.0, np.inf])
    np.testing.assert_array_equal(tail_pool(v, 1.5, 1.0), [0, 0, 1.5, 1.5])
    np.testing.assert_array_equal(winsorize(v, 1.0), [0, 0.5, 1, 1])


@pytest.mark.parametrize("noise", ["vllm-cpu", "keyed"])
def test_postgumbel_gaps_agree_with_the_margin(noise):
    torch.manual_seed(0)
    T, V = 64, 300
    logits = torch.randn(T, V) * 3
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.0, seed=123, max_tokens=T, noise=noise)
    from verinfer.sampling.sampler import replay_tokens

    replay = replay_tokens(logits, p, 5)
    claimed = replay.clone()
    flip = torch.arange(T) % 3 == 0
    claimed[flip] = logits.topk(3, -1).indices[flip, 1]    # a competitor, usually kept
    claimed[7] = logits.argmin(-1)[7]                       # filtered out
    gaps = postgumbel_gaps(logits, claimed, p, 5, k=8)
    margin, rep, kept = postgumbel_margin(logits, claimed, p, 5)
    mism = (claimed != rep) & kept
    assert mism.sum() > 5
    np.testing.assert_allclose(gaps[mism, 0].numpy(), margin[mism].numpy(), rtol=0, atol=1e-9)
    assert (gaps[(claimed == rep), 0] <= 1e-9).all()
    assert torch.isinf(gaps[7]).all() and (gaps[7] > 0).all()
    assert (gaps[:, :-1] >= gaps[:, 1:]).all()               # descending


def test_alternative_evidence_vectorized_equals_loop():
    from benchmarks.difr_variants import alternative_evidence

    rng = np.random.default_rng(3)
    m = np.where(rng.random(500) < 0.9, 0.0, rng.exponential(0.5, 500))
    m[3] = np.inf
    alts = [np.where(rng.random(500) < 0.9, 0.0, rng.exponential(0.5, 500)) for _ in range(2)]
    alts[0][4] = np.inf
    np.testing.assert_allclose(alternative_evidence(m, alts, 1.0), alternative_evidence_loop(m, alts, 1.0))
    # a claim the alternative reproduces exactly scores twice its clipped honest margin
    assert alternative_evidence(np.array([0.4]), [np.array([0.0])], 1.0)[0] == pytest.approx(0.8)


def test_temperature_margin_is_zero_at_the_claimed_temperature():
    import dataclasses

    from verinfer.claims import Claim
    from benchmarks.difr_variants import temperature_margin
    from verinfer.engine.engine import Replay
    from verinfer.sampling.sampler import replay_tokens

    torch.manual_seed(1)
    logits = torch.randn(300, 200) * 2
    p = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, min_p=0.0, seed=9, max_tokens=300, noise="vllm-cpu")
    y = replay_tokens(logits, p, 3).tolist()         # tokens an honest T=1.1 sampler draws
    c = Claim("c", "m", [1, 2, 3], y, dataclasses.replace(p, temperature=1.0))
    assert (temperature_margin([c], [Replay(logits)], 1.5) == 0).all()
    assert (temperature_margin([c], [Replay(logits)], 1.0) > 0).any()


def test_temperature_gaps_block_equals_full_vocabulary_loop():
    import dataclasses

    from verinfer.claims import Claim
    from benchmarks.difr_variants import temperature_gaps
    from verinfer.engine.engine import Replay
    from verinfer.sampling.sampler import replay_tokens

    torch.manual_seed(0)
    claims, replays = [], []
    for i in range(6):
        logits = (torch.randn(40, 600) * 3).to(torch.bfloat16).float()   # bf16 logits tie often
        p = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.0, seed=5 + i, max_tokens=40,
                           noise="vllm-cpu")
        y = replay_tokens(logits, dataclasses.replace(p, temperature=1.1), 7)   # a provider at 1.1 x T
        y[::9] = logits.topk(5, -1).indices[::9, 3]                            # some other competitors
        y[5] = logits.argmin(-1)[5]                                            # filtered out
        claims.append(Claim(f"c{i}", "m", list(range(7)), y.tolist(), p))
        replays.append(Replay(logits))
    factors = (1.0, 0.9, 1.1)
    fast = temperature_gaps(claims, replays, factors)
    np.testing.assert_array_equal(fast, temperature_gaps_loop(claims, replays, factors))
    # factor 1: positive gaps are the Token-DiFR margins; the 1.1 replay reproduces the 1.1 draws
    m, _, _ = postgumbel_margin(replays[0].logits_TV, torch.tensor(claims[0].output_token_ids), claims[0].sampling, 7)
    d = fast[:40, 0]
    np.testing.assert_allclose(np.maximum(d, 0)[np.isfinite(d)], m.numpy()[np.isfinite(d)], atol=1e-9)
    one = np.ones(40, bool)
    one[::9] = False
    one[5] = False
    drawn = np.tile(one, 6)
    assert (fast[drawn, 2] <= 0).all() and (fast[drawn, 0] > 0).mean() > 0.05
    assert np.isinf(fast[5]).all()


def test_block_gaps_k16_equal_postgumbel_gaps():
    from verinfer.claims import Claim
    from benchmarks.difr_variants import block_gaps
    from verinfer.engine.engine import Replay

    torch.manual_seed(3)
    claims, replays = [], []
    for i in range(4):
        logits = (torch.randn(30, 500) * 2).to(torch.bfloat16).float()
        p = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.0, seed=i, max_tokens=30, noise="keyed")
        y = logits.topk(3, -1).indices[:, i % 3]
        claims.append(Claim(f"c{i}", "m", [1, 2], y.tolist(), p))
        replays.append(Replay(logits))
    fast = block_gaps(claims, replays, (1.0, 1.2), 16)
    np.testing.assert_array_equal(fast, temperature_gaps_loop(claims, replays, (1.0, 1.2), 16))
    g = fast[np.isfinite(fast[:, 0, 0]), 0]
    assert np.isneginf(fast[:, :, -1]).mean() < 0.5 and (g[:, :-1] >= g[:, 1:]).all()   # descending, -inf padded


def test_block_gaps_top_p_slack_equals_a_per_token_loop():
    import dataclasses

    from verinfer.claims import Claim
    from benchmarks.difr_variants import block_gaps
    from verinfer.engine.engine import Replay
    from verinfer.sampling.filters import filter_mask
    from verinfer.sampling.noise import get_backend

    torch.manual_seed(4)
    claims, replays = [], []
    for i in range(3):
        logits = (torch.randn(25, 300) * 1.5).to(torch.bfloat16).float()   # flat: the top-p cut keeps ~100
        p = SamplingParams(temperature=1.0, top_k=200, top_p=0.9, min_p=0.0, seed=i, max_tokens=25, noise="vllm-cpu")
        y = logits.topk(120, -1).indices[torch.arange(25), torch.randint(0, 120, (25,))]
        claims.append(Claim(f"c{i}", "m", [1, 2, 3], y.tolist(), p))
        replays.append(Replay(logits))
    tau, factors = 0.02, (1.0, 1.1)
    fast = block_gaps(claims, replays, factors, 1, top_p_slack=tau)[:, :, 0]
    slow = []
    for c, r in zip(claims, replays):
        l, p = r.logits_TV, c.sampling
        g = get_backend(p.noise).tape(p.seed, 25, 300, 3).gumbel(torch.arange(300).expand(25, 300), exact=False)
        for t, y in enumerate(c.output_token_ids):
            row = []
            for f in factors:
                q = dataclasses.replace(p, temperature=p.temperature * f)
                strict = filter_mask(l[t : t + 1], q.temperature, q.top_k, q.top_p - tau, q.min_p)[0]
                loose = filter_mask(l[t : t + 1], q.temperature, q.top_k, q.top_p + tau, q.min_p)[0]
                s = l[t].double() + float(torch.tensor(q.temperature, dtype=torch.float32)) * g[t]
                comp = [float(s[v] - s[y]) for v in range(300) if strict[v] and v != y]
                row.append(math.inf if not loose[y] else max(comp, default=-math.inf))
            slow.append(row)
    np.testing.assert_allclose(fast, np.array(slow), rtol=0, atol=1e-9)
    plain = block_gaps(claims, replays, factors, 1)[:, :, 0]
    assert (fast <= plain).all() and (fast < plain).any()     # the slack only removes unstable evidence
