"""SGLang's seeded sampler (deterministic inference), reproduced in torch (no Triton, no sgl_kernel).

Shape key: T = rows (sampled steps), V = vocab, N = noise elements (any broadcast of positions and
noise columns).

Reproduces sglang 0.5.23 (sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl, sha256 00b3cd5b...9937):
sglang/srt/layers/sampler.py (Sampler.forward's standard path, sampling_from_probs_torch,
top_k_top_p_min_p_sampling_from_probs_torch, multinomial_with_seed) and
sglang/kernels/ops/sampling/murmur_hash.py (murmur_hash32_kernel), as a server runs them with
--enable-deterministic-inference (which sets --sampling-backend pytorch). A request's seed s is its
`sampling_seed` (the OpenAI chat and completions endpoints pass their `seed` field through; a request
without one gets 42), an int64 of either sign. For a row at SGLang position p and noise column c:
    p  = the position of the row's *last input token* (`forward_batch.positions` in decode,
         `seq_lens - 1` in prefill): the token it samples sits at p + 1, so p = verinfer's
         position - 1, as vLLM MRv2 (noise.py counts the sampled token's own position)
    h  = murmur_hash32(uint64 s, p, c): vLLM MRv2's murmur3 with domain 0 (vllm_gumbel.murmur3_hash32,
         the words lo32 s, hi32 s, lo32 p, lo32 c, then fmix32(h ^ 16))                (uint32)
    u  = float64(h) / 4294967295                                                 (float64, [0, 1])
    G  = -log(-clamp(log(u), min=-DBL_MAX, max=-2**-32))                          (float64)
         (h = 0: G = -709.78; h = 2**32 - 1: G = 22.18)
One step of a request with temperature T (SGLang samples T < 1e-6 greedily, verinfer T == 0):
    probs = softmax(fp32(logits) / fp32(T))                            (fp32, torch.softmax)
  unfiltered path (`sampling_from_probs_torch`, top-k, top-p and min-p all off):
    x_c = float64(log(probs_c)) + G(s, p, c)       (fp32 log, then float64)   column c = token id
  sorted path (`top_k_top_p_min_p_sampling_from_probs_torch`):
    q, idx = sort(probs, descending)        (torch's unstable sort: tied probabilities are ranked
                                              in the order the device's sort gives them)
    cum = cumsum(q)                                                    (fp32, before any masking)
    q_r = 0 where r >= top_k;  then q_r = 0 where cum_r - q_r > top_p   (fp32; top-p on the
                                              unfiltered sorted probs, not renormalized after top-k)
    x_r = log(float64(q_r)) + G(s, p, r)     (float64; -inf where q_r == 0)    column r = rank
  token = the column's token (idx[r], or c) at argmax x                    (the first maximum)
So the noise is addressed by rank in the sorted probabilities on the sorted path: a token's G
depends on how many tokens the verifier's own probabilities rank above it (`sglang_scores` returns
that column map; the sampler reads the noise through it, noise.py `by_columns`). A logit difference
between server and verifier that swaps two tokens' order above a candidate changes its noise, so the
replay of the sorted path is far more sensitive to numerics than token-id-addressed noise
(docs/architecture.md gives measured rates).

SGLang picks the path per *batch*: the sorted path whenever any request of the batch has top-k,
top-p or min-p on or is greedy (SGLang samples greedy requests in a mixed batch as top_k = 1). An
unfiltered request therefore takes either path depending on what it was batched with; `sorted_path`
says which one each verinfer backend reproduces ("sglang-seeded": the request's own path, as in a
batch of its kind; "sglang-seeded-sorted": always the sorted path). With min-p on, SGLang's seeded
sampler refuses the batch (an assert): no path exists, and the backends refuse min_p > 0.

The transcendental functions decide the last bits: `exact=True` evaluates G's logs with torch on
the host (what SGLang's pytorch backend computes on a CPU, bit for bit: tests/sampling/
test_sglang_seeded.py runs SGLang's own functions from the wheel); `exact=False` on the tensor's
device. SGLang on a GPU computes them with CUDA's log (and, multinomial_with_seed being
@torch.compile'd, possibly with Inductor's), which may differ in the last bit; the sampled token
changes only where two candidates tie within ~1e-15 (not checked without a GPU). Likewise fp32
softmax / log / cumsum on another device may round differently, and ties are ranked by that
device's sort.
"""

from __future__ import annotations

import torch

from verinfer.sampling.vllm_gumbel import murmur3_hash32

U32_MAX = 4294967295.0               # torch.iinfo(torch.uint32).max
LOG_U_MAX = -(2.0**-32)              # multinomial_with_seed's clamp: caps G at -log(2**-32)
TOP_K_ALL = 1 << 30                  # SGLang's top_k for "whole vocabulary" (request top_k -1)
WHEEL = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"


