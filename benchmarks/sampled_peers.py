"""Peers for audits of sampled, unseeded replies, as pure functions a benchmark calls on the same
vendors and request budgets as verinfer's unseeded mode: RUT, Model Equality Testing, and the DiFR
paper's mean cross-entropy. Each takes replies (token ids, or per-reply scores from a trusted
reference) and returns a p-value; small means "not the claimed model at the claimed settings".

    PYTHONPATH=.:src .venv/bin/python -m benchmarks.sampled_peers --prompts 60 --local 20 --seed 2
        # the three peers on the shipped testbed: an honest vendor, temperature 1.5, the draft model

Shape key: T = tokens of one reply, V = vocab, N = reply tokens of a replay batch.

1. RUT, the rank-based uniformity test (Zhu, Ye, Qiu, Zhu, Tan, Mannan, Michala, Popa, Neiswanger,
   "Auditing Black-Box LLM APIs with a Rank-Based Uniformity Test", arXiv 2506.06975, ICLR 2026;
   code github.com/xyzhu123/RUT). The authors' code could not be read here (no stored snapshot of
   the repository, no file of it in the code index), so this implements the paper's definitions,
   as its equations and settings are quoted by a published note of the paper (en.papernotes.org,
   ICLR 2026, "Auditing Black-Box LLM APIs with a Rank-Based Uniformity Test"), and cites no file
   or line of theirs:
     - one API reply per prompt; m local samples per prompt from the reference model at the same
       sampling parameters (paper: m = 100, 100 prompts, temperature 0.5, 30 tokens);
     - score f(y, x) = log-rank: the mean over the reply's tokens of log(rank), the rank of each
       token in the reference's next-token ordering, teacher-forced on prompt + reply (the paper
       picked it from log-likelihood, rank, log-rank, entropy and LRR by power);
     - randomized rank (randomized quantile residual, Dunn & Smyth 1996), the paper's
       r_i = (1/m) (#{j: s_i > s_ij} + U_i #{j: s_i = s_ij}),  U_i ~ Uniform[0, 1] independent;
     - Cramer-von Mises test of r_1..r_n against Uniform[0, 1] (omega^2 = 1/(12n) +
       sum_i ((2i-1)/(2n) - r_(i))^2), p-value Pr_H0(omega^2 >= observed): here
       `scipy.stats.cramervonmises(r, "uniform")`; reject at alpha = 0.05.
   Choices the paper's text does not fix, made here (say so wherever a number is reported): a
   token's rank is 1 + the number of vocabulary entries with a strictly larger raw logit (1 = the
   argmax, so log-rank >= 0; exact logit ties take the best rank, where DetectLLM-style code takes
   the position in an argsort); ranks come from the raw logits (temperature does not change them;
   top-k / top-p do not re-rank kept tokens); the score covers the reply's tokens only, every one
   including a final end token; U_i come from numpy's default_rng(seed).
   The paper's r_i is reproduced as written, dividing by m: without ties it takes the m + 1 values
   k/m, not a continuous uniform, and at small m the CvM test rejects a little more often than
   alpha (simulated: 6.5% at alpha 0.05 for m = 20, n = 60; 5.7% at the paper's m = n = 100;
   (k + U)/(m + 1) would be exact). Keep m large where the level matters.

2. Model Equality Testing (Gao, Liang, Guestrin, arXiv 2410.20247, ICLR 2025): its own package,
   `model-equality-testing` 0.0.2 (PyPI, github.com/i-gao/model-equality-testing, MIT), called as
   its README and demo.ipynb do: `CompletionSample(prompts, completions, m)` for each side (prompt
   indices in [0, m), completions a 2-D array padded with -1 to a shared length L:
   `utils.stack_with_padding` + `utils.pad_to_length`, or `utils.tokenize_unicode` for text), then
   `algorithm.run_two_sample_test(api, local, pvalue_type="permutation_pvalue",
   stat_type="mmd_hamming", b=...)`: the MMD with the Hamming kernel K(x, y) = #{l: x_l = y_l}
   between completions of the same prompt (0 across prompts), normalized to a unit diagonal, and
   a permutation p-value = the fraction of b label permutations of the pooled rows (prompt index
   and completion together) whose MMD is >= the observed one (no +1: it can be 0). Its defaults
   kept: b = 1000 (the package's; the demo uses 100), alpha = 0.05 (README, demo), about 10
   samples per prompt per side (the paper's budget: "an average of 10 samples per prompt", each
   request's prompt drawn uniformly, as the demo's samples are; the permutation null, which
   shuffles prompt indices with completions, is exact for such draws, not for a fixed number per
   prompt: `testbed_run` draws them so). Adaptations, nothing of the package
   re-implemented: the permutations draw from torch's global generator (`torch.randperm`); the
   call runs under `torch.random.fork_rng()` seeded with `seed`, so a p-value is reproducible and
   the caller's torch stream untouched. L defaults to the longest completion, not the paper's 1000
   characters: padding matches padding, so every same-prompt kernel entry grows by the same L' - L
   and the unit-diagonal normalization divides all by L', which scales the MMD of every permutation
   alike and leaves the p-value unchanged while nothing is truncated (a shorter L truncates, as the
   package's dataset loader does). Completions are token ids (the package's `load_in_unicode=False`
   path) or strings (its default: unicode code points).

3. Mean cross-entropy, the DiFR paper's baseline without seeds (Karvonen et al., DiFR,
   /work/shared/papers/000_ad8e74b188be9187.txt, "Cross-entropy Baseline"): per token -log p_y, the
   claimed token under the verifier's distribution (here verinfer's definition of its
   `cross_entropy` score column: the filtered sampling distribution at the claimed temperature,
   top-k, top-p, min-p, +inf when the token is filtered out), mean-pooled over a batch of tokens and
   flagged when high. The paper thresholds the batch mean at an FPR of honest batches; here the
   honest batches are the local samples the other peers use (batch j = local sample j of every
   prompt), so p = (1 + #{j: mean_j >= mean_api}) / (m + 1), exact under the null (per prompt the
   API reply and the local samples are exchangeable). verinfer's own calibrated detectors on this
   column live in `verinfer.detect`; this is the plain statistic only.

Vendors on the testbed (`sample_replies`): plain ancestral sampling from softmax(filtered logits /
T) with a torch.Generator, the way an unseeded API samples; no seed reaches the auditor.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

ALPHA = 0.05            # RUT's and Model Equality Testing's significance level
MET_PERMUTATIONS = 1000  # model_equality_testing.algorithm.run_two_sample_test's default b
MET_PAD = -1            # the package's padding id (utils.tokenize_unicode, pad_to_length)


# --- RUT --------------------------------------------------------------------------------------------------------

def log_rank(logits_TV: torch.Tensor, tokens_T: Sequence[int] | torch.Tensor) -> float:
    """RUT's score of one reply: mean over its tokens of log(rank), rank = 1 + #{v: l_v > l_y}
    in row t of the teacher-forced logits (the distribution token t was drawn from)."""
    y_T = torch.as_tensor(tokens_T, dtype=torch.long, device=logits_TV.device)
    if logits_TV.dim() != 2 or logits_TV.shape[0] != y_T.numel():
        raise ValueError(f"logits_TV {tuple(logits_TV.shape)} must be [T, V] with T = {y_T.numel()} reply tokens")
    if y_T.numel() == 0:
        raise ValueError("an empty reply has no log-rank")
    return float(_log_ranks_N(logits_TV, y_T).mean())


def _log_ranks_N(logits_NV: torch.Tensor, y_N: torch.Tensor) -> torch.Tensor:
    l_NV = logits_NV.float()
    rank_N = 1 + (l_NV > l_NV.gather(1, y_N[:, None])).sum(-1)
    return torch.log(rank_N.double())


def rut_statistic(api_stat: float, local_stats: Sequence[float], u: float) -> float:
    """The randomized rank of one API reply's score among its prompt's m local scores (paper):
    (#{local < api} + u * #{local == api}) / m, u ~ Uniform[0, 1]."""
    s = np.asarray(local_stats, dtype=np.float64)
    if s.ndim != 1 or s.size == 0:
        raise ValueError("local_stats: one score per local sample (m >= 1) expected")
    if not 0.0 <= u <= 1.0:
        raise ValueError(f"u must be in [0, 1], got {u}")
    return float((np.sum(s < api_stat) + u * np.sum(s == api_stat)) / s.size)


def rut_ranks(api_stats: Sequence[float], local_stats_per_prompt: Sequence[Sequence[float]], seed: int = 0) -> np.ndarray:
    """Every prompt's randomized rank, U_i from numpy's default_rng(seed)."""
    api = np.asarray(api_stats, dtype=np.float64)
    if api.ndim != 1 or api.size != len(local_stats_per_prompt):
        raise ValueError(f"{api.size} API scores for {len(local_stats_per_prompt)} prompts: one API reply per prompt")
    u = np.random.default_rng(seed).uniform(size=api.size)
    return np.array([rut_statistic(a, s, ui) for a, s, ui in zip(api, local_stats_per_prompt, u)])


def rut_test(api_stats: Sequence[float], local_stats_per_prompt: Sequence[Sequence[float]], seed: int = 0) -> float:
    """RUT's p-value: Cramer-von Mises of the randomized ranks against Uniform[0, 1]."""
    from scipy.stats import cramervonmises

    return float(cramervonmises(rut_ranks(api_stats, local_stats_per_prompt, seed), "uniform").pvalue)


# --- Model Equality Testing (its package) -----------------------------------------------------------------------

def _completion_array(completions: Sequence, L: int) -> np.ndarray:
    from model_equality_testing.utils import pad_to_length, stack_with_padding, tokenize_unicode

    if all(isinstance(c, str) for c in completions):
        arr = tokenize_unicode(list(completions))
    elif any(isinstance(c, str) for c in completions):
        raise ValueError("completions mix strings and token ids: give one kind")
    else:
        arr = stack_with_padding([torch.as_tensor(list(c) or [MET_PAD], dtype=torch.long) for c in completions],
                                 padding_token=MET_PAD)[0].numpy()
    return pad_to_length(arr[:, :L], L=L, pad_token_id=MET_PAD)


def _length(c) -> int:
    return len(c)


def met_sample(samples: Sequence[tuple[int, Sequence]], n_prompts: int, L: int):
    """The package's CompletionSample of (prompt index, completion) pairs, completions padded /
    truncated to L."""
    from model_equality_testing.distribution import CompletionSample

    if not samples:
        raise ValueError("no samples")
    prompts = np.array([int(p) for p, _ in samples])
    if prompts.min() < 0 or prompts.max() >= n_prompts:
        raise ValueError(f"prompt indices must be in [0, {n_prompts})")
    return CompletionSample(prompts=prompts, completions=_completion_array([c for _, c in samples], L), m=n_prompts)


def met_test(api_samples: Sequence[tuple[int, Sequence]], local_samples: Sequence[tuple[int, Sequence]], *,
             n_prompts: int | None = None, L: int | None = None, b: int = MET_PERMUTATIONS, seed: int = 0,
             stat_type: str = "mmd_hamming") -> float:
    """Model Equality Testing's p-value, by its package: run_two_sample_test(api, local,
    pvalue_type="permutation_pvalue", stat_type="mmd_hamming", b). Samples are (prompt index,
    completion) pairs, a completion token ids or a string; L: the longest completion by default."""
    from model_equality_testing.algorithm import run_two_sample_test

    pairs = list(api_samples) + list(local_samples)
    n_prompts = n_prompts if n_prompts is not None else 1 + max(int(p) for p, _ in pairs)
    L = L if L is not None else max(1, max(_length(c) for _, c in pairs))
    api, local = met_sample(api_samples, n_prompts, L), met_sample(local_samples, n_prompts, L)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pvalue, _ = run_two_sample_test(api, local, pvalue_type="permutation_pvalue", stat_type=stat_type, b=b)
    return float(pvalue)


# --- mean cross-entropy (DiFR's baseline) ------------------------------------------------------------------------

def token_cross_entropies(logits_TV: torch.Tensor, tokens_T, *, temperature: float, top_k: int = -1,
                          top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Per token -log p_y under the filtered sampling distribution (verinfer's `cross_entropy`
    score column: +inf where the filters drop y)."""
    y_T = torch.as_tensor(tokens_T, dtype=torch.long, device=logits_TV.device)
    return _cross_entropies_N(logits_TV, y_T, temperature, top_k, top_p, min_p).cpu().numpy()


def _cross_entropies_N(logits_NV, y_N, temperature, top_k, top_p, min_p) -> torch.Tensor:
    from verinfer.sampling.filters import filter_logits

    N = logits_NV.shape[0]
    full = lambda v, dt: torch.full((N,), v, dtype=dt, device=logits_NV.device)  # noqa: E731
    x_NV = filter_logits(logits_NV, full(temperature, torch.float32), full(top_k, torch.int64),
                         full(top_p, torch.float32), full(min_p, torch.float32)).double()
    return -(x_NV.gather(1, y_N[:, None])[:, 0] - torch.logsumexp(x_NV, -1))


def mean_cross_entropy(ce_per_reply: Sequence[Sequence[float]]) -> float:
    """DiFR's pooled statistic: the mean over every token of a batch of replies."""
    ce = np.concatenate([np.asarray(c, dtype=np.float64) for c in ce_per_reply]) if ce_per_reply else np.zeros(0)
    if ce.size == 0:
        raise ValueError("no tokens to pool")
    return float(ce.mean())


def mean_ce_test(api_ce: Sequence[Sequence[float]], local_ce_per_prompt: Sequence[Sequence[Sequence[float]]]) -> float:
    """p-value of the API batch's mean cross-entropy (one reply per prompt) against the honest
    batches j = (local sample j of every prompt): (1 + #{j: mean_j >= mean_api}) / (m + 1)."""
    if len(api_ce) != len(local_ce_per_prompt):
        raise ValueError(f"{len(api_ce)} API replies for {len(local_ce_per_prompt)} prompts: one per prompt")
    m = min(len(s) for s in local_ce_per_prompt)
    if m < 1:
        raise ValueError("every prompt needs local samples")
    api = mean_cross_entropy(api_ce)
    honest = np.array([mean_cross_entropy([s[j] for s in local_ce_per_prompt]) for j in range(m)])
    return float((1 + np.sum(honest >= api)) / (m + 1))


# --- per-reply scores from a trusted reference, teacher-forced ---------------------------------------------------

def reply_scores(engine, prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]], *,
                 temperature: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0,
                 batch_tokens: int = 8192) -> tuple[np.ndarray, list[np.ndarray]]:
    """(log-rank per reply, per-token cross-entropies per reply) under `engine`'s model,
    teacher-forced on prompt + reply (verinfer's `Engine.replay_batches`: row t of a reply's
    logits is the distribution its token t was drawn from). Empty replies are refused."""
    if len(prompts) != len(replies):
        raise ValueError(f"{len(prompts)} prompts for {len(replies)} replies")
    pairs = [(list(p), list(r)) for p, r in zip(prompts, replies)]
    lr = np.full(len(pairs), np.nan)
    ce: list[np.ndarray | None] = [None] * len(pairs)
    for group, logits_NV, _ in engine.replay_batches(pairs, batch_tokens):
        y_N = torch.cat([torch.as_tensor(pairs[i][1], dtype=torch.long) for i in group]).to(logits_NV.device)
        lrank_N = _log_ranks_N(logits_NV, y_N).cpu().numpy()
        ce_N = _cross_entropies_N(logits_NV, y_N, temperature, top_k, top_p, min_p).cpu().numpy()
        o = 0
        for i in group:
            n = len(pairs[i][1])
            lr[i], ce[i] = lrank_N[o : o + n].mean(), ce_N[o : o + n]
            o += n
    return lr, ce  # type: ignore[return-value]


