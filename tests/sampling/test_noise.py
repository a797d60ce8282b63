"""Noise backends: vectorized vs pure-Python references, stream vs tape, error paths."""

import math
import random

import pytest
import torch

from verinfer.sampling import noise as noise_mod
from verinfer.sampling.noise import (GOLDEN, POSITION_MUL, NoiseKindError, _neglog_neglog, _splitmix64_ref,
                                     as_int64, as_uint64, get_backend, splitmix64)
from verinfer.sampling.params import NOISE_BACKENDS

M64 = (1 << 64) - 1
GUMBEL_BACKENDS = ("vllm-cpu", "keyed", "vllm-v1-exponential", "speculative-keyed")


# --- splitmix64 -------------------------------------------------------------------------------
def test_splitmix64_reference_matches_published_vectors():
    # SplitMix64 generator seeded with 0: outputs are the finalizer of k * GOLDEN (Vigna's splitmix64.c)
    outs = [_splitmix64_ref(k * GOLDEN & M64) for k in (1, 2, 3)]
    assert outs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert _splitmix64_ref(0) == 0


def test_vectorized_splitmix64_equals_python_int_reference():
    rng = random.Random(1234)
    xs = [0, 1, 2, M64, M64 - 1, 1 << 63, (1 << 63) - 1, (1 << 63) + 1, 1 << 31, GOLDEN, 0xFFFFFFFF]
    xs += [rng.getrandbits(64) for _ in range(500)] + [rng.getrandbits(rng.randint(1, 64)) for _ in range(200)]
    got = splitmix64(torch.tensor([as_int64(x) for x in xs], dtype=torch.int64))
    assert got.dtype == torch.int64
    assert [as_uint64(v) for v in got.tolist()] == [_splitmix64_ref(x) for x in xs]
    # the scalar form and 2-D shapes
    assert [splitmix64(x) for x in xs[:20]] == [_splitmix64_ref(x) for x in xs[:20]]
    grid = torch.tensor([as_int64(x) for x in xs[:60]]).view(6, 10)
    assert torch.equal(splitmix64(grid), got[:60].view(6, 10))


# --- pure-Python references of whole pipelines -------------------------------------------------
def _ref_gumbel(key: int, i: int) -> float:
    bits = _splitmix64_ref((key + (i + 1) * GOLDEN) & M64) >> 11
    u = (float(bits) + 0.5) * 2.0**-53
    return -math.log(-math.log(u))


def _ref_vllm_cpu(seed: int, n_steps: int, vocab: int) -> list[list[float]]:
    g = torch.Generator("cpu").manual_seed(seed)
    out = []
    for _ in range(n_steps):
        step_seed = int(torch.randint(0, 2**31, (1,), generator=g).item())
        key = _splitmix64_ref(step_seed)
        out.append([_ref_gumbel(key, i) for i in range(vocab)])
    return out


def _ref_keyed(seed: int, positions: list[int], vocab: int) -> list[list[float]]:
    base = _splitmix64_ref(seed)
    return [[_ref_gumbel(_splitmix64_ref(base ^ ((pos * POSITION_MUL) & M64)), i) for i in range(vocab)]
            for pos in positions]


@pytest.mark.parametrize("seed,n_steps,vocab", [(0, 3, 17), (12345, 5, 64), (2**62 + 7, 2, 300), (999, 4, 1)])
def test_vllm_cpu_noise_equals_pure_python_pipeline(seed, n_steps, vocab):
    ref = torch.tensor(_ref_vllm_cpu(seed, n_steps, vocab), dtype=torch.float64)
    stream = get_backend("vllm-cpu").stream(seed, vocab, start_position=11)
    got = torch.stack([stream.next().gumbel_all() for _ in range(n_steps)])
    assert torch.equal(got, ref)  # exact float64 equality
    tape = get_backend("vllm-cpu").tape(seed, n_steps, vocab, start_position=11)
    assert torch.equal(tape.gumbel_all(), ref)
    ids_TK = torch.randint(0, vocab, (n_steps, 7), generator=torch.Generator().manual_seed(seed % 1000))
    assert torch.equal(tape.gumbel(ids_TK), ref.gather(1, ids_TK))


