"""Unseeded audits: per-token features of a claimed token under the reference's filtered sampling
distribution, pure functions of (logits, claimed ids, SamplingParams, uniforms).

Shape key: N = token rows (the steps of one claim, or of many claims concatenated; T for one
claim), V = vocab. In formulas T is the temperature.

Pipeline, per step, with l the reference's raw logits teacher-forced on the claim and x the claimed
token (the distribution is exactly the one filters.py's samplers draw from):
    p      = softmax(float64(filter_logits(l, T, top_k, top_p, min_p)))   0 outside the kept set S
    order  tokens by DESCENDING p, ties by ascending token id
    F(x-)  = sum_{v before x} p_v = sum_{p_v > p_x} p_v + sum_{p_v = p_x, v < x} p_v
    u      = F(x-) + V p_x,   V ~ U(0, 1) from `pit_uniforms` (keyed by claim id and position)
    logp   = log p_x                              (-inf outside S)
    H      = -sum_v p_v log p_v                   (the filtered distribution's entropy)
    excess = -logp - H                            (cross-entropy excess; `xent_excess`)
If x was sampled from p, u is Uniform(0, 1) given every earlier token (randomized probability
integral transform: Brockwell 2007; Czado, Gneiting & Held 2009), whatever the prompt, so the
u's of a provider's tokens are i.i.d. uniform; and excess has conditional mean 0
(E -log p_x = H). Neither needs the sampler's seed.

Why descending probability: u is uniform under any fixed order, but an order only sees the
misconfigurations that move probability along it. Those that matter (a wrong temperature, a wrong
top-p, a quantized model whose temperature was lowered to match honest cross-entropy) move mass
between the reference's likely and unlikely tokens: a lower temperature or a smaller nucleus puts
u near 0 (top ranks), a higher one spreads it toward 1, quantization noise to both ends. In
descending order these are shifts of the mean and spread of u, which the first Legendre
components see (detect/unseeded.py); in token-id order they scatter and u stays near uniform.

Out of support: a claimed token with p_x = 0 (filtered out at the claimed settings: a higher
temperature widens the top-p nucleus, so temperature +0.1 yields such tokens; top-p 0.9 served
for 0.95 never does) comes after every kept token in the order, so F(x-) = 1 and u = 1 exactly:
the most extreme value, on the side of "less probable than anything the sampler could emit".
logp = -inf and excess = +inf there; the detectors clip the excess at its honest quantile and
read u = 1 as the largest Legendre scores (detect/unseeded.py says how each uses them).

`pit_uniforms` is the documented generator of V: key = the first 8 bytes (little-endian) of
sha256(PIT_DOMAIN + claim id), V_t = noise.uniforms_from_keys(key, t) (SplitMix64 of key + (t + 1)
x 0x9E3779B97F4A7C15, top 53 bits, + 0.5 ulp): the same audit of the same claims reproduces every
u on any machine.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch

from verinfer.sampling.filters import filter_mask_and_logits
from verinfer.sampling.noise import as_int64, uniforms_from_keys
from verinfer.sampling.params import SamplingParams

PIT_DOMAIN = b"verinfer-pit-v1\x00"  # separates the PIT's uniforms from every sampler's noise


def pit_key(claim_id: str) -> int:
    """The uint64 key of a claim's PIT uniforms (module docstring)."""
    return int.from_bytes(hashlib.sha256(PIT_DOMAIN + str(claim_id).encode("utf-8")).digest()[:8], "little")


def pit_uniforms(claim_id: str, n: int, start: int = 0) -> torch.Tensor:
    """V_T float64 in (0, 1): the PIT's uniforms of output positions start .. start + n - 1 of a claim."""
    key = torch.tensor(as_int64(pit_key(claim_id)), dtype=torch.int64)
    return uniforms_from_keys(key, torch.arange(start, start + n, dtype=torch.int64))


def _rows(params_N: list[SamplingParams], device) -> tuple[torch.Tensor, ...]:
    return (torch.tensor([p.temperature for p in params_N], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params_N], dtype=torch.int64, device=device),
            torch.tensor([p.top_p for p in params_N], dtype=torch.float32, device=device),
            torch.tensor([p.min_p for p in params_N], dtype=torch.float32, device=device))


