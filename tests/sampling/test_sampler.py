"""Samplers: argmax of the right expression, vLLM's exponential path, the sampled distribution,
replay vs step-by-step sampling, and the Token-DiFR margin vs a slow full-vocab loop."""

import math

import pytest
import torch

from verinfer.sampling import sampler as sampler_mod
from verinfer.sampling.filters import filter_logits, filter_mask
from verinfer.sampling.noise import NoiseKindError, get_backend
from verinfer.sampling.params import NOISE_BACKENDS, SamplingParams
from verinfer.sampling.gap import postgumbel_margin
from verinfer.sampling.sampler import (_gumbel_argmax, inverse_cdf_interval, replay_tokens, sample_batch,
                                       sample_one)
from verinfer.sampling.sglang_seeded import sglang_sample, sglang_scores

NEG_INF = float("-inf")


def _logits(T, V, seed=0, scale=2.0):
    return torch.randn(T, V, generator=torch.Generator().manual_seed(seed)) * scale


def _scaled(logits_V, p):
    return filter_logits(logits_V[None], p.temperature, p.top_k, p.top_p, p.min_p)[0]


def _scaled_rows(logits_TV, p):
    T = logits_TV.shape[0]
    return filter_logits(logits_TV, *(torch.full((T,), v) for v in (p.temperature, p.top_k, p.top_p, p.min_p)))


PARAMS = [dict(temperature=1.0), dict(temperature=0.7, top_k=10, top_p=0.9),
          dict(temperature=1.3, min_p=0.05, top_p=0.95), dict(temperature=0.5, top_k=1)]


# --- one step: argmax of the right expression -------------------------------------------------
@pytest.mark.parametrize("name", NOISE_BACKENDS)
@pytest.mark.parametrize("kw", PARAMS)
def test_sample_one_is_argmax_of_the_backend_expression(name, kw):
    V, T = 60, 6
    logits = _logits(T, V, seed=1)
    b = get_backend(name)
    if kw.get("min_p", 0) > 0 and not b.supports_min_p:
        pytest.skip(f"{name} refuses min-p")
    p = SamplingParams(seed=31, noise=name, **kw)
    stream = b.stream(31, V, start_position=3)
    for t in range(T):
        noise = stream.next()
        x = _scaled(logits[t], p)
        if b.pipeline == "sglang":  # SGLang's own filters, log p scores and columns (test_sglang_seeded.py)
            sorted_ = b.always_sorted
            expect = int(sglang_sample(logits[t][None], 31, torch.tensor([3 + t - 1]), p.temperature, p.top_k,
                                       p.top_p, sorted_)[0])
            got = sample_one(logits[t], p, noise)
            assert got == expect
            assert bool(sglang_scores(logits[t][None], p.temperature, p.top_k, p.top_p, sorted_)[0][0, got])
            continue
        if name in ("vllm-cpu", "keyed", "speculative-keyed") or name.startswith("vllm-mrv2-"):
            # vLLM MRv2 fp32 adds in fp32 (noise.score_dtype); argmax: the first maximum
            expect = int((x.to(noise.score_dtype) + noise.gumbel_all().to(noise.score_dtype)).argmax())
        elif name == "vllm-v1-exponential":
            expect = int((torch.softmax(x, -1) / noise.exponential_V).argmax())
        else:  # smallest i with cdf_i > u * cdf_last, by a Python loop
            probs = torch.softmax(x.double(), -1).tolist()
            cdf, acc = [], 0.0
            for q in probs:
                acc += q
                cdf.append(acc)
            target = noise.uniform * cdf[-1]
            expect = next(i for i, c in enumerate(cdf) if c > target)
        got = sample_one(logits[t], p, noise)
        assert got == expect
        assert bool(filter_mask(logits[t][None], p.temperature, p.top_k, p.top_p, p.min_p)[0, got])


