"""Samplers and their replay: pure functions of (logits, SamplingParams, noise).

Shape key: B = batch rows, T = sampled steps of one request, V = vocab, K = candidate ids per step,
J = K + 1 (candidates and the claimed id), N = flat (step, id) pairs. In formulas T is the temperature.

Pipeline reproduced for one step of one request (filters.py, then noise.py's backend):
  greedy (temperature == 0):  token = argmax(raw logits)            (first index on ties; no noise)
  scaled = filter_logits(logits)   # fp32 logits / T, -inf outside the kept set S
  vllm-cpu, keyed:        token = argmax_i float64(scaled_i) + G_i      (lowest id on exact ties)
  vllm-mrv2-*-fp32:       token = argmax_i fp32(scaled_i + G_i)         (vLLM MRv2's fp32 sum; lowest
                                                                         id on ties; -fp64: as keyed)
  vllm-v1-exponential:    token = argmax(softmax(scaled) / q)           (fp32, as vLLM's
                                                                         probs.div_(q).argmax())
  inverse-cdf:            token = smallest i with cdf_i > u * cdf_{V-1},
                          cdf = cumsum(softmax(float64(scaled)))         (token-id order)
  speculative-keyed:      as keyed (step t = round t's token noise, noise.py)
  sglang-seeded(-sorted): SGLang's own filters and scores instead (sglang_seeded.py):
                          token = argmax_i float64(log p_i) + G_{col(i)}  (p: SGLang's filtered fp32
                          probs; col: the token id, or its rank in the sorted probs on SGLang's
                          sorted path, the noise read through noise.by_columns)
From a probability vector p (speculative decoding, speculative-keyed noise):
  sample_probs:           token = argmax_{v: p_v > 0} float64(log p_v) + G_v
Gumbel argmaxes are decided on exact G (C-library log, noise.py): the fast torch.log values pick
the near-maximal candidates (within 1e-9; with fp32 scores within NEAR_TIE32 + 2**-16 |max|, which
covers fp32 rounding of the sum and fast-vs-exact fp32 logs) and only those are re-scored exactly,
in the noise's score_dtype.

Auditing: replay_tokens gives what an honest sampler with this seed would have drawn from the
verifier's logits; inverse_cdf_interval gives the claimed token's CDF interval and the step's shared
uniform (IPT-DiFR). The Token-DiFR margin and every other post-Gumbel gap are in gap.py.
"""

from __future__ import annotations

import torch

from verinfer.sampling.filters import filter_mask_and_logits
from verinfer.sampling.noise import ExponentialStepNoise, NoiseKindError, StepNoise, get_backend
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.sglang_seeded import sglang_scores

NEAR_TIE = 1e-9          # fast-vs-exact Gumbel scores differ by < 1e-12; re-score within this
NEAR_TIE32 = 1e-4        # fp32 scores (vLLM MRv2 fp32): fast-vs-exact fp32 logs differ by a few ulp
_CHUNK_ELEMS = 1 << 22   # candidate noise is computed for at most this many (step, id) pairs at once


def _param_rows(params_list: list[SamplingParams], device) -> tuple[torch.Tensor, ...]:
    return (torch.tensor([p.temperature for p in params_list], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params_list], dtype=torch.int64, device=device),
            torch.tensor([p.top_p for p in params_list], dtype=torch.float32, device=device),
            torch.tensor([p.min_p for p in params_list], dtype=torch.float32, device=device))


def _view(logits_TV: torch.Tensor, params: SamplingParams):
    """(keep_TV, scaled_TV, cols_TV): the kept set, the scores the noise is added to and the noise
    column of each token id (None: the token id itself) of the sampler params.noise drives. The
    verinfer pipeline: filters.py's fp32 logits / T; SGLang's: its float64 log p and, on its sorted
    path, each token's rank (sglang_seeded.sglang_scores)."""
    if not params.greedy and get_backend(params.noise).pipeline == "sglang":
        return sglang_scores(logits_TV, params.temperature, params.top_k, params.top_p,
                             get_backend(params.noise).always_sorted)
    T = logits_TV.shape[0]
    return (*filter_mask_and_logits(logits_TV, *_param_rows([params] * T, logits_TV.device)), None)


def _filtered(logits_TV: torch.Tensor, params: SamplingParams):
    """(keep_TV, scaled_TV) of `_view`."""
    return _view(logits_TV, params)[:2]


