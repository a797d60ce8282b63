"""SGLang's seeded sampler (sampling/sglang_seeded.py, backends sglang-seeded / -sorted) against
SGLang's own functions from its wheel, bit for bit:

- the wheel (sglang 0.5.23, sha256 pinned) is fetched with `pip download --no-deps` into the
  repository's .cache/sglang/ once; without the package index the module is skipped, except with
  VERINFER_REQUIRE_SGLANG=1 (CI), where that is a failure.
- from sglang/srt/layers/sampler.py only the function definitions the seeded sampler runs are
  executed (multinomial_with_seed, top_k_top_p_min_p_sampling_from_probs_torch,
  sampling_from_probs_torch), parsed with ast, in a namespace with torch and a no-op torch.compile;
  murmur_hash32 and its @triton.jit kernel come from sglang/kernels/ops/sampling/murmur_hash.py, the
  kernel body run block by block on numpy by a small stand-in for triton / triton.language (uint32 /
  uint64 arrays wrap as Triton's do; checked once against Triton 3.9's own interpreter), and the
  wrapper without its CPU branch (which calls sgl_kernel's compiled op instead of the kernel).
- noise: G as SGLang's multinomial_with_seed computes it (its argmax input with zero log-probs), as
  float64 bit patterns, for >= 10,000 (seed, position, column) triples: seeds of both signs up to
  +-2**63, positions past 2**32, a 152k-wide vocabulary.
- tokens: Sampler.forward's standard path (logits / temperature, torch.softmax, then the unfiltered
  or the sorted sampler) on random and tied logits, several temperatures, top-k, top-p, vocab sizes,
  seeds and positions, mixed batches; replay_tokens / sample_one / the Token-DiFR margin on them.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
import tempfile
import types
import typing
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from verinfer.sampling.gap import block_gaps, postgumbel_gaps, postgumbel_margin, score_claimed
from verinfer.sampling.noise import get_backend
from verinfer.sampling.params import SamplingParamError, SamplingParams
from verinfer.sampling.sampler import replay_tokens, sample_batch, sample_one
from verinfer.sampling.sglang_seeded import (TOP_K_ALL, WHEEL, WHEEL_SHA256, sglang_gumbel, sglang_sample,
                                            sglang_scores)

REQUIREMENT = "sglang==0.5.23"
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "sglang"
SAMPLER_PY = "sglang/srt/layers/sampler.py"
MURMUR_PY = "sglang/kernels/ops/sampling/murmur_hash.py"
WANTED = ("multinomial_with_seed", "top_k_top_p_min_p_sampling_from_probs_torch", "sampling_from_probs_torch")
SEEDS = [0, 1, 42, -1, -5, 2**31 - 1, 2**32 + 7, 2**62 + 3, 2**63 - 1, 2**63 - 2, -(2**63), -(2**63) + 1,
         987654321987654321, -123456789012345678]
POSITIONS = [0, 1, 7, 255, 4095, 2**31 - 1, 2**31 + 11, 2**32 + 7, 10**12 + 3]


# --- the wheel -----------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _unavailable(why: str):
    if os.environ.get("VERINFER_REQUIRE_SGLANG") == "1":
        pytest.fail(f"VERINFER_REQUIRE_SGLANG=1 but {why}")
    pytest.skip(why)


def _wheel() -> Path:
    """The pinned sglang wheel in .cache/sglang/, downloaded with pip (any host: the wheel's own
    platform tags are asked for) unless it is there."""
    path = CACHE / WHEEL
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=".download-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--platform",
                   "manylinux_2_34_x86_64", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                   "--disable-pip-version-check", "-q", "--retries", "2", "--timeout", "30", REQUIREMENT, "-d", tmp]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as e:
                _unavailable(f"pip download {REQUIREMENT} did not finish ({e})")
            got = Path(tmp) / WHEEL
            if r.returncode != 0 or not got.is_file():
                tail = " / ".join((r.stderr or r.stdout).strip().splitlines()[-2:])
                _unavailable(f"pip download {REQUIREMENT} failed ({tail or r.returncode}); copy {WHEEL} into {CACHE}/")
            os.replace(got, path)
    got = _sha256(path)
    assert got == WHEEL_SHA256, f"{path} has sha256 {got}, expected {WHEEL_SHA256}: delete it (it is downloaded again)"
    return path


# --- SGLang's functions, executed from the wheel's source ------------------------------------------
class _Block(np.ndarray):
    """A Triton block value on numpy: immutable (h ^= k rebinds h, as in Triton) with .to(dtype)."""

    def to(self, dtype):
        return np.asarray(self).astype(dtype).view(_Block)

    __ixor__ = np.ndarray.__xor__
    __iand__ = np.ndarray.__and__
    __ior__ = np.ndarray.__or__
    __iadd__ = np.ndarray.__add__
    __imul__ = np.ndarray.__mul__


class _Pointer:
    def __init__(self, flat: np.ndarray, offset=0):
        self.flat, self.offset = flat, offset

    def __add__(self, x):
        return _Pointer(self.flat, self.offset + np.asarray(x))


class _Jit:
    """@triton.jit: a plain call runs the function; kernel[grid](...) runs every program in turn."""

    program = (0, 0, 0)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            args = [_Pointer(a.reshape(-1).numpy()) if isinstance(a, torch.Tensor) else a for a in args]
            for i in range(grid[0]):
                for j in range(grid[1] if len(grid) > 1 else 1):
                    _Jit.program = (i, j, 0)
                    self.fn(*args, **kwargs)
        return launch


def _load(ptr: _Pointer, mask=None, other=0):
    idx = np.atleast_1d(ptr.offset)
    if mask is None:
        return ptr.flat[idx].view(_Block)
    mask = np.atleast_1d(mask)
    return np.where(mask, ptr.flat[np.where(mask, idx, 0)], other).astype(ptr.flat.dtype).view(_Block)


def _store(ptr: _Pointer, value, mask=None):
    idx = np.atleast_1d(ptr.offset)
    mask = np.ones(idx.shape, bool) if mask is None else np.atleast_1d(np.asarray(mask))
    ptr.flat[idx[mask]] = np.broadcast_to(np.asarray(value), idx.shape)[mask]   # cast to the pointee, as tl.store


_tl = types.SimpleNamespace(uint32=np.uint32, uint64=np.uint64, constexpr=int, load=_load, store=_store,
                            program_id=lambda axis: _Jit.program[axis],
                            arange=lambda a, b: np.arange(a, b).view(_Block))
_triton = types.SimpleNamespace(jit=_Jit, cdiv=lambda a, b: -(-a // b), language=_tl)


class _Torch(types.ModuleType):
    """torch for SGLang's functions: torch.compile a no-op; torch.argmax records its input when asked
    (multinomial_with_seed's argmax input with zero log-probs is its Gumbel noise)."""

    seen: list | None = None

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def compile(*args, **kwargs):
        return args[0] if args and callable(args[0]) else (lambda fn: fn)

    def argmax(self, x, *args, **kwargs):
        if self.seen is not None:
            self.seen.append(x.clone())
        return torch.argmax(x, *args, **kwargs)


def _functions(source: str) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}


