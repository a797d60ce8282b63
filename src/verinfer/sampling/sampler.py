"""Samplers and their replay: pure functions of (logits, SamplingParams, noise).

Shape key: B = batch rows, T = sampled steps of one request, V = vocab, K = candidate ids per step,
J = K + 1 (candidates and the claimed id), N = flat (step, id) pairs. In formulas T is the temperature.

Pipeline reproduced for one step of one request (filters.py, then noise.py's backend):
  greedy (temperature == 0):  token = argmax(raw logits)            (first index on ties; no noise)
  scaled = filter_logits(logits)   # fp32 logits / T, -inf outside the kept set S
  vllm-cpu, keyed:        token = argmax_i float64(scaled_i) + G_i      (lowest id on exact ties)
  vllm-v1-exponential:    token = argmax(softmax(scaled) / q)           (fp32, as vLLM's
                                                                         probs.div_(q).argmax())
  inverse-cdf:            token = smallest i with cdf_i > u * cdf_{V-1},
                          cdf = cumsum(softmax(float64(scaled)))         (token-id order)
Gumbel argmaxes are decided on exact G (C-library log, noise.py): the fast torch.log values pick
the near-maximal candidates (within 1e-9) and only those are re-scored exactly.

Auditing: replay_tokens gives what an honest sampler with this seed would have drawn from the
verifier's logits; postgumbel_margin gives the Token-DiFR margin
  delta = max_{v in S} (l_v + T*G_v) - (l_y + T*G_y)
on the temperature-invariant scale of the raw logits l (0 when y is the replayed token, +inf when
y was filtered out; greedy: max l - l_y); inverse_cdf_interval gives the claimed token's CDF
interval and the step's shared uniform (IPT-DiFR).
"""

from __future__ import annotations

import math

import torch

from verinfer.sampling.filters import filter_mask_and_logits
from verinfer.sampling.noise import ExponentialStepNoise, HashTape, NoiseKindError, StepNoise, get_backend
from verinfer.sampling.params import SamplingParams

NEAR_TIE = 1e-9          # fast-vs-exact Gumbel scores differ by < 1e-12; re-score within this
_HASH_BACKENDS = ("vllm-cpu", "keyed")  # one 64-bit key per step: tapes stack row-wise
_CHUNK_ELEMS = 1 << 22   # candidate noise is computed for at most this many (step, id) pairs at once


def _param_rows(params_list: list[SamplingParams], device) -> tuple[torch.Tensor, ...]:
    return (torch.tensor([p.temperature for p in params_list], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params_list], dtype=torch.int64, device=device),
            torch.tensor([p.top_p for p in params_list], dtype=torch.float32, device=device),
            torch.tensor([p.min_p for p in params_list], dtype=torch.float32, device=device))


def _filtered(logits_TV: torch.Tensor, params: SamplingParams):
    T = logits_TV.shape[0]
    return filter_mask_and_logits(logits_TV, *_param_rows([params] * T, logits_TV.device))


def _temperature32(params: SamplingParams) -> float:
    """The fp32 temperature the filters divide by, as a Python float."""
    return float(torch.tensor(params.temperature, dtype=torch.float32))


# --- one step -------------------------------------------------------------------------------
def _gumbel_argmax(base_K: torch.Tensor, ids_K: torch.Tensor, noise: StepNoise) -> int:
    """argmax over candidates of base + G (float64), decided on exact G, lowest id on ties."""
    s_K = base_K + noise.gumbel(ids_K, exact=False)
    near = s_K >= s_K.max() - NEAR_TIE
    cand_ids = ids_K[near]
    s_exact = base_K[near] + noise.gumbel(cand_ids, exact=True)
    return int(cand_ids[s_exact == s_exact.max()].min())


def _inverse_cdf_pick(scaled_TV: torch.Tensor, keep_TV: torch.Tensor, u_T: torch.Tensor) -> torch.Tensor:
    cdf_TV = torch.softmax(scaled_TV.to(torch.float64), dim=-1).cumsum(dim=-1)
    x_T1 = u_T.to(cdf_TV)[:, None] * cdf_TV[:, -1:]
    idx_T = torch.searchsorted(cdf_TV, x_T1, right=True)[:, 0]
    # u * cdf_last < cdf_last for u < 1; never step past the last kept token in any case
    last_kept_T = torch.arange(keep_TV.shape[1], device=keep_TV.device).expand_as(keep_TV) \
        .masked_fill(~keep_TV, -1).amax(-1)
    return torch.minimum(idx_T, last_kept_T)