def test_greedy_is_raw_argmax_and_takes_no_noise():
    logits = _logits(1, 30, seed=2)[0]
    g = SamplingParams(temperature=0.0, top_k=3)
    assert sample_one(logits, g, None) == int(logits.argmax())
    with pytest.raises(ValueError, match="draws no noise"):
        sample_one(logits, g, get_backend("vllm-cpu").stream(1, 30).next())
    with pytest.raises(ValueError, match="needs the step's noise"):
        sample_one(logits, SamplingParams(temperature=1.0, seed=1), None)


def test_exact_gumbel_decides_near_ties():
    """Two candidates whose scores tie to within 1e-15: the winner is decided on exact G."""
    V = 64
    noise = get_backend("keyed").stream(5, V, 0).next()
    ids = torch.arange(V)
    g_exact = noise.gumbel_all()
    base = torch.full((V,), -50.0, dtype=torch.float64)
    for trial in range(20):
        a, b = 3 + trial, 40 + trial % 20
        base[:] = -50.0
        base[a] = 10.0 - g_exact[a]
        base[b] = 10.0 - g_exact[b] + (trial - 10) * 2.0**-50
        s = (base + g_exact).tolist()
        best = max(s)
        expect = min(i for i in range(V) if s[i] == best)
        assert _gumbel_argmax(base, ids, noise) == expect


# --- vLLM's exponential path, re-implemented independently ------------------------------------
def test_exponential_backend_equals_vllm_random_sample():
    B, V, steps = 4, 80, 5
    seeds = [11, 12, 13, 14]
    params = [SamplingParams(temperature=[1.0, 0.7, 1.2, 0.9][b], top_k=[-1, 20, 5, -1][b],
                             top_p=[1.0, 0.9, 1.0, 0.8][b], seed=seeds[b], noise="vllm-v1-exponential")
              for b in range(B)]
    generators = {b: torch.Generator(device="cpu").manual_seed(seeds[b]) for b in range(B)}
    streams = [get_backend("vllm-v1-exponential").stream(seeds[b], V) for b in range(B)]
    temp = torch.tensor([p.temperature for p in params])
    args = (temp, torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]), torch.zeros(B))
    for step in range(steps):
        logits = _logits(B, V, seed=100 + step)
        # vLLM: probs = logits.softmax(dim=-1, dtype=float32); q = empty_like(probs);
        # q[i].exponential_(generator=g_i); probs.div_(q).argmax(dim=-1)
        probs = filter_logits(logits, *args).softmax(dim=-1, dtype=torch.float32)
        q = torch.empty_like(probs)
        for i, gen in generators.items():
            q[i].exponential_(generator=gen)
        expect = probs.div_(q).argmax(dim=-1).view(-1)
        got = sample_batch(logits, params, [s.next() for s in streams])
        assert torch.equal(got, expect)