@pytest.fixture(scope="module")
def wheel() -> Path:
    return _wheel()


@pytest.fixture(scope="module")
def sglang(wheel):
    """SGLang's seeded-sampler functions from the wheel: a namespace (dict) holding WANTED and all the
    module-level functions they call, in sampler.py or murmur_hash.py."""
    with zipfile.ZipFile(wheel) as z:
        sampler_defs = _functions(z.read(SAMPLER_PY).decode())
        murmur_defs = _functions(z.read(MURMUR_PY).decode())
    defs = {**murmur_defs, **sampler_defs}
    wrapper = defs["murmur_hash32"]  # drop `if device.type == "cpu": ... sgl_kernel ...`: the kernel runs instead
    wrapper.body = [s for s in wrapper.body if not (isinstance(s, ast.If) and "cpu" in ast.unparse(s.test))]
    order, todo = [], list(WANTED)
    while todo:
        name = todo.pop()
        if name not in order:
            order.append(name)
            todo += sorted({n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs})
    assert {"murmur_hash32", "murmur_hash32_kernel", "murmur3_mix", "fmix32", "rotl32"} <= set(order)
    ns = {"torch": _Torch("torch"), "triton": _triton, "tl": _tl, "is_npu": lambda: False,
          **{k: getattr(typing, k) for k in ("Optional", "Tuple", "List", "Dict")}}
    module = ast.fix_missing_locations(ast.Module(body=[defs[n] for n in reversed(order)], type_ignores=[]))
    exec(compile(module, f"{WHEEL}:{SAMPLER_PY}", "exec"), ns)
    return ns


