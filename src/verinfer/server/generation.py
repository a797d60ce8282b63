"""One request's generation, token by token, over the engine.

Every request runs alone (batch of one) with its own KV cache and its own noise stream created
from its own seed (engine.prefill), and, for the sampling-bug misconfiguration, its own bug RNG
seeded from its seed. Nothing is shared between requests but the read-only weights, so
concurrent requests give exactly the tokens they give one at a time.

Logprobs are those of the raw model distribution (log-softmax of the fp32 logits the token was
sampled from, before temperature and filters), as vLLM returns by default.

Shape key: V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from verinfer.providers.simulated import bug_sampler
from verinfer.engine.engine import Request
from verinfer.sampling.params import SamplingParams
from verinfer.server.registry import ServedModel

BUG_SEED_SALT = 0x5EED_B06


@dataclass
class Step:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    finish_reason: str | None = None            # set on the last step: "stop" | "length"


def generate_steps(model: ServedModel, request_id: str, prompt_ids: list[int], claimed: SamplingParams, *,
                   logprobs: int | None = None, ignore_eos: bool = False) -> Iterator[Step]:
    """Yield one Step per output token (the last one carries finish_reason)."""
    engine = model.engine_no_eos if ignore_eos else model.engine
    params = model.provider.run_params(claimed)  # what a misconfigured server really samples with
    batch = engine.prefill([Request(request_id, list(prompt_ids), params)])
    sampler = None
    if model.provider.bug_rate > 0 and not params.greedy:
        sampler = bug_sampler(model.provider, (params.seed ^ BUG_SEED_SALT) % 2**63)
    while not batch.finished:
        logits_V = batch.logits_BV[0].float()
        tok = int(engine.decode_step(batch, sampler)[0])
        yield step_of(logits_V, tok, logprobs, batch.finish[0] if batch.finished else None)


def step_of(logits_V: torch.Tensor, token: int, logprobs: int | None, finish: str | None) -> Step:
    """The Step of one row: its token with the log-probability and top-`logprobs` alternatives of
    the raw distribution it was picked from (logits_V: that row's fp32 logits before the step)."""
    step = Step(token, finish_reason=finish)
    if logprobs is not None:
        lp_V = torch.log_softmax(logits_V, dim=-1)
        step.logprob = float(lp_V[token])
        if logprobs > 0:
            vals, ids = lp_V.topk(logprobs)
            step.top = list(zip(ids.tolist(), vals.tolist()))
    return step