# --- the sampled distribution -----------------------------------------------------------------
@pytest.mark.parametrize("name", NOISE_BACKENDS)
@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 3)])
def test_samples_follow_the_filtered_softmax(name, temperature, top_k):
    """3,000 draws: 30 seeds x 100 steps, replayed at once (replay_tokens equals step-by-step sampling
    for every backend: test_replay_tokens_equal_step_by_step_sampling), the seeds' start positions
    spread over 0..6."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    n_seeds, steps = 30, 100
    n = n_seeds * steps
    counts = torch.zeros(5)
    for seed in range(n_seeds):
        p = SamplingParams(temperature=temperature, top_k=top_k, seed=seed, noise=name)
        counts += torch.bincount(replay_tokens(logits.expand(steps, 5), p, seed % 7), minlength=5)
    probs = torch.softmax(_scaled(logits, SamplingParams(temperature=temperature, top_k=top_k, seed=0)).double(), -1)
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = probs[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    # dof = 4 (or 2): p(chi2 > 25) ~ 5e-5; deterministic seeds, so this cannot flake
    assert chi2 < 25, (name, counts.tolist(), expected.tolist())
    assert (counts[kept] / n - probs[kept]).abs().max() < 0.035


# --- batches and replay -----------------------------------------------------------------------
def test_sample_batch_equals_sample_one_per_row():
    V = 50
    logits = _logits(5, V, seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=7, seed=1),
              SamplingParams(temperature=1.0, top_p=0.8, seed=2, noise="keyed"),
              SamplingParams(temperature=1.1, min_p=0.1, seed=3, noise="inverse-cdf"),
              SamplingParams(temperature=0.9, seed=4, noise="vllm-v1-exponential")]
    mk = lambda: [None if p.greedy else get_backend(p.noise).stream(p.seed, V, 2).next() for p in params]  # noqa: E731
    got = sample_batch(logits, params, mk())
    assert got.dtype == torch.int64
    assert got.tolist() == [sample_one(logits[b], p, n) for b, (p, n) in enumerate(zip(params, mk()))]
    # a finished (noise None) sampled row gets the greedy placeholder; greedy rows refuse noise
    n = mk()
    n[1] = None
    assert int(sample_batch(logits, params, n)[1]) == int(logits[1].argmax())
    with pytest.raises(ValueError, match="draws no noise"):
        sample_batch(logits, params, [get_backend("vllm-cpu").stream(1, V).next()] + mk()[1:])


@pytest.mark.parametrize("name", NOISE_BACKENDS)
@pytest.mark.parametrize("kw", PARAMS + [dict(temperature=0.0)])
def test_replay_tokens_equal_step_by_step_sampling(name, kw, monkeypatch):
    if kw.get("min_p", 0) > 0 and not get_backend(name).supports_min_p:
        pytest.skip(f"{name} refuses min-p")
    V, T, start = 70, 12, 5
    logits = _logits(T, V, seed=4)
    p = SamplingParams(seed=8, noise=name, **kw)
    stream = None if p.greedy else get_backend(name).stream(8, V, start)
    expect = [sample_one(logits[t], p, None if stream is None else stream.next()) for t in range(T)]
    assert replay_tokens(logits, p, start).tolist() == expect
    monkeypatch.setattr(sampler_mod, "_CHUNK_ELEMS", 30)  # several steps per chunk, several chunks
    assert replay_tokens(logits, p, start).tolist() == expect


# --- Token-DiFR margin ------------------------------------------------------------------------
def _slow_margins(logits, claimed, p, start):
    """Per-step loop over the full vocab with the stream's exact noise."""
    T, V = logits.shape
    stream = None if p.greedy else get_backend(p.noise).stream(p.seed, V, start)
    temp = float(torch.tensor(p.temperature, dtype=torch.float32))
    out, replay = [], []
    for t in range(T):
        l = logits[t].double().tolist()  # noqa: E741
        y = int(claimed[t])
        if p.greedy:
            r = int(logits[t].argmax())
            out.append(0.0 if y == r else max(l) - l[y])
            replay.append(r)
            continue
        noise = stream.next()
        r = sample_one(logits[t], p, noise)
        keep = filter_mask(logits[t][None], p.temperature, p.top_k, p.top_p, p.min_p)[0].tolist()
        G = noise.gumbel_all().tolist()
        score = [l[v] + temp * G[v] for v in range(V)]
        if not keep[y]:
            m = math.inf
        elif y == r:
            m = 0.0
        else:
            m = max(score[v] for v in range(V) if keep[v]) - score[y]
        out.append(m)
        replay.append(r)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(replay)


@pytest.mark.parametrize("name", ["vllm-cpu", "keyed", "vllm-v1-exponential"])
@pytest.mark.parametrize("kw", [dict(temperature=0.7, top_k=12, top_p=0.9), dict(temperature=1.0),
                                dict(temperature=0.7, min_p=0.05), dict(temperature=0.0)])