def sglang_noise(sglang, seeds_B: torch.Tensor, positions_B: torch.Tensor, V: int) -> torch.Tensor:
    """G_BV float64 as SGLang's multinomial_with_seed computes it (its argmax input, log-probs 0)."""
    torch_ns = sglang["torch"]
    torch_ns.seen = []
    try:
        sglang["multinomial_with_seed"](torch.zeros(len(seeds_B), V, dtype=torch.float64), seeds_B, positions_B)
        return torch_ns.seen[0]
    finally:
        torch_ns.seen = None


def sglang_tokens(sglang, logits_BV, temperature_B, top_k_B, top_p_B, seed_B, positions_B, scores: bool = False):
    """Sampler.forward's standard path with deterministic inference (the pytorch backend): logits.div_
    (an fp32 [B, 1] temperature), torch.softmax, then the unfiltered sampler when no row of the batch
    filters, else the sorted one. Rows: SGLang's top_k (TOP_K_ALL: off) and top_p. token_B (int64);
    scores=True: (token_B, x_BV), x the scores SGLang's argmax picks from (log p + G by column)."""
    if scores:
        sglang["torch"].seen = []
        try:
            return sglang_tokens(sglang, logits_BV, temperature_B, top_k_B, top_p_B, seed_B, positions_B), \
                sglang["torch"].seen[0]
        finally:
            sglang["torch"].seen = None
    logits = logits_BV.clone().float()
    B = logits.shape[0]
    logits.div_(torch.tensor(temperature_B, dtype=torch.float).view(-1, 1))
    probs = torch.softmax(logits, dim=-1)
    seeds = torch.tensor(seed_B, dtype=torch.int64)
    positions = torch.as_tensor(positions_B, dtype=torch.int64)
    if all(k == TOP_K_ALL for k in top_k_B) and all(p == 1.0 for p in top_p_B):
        return sglang["sampling_from_probs_torch"](probs, seeds, positions).long()
    return sglang["top_k_top_p_min_p_sampling_from_probs_torch"](
        probs, torch.tensor(top_k_B, dtype=torch.int32), torch.tensor(top_p_B, dtype=torch.float),
        torch.zeros(B, dtype=torch.float), False, seeds, positions).long()


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int64)


def _logits(T: int, V: int, seed: int, tie_step: float | None = None) -> torch.Tensor:
    l_TV = torch.randn(T, V, generator=torch.Generator().manual_seed(seed)) * 3
    return l_TV if tie_step is None else torch.round(l_TV / tie_step) * tie_step  # tied logits: ties in probs


def _sglang_top_k(top_k: int) -> int:
    return top_k if top_k > 0 else TOP_K_ALL


def _our_scores(logits_TV, seed, positions_T, temperature, top_k, top_p, always_sorted=False) -> torch.Tensor:
    """x_TV by noise column (token id, or rank on the sorted path): float64 log p + G, from
    sglang_scores and sglang_gumbel."""
    _, logp_TV, cols_TV = sglang_scores(logits_TV, temperature, top_k, top_p, always_sorted)
    g_TV = sglang_gumbel(seed, positions_T[:, None], torch.arange(logits_TV.shape[1]))
    return logp_TV + g_TV if cols_TV is None else torch.empty_like(logp_TV).scatter_(1, cols_TV, logp_TV) + g_TV