# --- vendors: unseeded ancestral sampling on verinfer's engine ---------------------------------------------------

@torch.no_grad()
def sample_replies(engine, prompts: Sequence[Sequence[int]], n: int, *, temperature: float, max_tokens: int,
                   seed: int, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0,
                   batch_size: int = 512, log_ranks: list | None = None) -> list[list[list[int]]]:
    """n replies per prompt, each drawn token by token from softmax(filtered logits / T) with one
    torch.Generator(seed) (an unseeded vendor: no per-request seed the auditor could replay).
    Stops at the engine's stop tokens or max_tokens. Returns replies[prompt][k]. log_ranks: a list
    filled with each reply's mean log-rank (RUT's score, `log_rank`'s definition, from the logits
    the token was drawn from: no replay needed), log_ranks[prompt][k]."""
    from verinfer.engine.engine import Request
    from verinfer.sampling.filters import filter_logits
    from verinfer.sampling.params import SamplingParams

    if temperature <= 0:
        raise ValueError("sample_replies draws sampled replies: temperature must be > 0")
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=0,
                            max_tokens=max_tokens)

    sums: list[float] = []

    def draw(logits_BV, _params, _noises, batch):
        B = logits_BV.shape[0]
        full = lambda v, dt: torch.full((B,), v, dtype=dt)  # noqa: E731
        x_BV = filter_logits(logits_BV.float().cpu(), full(temperature, torch.float32), full(top_k, torch.int64),
                             full(top_p, torch.float32), full(min_p, torch.float32))
        y_B = torch.multinomial(torch.softmax(x_BV.double(), -1), 1, generator=gen)[:, 0]
        if log_ranks is not None:
            lr_B = _log_ranks_N(logits_BV.cpu(), y_B).tolist()
            for b in range(B):
                if not batch.done_B[b]:
                    sums[b] += lr_B[b]
        return y_B

    reqs = [Request(f"{i}/{k}", list(p), params) for i, p in enumerate(prompts) for k in range(n)]
    out: list[list[list[int]]] = [[] for _ in prompts]
    if log_ranks is not None:
        log_ranks[:] = [[] for _ in prompts]
    for s in range(0, len(reqs), batch_size):
        group = reqs[s : s + batch_size]
        batch = engine.prefill(group)
        batch.streams = [None] * len(group)  # no seeded noise stream: `draw` is the vendor's sampler
        sums[:] = [0.0] * len(group)
        while not batch.finished:
            engine.advance(batch, engine.emit(batch, draw))
        for r, o, lr in zip(group, batch.outputs, sums):
            out[int(r.id.split("/")[0])].append(list(o))
            if log_ranks is not None:
                log_ranks[int(r.id.split("/")[0])].append(lr / max(len(o), 1))
    return out


