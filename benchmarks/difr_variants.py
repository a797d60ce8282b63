"""The DiFR score variants the detection lab studies, as pure functions of replay outputs (DiFR
appendix A, B, E). Research code: the product scores live in `verinfer.scores` and `audit.replay`,
the perturbation model the `best` detector uses in `verinfer.detect.perturbation`.

Shape key: N = tokens, K = competitors kept per token.

Inputs come from one replay of the claims with the verifier (`features_table`):
    margin, exact_match, cross_entropy   as in `replay.scores_table`
    gap_0 .. gap_{K-1}                   post-Gumbel gaps of the K strongest competitors
                                         (`sampling.gap.postgumbel_gaps`; Gumbel backends)
    ipt_lo, ipt_hi, ipt_u                the claimed token's CDF interval and the step's uniform
                                         (`sampling.sampler.inverse_cdf_interval`; inverse-cdf)
    logit_gap                            raw logit of the replayed minus the claimed token

Every function returns a per-token divergence (higher = more divergent, +inf allowed); batch
statistics clip / pool them (`metrics`).

    ipt_difr(lo, hi, u, sigma)              -log(P[u + sigma Z in [lo, hi)] + eps)   (appendix B)
    mc_difr(gaps, sigma, n_trials, rng)     -log((#wins + eps) / (n_trials + eps)): the claimed
                                            token wins a trial when the Gaussian-perturbed logits
                                            (std sigma per logit) still rank it first (appendix B.1)

Signed gaps (the input of the perturbation likelihood, `verinfer.detect.perturbation`):

    temperature_gaps(claims, replays, factors)  signed top-competitor gap d at temperature r * T
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa
import torch
from scipy.special import ndtr
from scipy.stats import norm

from verinfer.audit.replay import gap_args, scores_table
from verinfer.detect.clipping import winsorize
from verinfer.scores import gap_column, temperature_column
from verinfer.sampling import gap
from verinfer.sampling.sampler import inverse_cdf_interval

MC_EPS = 1.0
IPT_EPS = 1e-12


def ipt_distance(lo, hi, u) -> np.ndarray:
    """How far the shared uniform u lies outside the claimed interval [lo, hi) (0 inside)."""
    lo, hi, u = (np.asarray(x, dtype=np.float64) for x in (lo, hi, u))
    return np.maximum(np.maximum(lo - u, u - hi), 0.0)


def fit_ipt_sigma(lo, hi, u, default: float = 1e-6) -> float:
    """Kernel width for `ipt_difr` from honest tokens: the robust half-normal scale of the nonzero
    distances of u outside the claimed interval (median / Phi^-1(3/4)), `default` if none."""
    d = ipt_distance(lo, hi, u)
    d = d[np.isfinite(d) & (d > 0)]
    return float(np.median(d) / norm.ppf(0.75)) if d.size else float(default)


def ipt_difr(lo, hi, u, sigma: float, eps: float = IPT_EPS) -> np.ndarray:
    """-log(Phi((hi - u)/sigma) - Phi((lo - u)/sigma) + eps): minus the log of the mass of a
    Gaussian kernel N(u, sigma^2) inside the claimed interval. ~0 when u is well inside,
    -log(eps) when the interval is empty (claimed token filtered out) or far from u."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    lo, hi, u = (np.asarray(x, dtype=np.float64) for x in (lo, hi, u))
    mass = np.clip(ndtr((hi - u) / sigma) - ndtr((lo - u) / sigma), 0.0, 1.0)
    return -np.log(mass + eps)