# --- what the backends assume of the rest of SGLang -------------------------------------------------
WHEEL_SAYS = {  # file in the wheel -> passages (whitespace aside) the backends and their docstrings rely on
    "sglang/srt/model_executor/model_runner.py": [  # positions: the last input token's
        "forward_batch.positions if forward_batch.forward_mode.is_decode() else forward_batch.seq_lens - 1"],
    "sglang/srt/model_executor/forward_batch_info.py": ["ret.positions = clamp_position(batch.seq_lens)"],
    "sglang/kernels/ops/attention/clamp_position.py": ["torch.clamp(seq_lens - 1, min=0)"],
    "sglang/srt/entrypoints/openai/protocol.py": ['"sampling_seed": self.seed'],        # chat `seed`
    "sglang/srt/entrypoints/openai/serving_completions.py": ['"sampling_seed": request.seed'],
    "sglang/srt/sampling/sampling_batch_info.py": [
        "if r.sampling_params.sampling_seed is not None else 42", "dtype=torch.int64",
        "need_top_p_sampling=any(r.sampling_params.top_p != 1.0 for r in reqs)",
        "need_top_k_sampling=any(r.sampling_params.top_k != TOP_K_ALL for r in reqs)"],
    "sglang/srt/sampling/sampling_params.py": ["_SAMPLING_EPS = 1e-6", "self.top_k = 1",
                                               "-(2**63) <= self.sampling_seed <= 2**63 - 1"],
    "sglang/srt/arg_groups/overrides.py": ['return {"sampling_backend": "pytorch"}'],
    SAMPLER_PY: ["logits.div_(sampling_info.temperatures)",
                 "torch.softmax(logits, dim=-1) if self.enable_deterministic else sampler_softmax(logits)",
                 "simple_sampling_case = ( not sampling_info.need_top_p_sampling and not "
                 "sampling_info.need_top_k_sampling and not sampling_info.need_min_p_sampling )"],
}


def test_the_wheel_says_what_the_backends_assume(wheel):
    """The passages of SGLang outside the sampler functions that the module docstring cites (positions,
    the seed's path from the OpenAI request, the batch-wide path choice, the pytorch backend under
    deterministic inference, temperature and softmax): a new pinned wheel must still say them."""
    with zipfile.ZipFile(wheel) as z:
        for name, passages in WHEEL_SAYS.items():
            text = " ".join(z.read(name).decode().split())
            for passage in passages:
                assert " ".join(passage.split()) in text, (name, passage)


# --- noise ---------------------------------------------------------------------------------------
def test_noise_bit_exact(sglang):
    """G(seed, position, column) == SGLang's, float64 bit patterns: 14 x 9 (seed, position) rows x 96
    columns (12,096 triples) and 2 rows of a 152,064-wide vocabulary."""
    seeds_B = torch.tensor([s for s in SEEDS for _ in POSITIONS], dtype=torch.int64)
    pos_B = torch.tensor([p for _ in SEEDS for p in POSITIONS], dtype=torch.int64)
    V = 96
    ref_BV = sglang_noise(sglang, seeds_B, pos_B, V)
    assert ref_BV.shape == (len(SEEDS) * len(POSITIONS), V) and ref_BV.numel() >= 10_000
    got_BV = torch.stack([sglang_gumbel(int(s), p, torch.arange(V)) for s, p in zip(seeds_B, pos_B)])
    assert torch.equal(_bits(got_BV), _bits(ref_BV))
    assert torch.equal(_bits(sglang_gumbel(int(seeds_B[0]), pos_B[:, None], torch.arange(V))[:len(POSITIONS)]),
                       _bits(ref_BV[:len(POSITIONS)]))                                   # broadcast form
    assert torch.equal(_bits(sglang_gumbel(2**64 - 5, torch.tensor(9), torch.arange(V))),  # uint64 seed form
                       _bits(sglang_gumbel(-5, torch.tensor(9), torch.arange(V))))
    V = 152_064
    seeds_2, pos_2 = torch.tensor([2**63 - 1, -77]), torch.tensor([2**32 + 7, 123])
    ref_2V = sglang_noise(sglang, seeds_2, pos_2, V)
    got_2V = torch.stack([sglang_gumbel(int(s), p, torch.arange(V)) for s, p in zip(seeds_2, pos_2)])
    assert torch.equal(_bits(got_2V), _bits(ref_2V))
    # the whole range of G is reached on this many values, the clamped ends aside
    assert float(ref_2V.min()) < -2.5 and float(ref_2V.max()) > 12