def filtered_probs(logits_NV: torch.Tensor, params_N: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep_NV, p_NV float64): the kept set and the distribution each row samples from."""
    keep_NV, scaled_NV = filter_mask_and_logits(logits_NV, *_rows(params_N, logits_NV.device))
    return keep_NV, torch.softmax(scaled_NV.double(), dim=-1)


def entropy(p_NV: torch.Tensor) -> torch.Tensor:
    """H_N = -sum p log p in nats (terms with p = 0 contribute 0)."""
    return -torch.where(p_NV > 0, p_NV * p_NV.clamp_min(1e-300).log(), torch.zeros_like(p_NV)).sum(-1)


def randomized_pit(p_NV: torch.Tensor, x_N: torch.Tensor, v_N: torch.Tensor) -> torch.Tensor:
    """u_N = F(x-) + V p_x in [0, 1], tokens ordered by descending p, ties by ascending id; u = 1
    where p_x = 0 (module docstring)."""
    px_N1 = p_NV.gather(1, x_N[:, None])
    ids_V = torch.arange(p_NV.shape[1], device=p_NV.device)
    before_NV = (p_NV > px_N1) | ((p_NV == px_N1) & (ids_V[None, :] < x_N[:, None]))
    below_N = torch.where(before_NV, p_NV, torch.zeros_like(p_NV)).sum(-1)
    u_N = below_N + v_N.to(p_NV) * px_N1[:, 0]
    return torch.where(px_N1[:, 0] > 0, u_N.clamp(0.0, 1.0), torch.ones_like(u_N))


class UnseededRows(NamedTuple):
    """`unseeded_rows`' values, [N] each."""

    pit: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    kept: torch.Tensor
    replay: torch.Tensor
    margin: torch.Tensor


def unseeded_rows(logits_NV: torch.Tensor, x_N: torch.Tensor, params_N: list[SamplingParams],
                  v_N: torch.Tensor) -> UnseededRows:
    """Every per-token value of an unseeded row, [N] each on the logits' device:
    pit (u), logp (log p_x, -inf outside S), entropy (H), kept (x in S), and the noise-free
    margin and replay the scores contract's other columns hold for such rows: replay = argmax_S p
    (lowest id on ties), margin = max_{v in S} l_v - l_x on the raw-logit scale (0 when x is that
    argmax, +inf outside S): Token-DiFR's margin with no noise, not a seeded replay's."""
    x_N = x_N.to(device=logits_NV.device, dtype=torch.int64)
    keep_NV, p_NV = filtered_probs(logits_NV, params_N)
    kept_N = keep_NV.gather(1, x_N[:, None])[:, 0]
    px_N = p_NV.gather(1, x_N[:, None])[:, 0]
    logp_N = torch.where(px_N > 0, px_N.clamp_min(1e-300).log(), torch.full_like(px_N, float("-inf")))
    l64_NV = logits_NV.double()
    top_N = l64_NV.masked_fill(~keep_NV, float("-inf")).amax(-1)
    margin_N = torch.where(kept_N, (top_N - l64_NV.gather(1, x_N[:, None])[:, 0]).clamp_min(0.0),
                           torch.full_like(top_N, float("inf")))
    return UnseededRows(randomized_pit(p_NV, x_N, v_N), logp_N, entropy(p_NV), kept_N, p_NV.argmax(-1), margin_N)


def pit_features(logits_TV: torch.Tensor, claimed_T: torch.Tensor, params: SamplingParams,
                 v_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pit_T, logp_T, entropy_T) of one claim (module docstring); v_T: its `pit_uniforms`."""
    r = unseeded_rows(logits_TV, claimed_T, [params] * logits_TV.shape[0], v_T)
    return r.pit, r.logp, r.entropy


def xent_excess(logp_N: torch.Tensor, entropy_N: torch.Tensor) -> torch.Tensor:
    """-log p_x - H: mean 0 under honest sampling (+inf outside S)."""
    return -logp_N - entropy_N