def _sample_row(logits_V, scaled_V, keep_V, params: SamplingParams, noise: StepNoise | None) -> int:
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
    return _gumbel_argmax(scaled_V[ids_K].to(torch.float64), ids_K, noise)


def sample_one(logits_V: torch.Tensor, params: SamplingParams, noise: StepNoise | None) -> int:
    """The token an honest sampler draws from raw logits_V with this step's noise."""
    if params.greedy:
        if noise is not None:
            raise ValueError("greedy sampling (temperature 0) draws no noise; pass noise=None")
        return int(logits_V.argmax())
    keep_1V, scaled_1V = _filtered(logits_V[None], params)
    return _sample_row(logits_V, scaled_1V[0], keep_1V[0], params, noise)


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
            out_B[b] = _sample_row(logits_BV[b], scaled_BV[b], keep_BV[b], params_list[b], noises[b])
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
    s_TK = (base_TK + g_TK).masked_fill(~valid_TK, float("-inf"))
    near_TK = valid_TK & (s_TK >= s_TK.amax(-1, keepdim=True) - NEAR_TIE)
    t_N, k_N = near_TK.nonzero(as_tuple=True)
    ids_N = ids_TK[t_N, k_N]
    s_N = base_TK[t_N, k_N] + tape.gumbel_pairs(t_N, ids_N, exact=True)
    best_T = torch.full((T,), float("-inf"), dtype=torch.float64, device=dev).scatter_reduce(0, t_N, s_N, "amax")
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


def _tape(params: SamplingParams, T: int, V: int, start_position: int):
    return get_backend(params.noise).tape(params.seed, T, V, start_position)


def replay_tokens(logits_TV: torch.Tensor, params: SamplingParams, start_position: int) -> torch.Tensor:
    """LongTensor [T]: what an honest sampler with params.seed draws at each step from these raw
    logits (step t samples position start_position + t). Uses the backend's tape."""
    T, V = logits_TV.shape
    if params.greedy or T == 0:
        return logits_TV.argmax(dim=-1)
    keep_TV, scaled_TV = _filtered(logits_TV, params)
    return _replay(logits_TV, params, start_position, keep_TV, scaled_TV, _tape(params, T, V, start_position))