def test_noise_clamps_like_sglang(sglang, monkeypatch):
    """The ends of the hash, h = 0 and 2**32 - 1 (u = 0 and 1), clamp as SGLang's: G = -log(DBL_MAX)
    = -709.78 and -log(2**-32) = 22.18 (hashes swapped in on both sides: no seed is known to reach them)."""
    from verinfer.sampling import sglang_seeded as S

    ends = torch.tensor([0, 2**32 - 1, 1, 2**31])
    monkeypatch.setitem(sglang, "murmur_hash32", lambda s, p, c: ends.to(torch.uint32)[None].expand(len(s), 4))
    monkeypatch.setattr(S, "murmur3_hash32", lambda s, p, c: ends.expand(torch.broadcast_shapes(p.shape, c.shape)))
    ref = sglang_noise(sglang, torch.tensor([3]), torch.tensor([4]), 4)[0]
    got = sglang_gumbel(3, torch.tensor(4), torch.arange(4))
    assert torch.equal(_bits(got), _bits(ref))
    assert abs(float(got[0]) + 709.782712893384) < 1e-9 and abs(float(got[1]) - 32 * 0.6931471805599453) < 1e-12


# --- tokens --------------------------------------------------------------------------------------
CASES = [  # (V, temperature, top_k, top_p, tie_step): verinfer's top_k (<= 0 off)
    (50, 1.0, -1, 1.0, None), (50, 0.7, 5, 1.0, 0.5), (1000, 1.0, -1, 1.0, 0.25), (1000, 0.3, 40, 0.9, None),
    (1000, 1.6, -1, 0.8, 0.5), (1000, 0.7, 1, 1.0, None), (1000, 1.0, 1003, 1.0, 0.5), (4099, 0.9, 20, 0.5, 0.25),
    (32000, 1.0, -1, 1.0, 0.5), (32000, 0.6, 50, 0.95, 0.25),
]


@pytest.mark.parametrize("V,temperature,top_k,top_p,tie_step", CASES)
def test_tokens_bit_exact(sglang, V, temperature, top_k, top_p, tie_step):
    """SGLang's tokens for a batch of 12 rows of one request (its seed, consecutive positions) equal
    sglang_sample's, and the scores its argmax picks from (float64 log p + G by column, -inf where
    filtered) equal ours bit for bit; with tied logits the sorted path ranks ties as SGLang's own
    sort does."""
    T, start = 12, 17 + V
    logits = _logits(T, V, seed=V + int(temperature * 10), tie_step=tie_step)
    for seed in (7, -(2**63), 2**63 - 1):
        positions = torch.arange(start - 1, start - 1 + T)      # SGLang's: the last input token's
        ref, x_ref = sglang_tokens(sglang, logits, [temperature] * T, [_sglang_top_k(top_k)] * T, [top_p] * T,
                                   [seed] * T, positions, scores=True)
        got = sglang_sample(logits, seed, positions, temperature, top_k, top_p)
        assert torch.equal(got, ref), (seed, got.tolist(), ref.tolist())
        assert torch.equal(_bits(_our_scores(logits, seed, positions, temperature, top_k, top_p)), _bits(x_ref))
        # the sorted path for an unfiltered request (batched with a filtered or greedy one)
        if top_k <= 0 and top_p == 1.0:
            other = sglang_tokens(sglang, torch.cat([logits, logits[:1]]), [temperature] * T + [1.0],
                                  [TOP_K_ALL] * T + [1], [1.0] * (T + 1), [seed] * (T + 1),
                                  torch.cat([positions, positions[:1]]))[:T]
            assert torch.equal(sglang_sample(logits, seed, positions, temperature, top_k, top_p, always_sorted=True),
                               other)


