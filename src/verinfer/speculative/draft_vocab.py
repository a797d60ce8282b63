"""Frequency-ranked draft vocabulary (FR-Spec; Zhao et al. 2025, "FR-Spec: Accelerating
Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling"): the draft proposes
only from the N tokens most frequent in its training text, so its lm_head runs on N rows of the
embedding instead of all V.

Why: a small draft on a large vocabulary spends most of a step in its head. SmolLM2's draft
(d 256, 4 layers, V 49,152) holds 12.6M of its 15.7M parameters in the tied embedding; on one CPU
thread the full head is about 2.9 ms of a 6.7 ms draft step, a 8,192-row head 0.2 ms.

Pipeline (per draft step, B rows):
  h_BD            the draft's final-norm hidden state (unchanged)
  logits_BN       = h_BD @ E[ids_N].T          only the kept rows of the head
  x_B             = ids_N[argmax_N logits_BN]   greedy; sampling draws from softmax(logits_BN / T)
  q_BV            = softmax(logits_BN / T) scattered into ids_N, 0 elsewhere
Standard speculative sampling stays lossless for ANY draft distribution q (Leviathan et al. 2023,
Theorem 3.5; the residual norm(max(0, p - q)) returns p's mass outside ids_N), and greedy
verification accepts x only when it is the target's argmax, so the output is the target's
whatever ids_N is: the vocabulary changes speed (acceptance), never the answer. Rules that read
q's whole distribution (the KL judge, the entropy rules, AutoJudge's features) are refused with a
restricted vocabulary: q would be zero outside ids_N (KL(p || q) infinite wherever p has mass there).

The ranking is counted once on the draft's training stream (models/draft.py writes the counts
beside the weights, draft.COUNTS_FILE) and N is the smallest power of two whose top-N tokens cover at least
MIN_COVERAGE of that stream, a rule fixed before any benchmark run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from verinfer.models.draft import load_counts
from verinfer.models.llama import LlamaLM

MIN_COVERAGE = 0.99


def ranking(counts_V: torch.Tensor) -> torch.Tensor:
    """Token ids from most to least frequent (ties: the lower id first)."""
    return torch.argsort(-counts_V, stable=True)  # stable: ids stay ascending within a count


def _cumulative_share(counts_V: torch.Tensor) -> torch.Tensor:
    """share_V[n - 1]: the share of the stream's tokens among its n most frequent ids."""
    total = int(counts_V.sum())
    if total == 0:
        raise ValueError("empty token counts: no coverage to compute")
    return counts_V.sort(descending=True).values.cumsum(0).double() / total


def coverage(counts_V: torch.Tensor, n: int) -> float:
    """Share of the stream's tokens that are among its n most frequent ids."""
    return float(_cumulative_share(counts_V)[min(n, len(counts_V)) - 1])


def choose_size(counts_V: torch.Tensor, min_coverage: float = MIN_COVERAGE) -> int:
    """The smallest power of two N whose top-N tokens cover >= min_coverage of the stream (at most V)."""
    share, V, n = _cumulative_share(counts_V), len(counts_V), 1
    while n < V and share[n - 1] < min_coverage:
        n *= 2
    return min(n, V)


def top_ids(counts_V: torch.Tensor, n: int) -> torch.Tensor:
    """ids_N: the n most frequent token ids, sorted ascending (the head's row order)."""
    if not 1 <= n <= len(counts_V):
        raise ValueError(f"draft vocabulary size must be between 1 and {len(counts_V)}, got {n}")
    return ranking(counts_V)[:n].sort().values


def draft_vocab(draft_dir: str | Path, n: int | None = None) -> torch.Tensor:
    """ids_N of a draft: its n most frequent training tokens (n None: choose_size's rule)."""
    counts = load_counts(draft_dir)
    return top_ids(counts, choose_size(counts) if n is None else n)


def restrict_head(draft: LlamaLM, ids_N: torch.Tensor) -> LlamaLM:
    """The draft model (same weight tensors) with its lm_head cut to the rows ids_N: its logits are
    over N tokens, position j meaning token ids_N[j]. The input embedding stays whole."""
    V = draft.config.vocab_size
    ids = ids_N.long().flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != ids.numel():
        raise ValueError(f"a draft vocabulary must be distinct token ids in [0, {V}); got {ids.numel()} ids")
    w = dict(draft.w)
    w["lm_head.weight"] = draft.w["lm_head.weight"][ids.to(draft.device)].contiguous()
    return type(draft)(replace(draft.config, vocab_size=ids.numel()), w, attn=draft.attn, kernels=draft.kernels)
