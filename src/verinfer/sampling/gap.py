"""The signed post-Gumbel gap: the Token-DiFR margin and its variants, one function per formula.

Shape key: N = token rows (the steps of one claim, or of many claims concatenated), K = candidate
ids per row, J = K + 1 (candidates and the claimed id), k = gaps kept per row, F = temperature
factors, V = vocab. In formulas T is the temperature.

Pipeline reproduced (sampler.py): an honest Gumbel-max sampler draws
    y = argmax_{v in S} float64(fp32(l_v) / T) + G_v
with l the raw logits, S the set the filters keep (filters.py) and G the step's Gumbel noise
regenerated from the claim's seed (noise.py; vllm-v1-exponential: G = -log q). On the
temperature-invariant scale of the raw logits (the sampler's expression times T), the post-Gumbel
score of token v and the signed gap of a candidate c over the claimed token y are
    s_v = float64(l_v) + float64(fp32(T)) * G_v
    d_c = s_c - s_y                                                      `signed_gaps` (float64)
SGLang's seeded sampler (sglang-seeded*, sglang_seeded.py) scores x_v = float64(log p_v) + G_v with
its own filters and its own log p, so its gaps are taken in that score space and put on the same
scale: d_c = float64(fp32(T)) * (x_c - x_y)                              `_claim_gaps`
Every score of this module is built from d, one function per formula:
    Token-DiFR margin (DiFR eq. 1)                                       `token_difr_margin`
        delta = max_{c in S} d_c = max_{v in S}(l_v + T G_v) - (l_y + T G_y)   (>= 0)
        0 when y is the replayed token, +inf when y is not in S; greedy (T = 0, S = every
        token, no noise): max l - l_y
    competitor gaps                                                      `competitor_gaps`
        the k largest d_c over c in S_c, c != y (descending, -inf padded), a row of +inf when y
        is not in S_y. S_c = S_y = S; with a top-p slack tau (the one discontinuity of the
        sampler, where honest rounding moves a token in or out of S) S_c = S at top_p - tau and
        S_y = S at top_p + tau. k = 1: the signed top-competitor gap (> 0 the margin of a token
        the replay does not reproduce, < 0 minus the runner-up gap of one it does).
    temperature variants: the same with r * T in place of T (filters at r * T; same logits,
        same noise): the evidence for a temperature misconfiguration.

Entry points (pure functions of logits, claimed ids, SamplingParams and the noise the claim's seed
and positions regenerate):
    postgumbel_margin(logits_TV, claimed_T, params, start)   margin, replay, kept of one claim
    postgumbel_gaps(logits_TV, claimed_T, params, start, k)  competitor gaps of one claim
    score_claimed(logits, claimed, params, starts)           margin, replay, kept, log p_y of many
                                                             claims in one pass (the replay's hot path)
    block_gaps(logits, claimed, params, starts, factors, k, top_p_slack)
                                                             [N, F, k] competitor gaps at every
                                                             temperature factor from one top-k block
    block_gaps_loop(...)                                     its reference: postgumbel_gaps per
                                                             claim and factor (full-vocabulary filter)
    probs_margin(probs_V, claimed, noise)                    margin of one Gumbel-max draw from a
                                                             probability vector (speculative tokens:
                                                             logits log p, T = 1)
postgumbel_margin / postgumbel_gaps filter the full vocabulary and are the references the batched
functions are tested against (tests/sampling/test_gap.py, tests/audit/test_variants.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from verinfer.sampling.filters import filter_mask_and_logits
from verinfer.sampling.noise import HashTape, NoiseKindError, get_backend
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.sampler import (_candidates, _filtered, _gumbel_replay, _param_rows, _replay, _tape,
                                       _tape_gumbel, _temperature32, _view, replay_tokens, sample_probs)

HASH_BACKENDS = ("vllm-cpu", "keyed", "speculative-keyed")  # one 64-bit key per step: tapes of many claims stack row-wise
BLOCK_SLACK = 16                       # extra columns of the top-k block past the largest top_k


# --- the formulas -----------------------------------------------------------------------------
def signed_gaps(logits_NK: torch.Tensor, gumbel_NK: torch.Tensor | None, logit_y_N: torch.Tensor,
                gumbel_y_N: torch.Tensor | None, temperature_N: torch.Tensor | float) -> torch.Tensor:
    """d_NK float64 = (l_c + T*G_c) - (l_y + T*G_y): the post-Gumbel gap of each candidate c over
    the claimed token y on the raw-logit scale. gumbel None: greedy, d = l_c - l_y.
    temperature_N: the fp32 temperature of each row as float64 (or one Python float)."""
    l_NK, l_y_N = logits_NK.to(torch.float64), logit_y_N.to(torch.float64)
    if gumbel_NK is None:
        return l_NK - l_y_N[:, None]
    t = temperature_N
    t_N1 = t[:, None] if isinstance(t, torch.Tensor) else t
    return (l_NK + t_N1 * gumbel_NK) - (l_y_N + t * gumbel_y_N)[:, None]


def token_difr_margin(gaps_NK: torch.Tensor, valid_NK: torch.Tensor, replayed_N: torch.Tensor,
                      kept_N: torch.Tensor) -> torch.Tensor:
    """margin_N float64 = max_{c valid} d_c clamped at 0; 0 where the claimed token is the replayed
    one (replayed_N), +inf where it was filtered out (~kept_N). valid_NK: the candidates in S."""
    m_N = gaps_NK.masked_fill(~valid_NK, float("-inf")).amax(-1).clamp_min(0.0)
    return m_N.masked_fill(replayed_N, 0.0).masked_fill(~kept_N, math.inf)


def competitor_gaps(gaps_NK: torch.Tensor, competitor_NK: torch.Tensor, kept_N: torch.Tensor, k: int) -> torch.Tensor:
    """gaps_Nk float64: the k largest d_c over the competitors (c in S_c, c != y; competitor_NK),
    descending, -inf padded; a row of +inf where the claimed token is not kept (~kept_N)."""
    comp_NK = gaps_NK.masked_fill(~competitor_NK, float("-inf"))
    out_Nk = torch.full((comp_NK.shape[0], k), float("-inf"), dtype=torch.float64, device=comp_NK.device)
    kk = min(k, comp_NK.shape[1])
    out_Nk[:, :kk] = comp_NK.topk(kk, dim=-1).values if kk > 1 else comp_NK.amax(-1, keepdim=True)
    return out_Nk.masked_fill(~kept_N[:, None], math.inf)


def _claim_gaps(logits_TV: torch.Tensor, scaled_TV: torch.Tensor, ids_TK: torch.Tensor, g_TJ: torch.Tensor,
                claimed_T: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """d_TK float64 of the candidates ids_TK over the claimed tokens (g_TJ: their G, then the claimed
    one's): `signed_gaps` on the raw logits, or for SGLang's sampler in its own scores (scaled_TV,
    `sampler._view`) times fp32(T) (module docstring)."""
    y_T1, t32 = claimed_T[:, None], _temperature32(params)
    if get_backend(params.noise).pipeline == "sglang":
        return t32 * signed_gaps(scaled_TV.gather(1, ids_TK), g_TJ[:, :-1], scaled_TV.gather(1, y_T1)[:, 0],
                                 g_TJ[:, -1], 1.0)
    return signed_gaps(logits_TV.gather(1, ids_TK), g_TJ[:, :-1], logits_TV.gather(1, y_T1)[:, 0], g_TJ[:, -1], t32)


# --- one claim, full vocabulary (the references) --------------------------------------------------
def _check_claimed(claimed_T: torch.Tensor, T: int, V: int, device) -> torch.Tensor:
    claimed_T = claimed_T.to(device=device, dtype=torch.int64)
    if claimed_T.shape != (T,):
        raise ValueError(f"claimed_T must have shape [{T}], got {tuple(claimed_T.shape)}")
    if T and (int(claimed_T.min()) < 0 or int(claimed_T.max()) >= V):
        raise IndexError(f"claimed token ids must lie in [0, {V})")
    return claimed_T


def _refuse_unseeded(params_list: list[SamplingParams], what: str) -> None:
    """A ValueError when a claim is unseeded: no seed regenerates its sampler's noise."""
    i = next((i for i, p in enumerate(params_list) if p.unseeded), None)
    if i is not None:
        raise ValueError(f"{what}: claim #{i} is unseeded (`\"seed\": null`): no seed regenerates its sampler's "
                         "noise, so it has no post-Gumbel margin or gap; score it from the distribution with "
                         "sampling.pit.unseeded_rows (audit.replay.scores_table does)")


def postgumbel_margin(logits_TV: torch.Tensor, claimed_T: torch.Tensor, params: SamplingParams,
                      start_position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-DiFR margin per step: (margin_T float64, replay_T long, kept_T bool) (`token_difr_margin`
    on the full vocabulary). Gumbel backends only (vllm-cpu, keyed, vllm-v1-exponential, vllm-mrv2-*,
    sglang-seeded*)."""
    _refuse_unseeded([params], "postgumbel_margin")
    T, V = logits_TV.shape
    dev = logits_TV.device
    claimed_T = _check_claimed(claimed_T, T, V, dev)
    if params.greedy:
        replay_T = logits_TV.argmax(dim=-1)
        d_TV = signed_gaps(logits_TV, None, logits_TV.gather(1, claimed_T[:, None])[:, 0], None, 0.0)
        kept_T = torch.ones(T, dtype=torch.bool, device=dev)
        return token_difr_margin(d_TV, kept_T[:, None].expand(T, V), claimed_T == replay_T, kept_T), replay_T, kept_T
    if get_backend(params.noise).kind != "gumbel":
        raise NoiseKindError(f"postgumbel_margin needs per-token Gumbel noise; backend {params.noise!r} "
                             "draws one uniform per step -- use inverse_cdf_interval instead")
    if T == 0:
        e = torch.empty(0, device=dev)
        return e.double(), e.long(), e.bool()
    keep_TV, scaled_TV, cols_TV = _view(logits_TV, params)
    tape = _tape(params, T, V, start_position, cols_TV)
    ids_TK, valid_TK = _candidates(scaled_TV, keep_TV)
    # fast G for the candidates plus the claimed token, one noise call; exact G decides the replay
    ids_TJ = torch.cat([ids_TK, claimed_T[:, None]], dim=1)
    g_TJ = _tape_gumbel(tape, ids_TJ)
    replay_T = _replay(logits_TV, params, start_position, keep_TV, scaled_TV, tape, (ids_TK, valid_TK), g_TJ[:, :-1])
    kept_T = keep_TV.gather(1, claimed_T[:, None])[:, 0]
    d_TK = _claim_gaps(logits_TV, scaled_TV, ids_TK, g_TJ, claimed_T, params)
    return token_difr_margin(d_TK, valid_TK, claimed_T == replay_T, kept_T), replay_T, kept_T


def postgumbel_gaps(logits_TV: torch.Tensor, claimed_T: torch.Tensor, params: SamplingParams,
                    start_position: int, k: int = 16) -> torch.Tensor:
    """gaps_Tk float64 (CPU): `competitor_gaps` of each step on the full vocabulary. Where y is not
    the replayed token, gaps[:, 0] is the Token-DiFR margin; Monte-Carlo DiFR perturbs these gaps
    (the detection lab's mc_difr, benchmarks/difr_variants.py). Gumbel backends only (vllm-cpu, keyed, vllm-v1-exponential)."""
    _refuse_unseeded([params], "postgumbel_gaps")
    if params.greedy or get_backend(params.noise).kind != "gumbel":
        raise NoiseKindError(f"postgumbel_gaps needs per-token Gumbel noise and temperature > 0; "
                             f"got noise={params.noise!r}, temperature={params.temperature}")
    T, V = logits_TV.shape
    claimed_T = claimed_T.to(device=logits_TV.device, dtype=torch.int64)
    if claimed_T.shape != (T,):
        raise ValueError(f"claimed_T must have shape [{T}], got {tuple(claimed_T.shape)}")
    if T == 0:
        return torch.full((0, k), float("-inf"), dtype=torch.float64)
    keep_TV, scaled_TV, cols_TV = _view(logits_TV, params)
    ids_TK, valid_TK = _candidates(scaled_TV, keep_TV)
    ids_TJ = torch.cat([ids_TK, claimed_T[:, None]], dim=1)
    g_TJ = _tape_gumbel(_tape(params, T, V, start_position, cols_TV), ids_TJ)
    d_TK = _claim_gaps(logits_TV, scaled_TV, ids_TK, g_TJ, claimed_T, params)
    kept_T = keep_TV.gather(1, claimed_T[:, None])[:, 0]
    return competitor_gaps(d_TK, valid_TK & (ids_TK != claimed_T[:, None]), kept_T, k).cpu()


def probs_margin(probs_V: torch.Tensor, claimed: int, noise) -> tuple[float, int]:
    """(margin, replay) of a Gumbel-max draw from a probability vector (`sampler.sample_probs`:
    speculative decoding's draft, correction and bonus tokens): `token_difr_margin` with logits
    log p on the support (p > 0) and T = 1; +inf when p_claimed == 0."""
    ids_K = (probs_V > 0).nonzero()[:, 0]
    replay = sample_probs(probs_V, noise)
    if not bool(probs_V[claimed] > 0):
        return math.inf, replay
    y_1 = torch.tensor([claimed], device=probs_V.device)
    logp_1K = probs_V[ids_K].to(torch.float64).log()[None]
    d_1K = signed_gaps(logp_1K, noise.gumbel(ids_K, exact=False)[None], probs_V[y_1].to(torch.float64).log(),
                       noise.gumbel(y_1, exact=False), 1.0)
    every_1K = torch.ones_like(d_1K, dtype=torch.bool)
    return float(token_difr_margin(d_1K, every_1K, y_1 == replay, every_1K[:, 0])[0]), replay


# --- the top-k block: filters on K << V columns, exact ----------------------------------------------
def topk_block(l_NV: torch.Tensor, rows_p: list[SamplingParams], slack: int = BLOCK_SLACK):
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
    top_p, min_p) applied to a top-k block (`topk_block`), keeping exactly what they keep on the
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


# --- many claims at once ----------------------------------------------------------------------------
class _RowsTape(HashTape):
    """Hash-backend tapes of several requests stacked row-wise: row n has its own step key."""

    def __init__(self, keys_N: torch.Tensor, vocab_size: int):
        self.backend, self.seed, self.n_steps = None, 0, int(keys_N.shape[0])
        self.vocab_size, self.start_position, self.keys_T = vocab_size, 0, keys_N


class _GatheredTape:
    """A tape seen through per-row candidate lists: local column j of row n is token ids_NK[n, j]."""

    def __init__(self, tape, ids_NK):
        self.tape, self.ids_NK = tape, ids_NK
        self.score_dtype = tape.score_dtype

    def gumbel_pairs(self, t_N, j_N, exact=True):
        return self.tape.gumbel_pairs(t_N, self.ids_NK[t_N, j_N], exact)


def _offsets(counts: list[int]) -> list[int]:
    offs = [0]
    for n in counts:
        offs.append(offs[-1] + n)
    return offs


def score_claimed(logits_list: list[torch.Tensor], claimed_list: list[torch.Tensor],
                  params_list: list[SamplingParams], starts: list[int]):
    """Token-DiFR margin, replayed token, kept flag and log p(claimed) under the filtered sampling
    distribution, for many claims at once: (margin_N, replay_N, kept_N, logp_N), rows of all
    claims concatenated in order. Equal to postgumbel_margin per claim; claims with hash noise
    (vllm-cpu, keyed) share one filter pass and one noise pass, others go one by one; inverse-cdf
    claims get margin 0 where the replay reproduces the claimed token, +inf elsewhere.
    Everything runs on the logits' device and the four results stay there ([N] each: only
    they need cross to the host, never a [N, V] tensor). Unseeded claims are refused (no noise)."""
    _refuse_unseeded(params_list, "score_claimed")
    fast = [i for i, p in enumerate(params_list) if not p.greedy and get_backend(p.noise).name in HASH_BACKENDS]
    n_i = [int(l.shape[0]) for l in logits_list]
    offs = _offsets(n_i)
    N = offs[-1]
    dev = logits_list[0].device if logits_list else torch.device("cpu")
    margin_N = torch.empty(N, dtype=torch.float64, device=dev)
    replay_N = torch.empty(N, dtype=torch.int64, device=dev)
    kept_N = torch.empty(N, dtype=torch.bool, device=dev)
    logp_N = torch.empty(N, dtype=torch.float64, device=dev)
    fast_set = set(fast)
    for i in range(len(logits_list)):  # greedy / exponential / inverse-cdf claims: one by one
        if i in fast_set:
            continue
        p, l_TV, y_T = params_list[i], logits_list[i], claimed_list[i].to(device=dev, dtype=torch.int64)
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
        margin_N[s], replay_N[s], kept_N[s] = m, r, k
        logp_N[s] = lp_TV.gather(1, y_T[:, None])[:, 0]
    if not fast:
        return margin_N, replay_N, kept_N, logp_N
    l_NV = torch.cat([logits_list[i] for i in fast])
    y_N = torch.cat([claimed_list[i].to(torch.int64) for i in fast]).to(l_NV.device)
    rows_p = [params_list[i] for i in fast for _ in range(n_i[i])]
    V = l_NV.shape[1]
    keys_N = torch.cat([_tape(params_list[i], n_i[i], V, starts[i]).keys_T for i in fast])
    m_N, rep_N, kept, lp_N = _score_rows(l_NV, y_N, rows_p, _RowsTape(keys_N, V))
    if len(fast) == len(logits_list):  # the common case: every row, in order
        return m_N, rep_N, kept, lp_N
    idx = torch.cat([torch.arange(offs[i], offs[i + 1]) for i in fast]).to(dev)
    margin_N[idx], replay_N[idx], kept_N[idx], logp_N[idx] = m_N, rep_N, kept, lp_N
    return margin_N, replay_N, kept_N, logp_N


def _score_rows(l_NV, y_N, rows_p, tape):
    """Margin, replay, kept and log p(claimed) for rows with hash noise (see score_claimed)."""
    block = topk_block(l_NV, rows_p)
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
    d_NK = signed_gaps(base_NK, g_NJ[:, :-1], l_NV.gather(1, y_N[:, None])[:, 0], g_NJ[:, -1], temp_N)
    return token_difr_margin(d_NK, valid_NK, y_N == rep_N, kept), rep_N, kept, lp_N


def _gumbel_claims(params_list: list[SamplingParams], claimed_list: list[torch.Tensor]) -> list[bool]:
    """Which claims have a post-Gumbel gap: sampled (temperature > 0) with a seed (not unseeded) and a
    Gumbel backend, >= 1 token."""
    return [len(y) > 0 and not p.greedy and not p.unseeded and get_backend(p.noise).kind == "gumbel"
            for p, y in zip(params_list, claimed_list)]


def block_gaps(logits_list: list[torch.Tensor], claimed_list: list[torch.Tensor], params_list: list[SamplingParams],
               starts: list[int], factors, k: int = 1, top_p_slack: float = 0.0) -> torch.Tensor:
    """[N, F, k] float64 (CPU), rows of all claims concatenated: `competitor_gaps` of every token
    at each temperature factor r (the claim's logits and noise, filters and T at r times its
    temperature); NaN rows for claims without Gumbel noise (greedy, unseeded, inverse-cdf). With k = 1 the
    signed top-competitor gap: d > 0 the Token-DiFR margin of a token the replay at r T does not
    reproduce, d < 0 minus the runner-up gap of one it does, +inf if the claimed token is filtered
    out at r T.

    One top-(top_k + 16) block of logits (`topk_block`) and one Gumbel draw per claim serve every
    factor (top-k does not depend on the temperature; top-p is applied on the block, rows within
    rounding of the top-p cut redone on the full row, `filter_block`); claims whose block is not
    safe (min-p, no top-k, ties past the block) fall back to `block_gaps_loop` (which ignores the
    slack).

    top_p_slack tau > 0: competitors count only if kept at top_p - tau, the claimed token counts as
    kept if kept at top_p + tau (module docstring)."""
    n_i = [len(y) for y in claimed_list]
    offs = _offsets(n_i)
    out = torch.full((offs[-1], len(factors), k), math.nan, dtype=torch.float64)
    rows = []   # (claim index, block) of the claims done on the block, batched below
    for i, gumbel in enumerate(_gumbel_claims(params_list, claimed_list)):
        if not gumbel:
            continue
        p = params_list[i]
        block = (topk_block(logits_list[i], [p] * n_i[i])
                 if p.top_k > 0 and p.min_p == 0 and get_backend(p.noise).pipeline == "verinfer" else None)
        if block is None or (rows and block[0].shape[1] != rows[0][1][0].shape[1]):
            out[offs[i] : offs[i + 1]] = block_gaps_loop(logits_list[i : i + 1], claimed_list[i : i + 1],
                                                         params_list[i : i + 1], starts[i : i + 1], factors, k)
        else:
            rows.append((i, block))
    if not rows:
        return out
    vals_NK = torch.cat([b[0] for _, b in rows])
    ids_NK = torch.cat([b[1] for _, b in rows])
    l_NV = torch.cat([logits_list[i] for i, _ in rows])
    dev = l_NV.device
    y_N = torch.cat([claimed_list[i].to(torch.int64) for i, _ in rows]).to(dev)
    g_NJ = torch.cat([_tape_gumbel(_tape(params_list[i], n_i[i], logits_list[i].shape[1], starts[i]),
                                   torch.cat([b[1], claimed_list[i].to(device=b[1].device, dtype=torch.int64)[:, None]], 1))
                      for i, b in rows])
    l_y_N = l_NV.gather(1, y_N[:, None])[:, 0]
    is_y = ids_NK == y_N[:, None]
    idx = torch.cat([torch.arange(offs[i], offs[i + 1]) for i, _ in rows])

    def per_row(attr, dt):
        return torch.tensor([getattr(params_list[i], attr) for i, _ in rows for _ in range(n_i[i])], dtype=dt, device=dev)

    temp64, top_k_r, top_p64, min_p_r = (per_row("temperature", torch.float64), per_row("top_k", torch.int64),
                                         per_row("top_p", torch.float64), per_row("min_p", torch.float32))

    def keep_of(temp32, top_p32):
        return filter_block(vals_NK, ids_NK, l_NV, (temp32, top_k_r, top_p32, min_p_r))[0]

    for j, f in enumerate(factors):
        temp32 = (temp64 * float(f)).to(torch.float32)   # = the fp32 cast of each claim's r * T, as _param_rows
        keep_NK = keep_of(temp32, top_p64.to(torch.float32))
        y_keep_NK = keep_NK
        if top_p_slack > 0:
            strict = torch.where(top_p64 < 1, (top_p64 - top_p_slack).clamp_min(1e-6), top_p64)
            keep_NK = keep_of(temp32, strict.to(torch.float32))
            y_keep_NK = keep_of(temp32, (top_p64 + top_p_slack).clamp_max(1.0).to(torch.float32))
        d_NK = signed_gaps(vals_NK, g_NJ[:, :-1], l_y_N, g_NJ[:, -1], temp32.to(torch.float64))
        out[idx, j] = competitor_gaps(d_NK, keep_NK & ~is_y, (y_keep_NK & is_y).any(-1), k).cpu()
    return out


def block_gaps_loop(logits_list: list[torch.Tensor], claimed_list: list[torch.Tensor],
                    params_list: list[SamplingParams], starts: list[int], factors, k: int = 1) -> torch.Tensor:
    """Reference for `block_gaps` (no top-p slack): `postgumbel_gaps` (full-vocabulary filter) per
    claim and factor, [N, F, k] float64 (CPU), NaN rows for claims without Gumbel noise (greedy, unseeded,
    inverse-cdf)."""
    n_i = [len(y) for y in claimed_list]
    offs = _offsets(n_i)
    out = torch.full((offs[-1], len(factors), k), math.nan, dtype=torch.float64)
    for i, gumbel in enumerate(_gumbel_claims(params_list, claimed_list)):
        if gumbel:
            p = params_list[i]
            for j, f in enumerate(factors):
                q = replace(p, temperature=p.temperature * float(f))
                out[offs[i] : offs[i + 1], j] = postgumbel_gaps(logits_list[i], claimed_list[i], q, starts[i], k)
    return out