def test_mixed_batch_rows_equal_each_request_alone(sglang):
    """One SGLang batch of requests with their own seeds, positions, temperatures, top-k and top-p
    (the sorted path for all): each row equals sglang_sample of that request."""
    V = 3000
    rows = [(11, 5, 1.0, -1, 1.0), (-3, 900, 0.7, 30, 1.0), (2**63 - 1, 2**32 + 1, 1.3, -1, 0.7),
            (123456789, 64, 0.5, 8, 0.9), (0, 0, 1.0, -1, 0.95), (42, 31, 0.9, 2000, 0.99)]
    logits = _logits(len(rows), V, seed=3, tie_step=0.25)
    ref, x_ref = sglang_tokens(sglang, logits, [r[2] for r in rows], [_sglang_top_k(r[3]) for r in rows],
                               [r[4] for r in rows], [r[0] for r in rows], [r[1] for r in rows], scores=True)
    for b, (seed, pos, temperature, top_k, top_p) in enumerate(rows):
        got = sglang_sample(logits[b : b + 1], seed, torch.tensor([pos]), temperature, top_k, top_p,
                            always_sorted=True)
        assert int(got[0]) == int(ref[b]), b
        x_1V = _our_scores(logits[b : b + 1], seed, torch.tensor([pos]), temperature, top_k, top_p, True)
        assert torch.equal(_bits(x_1V[0]), _bits(x_ref[b])), b


def test_paths_differ_and_min_p_is_refused(sglang):
    """The unfiltered and the sorted path draw different tokens from the same seed (why there are two
    backends); SGLang asserts on seeded min-p, and verinfer refuses the claim."""
    V, T = 500, 40
    logits = _logits(T, V, seed=9)
    pos = torch.arange(T)
    a = sglang_sample(logits, 5, pos, 1.0)
    b = sglang_sample(logits, 5, pos, 1.0, always_sorted=True)
    assert (a != b).sum() > T // 4
    probs = torch.softmax(logits[:2], -1)
    with pytest.raises(AssertionError, match="sampling seed"):
        sglang["top_k_top_p_min_p_sampling_from_probs_torch"](
            probs, torch.full((2,), TOP_K_ALL, dtype=torch.int32), torch.ones(2), torch.full((2,), 0.1), True,
            torch.tensor([1, 1]), torch.tensor([0, 1]))
    for name in ("sglang-seeded", "sglang-seeded-sorted"):
        with pytest.raises(SamplingParamError, match="min_p must be 0"):
            SamplingParams(temperature=1.0, min_p=0.1, seed=1, noise=name)


# --- the sampler: sample_one, replay_tokens, margins ---------------------------------------------------
REPLAY = [(1.0, -1, 1.0, "sglang-seeded"), (1.0, -1, 1.0, "sglang-seeded-sorted"), (0.7, 20, 1.0, "sglang-seeded"),
          (1.2, -1, 0.9, "sglang-seeded"), (0.5, 8, 0.8, "sglang-seeded-sorted")]


