"""vLLM Model Runner V2's keyed Gumbel noise without Triton (sampling/vllm_gumbel.py and its
backends in noise.py): Philox4x32-10 against Random123's known-answer vectors, the vectorized
murmur3 against a scalar reference loop, streams against tapes, and the fp32 sampler's ties.
The bit-exact comparison with Triton's own kernels is tests/vllm_engine/test_mrv2_gumbel.py."""

from __future__ import annotations

import pytest
import torch

from verinfer.sampling.gap import postgumbel_margin
from verinfer.sampling.noise import MRV2_BACKENDS, NOISE_BACKENDS, get_backend
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.sampler import replay_tokens, sample_one
from verinfer.sampling.vllm_gumbel import mrv2_gumbel, murmur3_hash32, philox4x32

M32 = 0xFFFFFFFF
NAMES = [b.name for b in MRV2_BACKENDS]


@pytest.mark.parametrize("ctr,key,out", [  # Random123 kat_vectors, philox4x32 with 10 rounds
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox4x32_known_answers(ctr, key, out):
    t = [torch.tensor([v]) for v in (*ctr, *key)]
    assert tuple(int(x) for x in philox4x32(*t)) == out


def _murmur3_ref(seed: int, pos: int, i: int, domain: int = 0) -> int:
    """vLLM's murmur3_hash32 on Python ints, one value at a time."""
    rotl = lambda x, n: ((x << n) | (x >> (32 - n))) & M32  # noqa: E731

    def mix(h, k):
        k = rotl((k * 0xCC9E2D51) & M32, 15) * 0x1B873593 & M32
        return (rotl(h ^ k, 13) * 5 + 0xE6546B64) & M32

    h = domain
    for w in (seed & M32, (seed >> 32) & M32, pos & M32, i & M32):
        h = mix(h, w)
    h ^= 16
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & M32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def test_murmur3_matches_a_scalar_reference():
    ids = torch.arange(0, 3000, 7)
    for seed, pos, domain in ((0, 0, 0), (2**62 + 3, 4095, 0), (-5, 2**31 + 11, 0x9E3779B9), (123, 7, 0x9E3779B9)):
        got = murmur3_hash32(torch.tensor(seed), torch.tensor(pos), ids, domain).tolist()
        assert got == [_murmur3_ref(seed, pos, i, domain) for i in ids.tolist()]


def test_backends_registered_and_documented():
    assert set(NAMES) == {"vllm-mrv2-gumbel-fp32", "vllm-mrv2-gumbel-fp64", "vllm-mrv2-philox-fp32",
                          "vllm-mrv2-philox-fp64"}
    assert all(n in NOISE_BACKENDS for n in NAMES)
    assert get_backend("vllm-mrv2-gumbel-fp32").score_dtype == torch.float32
    assert get_backend("vllm-mrv2-philox-fp64").score_dtype == torch.float64


@pytest.mark.parametrize("name", NAMES)
def test_stream_tape_and_fast_noise_agree(name):
    b, V, start = get_backend(name), 300, 17
    stream, tape = b.stream(99, V, start), b.tape(99, 6, V, start)
    ids_TV = torch.arange(V).expand(6, V)
    g_exact = tape.gumbel(ids_TV, exact=True)
    for t in range(6):
        assert torch.equal(stream.next().gumbel_all(), g_exact[t])
        assert torch.equal(tape.step(t).gumbel_all(), g_exact[t])
    # vLLM's pos is the last input token's: the sampled token's position - 1
    fp64 = name.endswith("fp64")
    ref = mrv2_gumbel(99, torch.tensor(start - 1), torch.arange(V), rng=b.rng, fp64=fp64).double()
    assert torch.equal(g_exact[0], ref)
    assert (tape.gumbel(ids_TV, exact=False) - g_exact).abs().max() < (1e-12 if fp64 else 1e-5)
    t_N, ids_N = torch.tensor([5, 0, 3]), torch.tensor([299, 0, 150])
    assert torch.equal(tape.gumbel_pairs(t_N, ids_N), g_exact[t_N, ids_N])


def test_fp32_sum_ties_go_to_the_lowest_id():
    """vLLM MRv2 fp32 adds logits / T and G in fp32 and takes the first maximum: where the fp32 sums
    of ids 0 and 1 round to the same value, id 0 wins even though its exact (float64) sum is lower."""
    name = "vllm-mrv2-gumbel-fp32"
    params = SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, seed=5, noise=name)
    pos = next(p for p in range(10, 200) if get_backend(name).stream(5, 2, p).next().gumbel(torch.tensor([0])) > 0.5)
    g = get_backend(name).stream(5, 2, pos).next().gumbel(torch.arange(2)).float()
    l1 = torch.tensor(4.5) - g[1]          # id 1 scores ~4.5 (fp32 ulp 2**-21) ...
    s1 = l1 + g[1]
    l0 = s1 - g[0]                         # ... id 0's logit lies in [2, 4) (ulp 2**-22): finer steps
    for _ in range(64):                    # the lowest logit whose fp32 sum still ties
        lower = torch.nextafter(l0, torch.tensor(-1e9))
        if float(lower + g[0]) != float(s1):
            break
        l0 = lower
    logits = torch.stack([l0, l1])
    assert float(l0 + g[0]) == float(s1)                                   # fp32: a tie, id 0 first
    assert float(l0.double() + g[0].double()) < float(l1.double() + g[1].double())  # float64 would pick 1
    assert sample_one(logits, params, get_backend(name).stream(5, 2, pos).next()) == 0
    assert int(replay_tokens(logits[None], params, pos)[0]) == 0
    margin, replay, kept = postgumbel_margin(logits[None], torch.tensor([0]), params, pos)
    assert int(replay[0]) == 0 and float(margin[0]) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_replay_and_margin_of_own_samples(name):
    """Tokens sampled step by step with the backend's stream replay exactly, margin 0; another seed
    does not."""
    gen = torch.Generator().manual_seed(3)
    T, V = 40, 500
    logits = torch.randn(T, V, generator=gen) * 2
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1234, noise=name)
    stream = get_backend(name).stream(1234, V, 9)
    y = torch.tensor([sample_one(logits[t], params, stream.next()) for t in range(T)])
    margin, replay, kept = postgumbel_margin(logits, y, params, 9)
    assert torch.equal(replay, y) and bool((margin == 0).all()) and bool(kept.all())
    other = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1235, noise=name)
    assert (replay_tokens(logits, other, 9) == y).float().mean() < 0.5