def test_postgumbel_margin_equals_slow_loop(name, kw):
    V, T, start = 90, 16, 9
    logits = _logits(T, V, seed=5)
    p = SamplingParams(seed=77, noise=name, **kw)
    replay = replay_tokens(logits, p, start)
    keep = filter_mask(logits, torch.full((T,), p.temperature), torch.full((T,), p.top_k),
                       torch.full((T,), p.top_p), torch.full((T,), p.min_p))
    g = torch.Generator().manual_seed(6)
    claimed = torch.randint(0, V, (T,), generator=g)
    claimed[::3] = replay[::3]                                      # claimed == replay -> 0
    if not p.greedy and p.top_k > 0:
        for t in (1, 4):                                            # filtered out -> inf
            claimed[t] = int((~keep[t]).nonzero()[0])
    margin, rep, kept = postgumbel_margin(logits, claimed, p, start)
    ref_margin, ref_replay = _slow_margins(logits, claimed, p, start)
    assert torch.equal(rep, ref_replay) and torch.equal(rep, replay)
    assert margin.dtype == torch.float64 and kept.dtype == torch.bool
    assert torch.equal(torch.isinf(margin), torch.isinf(ref_margin))
    assert torch.allclose(margin, ref_margin, rtol=0, atol=1e-9)
    assert (margin[::3] == 0).all() and (margin >= 0).all()
    if p.greedy:
        assert kept.all()
    else:
        assert torch.equal(kept, keep.gather(1, claimed[:, None])[:, 0])
        if p.top_k > 0:
            assert torch.isinf(margin[[1, 4]]).all() and not kept[[1, 4]].any()
    # greedy margins are on the raw logit scale: max l - l_y
    if p.greedy:
        assert torch.allclose(margin, logits.double().amax(-1) - logits.double().gather(1, claimed[:, None])[:, 0])


def test_postgumbel_margin_refuses_inverse_cdf():
    with pytest.raises(NoiseKindError, match="inverse_cdf_interval"):
        postgumbel_margin(_logits(3, 10), torch.zeros(3, dtype=torch.long),
                          SamplingParams(temperature=1.0, seed=1, noise="inverse-cdf"), 0)


def test_inverse_cdf_interval_contains_the_replayed_uniform():
    V, T = 40, 20
    logits = _logits(T, V, seed=7)
    p = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.01, seed=5, noise="inverse-cdf")
    replay = replay_tokens(logits, p, 0)
    lo, hi, u = inverse_cdf_interval(logits, replay, p)
    assert torch.equal(u, get_backend("inverse-cdf").tape(5, T, V).uniforms_T)
    assert ((lo <= u) & (u < hi)).all()
    # the intervals of all tokens tile [0, 1]; filtered tokens get empty intervals
    keep = filter_mask(logits, *(torch.full((T,), v) for v in (p.temperature, p.top_k, p.top_p, p.min_p)))
    widths = torch.zeros(T, V, dtype=torch.float64)
    for v in range(V):
        a, b, _ = inverse_cdf_interval(logits, torch.full((T,), v), p)
        widths[:, v] = b - a
    assert torch.allclose(widths.sum(-1), torch.ones(T, dtype=torch.float64), atol=1e-12)
    assert (widths[~keep] == 0).all() and (widths[keep] > 0).all()
    with pytest.raises(NoiseKindError):
        inverse_cdf_interval(logits, replay, SamplingParams(temperature=1.0, seed=1))