# --- Monte-Carlo DiFR -----------------------------------------------------------------------------
def mc_difr(gaps_NK, sigma: float, n_trials: int = 100, rng: np.random.Generator | None = None,
            eps: float = MC_EPS, chunk: int = 4096) -> np.ndarray:
    """Monte-Carlo DiFR from the post-Gumbel gaps of the K strongest competitors (gap_k =
    s_k - s_y, s = raw logit + T * Gumbel). Each trial adds independent N(0, sigma^2) to every
    logit; the claimed token wins iff max_k(gap_k + sigma (Z_k - Z_y)) < 0. Score =
    -log((wins + eps) / (n_trials + eps)); +inf gaps (claimed token filtered out) never win."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    g = np.asarray(gaps_NK, dtype=np.float64)
    if g.ndim != 2:
        raise ValueError(f"gaps_NK must be 2-D [tokens, competitors], got shape {g.shape}")
    rng = rng if rng is not None else np.random.default_rng(0)
    N, K = g.shape
    wins = np.empty(N)
    for s in range(0, N, chunk):
        gs = g[s : s + chunk]
        z = rng.standard_normal((gs.shape[0], n_trials, K + 1))
        pert = gs[:, None, :] + sigma * (z[:, :, 1:] - z[:, :, :1])   # -inf stays -inf, +inf stays +inf
        wins[s : s + chunk] = (pert.max(axis=-1) < 0).sum(axis=1) if K else n_trials
    return -np.log((wins + eps) / (n_trials + eps))


def features_table(claims, replays, k: int = 16, temperature_factors=(), top_p_slacks=()) -> pa.Table:
    """`replay.scores_table` plus the gap_* columns (Gumbel claims; NaN otherwise), the
    ipt_lo / ipt_hi / ipt_u columns (inverse-cdf claims; NaN otherwise) and, per factor r in
    `temperature_factors`, the column `gapT_{r}` = `temperature_gaps` (Gumbel claims; NaN otherwise);
    per tau in `top_p_slacks` the same signed gaps with that top-p slack (`gap_0_s{tau}`, `gapT_{r}_s{tau}`)."""
    base = scores_table(claims, replays)
    N = base.num_rows
    # raw-logit gap of the replayed over the claimed token (> 0: the claimed token had the lower logit,
    # as a too-high temperature produces; honest flips go either way)
    if N:
        l_NV = torch.cat([r.logits_TV for r in replays]).to(torch.float64)
        y_N = torch.tensor(base["token_id"].to_numpy(), dtype=torch.long)
        r_N = torch.tensor(base["replay_token_id"].to_numpy(), dtype=torch.long)
        logit_gap = (l_NV.gather(1, r_N[:, None]) - l_NV.gather(1, y_N[:, None]))[:, 0].numpy()
    else:
        logit_gap = np.zeros(0)
    bg = block_gaps(claims, replays, (1.0, *temperature_factors), k)   # NaN rows for non-Gumbel claims
    ipt = np.full((N, 3), np.nan)
    off = 0
    for c, r in zip(claims, replays):
        n = len(c.output_token_ids)
        p = c.sampling
        if not p.greedy and p.noise == "inverse-cdf":
            y = torch.tensor(c.output_token_ids, dtype=torch.long)
            lo, hi, u = inverse_cdf_interval(r.logits_TV, y, p, len(c.prompt_token_ids))
            ipt[off : off + n] = torch.stack([lo, hi, u], 1).cpu().numpy()
        off += n
    cols = {f"gap_{j}": bg[:, 0, j] for j in range(k)}
    cols.update(ipt_lo=ipt[:, 0], ipt_hi=ipt[:, 1], ipt_u=ipt[:, 2], logit_gap=logit_gap)
    cols.update({temperature_column(r): bg[:, j + 1, 0] for j, r in enumerate(temperature_factors)})
    for tau in top_p_slacks:
        sg = block_gaps(claims, replays, (1.0, *temperature_factors), 1, top_p_slack=tau)[:, :, 0]
        cols[gap_column(tau)] = sg[:, 0]
        cols.update({temperature_column(r, tau): sg[:, j + 1] for j, r in enumerate(temperature_factors)})
    for name, v in cols.items():
        base = base.append_column(name, pa.array(v, pa.float64()))
    return base


def gaps_of(table: pa.Table) -> np.ndarray:
    """The gap_* columns of a features table as an [N, K] float64 array."""
    names = sorted((c for c in table.column_names if c.startswith("gap_") and c[4:].isdigit()), key=lambda s: int(s[4:]))
    if not names:
        raise KeyError("no gap_* columns: build the table with variants.features_table")
    return np.stack([table[c].to_numpy() for c in names], axis=1)


# --- replay under alternative hypotheses ------------------------------------------------------------
def temperature_margin(claims, replays, temperature: float) -> np.ndarray:
    """Token-DiFR margins of the claims as if they had been sampled at `temperature` (same logits,
    same seeds): the evidence for a temperature misconfiguration. Raw-logit scale, +inf if filtered."""
    logits, claimed, params, starts = gap_args(claims, replays)
    m, _, _, _ = gap.score_claimed(logits, claimed, [replace(p, temperature=temperature) for p in params], starts)
    return m.numpy()


def alternative_evidence(margin, alt_margins, clip: float) -> np.ndarray:
    """Per-token evidence of a library of alternative configurations: the clipped honest margin
    plus, for each alternative A, how much better A's replay explains the claimed token,
    min(margin, clip) - min(margin_A, clip). For an honest claim the A terms are <= 0 (A's replay
    flips tokens the honest one reproduces); for a claim produced by A they are > 0; for a
    misconfiguration outside the library they are ~0 and the clipped margin remains."""
    base = winsorize(margin, clip)
    out = base.copy()
    for a in alt_margins:
        out += base - winsorize(a, clip)
    return out


def temperature_gaps(claims, replays, factors) -> np.ndarray:
    return block_gaps(claims, replays, factors, 1)[:, :, 0]


def block_gaps(claims, replays, factors, k: int = 1, top_p_slack: float = 0.0) -> np.ndarray:
    """[N, len(factors), k]: the k largest post-Gumbel gaps s_c - s_y of kept competitors c != y
    (descending, -inf padded) at each temperature factor r (`sampling.gap.block_gaps`: the claim's
    logits and seed, r times its temperature); with k = 1 the signed top-competitor gap of
    `temperature_gaps`. NaN rows for claims without Gumbel noise (greedy, inverse-cdf).
    top_p_slack tau > 0: competitors count only if kept at top_p - tau, the claimed token counts as
    kept if kept at top_p + tau (claims off the top-k block path ignore the slack)."""
    return gap.block_gaps(*gap_args(claims, replays), factors, k, top_p_slack).numpy()