def _temperature32(params: SamplingParams) -> float:
    """The fp32 temperature the filters divide by, as a Python float."""
    return float(torch.tensor(params.temperature, dtype=torch.float32))


# --- one step -------------------------------------------------------------------------------
def _near_window(s_max: torch.Tensor, score_dtype: torch.dtype) -> torch.Tensor | float:
    """How far below the fast maximum a candidate may still win on exact scores."""
    if score_dtype == torch.float64:
        return NEAR_TIE
    return NEAR_TIE32 + s_max.abs().nan_to_num(0.0, 0.0, 0.0) * 2.0**-16


def _exact_scores(base: torch.Tensor, g: torch.Tensor, score_dtype: torch.dtype) -> torch.Tensor:
    """base + G in the sampler's dtype (base: float64 of the fp32 scaled logits, exact either way)."""
    return base.to(score_dtype) + g.to(score_dtype)


def _gumbel_argmax(base_K: torch.Tensor, ids_K: torch.Tensor, noise: StepNoise) -> int:
    """argmax over candidates of base + G (in noise.score_dtype), decided on exact G, lowest id on ties."""
    s_K = base_K + noise.gumbel(ids_K, exact=False)
    s_max = s_K.max()
    near = s_K >= s_max - _near_window(s_max, noise.score_dtype)
    cand_ids = ids_K[near]
    s_exact = _exact_scores(base_K[near], noise.gumbel(cand_ids, exact=True), noise.score_dtype)
    return int(cand_ids[s_exact == s_exact.max()].min())


def _inverse_cdf_pick(scaled_TV: torch.Tensor, keep_TV: torch.Tensor, u_T: torch.Tensor) -> torch.Tensor:
    cdf_TV = torch.softmax(scaled_TV.to(torch.float64), dim=-1).cumsum(dim=-1)
    x_T1 = u_T.to(cdf_TV)[:, None] * cdf_TV[:, -1:]
    idx_T = torch.searchsorted(cdf_TV, x_T1, right=True)[:, 0]
    # u * cdf_last < cdf_last for u < 1; never step past the last kept token in any case
    last_kept_T = torch.arange(keep_TV.shape[1], device=keep_TV.device).expand_as(keep_TV) \
        .masked_fill(~keep_TV, -1).amax(-1)
    return torch.minimum(idx_T, last_kept_T)


def _sample_row(logits_V, scaled_V, keep_V, params: SamplingParams, noise: StepNoise | None, cols_V=None) -> int:
    if params.greedy:
        if noise is not None:
            raise ValueError("greedy sampling (temperature 0) draws no noise; pass noise=None")
        return int(logits_V.argmax())
    if noise is None:
        raise ValueError(f"temperature {params.temperature} > 0 needs the step's noise "
                         f"(get_backend({params.noise!r}).stream(seed, V, start_position).next())")
    if noise.backend != params.noise:
        raise ValueError(f"noise from backend {noise.backend!r} but params.noise is {params.noise!r}")
    if isinstance(noise, ExponentialStepNoise):
        probs_V = torch.softmax(scaled_V, dim=-1)
        return int((probs_V / noise.exponential_V.to(probs_V.device)).argmax())
    if noise.kind == "uniform":
        u = torch.tensor([noise.uniform], dtype=torch.float64, device=scaled_V.device)
        return int(_inverse_cdf_pick(scaled_V[None], keep_V[None], u)[0])
    ids_K = keep_V.nonzero()[:, 0]
    noise = noise if cols_V is None else noise.by_columns(cols_V)  # SGLang's sorted path: noise by rank
    return _gumbel_argmax(scaled_V[ids_K].to(torch.float64), ids_K, noise)


def sample_one(logits_V: torch.Tensor, params: SamplingParams, noise: StepNoise | None) -> int:
    """The token an honest sampler draws from raw logits_V with this step's noise."""
    if params.greedy:
        if noise is not None:
            raise ValueError("greedy sampling (temperature 0) draws no noise; pass noise=None")
        return int(logits_V.argmax())
    keep_1V, scaled_1V, cols_1V = _view(logits_V[None], params)
    return _sample_row(logits_V, scaled_1V[0], keep_1V[0], params, noise, None if cols_1V is None else cols_1V[0])


