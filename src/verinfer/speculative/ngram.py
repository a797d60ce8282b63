"""N-gram prompt-lookup drafting (vLLM's `method="ngram"`; Saxena 2023, "prompt lookup decoding"):
no draft model; the draft tokens are what followed an earlier occurrence of the sequence's own
suffix.

propose(seq, min_n, max_n, k), as vLLM's NgramProposer (v1/spec_decode/ngram_proposer.py):
  n*       = the longest n in [min_n, max_n] whose last-n-token suffix of seq also occurs earlier
             in seq (an occurrence ending before the last token);
  match    = the EARLIEST such occurrence, at i (seq[i:i+n*] == seq[-n*:]);
  proposal = seq[i+n* : i+n*+k] (fewer than k when the sequence ends sooner; none without a match).
The draft is deterministic (q = one-hot at each proposed token), so standard speculative
sampling stays lossless: accept x with probability p(x); after a rejection, sample from p with x
removed (the residual of a one-hot q).
vLLM's defaults when neither bound is given: min_n = max_n = 5 ("arbitrarily chosen", its config).
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM_DEFAULT_N = 5


@dataclass(frozen=True)
class NgramDraft:
    """The drafter of the n-gram baseline: pass it as SpeculativeDecoder's `draft`."""

    min_n: int = VLLM_DEFAULT_N
    max_n: int = VLLM_DEFAULT_N

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram bounds must satisfy 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def propose(self, seq: list[int], k: int) -> list[int]:
        return propose(seq, self.min_n, self.max_n, k)


def propose(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of seq's longest matching suffix."""
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = seq[L - n:]
        for i in range(0, L - n):  # occurrences ending before the last token
            if seq[i:i + n] == suffix:
                return seq[i + n:i + n + k]
    return []