def postgumbel_margin(logits_TV: torch.Tensor, claimed_T: torch.Tensor, params: SamplingParams,
                      start_position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-DiFR margin per step: (margin_T float64, replay_T long, kept_T bool).
    margin = max_{v in S}(l_v + T*G_v) - (l_y + T*G_y) with raw logits l, 0 when the claimed y
    is the replayed token, +inf when y was filtered out; greedy: max l - l_y.
    Gumbel backends only (vllm-cpu, keyed, vllm-v1-exponential with G = -log q)."""
    T, V = logits_TV.shape
    dev = logits_TV.device
    claimed_T = claimed_T.to(device=dev, dtype=torch.int64)
    if claimed_T.shape != (T,):
        raise ValueError(f"claimed_T must have shape [{T}], got {tuple(claimed_T.shape)}")
    if T and (int(claimed_T.min()) < 0 or int(claimed_T.max()) >= V):
        raise IndexError(f"claimed token ids must lie in [0, {V})")
    if params.greedy:
        l_TV = logits_TV.to(torch.float64)
        replay_T = logits_TV.argmax(dim=-1)
        margin_T = l_TV.amax(-1) - l_TV.gather(1, claimed_T[:, None])[:, 0]
        margin_T = margin_T.masked_fill(claimed_T == replay_T, 0.0)
        return margin_T, replay_T, torch.ones(T, dtype=torch.bool, device=dev)
    if get_backend(params.noise).kind != "gumbel":
        raise NoiseKindError(f"postgumbel_margin needs per-token Gumbel noise; backend {params.noise!r} "
                             "draws one uniform per step -- use inverse_cdf_interval instead")
    if T == 0:
        e = torch.empty(0, device=dev)
        return e.double(), e.long(), e.bool()
    keep_TV, scaled_TV = _filtered(logits_TV, params)
    tape = _tape(params, T, V, start_position)
    ids_TK, valid_TK = _candidates(scaled_TV, keep_TV)
    # fast G for the candidates plus the claimed token, one noise call; exact G decides the replay
    ids_TJ = torch.cat([ids_TK, claimed_T[:, None]], dim=1)
    g_TJ = _tape_gumbel(tape, ids_TJ)
    replay_T = _replay(logits_TV, params, start_position, keep_TV, scaled_TV, tape, (ids_TK, valid_TK), g_TJ[:, :-1])
    kept_T = keep_TV.gather(1, claimed_T[:, None])[:, 0]
    temp = _temperature32(params)
    score_TJ = logits_TV.gather(1, ids_TJ).to(torch.float64) + temp * g_TJ
    best_T = score_TJ[:, :-1].masked_fill(~valid_TK, float("-inf")).amax(-1)
    margin_T = (best_T - score_TJ[:, -1]).clamp_min(0.0)
    margin_T = margin_T.masked_fill(claimed_T == replay_T, 0.0)
    margin_T = margin_T.masked_fill(~kept_T, math.inf)
    return margin_T, replay_T, kept_T


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


# --- many claims at once (auditor's hot path) ------------------------------------------------
class _RowsTape(HashTape):
    """Hash-backend tapes of several requests stacked row-wise: row n has its own step key."""

    def __init__(self, keys_N: torch.Tensor, vocab_size: int):
        self.backend, self.seed, self.n_steps = None, 0, int(keys_N.shape[0])
        self.vocab_size, self.start_position, self.keys_T = vocab_size, 0, keys_N


def score_claimed(logits_list: list[torch.Tensor], claimed_list: list[torch.Tensor],
                  params_list: list[SamplingParams], starts: list[int]):
    """Token-DiFR margin, replayed token, kept flag and log p(claimed) under the filtered sampling
    distribution, for many claims at once: (margin_N, replay_N, kept_N, logp_N), rows of all
    claims concatenated in order. Equal to postgumbel_margin per claim; claims with hash noise
    (vllm-cpu, keyed) share one filter pass and one noise pass, others go one by one."""
    fast = [i for i, p in enumerate(params_list) if not p.greedy and get_backend(p.noise).name in _HASH_BACKENDS]
    n_i = [int(l.shape[0]) for l in logits_list]
    offs = [0]
    for n in n_i:
        offs.append(offs[-1] + n)
    N = offs[-1]
    margin_N = torch.empty(N, dtype=torch.float64)
    replay_N = torch.empty(N, dtype=torch.int64)
    kept_N = torch.empty(N, dtype=torch.bool)
    logp_N = torch.empty(N, dtype=torch.float64)
    fast_set = set(fast)
    for i in range(len(logits_list)):  # greedy / exponential / inverse-cdf claims: one by one
        if i in fast_set:
            continue
        p, l_TV, y_T = params_list[i], logits_list[i], claimed_list[i].to(torch.int64)
        s = slice(offs[i], offs[i + 1])
        if p.greedy:
            lp_TV = torch.log_softmax(l_TV.double(), -1)
            m, r, k = postgumbel_margin(l_TV, y_T, p, starts[i])
        else:
            keep_TV, scaled_TV = _filtered(l_TV, p)
            lp_TV = torch.log_softmax(scaled_TV.double(), -1)
            if get_backend(p.noise).kind == "gumbel":
                m, r, k = postgumbel_margin(l_TV, y_T, p, starts[i])
            else:
                r = replay_tokens(l_TV, p, starts[i])
                k = keep_TV.gather(1, y_T[:, None])[:, 0]
                m = torch.where(r == y_T, 0.0, math.inf).double()
        margin_N[s], replay_N[s], kept_N[s] = m.cpu(), r.cpu(), k.cpu()
        logp_N[s] = lp_TV.gather(1, y_T[:, None])[:, 0].cpu()
    if not fast:
        return margin_N, replay_N, kept_N, logp_N
    l_NV = torch.cat([logits_list[i] for i in fast])
    y_N = torch.cat([claimed_list[i].to(torch.int64) for i in fast]).to(l_NV.device)
    rows_p = [params_list[i] for i in fast for _ in range(n_i[i])]
    V = l_NV.shape[1]
    keys_N = torch.cat([_tape(params_list[i], n_i[i], V, starts[i]).keys_T for i in fast])
    m_N, rep_N, kept, lp_N = _score_rows(l_NV, y_N, rows_p, _RowsTape(keys_N, V))
    idx = torch.cat([torch.arange(offs[i], offs[i + 1]) for i in fast])
    margin_N[idx], replay_N[idx], kept_N[idx], logp_N[idx] = m_N.cpu(), rep_N.cpu(), kept.cpu(), lp_N.cpu()
    return margin_N, replay_N, kept_N, logp_N


def _topk_block(l_NV: torch.Tensor, rows_p: list[SamplingParams], slack: int = 16):
    """(vals_NK, ids_NK), the K = max top_k + slack largest logits of each row, when every row has
    top_k >= 1 and min_p == 0 and each row's block ends strictly below its k-th value: then the
    block holds every token top-k keeps (ties at the k-th value included; bf16 logits tie often),
    so the filters applied to the block keep exactly what they keep on the full row.
    None when the full-vocabulary path is needed."""
    V = l_NV.shape[1]
    ks = [p.top_k for p in rows_p]
    if not ks or min(ks) < 1 or max(ks) + slack >= V or any(p.min_p > 0 for p in rows_p):
        return None
    k_N = torch.tensor(ks, device=l_NV.device)
    vals_NK, ids_NK = l_NV.topk(int(k_N.max()) + slack, dim=-1)
    kth = vals_NK.gather(1, (k_N - 1)[:, None])[:, 0]
    if bool((vals_NK[:, -1] >= kth).any()):  # a tie run reaching past the block
        return None
    # columns in token-id order, so the filters' stable sort breaks ties (at the top-k and
    # top-p cuts) by token id exactly as on the full row
    ids_NK, perm = ids_NK.sort(dim=-1)
    return vals_NK.gather(1, perm), ids_NK


def filter_block(vals_NK, ids_NK, l_NV, prow):
    """(keep_NK, scaled_NK): the filters of the per-row parameters `prow` (temperature, top_k,
    top_p, min_p) applied to a top-k block (`_topk_block`), keeping exactly what they keep on the
    full rows l_NV. Top-p's softmax over the short row sums in another order than over the V-long
    row vLLM builds, so a cumulative sum within rounding of the cut may fall the other way: those
    rows are redone with the full-row filter and mapped back to the block's columns."""
    keep_NK, scaled_NK = filter_mask_and_logits(vals_NK, *prow)
    redo = _near_top_p_cut(vals_NK, prow)
    if redo.any():
        r = redo.nonzero()[:, 0]
        keep_rV, _ = filter_mask_and_logits(l_NV[r], *(t[r] for t in prow))
        keep_NK[r] = keep_rV.gather(1, ids_NK[r])
        scaled_NK[r] = torch.where(keep_NK[r], vals_NK[r].float() / _scale_of(prow[0][r])[:, None], float("-inf"))
    return keep_NK, scaled_NK


def _score_rows(l_NV, y_N, rows_p, tape):
    """Margin, replay, kept and log p(claimed) for rows with hash noise (see score_claimed)."""
    block = _topk_block(l_NV, rows_p)
    t_of = {t: _temperature32(SamplingParams(temperature=t, seed=0)) for t in {p.temperature for p in rows_p}}
    temp_N = torch.tensor([t_of[p.temperature] for p in rows_p], dtype=torch.float64, device=l_NV.device)
    if block is not None:
        vals_NK, ids_NK = block
        keep_NK, scaled_NK = filter_block(vals_NK, ids_NK, l_NV, _param_rows(rows_p, l_NV.device))
        cand_scaled = scaled_NK
        valid_NK = keep_NK
        in_NK = ids_NK == y_N[:, None]
        kept = (in_NK & keep_NK).any(-1)
        s64 = scaled_NK.double()
        y_scaled = torch.where(kept, (s64.masked_fill(~in_NK, float("-inf"))).amax(-1), float("-inf"))
        lp_N = y_scaled - torch.logsumexp(s64, -1)
        base_NK = vals_NK
    else:
        keep_NV, scaled_NV = filter_mask_and_logits(l_NV, *_param_rows(rows_p, l_NV.device))
        ids_NK, valid_NK = _candidates(scaled_NV, keep_NV)
        cand_scaled = scaled_NV.gather(1, ids_NK)
        kept = keep_NV.gather(1, y_N[:, None])[:, 0]
        s64 = scaled_NV.double()
        lp_N = s64.gather(1, y_N[:, None])[:, 0] - torch.logsumexp(s64, -1)
        base_NK = l_NV.gather(1, ids_NK)
    ids_NJ = torch.cat([ids_NK, y_N[:, None]], dim=1)
    g_NJ = _tape_gumbel(tape, ids_NJ)
    # replay: argmax over kept candidates of scaled + G, near-ties re-scored with exact G
    K = ids_NK.shape[1]
    local = torch.arange(K, device=l_NV.device).expand_as(ids_NK)
    rep_N = ids_NK.gather(1, _gumbel_replay(cand_scaled, local, valid_NK, _GatheredTape(tape, ids_NK),
                                            g_NJ[:, :-1])[:, None])[:, 0]
    l_y = l_NV.gather(1, y_N[:, None])[:, 0].to(torch.float64)
    best_N = (base_NK.to(torch.float64) + temp_N[:, None] * g_NJ[:, :-1]).masked_fill(~valid_NK, float("-inf")).amax(-1)
    m_N = (best_N - (l_y + temp_N * g_NJ[:, -1])).clamp_min(0.0)
    m_N = m_N.masked_fill(y_N == rep_N, 0.0).masked_fill(~kept, math.inf)
    return m_N, rep_N, kept, lp_N


def _scale_of(temperature_r: torch.Tensor) -> torch.Tensor:
    return torch.where(temperature_r == 0, torch.ones_like(temperature_r), temperature_r)


def _near_top_p_cut(vals_NK: torch.Tensor, prow, tol: float = 1e-4) -> torch.Tensor:
    """Rows whose top-p decision is within `tol` of flipping (descending block of logits)."""
    temperature_N, top_k_N, top_p_N, _ = prow
    x_NK = vals_NK.float() / _scale_of(temperature_N)[:, None]
    x_NK, _ = x_NK.sort(dim=-1, descending=True)
    kth = x_NK.gather(1, (top_k_N - 1)[:, None])
    x_NK = x_NK.masked_fill(x_NK < kth, float("-inf"))
    p_NK = torch.softmax(x_NK.double(), -1)
    tail_NK = p_NK.flip(-1).cumsum(-1).flip(-1)  # mass of this token and all smaller ones
    near = ((tail_NK - (1 - top_p_N.double())[:, None]).abs() < tol) & (p_NK > 0)
    return near.any(-1) & (top_p_N < 1)


class _GatheredTape:
    """A tape seen through per-row candidate lists: local column j of row n is token ids_NK[n, j]."""

    def __init__(self, tape, ids_NK):
        self.tape, self.ids_NK = tape, ids_NK

    def gumbel_pairs(self, t_N, j_N, exact=True):
        return self.tape.gumbel_pairs(t_N, self.ids_NK[t_N, j_N], exact)


def postgumbel_gaps(logits_TV: torch.Tensor, claimed_T: torch.Tensor, params: SamplingParams,
                    start_position: int, k: int = 16) -> torch.Tensor:
    """gaps_Tk float64: for the k strongest kept competitors c != y of each step (descending),
    (l_c + T*G_c) - (l_y + T*G_y) on the raw-logit scale, -inf padded when fewer are kept; a row
    of +inf when the claimed y was filtered out. Where y is not the replayed token, gaps[:, 0] is
    the Token-DiFR margin; Monte-Carlo DiFR perturbs these gaps (audit.variants.mc_difr).
    Gumbel backends only (vllm-cpu, keyed, vllm-v1-exponential)."""
    if params.greedy or get_backend(params.noise).kind != "gumbel":
        raise NoiseKindError(f"postgumbel_gaps needs per-token Gumbel noise and temperature > 0; "
                             f"got noise={params.noise!r}, temperature={params.temperature}")
    T, V = logits_TV.shape
    claimed_T = claimed_T.to(device=logits_TV.device, dtype=torch.int64)
    if claimed_T.shape != (T,):
        raise ValueError(f"claimed_T must have shape [{T}], got {tuple(claimed_T.shape)}")
    out_Tk = torch.full((T, k), float("-inf"), dtype=torch.float64)
    if T == 0:
        return out_Tk
    keep_TV, scaled_TV = _filtered(logits_TV, params)
    ids_TK, valid_TK = _candidates(scaled_TV, keep_TV)
    ids_TJ = torch.cat([ids_TK, claimed_T[:, None]], dim=1)
    g_TJ = _tape_gumbel(_tape(params, T, V, start_position), ids_TJ)
    s_TJ = logits_TV.gather(1, ids_TJ).to(torch.float64) + _temperature32(params) * g_TJ
    comp_TK = (s_TJ[:, :-1] - s_TJ[:, -1:]).masked_fill(~valid_TK | (ids_TK == claimed_T[:, None]), float("-inf"))
    kk = min(k, comp_TK.shape[1])
    out_Tk[:, :kk] = comp_TK.topk(kk, dim=-1).values.cpu()
    kept_T = keep_TV.gather(1, claimed_T[:, None])[:, 0].cpu()
    out_Tk[~kept_T] = float("inf")
    return out_Tk
