"""Is a sampler lossless? Pearson's chi-square of the first two sampled tokens against the target's
exact two-token distribution (the test behind "standard speculative sampling passes the chi-square
losslessness test"; speculative sampling paper, Leviathan et al. 2023, Theorem 3.5: its output
distribution is the target's).

  P(y1, y2 | prompt) = p(y1 | prompt) * p(y2 | prompt, y1), by full forwards of the target, for the
  TOP_Y1 most likely y1 (a draw with another y1 falls in the "other" bin); bins are the (y1, y2)
  pairs in decreasing probability while their expected count is at least MIN_EXPECTED, then one
  "other" bin with the rest. A lossy rule (the KL judge) fails the same test at the same sample
  size, which is how a test shows that it has power.
"""

from __future__ import annotations

import torch
from scipy.stats import chisquare

TOP_Y1 = 64
MIN_EXPECTED = 5.0


@torch.no_grad()
def exact_two_token_dist(target, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p1_V, top_K, p2_KV): p(y1 | prompt) over the vocabulary, the TOP_Y1 most likely y1 and
    p(y2 | prompt, y1) for each of them, in float64 from the target's logits."""
    dev = target.device
    lg, _ = target(torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev)[None])
    p1_V = torch.softmax(lg[0, -1].double(), -1).cpu()
    top_K = p1_V.topk(TOP_Y1).indices
    seqs = torch.tensor([prompt + [int(y)] for y in top_K], device=dev)
    lg2, _ = target(seqs, torch.arange(len(prompt) + 1, device=dev).expand(len(top_K), -1))
    return p1_V, top_K, torch.softmax(lg2[:, -1].double(), -1).cpu()


def two_token_chi_square(target, first_two: list[tuple[int, int]], prompt: list[int]) -> tuple[float, float, int]:
    """(statistic, p-value, bins) of the draws' first two tokens against the target's exact
    distribution after `prompt` (module docstring)."""
    n = len(first_two)
    p1_V, top_K, p2_KV = exact_two_token_dist(target, prompt)
    joint_KV = p1_V[top_K][:, None] * p2_KV
    counts: dict[tuple[int, int], int] = {}
    for k in first_two:
        counts[k] = counts.get(k, 0) + 1
    flat = joint_KV.flatten()
    V = joint_KV.shape[1]
    obs, exp = [], []
    for j in flat.argsort(descending=True).tolist():
        e = n * flat[j].item()
        if e < MIN_EXPECTED:
            break
        obs.append(counts.pop((int(top_K[j // V]), j % V), 0))
        exp.append(e)
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
    stat, pval = chisquare(obs, exp)
    return float(stat), float(pval), len(obs)


def next_two_chi_square(target, outputs: list[list[int]], prompt: list[int]) -> tuple[float, float, int, int]:
    """The same test one token later: among draws whose first token is the most frequent one (y1*),
    tokens 2 and 3 against the target's exact distribution after prompt + [y1*]. For a decoder whose
    first token is not drafted (a feature-level head: the target's prefill draws it), this is where
    the draft, and a cut draft block, first act on two tokens. (statistic, p-value, bins, draws used)."""
    firsts = [o[0] for o in outputs if len(o) >= 3]
    if not firsts:
        raise ValueError("next_two_chi_square needs draws of at least 3 tokens")
    y1 = max(set(firsts), key=firsts.count)
    pairs = [(o[1], o[2]) for o in outputs if len(o) >= 3 and o[0] == y1]
    stat, pval, bins = two_token_chi_square(target, pairs, prompt + [y1])
    return stat, pval, bins, len(pairs)