def _int64(x: int) -> int:
    """A seed as SGLang's int64 tensor holds it (uint64 values wrap to their two's complement)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


# --- noise ---------------------------------------------------------------------------------------
def sglang_uniform(seed: int, pos_N: torch.Tensor, cols_N: torch.Tensor) -> torch.Tensor:
    """u = float64(murmur_hash32(s, p, c)) / (2**32 - 1), broadcasting SGLang positions p against
    noise columns c. seed: the request's sampling_seed (any int64, or its uint64 bit pattern)."""
    cols_N = cols_N.to(torch.int64)
    s = torch.tensor(_int64(int(seed)), dtype=torch.int64, device=cols_N.device)
    pos_N = pos_N.to(device=cols_N.device, dtype=torch.int64)
    return murmur3_hash32(s, pos_N, cols_N).to(torch.float64) / U32_MAX


def sglang_gumbel(seed: int, pos_N: torch.Tensor, cols_N: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """G = -log(-clamp(log u, -DBL_MAX, -2**-32)) (float64), broadcasting positions against columns.
    exact=True: the logs on the host (SGLang's pytorch backend on a CPU); False: on cols' device."""
    u_N = sglang_uniform(seed, pos_N, cols_N)
    dev = u_N.device
    if exact:
        u_N = u_N.cpu()
    log_u_N = torch.log(u_N).clamp_(min=torch.finfo(torch.float64).min, max=LOG_U_MAX)
    return torch.log(log_u_N.neg_()).neg_().to(dev)


# --- probabilities, filters and scores ----------------------------------------------------------
def sorted_path(top_k: int, top_p: float, always_sorted: bool) -> bool:
    """Whether SGLang samples this request on the sorted path (module docstring): some filter on,
    or a batch that forces it (always_sorted). verinfer's top_k <= 0 is SGLang's -1 (off)."""
    return always_sorted or top_k > 0 or top_p < 1.0


def sglang_probs(logits_TV: torch.Tensor, temperature: float) -> torch.Tensor:
    """probs_TV fp32 = softmax(fp32(logits) / fp32(T)): Sampler.forward's `logits.div_(temperatures)`
    (an fp32 [B, 1] tensor) then `torch.softmax` (deterministic inference)."""
    t = torch.tensor(temperature, dtype=torch.float32, device=logits_TV.device)
    return torch.softmax(logits_TV.to(torch.float32) / t, dim=-1)


def sglang_scores(logits_TV: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  always_sorted: bool = False):
    """(keep_TV, logp_TV, cols_TV): SGLang's view of each row in token-id order. logp_TV float64
    is the score the noise is added to (-inf where SGLang's filters or an fp32 underflow leave
    probability 0: keep_TV is logp_TV > -inf); cols_TV int64 is each token's noise column, its rank
    in the sorted probabilities (None on the unfiltered path, where the column is the token id)."""
    probs_TV = sglang_probs(logits_TV, temperature)
    if not sorted_path(top_k, top_p, always_sorted):
        logp_TV = torch.log(probs_TV).to(torch.float64)
        return logp_TV > float("-inf"), logp_TV, None
    T, V = probs_TV.shape
    q_TV, idx_TV = probs_TV.sort(dim=-1, descending=True)
    cum_TV = torch.cumsum(q_TV, dim=-1)
    rank_TV = torch.arange(V, device=q_TV.device).expand(T, V)
    q_TV[rank_TV >= (top_k if top_k > 0 else TOP_K_ALL)] = 0.0
    q_TV[(cum_TV - q_TV) > torch.tensor(top_p, dtype=torch.float32, device=q_TV.device)] = 0.0
    logp_TV = torch.empty(T, V, dtype=torch.float64, device=q_TV.device).scatter_(1, idx_TV, q_TV.double().log())
    cols_TV = torch.empty_like(idx_TV).scatter_(1, idx_TV, rank_TV)
    return logp_TV > float("-inf"), logp_TV, cols_TV


def sglang_sample(logits_TV: torch.Tensor, seed: int, positions_T: torch.Tensor, temperature: float,
                  top_k: int = -1, top_p: float = 1.0, always_sorted: bool = False) -> torch.Tensor:
    """token_T (int64): SGLang's seeded sampler on every row, the whole vocabulary at once (the
    module docstring's pipeline, the reference the sampler's candidate search is tested against).
    positions_T: SGLang's positions, the last input token's (verinfer's position - 1)."""
    keep_TV, logp_TV, cols_TV = sglang_scores(logits_TV, temperature, top_k, top_p, always_sorted)
    T, V = logp_TV.shape
    col_V = torch.arange(V, device=logp_TV.device)
    g_TV = sglang_gumbel(seed, positions_T.to(logp_TV.device)[:, None], col_V)   # by column
    if cols_TV is None:
        return (logp_TV + g_TV).argmax(dim=-1)
    x_TV = torch.empty_like(logp_TV).scatter_(1, cols_TV, logp_TV) + g_TV          # by rank, as SGLang
    order_TV = torch.empty_like(cols_TV).scatter_(1, cols_TV, col_V.expand(T, V))  # rank -> token id
    return order_TV.gather(1, x_TV.argmax(dim=-1, keepdim=True))[:, 0]


__all__ = ["TOP_K_ALL", "WHEEL", "WHEEL_SHA256", "sglang_gumbel", "sglang_probs", "sglang_sample", "sglang_scores",
           "sglang_uniform", "sorted_path"]