# --- the three peers on the testbed ------------------------------------------------------------------------------

def testbed_run(n_prompts: int = 60, m: int = 20, met_prompts: int = 30, met_per_prompt: int = 10,
                max_tokens: int = 10, max_prompt_tokens: int = 24, temperature: float = 0.7, met_b: int = 100,
                seed: int = 2) -> dict:
    """Each peer's p-value for three vendors of the testbed target at `temperature`: honest (same
    model and settings), temperature 1.5, and the testbed draft at `temperature`. Requests per
    vendor: RUT and mean-CE one reply for each of n_prompts prompts (against m local samples each);
    MET met_prompts x met_per_prompt replies, each to a prompt drawn uniformly from the first
    met_prompts (the paper's joint prompt-completion sample, "an average of 10 samples per
    prompt"; the package's permutation null assumes prompts drawn so), against as many local
    samples drawn the same way (the local samples of RUT, in order)."""
    from verinfer.engine.engine import Engine
    from verinfer.models.load import load_model, model_info
    from verinfer.models.prompts import prompts_for
    from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR

    if not (1 <= met_prompts <= n_prompts and met_per_prompt >= 1):
        raise ValueError("need 1 <= met_prompts <= n_prompts and met_per_prompt >= 1")
    eos = model_info(TARGET_DIR).eos_token_id
    target = Engine(load_model(TARGET_DIR), eos_token_id=eos)
    draft = Engine(load_model(DRAFT_DIR), eos_token_id=eos)
    prompts = prompts_for(TARGET_DIR, n_prompts, seed, max_prompt_tokens)
    local = sample_replies(target, prompts, m, temperature=temperature, max_tokens=max_tokens, seed=seed + 1)
    rng = np.random.default_rng(seed)
    n_met = met_prompts * met_per_prompt
    local_idx, api_idx = rng.integers(0, met_prompts, n_met), rng.integers(0, met_prompts, n_met)
    if np.bincount(local_idx).max() > m:
        raise ValueError(f"a MET prompt drew more than m = {m} local samples: raise m")
    seen = np.zeros(met_prompts, dtype=int)
    met_local = []
    for i in local_idx:
        met_local.append((int(i), local[i][seen[i]]))
        seen[i] += 1

    def vendor(engine, t, s):  # (one reply per prompt, MET's (prompt index, reply) pairs)
        one = sample_replies(engine, prompts, 1, temperature=t, max_tokens=max_tokens, seed=s)
        met = sample_replies(engine, [prompts[i] for i in api_idx], 1, temperature=t, max_tokens=max_tokens,
                             seed=s + 1)
        return [r[0] for r in one], [(int(i), r[0]) for i, r in zip(api_idx, met)]

    vendors = {"honest": vendor(target, temperature, seed + 10), "temperature-1.5": vendor(target, 1.5, seed + 20),
               "draft": vendor(draft, temperature, seed + 30)}
    lr, ce = reply_scores(target, [p for p in prompts for _ in range(m)], [x for r in local for x in r],
                          temperature=temperature)
    local_lr = lr.reshape(n_prompts, m)
    local_ce = [ce[i * m : (i + 1) * m] for i in range(n_prompts)]
    out = {"budget": {"prompts": n_prompts, "local_per_prompt": m, "met_prompts": met_prompts,
                      "met_samples": n_met, "max_tokens": max_tokens, "met_permutations": met_b,
                      "temperature": temperature}}
    for name, (one, met) in vendors.items():
        api_lr, api_ce = reply_scores(target, prompts, one, temperature=temperature)
        out[name] = {"rut": rut_test(api_lr, local_lr, seed=seed),
                     "met": met_test(met, met_local, n_prompts=met_prompts, b=met_b, seed=seed),
                     "mean_ce": mean_ce_test(api_ce, local_ce),
                     "api_mean_log_rank": float(np.mean(api_lr)), "local_mean_log_rank": float(local_lr.mean()),
                     "api_mean_ce": mean_cross_entropy(api_ce), "local_mean_ce": mean_cross_entropy(ce)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=60, help="prompts of RUT and mean-CE (RUT's paper: 100)")
    ap.add_argument("--local", type=int, default=20, help="local samples per prompt (RUT's m; its paper: 100)")
    ap.add_argument("--met-prompts", type=int, default=30)
    ap.add_argument("--met-per-prompt", type=int, default=10, help="MET samples per prompt, on average")
    ap.add_argument("--max-tokens", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=0.7, help="the claimed temperature (RUT's paper: 0.5)")
    ap.add_argument("--met-b", type=int, default=100, help="MET permutations (the demo's 100; the package's default 1000)")
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    res = testbed_run(args.prompts, args.local, args.met_prompts, args.met_per_prompt, args.max_tokens,
                      temperature=args.temperature, met_b=args.met_b, seed=args.seed)
    res.pop("budget")
    print("| vendor | RUT p | MET p | mean-CE p | API / local mean log-rank | API / local mean CE |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['rut']:.3g} | {r['met']:.3g} | {r['mean_ce']:.3g} | {r['api_mean_log_rank']:.3f} / "
              f"{r['local_mean_log_rank']:.3f} | {r['api_mean_ce']:.3f} / {r['local_mean_ce']:.3f} |")
    print(f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