@pytest.mark.parametrize("seed", [0, 2024, 2**62 + 7])
def test_vllm_cpu_tape_step_keys_equal_the_streams_one_draw_per_step(seed):
    """The tape draws all step seeds in one randint call, the stream one per step (as vLLM does):
    the same keys, also past the lengths where a vectorized kernel could change the order."""
    n = 5000
    stream = get_backend("vllm-cpu").stream(seed, 8)
    keys = [stream.next().key for _ in range(n)]
    assert get_backend("vllm-cpu").tape(seed, n, 8).keys_T.tolist() == [as_int64(k) for k in keys]


@pytest.mark.parametrize("seed,start", [(0, 0), (7, 5), (2**63 - 1, 1000)])
def test_keyed_noise_equals_pure_python_pipeline(seed, start):
    vocab, n = 40, 4
    ref = torch.tensor(_ref_keyed(seed, [start + t for t in range(n)], vocab), dtype=torch.float64)
    stream = get_backend("keyed").stream(seed, vocab, start_position=start)
    assert torch.equal(torch.stack([stream.next().gumbel_all() for _ in range(n)]), ref)
    assert torch.equal(get_backend("keyed").tape(seed, n, vocab, start).gumbel_all(), ref)


def test_keyed_depends_only_on_seed_position_and_token():
    kb = get_backend("keyed")
    a = kb.stream(5, 30, start_position=10)
    for _ in range(3):
        a.next()
    late = a.next()  # step 3 of a request whose prompt has 10 tokens -> position 13
    fresh = kb.stream(5, 30, start_position=13).next()
    assert late.position == fresh.position == 13 and late.step == 3 and fresh.step == 0
    assert torch.equal(late.gumbel_all(), fresh.gumbel_all())
    # a bigger vocab extends, never reshuffles, the noise; another seed or position changes it
    assert torch.equal(kb.stream(5, 100, 13).next().gumbel_all()[:30], fresh.gumbel_all())
    assert not torch.equal(kb.stream(6, 30, 13).next().gumbel_all(), fresh.gumbel_all())
    assert not torch.equal(kb.stream(5, 30, 14).next().gumbel_all(), fresh.gumbel_all())


def test_exponential_noise_is_torch_exponential_from_the_seeded_generator():
    g = torch.Generator("cpu").manual_seed(77)
    ref = [torch.empty(50, dtype=torch.float32).exponential_(generator=g) for _ in range(3)]
    s = get_backend("vllm-v1-exponential").stream(77, 50)
    for t in range(3):
        n = s.next()
        assert torch.equal(n.exponential_V, ref[t])
        assert torch.equal(n.gumbel_all(), torch.tensor([-math.log(q) for q in ref[t].tolist()], dtype=torch.float64))


def test_inverse_cdf_uniforms_are_torch_rand_float64():
    g = torch.Generator("cpu").manual_seed(3)
    ref = [torch.rand(1, dtype=torch.float64, generator=g).item() for _ in range(6)]
    s = get_backend("inverse-cdf").stream(3, 10)
    assert [s.next().uniform for _ in range(6)] == ref
    assert get_backend("inverse-cdf").tape(3, 6, 10).uniforms_T.tolist() == ref