@pytest.mark.parametrize("temperature,top_k,top_p,name", REPLAY)
def test_replay_and_margins_on_sglang_tokens(sglang, temperature, top_k, top_p, name):
    """replay_tokens and sample_one reproduce SGLang's tokens at verinfer positions start + t (SGLang's
    start + t - 1); the Token-DiFR margin is 0 on every honest token, > 0 on a substituted kept token
    and +inf on a token SGLang's filters drop."""
    T, V, start, seed = 24, 2000, 40, 2**62 + 12345
    logits = _logits(T, V, seed=int(temperature * 100) + top_k, tie_step=0.25)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, noise=name)
    batch_sorted = name.endswith("-sorted") or top_k > 0 or top_p < 1
    extra = 0 if batch_sorted == (top_k > 0 or top_p < 1) else 1   # a greedy row forces the sorted path
    rows = T + extra
    ref = sglang_tokens(sglang, torch.cat([logits, logits[:extra]]), [temperature] * T + [1.0] * extra,
                        [_sglang_top_k(top_k)] * T + [1] * extra, [top_p] * rows, [seed] * rows,
                        torch.arange(start - 1, start - 1 + rows))[:T]
    assert torch.equal(replay_tokens(logits, p, start), ref)
    stream = get_backend(name).stream(seed, V, start)
    assert [sample_one(logits[t], p, stream.next()) for t in range(T)] == ref.tolist()
    stream = get_backend(name).stream(seed, V, start)
    greedy = SamplingParams(temperature=0.0)
    assert sample_batch(torch.stack([logits[0], logits[0]]), [p, greedy], [stream.next(), None]).tolist() == \
        [int(ref[0]), int(logits[0].argmax())]

    margin, replay, kept = postgumbel_margin(logits, ref, p, start)
    assert torch.equal(replay, ref) and kept.all() and (margin == 0).all()
    keep_TV = sglang_scores(logits, temperature, top_k, top_p, name.endswith("-sorted"))[0]
    claimed = ref.clone()
    for t in range(T):  # substitute the most probable kept token other than SGLang's
        cand = (logits[t] / temperature).masked_fill(~keep_TV[t], float("-inf"))
        cand[ref[t]] = float("-inf")
        if torch.isfinite(cand.max()):
            claimed[t] = int(cand.argmax())
    sub = claimed != ref
    assert sub.sum() >= T // 2
    margin, replay, kept = postgumbel_margin(logits, claimed, p, start)
    assert torch.equal(replay, ref) and kept.all()
    assert (margin[sub] > 0).all() and torch.isfinite(margin[sub]).all() and (margin[~sub] == 0).all()
    # SGLang's own score space, times T: max_c (log p_c + G_c) - (log p_y + G_y)
    _, logp_TV, cols_TV = sglang_scores(logits, temperature, top_k, top_p, name.endswith("-sorted"))
    col_TV = torch.arange(V).expand(T, V) if cols_TV is None else cols_TV
    g_TV = sglang_gumbel(seed, torch.arange(start - 1, start - 1 + T)[:, None], col_TV)
    x_TV = logp_TV + g_TV
    t32 = float(torch.tensor(temperature, dtype=torch.float32))
    want = t32 * (x_TV.amax(-1) - x_TV.gather(1, claimed[:, None])[:, 0])
    assert torch.allclose(margin, want, rtol=0, atol=1e-12)
    m2, r2, k2, _ = score_claimed([logits], [claimed], [p], [start])
    assert torch.equal(m2, margin) and torch.equal(r2, replay) and torch.equal(k2, kept)
    gaps = postgumbel_gaps(logits, claimed, p, start, k=1)[:, 0]                # the top competitor's gap
    assert torch.equal(gaps[sub], margin[sub]) and (gaps[~sub] < 0).all()
    assert torch.equal(block_gaps([logits], [claimed], [p], [start], [1.0])[:, 0, 0], gaps)
    if top_k > 0:  # a token SGLang's top-k drops
        dropped = (~keep_TV[0]).nonzero()[0, 0]
        m3, _, k3 = postgumbel_margin(logits[:1], dropped[None], p, start)
        assert not k3[0] and torch.isinf(m3[0])


def test_noise_addressed_by_rank_not_token_id(sglang):
    """On the sorted path a token's noise is its rank's: reading it by token id (the other backends'
    addressing) replays other tokens than SGLang's."""
    T, V, start, seed = 30, 800, 5, 99
    logits = _logits(T, V, seed=12)
    p = SamplingParams(temperature=1.0, top_k=50, seed=seed, noise="sglang-seeded")
    pos = torch.arange(start - 1, start - 1 + T)
    ref = sglang_tokens(sglang, logits, [1.0] * T, [50] * T, [1.0] * T, [seed] * T, pos)
    assert torch.equal(replay_tokens(logits, p, start), ref)
    _, logp_TV, _ = sglang_scores(logits, 1.0, 50, 1.0)
    by_id = (logp_TV + sglang_gumbel(seed, pos[:, None], torch.arange(V))).argmax(-1)
    assert (by_id != ref).sum() > T // 3