def test_score_claimed_equals_per_claim_margin_and_logprob():
    """The vectorized many-claims scorer equals postgumbel_margin + log_softmax claim by claim,
    for a mix of backends, temperatures, filters and greedy claims."""
    import math

    from verinfer.sampling.gap import score_claimed

    g = torch.Generator().manual_seed(11)
    V = 64
    specs = [SamplingParams(temperature=1.0, top_k=10, top_p=0.9, seed=1, noise="vllm-cpu"),
             SamplingParams(temperature=0.7, seed=2, noise="keyed"),
             SamplingParams(temperature=0.0),
             SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, seed=3, noise="vllm-v1-exponential"),
             SamplingParams(temperature=1.0, top_k=5, seed=4, noise="vllm-cpu")]
    logits, claimed, starts = [], [], []
    for i, p in enumerate(specs):
        T = 7 + i
        logits.append(torch.randn(T, V, generator=g) * 3)
        claimed.append(torch.randint(0, V, (T,), generator=g))
        starts.append(3 + i)
    m, r, k, lp = score_claimed(logits, claimed, specs, starts)
    o = 0
    for l_TV, y_T, p, s in zip(logits, claimed, specs, starts):
        T = len(y_T)
        m1, r1, k1 = postgumbel_margin(l_TV, y_T, p, s)
        assert torch.equal(r[o:o + T], r1) and torch.equal(k[o:o + T], k1)
        assert torch.allclose(m[o:o + T], m1, atol=1e-9, equal_nan=True) or torch.equal(m[o:o + T], m1)
        if p.greedy:
            ref = torch.log_softmax(l_TV.double(), -1).gather(1, y_T[:, None])[:, 0]
        else:
            f = filter_logits(l_TV, torch.full((T,), p.temperature), torch.full((T,), p.top_k),
                              torch.full((T,), p.top_p), torch.full((T,), p.min_p))
            ref = torch.log_softmax(f.double(), -1).gather(1, y_T[:, None])[:, 0]
        fin = torch.isfinite(ref)
        assert torch.allclose(lp[o:o + T][fin], ref[fin], atol=1e-9)
        assert torch.all(~torch.isfinite(lp[o:o + T][~fin]))
        o += T
    assert math.isinf(m[~k].max()) if (~k).any() else True


@pytest.mark.parametrize("quantize", [None, 8.0, 2.0])
def test_score_claimed_topk_block_path_equals_per_claim(quantize):
    """All rows top-k filtered (the paper's reference spec): the [N, k+1] block path must equal
    the per-claim full-vocabulary computation; with coarse logits (ties at the k-th value) the
    block path must step aside."""
    from verinfer.sampling import gap as S

    g = torch.Generator().manual_seed(5)
    V = 300
    specs = [SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=10 + i, noise=("vllm-cpu", "keyed")[i % 2])
             for i in range(4)] + [SamplingParams(temperature=0.8, top_k=7, top_p=0.5, seed=99)]
    logits, claimed, starts = [], [], []
    for i, p in enumerate(specs):
        l = torch.randn(40, V, generator=g) * 2.5
        if quantize:  # bf16-like ties; at step 1/2 the tie runs outgrow the block's slack
            l = torch.round(l * quantize) / quantize
        logits.append(l)
        y = torch.randint(0, V, (40,), generator=g)
        y[::3] = l[::3].argmax(-1)  # plenty of kept and replay-equal claims
        claimed.append(y)
        starts.append(5 * i)
    rows_p = [p for p, l in zip(specs, logits) for _ in range(l.shape[0])]
    assert (S.topk_block(torch.cat(logits), rows_p) is None) == (quantize == 2.0)
    m, r, k, lp = S.score_claimed(logits, claimed, specs, starts)
    assert k.any() and (~k).any() and (m == 0).any()
    o = 0
    for l_TV, y_T, p, s in zip(logits, claimed, specs, starts):
        m1, r1, k1 = S.postgumbel_margin(l_TV, y_T, p, s)
        sl = slice(o, o + 40)
        assert torch.equal(r[sl], r1) and torch.equal(k[sl], k1)
        fin = torch.isfinite(m1)
        assert torch.equal(torch.isfinite(m[sl]), fin) and torch.allclose(m[sl][fin], m1[fin], atol=1e-9)
        scaled = _scaled_rows(l_TV, p)
        ref = torch.log_softmax(scaled.double(), -1).gather(1, y_T[:, None])[:, 0]
        assert torch.allclose(lp[sl][k1], ref[k1], atol=1e-9)
        o += 40