# --- stream vs tape ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NOISE_BACKENDS)
def test_stream_and_tape_agree_exactly(name):
    V, T, start = 37, 9, 4
    b = get_backend(name)
    stream = b.stream(2024, V, start_position=start)
    steps = [stream.next() for _ in range(T)]
    tape = b.tape(2024, T, V, start_position=start)
    assert [(s.step, s.position) for s in steps] == [(t, start + t) for t in range(T)]
    if name == "inverse-cdf":
        assert tape.uniforms_T.tolist() == [s.uniform for s in steps]
        assert [tape.step(t).uniform for t in range(T)] == [s.uniform for s in steps]
        return
    ids_TK = torch.randint(0, V, (T, 6), generator=torch.Generator().manual_seed(1))
    per_step = torch.stack([s.gumbel(ids_TK[t]) for t, s in enumerate(steps)])
    assert torch.equal(tape.gumbel(ids_TK), per_step)
    assert torch.equal(tape.gumbel_all(), torch.stack([s.gumbel_all() for s in steps]))
    assert torch.equal(tape.gumbel_rows(3, ids_TK[3:7]), per_step[3:7])
    t_N, ids_N = torch.tensor([8, 0, 3, 3, 8]), torch.tensor([1, 2, 3, 36, 0])
    assert torch.equal(tape.gumbel_pairs(t_N, ids_N), torch.stack([steps[t].gumbel(torch.tensor([i]))[0]
                                                                   for t, i in zip(t_N.tolist(), ids_N.tolist())]))
    assert torch.equal(tape.step(5).gumbel_all(), steps[5].gumbel_all())
    # the fast (torch.log) path is within far less than any logit difference that matters (fp32
    # noise, vLLM MRv2's default: a few fp32 ulps; the sampler re-scores within NEAR_TIE32 of the max)
    tol = 1e-12 if tape.score_dtype == torch.float64 else 1e-5
    assert (tape.gumbel(ids_TK, exact=False) - per_step).abs().max() < tol


def test_exponential_tape_regenerates_ranges_without_cache(monkeypatch):
    monkeypatch.setattr(noise_mod, "_CACHE_ELEMS", 0)
    b = get_backend("vllm-v1-exponential")
    s = b.stream(9, 20)
    ref = torch.stack([s.next().exponential_V for _ in range(6)])
    tape = b.tape(9, 6, 20)
    assert torch.equal(torch.stack(list(tape.rows(2, 5))), ref[2:5])   # before any state is recorded
    assert torch.equal(torch.stack(list(tape.rows(4, 6))), ref[4:6])
    assert torch.equal(torch.stack(list(tape.rows(1, 3))), ref[1:3])   # from a recorded state
    assert torch.equal(tape.exponential_TV, ref)
    assert tape._cache is None


def test_exact_gumbel_matches_c_log_and_handles_u_equal_one():
    u = torch.tensor([2.0**-54, 0.25, 0.5, 1 - 2.0**-52, 1.0], dtype=torch.float64)
    g = _neglog_neglog(u, exact=True)
    assert g[:4].tolist() == [-math.log(-math.log(x)) for x in u[:4].tolist()]
    assert g[4] == math.inf and _neglog_neglog(u, exact=False)[4] == math.inf
    # G lies in about [-3.62, 37.4] for every 53-bit u < 1
    assert 36.0 < g[3] < 37.5 and -3.7 < g[0] < -3.6


# --- errors -----------------------------------------------------------------------------------
def test_kind_errors_and_bad_inputs():
    n = get_backend("inverse-cdf").stream(1, 10).next()
    with pytest.raises(NoiseKindError, match="one uniform per step"):
        n.gumbel(torch.tensor([0]))
    with pytest.raises(NoiseKindError, match="uniforms"):
        get_backend("inverse-cdf").tape(1, 2, 10).gumbel(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(NoiseKindError, match="only for the inverse-cdf"):
        get_backend("vllm-cpu").stream(1, 10).next().uniform
    with pytest.raises(NoiseKindError, match="only for the inverse-cdf"):
        get_backend("keyed").tape(1, 2, 10).uniforms_T
    with pytest.raises(ValueError, match="unknown noise backend"):
        get_backend("mystery")
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        get_backend("keyed").stream(1, 10).next().gumbel(torch.tensor([10]))
    with pytest.raises(ValueError, match="needs a seed"):
        get_backend("vllm-cpu").stream(None, 10)
    with pytest.raises(ValueError, match="shape"):
        get_backend("vllm-cpu").tape(1, 3, 10).gumbel(torch.zeros(2, 1, dtype=torch.long))
