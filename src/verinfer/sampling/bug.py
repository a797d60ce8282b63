"""The simulated sampling bug of the DiFR paper (section 5.1, "sampling bug"): the honest sampler,
except that with probability `rate` per sampled token it ignores its noise and picks uniformly
among the top-k logits.

Per sampled (non-greedy) row, in batch order: u ~ U[0, 1) from the bug's own torch.Generator
(seeded once per run); if u < rate, the token is top-k index j with j ~ U{0..k-1} from the same
generator. The bug's stream is separate from the request's noise stream, so every token the bug
does not touch is exactly the honest sampler's token.
"""

from __future__ import annotations

import torch

from verinfer.sampling.sampler import sample_batch


def buggy_sampler(rate: float, seed: int, k: int | None = None):
    """A sampler(logits_BV, params, noises, batch) -> tokens_B for Engine.decode_step. k: the
    top-k set the bug draws from (None: each request's top_k, or 50 when it has none)."""
    g = torch.Generator().manual_seed(seed)

    def sampler(logits_BV, params, noises, batch):
        tokens = sample_batch(logits_BV, params, noises)
        for b, p in enumerate(params):
            if noises[b] is None or torch.rand(1, generator=g).item() >= rate:
                continue
            kb = k or (p.top_k if p.top_k > 0 else 50)
            top = torch.topk(logits_BV[b], kb).indices
            tokens[b] = top[torch.randint(0, kb, (1,), generator=g)].item()
        return tokens

    return sampler