def sample_probs(probs_V: torch.Tensor, noise: StepNoise) -> int:
    """Gumbel-max draw from a probability vector (speculative decoding's draft, correction and
    bonus tokens): argmax over v with p_v > 0 of float64(log p_v) + G_v, decided on exact G, lowest
    id on ties. Draws v with probability p_v / sum(p)."""
    if noise.kind != "gumbel":
        raise NoiseKindError(f"sample_probs needs per-token Gumbel noise, got backend {noise.backend!r}")
    ids_K = (probs_V > 0).nonzero()[:, 0]
    return _gumbel_argmax(probs_V[ids_K].to(torch.float64).log(), ids_K, noise)


def sample_batch(logits_BV: torch.Tensor, params_list: list[SamplingParams],
                 noises: list[StepNoise | None]) -> torch.Tensor:
    """One token per row (LongTensor [B] on logits' device): filters vectorized across rows,
    noise per row. A row with temperature > 0 but noise None (a finished row the engine no
    longer samples) gets its greedy token as a placeholder."""
    B = logits_BV.shape[0]
    if len(params_list) != B or len(noises) != B:
        raise ValueError(f"{B} logits rows but {len(params_list)} params and {len(noises)} noises")
    out_B = logits_BV.argmax(dim=-1)
    rows = [b for b in range(B) if not params_list[b].greedy and noises[b] is not None]
    for b in range(B):
        if params_list[b].greedy and noises[b] is not None:
            raise ValueError(f"row {b}: greedy sampling (temperature 0) draws no noise; pass None")
    if rows:
        keep_BV, scaled_BV = filter_mask_and_logits(logits_BV, *_param_rows(params_list, logits_BV.device))
        for b in rows:
            keep_V, scaled_V, cols_V = keep_BV[b], scaled_BV[b], None
            if get_backend(params_list[b].noise).pipeline != "verinfer":  # its own filters (SGLang's)
                keep_1V, scaled_1V, cols_1V = _view(logits_BV[b : b + 1], params_list[b])
                keep_V, scaled_V, cols_V = keep_1V[0], scaled_1V[0], None if cols_1V is None else cols_1V[0]
            out_B[b] = _sample_row(logits_BV[b], scaled_V, keep_V, params_list[b], noises[b], cols_V)
    return out_B


# --- replay (auditor) -----------------------------------------------------------------------
def _candidates(scaled_TV: torch.Tensor, keep_TV: torch.Tensor):
    """The kept set of every step as a top-K block: ids_TK (by descending scaled logit) and
    valid_TK (False on padding where a step keeps fewer than K = max kept count)."""
    T, V = keep_TV.shape
    K = max(int(keep_TV.sum(-1).max()), 1)
    if 4 * K > V:  # mostly unfiltered: every id is a candidate (cheaper than a near-full topk)
        return torch.arange(V, device=keep_TV.device).expand(T, V), keep_TV
    ids_TK = scaled_TV.topk(K, dim=-1).indices
    return ids_TK, keep_TV.gather(1, ids_TK)


def _chunks(T: int, K: int):
    step = max(1, _CHUNK_ELEMS // max(K, 1))
    for t0 in range(0, T, step):
        yield t0, min(T, t0 + step)


def _tape_gumbel(tape, ids_TK: torch.Tensor) -> torch.Tensor:
    """Fast (torch.log) G at ids_TK, computed a chunk of steps at a time."""
    g_TK = torch.empty(ids_TK.shape, dtype=torch.float64, device=ids_TK.device)
    for t0, t1 in _chunks(*ids_TK.shape):
        g_TK[t0:t1] = tape.gumbel_rows(t0, ids_TK[t0:t1], exact=False)
    return g_TK


def _gumbel_replay(scaled_TV, ids_TK, valid_TK, tape, g_TK=None) -> torch.Tensor:
    """_gumbel_argmax vectorized over all steps: fast G for the kept candidates, then the
    near-maximal ones re-scored with exact G; lowest id among exact ties."""
    T, V = scaled_TV.shape
    dev = scaled_TV.device
    base_TK = scaled_TV.gather(1, ids_TK).to(torch.float64)
    g_TK = _tape_gumbel(tape, ids_TK) if g_TK is None else g_TK
    score_dtype = tape.score_dtype
    s_TK = (base_TK + g_TK).masked_fill(~valid_TK, float("-inf"))
    s_max_T1 = s_TK.amax(-1, keepdim=True)
    near_TK = valid_TK & (s_TK >= s_max_T1 - _near_window(s_max_T1, score_dtype))
    t_N, k_N = near_TK.nonzero(as_tuple=True)
    ids_N = ids_TK[t_N, k_N]
    s_N = _exact_scores(base_TK[t_N, k_N], tape.gumbel_pairs(t_N, ids_N, exact=True), score_dtype)
    best_T = torch.full((T,), float("-inf"), dtype=score_dtype, device=dev).scatter_reduce(0, t_N, s_N, "amax")
    win_N = s_N == best_T[t_N]
    return torch.full((T,), V, dtype=torch.int64, device=dev).scatter_reduce(0, t_N[win_N], ids_N[win_N], "amin")


def _replay(logits_TV, params, start_position, keep_TV, scaled_TV, tape, cand=None, g_TK=None) -> torch.Tensor:
    if params.noise == "inverse-cdf":
        return _inverse_cdf_pick(scaled_TV, keep_TV, tape.uniforms_T.to(logits_TV.device))
    if params.noise == "vllm-v1-exponential":
        probs_TV = torch.softmax(scaled_TV, dim=-1)
        out = [int((probs_TV[t] / q_V.to(probs_TV.device)).argmax()) for t, q_V in enumerate(tape.rows())]
        return torch.tensor(out, dtype=torch.int64, device=logits_TV.device)
    ids_TK, valid_TK = cand if cand is not None else _candidates(scaled_TV, keep_TV)
    return _gumbel_replay(scaled_TV, ids_TK, valid_TK, tape, g_TK)


def _tape(params: SamplingParams, T: int, V: int, start_position: int, cols_TV: torch.Tensor | None = None):
    """The claim's noise tape, read through the column map of `_view` when it has one."""
    tape = get_backend(params.noise).tape(params.seed, T, V, start_position)
    return tape if cols_TV is None else tape.by_columns(cols_TV)


def replay_tokens(logits_TV: torch.Tensor, params: SamplingParams, start_position: int) -> torch.Tensor:
    """LongTensor [T]: what an honest sampler with params.seed draws at each step from these raw
    logits (step t samples position start_position + t). Uses the backend's tape."""
    T, V = logits_TV.shape
    if params.greedy or T == 0:
        return logits_TV.argmax(dim=-1)
    keep_TV, scaled_TV, cols_TV = _view(logits_TV, params)
    return _replay(logits_TV, params, start_position, keep_TV, scaled_TV, _tape(params, T, V, start_position, cols_TV))


def inverse_cdf_interval(logits_TV: torch.Tensor, claimed_T: torch.Tensor, params: SamplingParams,
                         start_position: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lo_T, hi_T, u_T) float64: the claimed token's interval [lo, hi) = [cdf_{y-1}, cdf_y] /
    cdf_{V-1} of the filtered distribution (token-id order; empty, lo == hi, when y was filtered
    out) and the step's shared uniform u. An honest inverse-cdf sampler drew y iff u falls in it
    (up to the rounding of the normalization). inverse-cdf backend only; start_position is
    accepted for symmetry (the generator stream does not depend on it)."""
    if params.greedy or params.noise != "inverse-cdf":
        raise NoiseKindError(f"inverse_cdf_interval needs the inverse-cdf backend with temperature > 0; "
                             f"got noise={params.noise!r}, temperature={params.temperature}")
    T, V = logits_TV.shape
    dev = logits_TV.device
    claimed_T = claimed_T.to(device=dev, dtype=torch.int64)
    _, scaled_TV = _filtered(logits_TV, params)
    cdf_TV = torch.softmax(scaled_TV.to(torch.float64), dim=-1).cumsum(dim=-1)
    total_T = cdf_TV[:, -1]
    hi_T = cdf_TV.gather(1, claimed_T[:, None])[:, 0]
    prev_T = (claimed_T - 1).clamp_min(0)
    lo_T = torch.where(claimed_T > 0, cdf_TV.gather(1, prev_T[:, None])[:, 0], torch.zeros_like(hi_T))
    u_T = _tape(params, T, V, start_position).uniforms_T.to(dev)
    return lo_T / total_T, hi_T / total_T, u_T
