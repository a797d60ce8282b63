"""Unseeded claims on the shipped testbed, scored the way `verinfer score` scores them (shared by
tests/detect/test_unseeded.py and benchmarks): a provider samples with its own seed and numerics,
the claim states the advertised settings with `"seed": null`, the verifier (bf16, sdpa) replays it."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pyarrow as pa
import torch

from verinfer.audit.replay import score_chunk
from verinfer.audit.score_file import verifier_engine
from verinfer.claims import Claim
from verinfer.engine.engine import Engine, Request
from verinfer.models.load import load_model, model_info
from verinfer.models.prompts import prompts_for
from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR
from verinfer.numerics import Numerics
from verinfer.sampling.params import SamplingParams

CLAIM_TOKENS = 64
N_CLAIMS = 80  # claims per provider: 5,120 tokens
PROMPT_SEED = 0
# the honest configurations: the serving testbed's bf16 batches with split-K GEMMs, and fp32
HONEST = {"bf16-b8": Numerics(dtype="bf16", matmul="split-k"), "fp32-b4": Numerics(dtype="fp32")}


@lru_cache(maxsize=None)
def _engine(model_dir: str, numerics: Numerics) -> Engine:
    return Engine(load_model(model_dir, numerics, "cpu"), numerics, eos_token_id=None)


@lru_cache(maxsize=1)
def _prompts() -> tuple:
    """2 N_CLAIMS prompts: the first half for calibration, the second for audited providers."""
    return tuple(tuple(p) for p in prompts_for(TARGET_DIR, 2 * N_CLAIMS, PROMPT_SEED))


@lru_cache(maxsize=1)
def _verifier() -> Engine:
    return verifier_engine(TARGET_DIR)


@lru_cache(maxsize=None)
def unseeded_scores(provider: str, seed: int, temperature: float = 1.0, top_p: float = 0.95,
                    served_temperature: float | None = None, served_top_p: float | None = None,
                    numerics: Numerics = HONEST["bf16-b8"], model: str = "target", calibration: bool = False,
                    n_claims: int = N_CLAIMS) -> pa.Table:
    """The scores of n_claims unseeded claims of CLAIM_TOKENS tokens (the calibration or the audit
    prompts, sampling seeds from `seed`) claiming (temperature, top_p, top_k off), served at
    served_temperature / served_top_p (None: as claimed) by `model` ("target", or "draft": a
    cheaper model) with these numerics."""
    torch.set_num_threads(1)
    model_dir = str(TARGET_DIR if model == "target" else DRAFT_DIR)
    served = SamplingParams(temperature=served_temperature or temperature, top_p=served_top_p or top_p,
                            seed=0, max_tokens=CLAIM_TOKENS)
    prompts = _prompts()[:N_CLAIMS][:n_claims] if calibration else _prompts()[N_CLAIMS:][:n_claims]
    requests = [Request(f"{provider}-{seed}-{i}", list(p), replace(served, seed=seed * 100_003 + i))
                for i, p in enumerate(prompts)]
    done = _engine(model_dir, numerics).generate(requests, batch_size=len(requests))  # one batch: fewest steps
    claimed = SamplingParams(temperature=temperature, top_p=top_p, seed=None, unseeded=True, max_tokens=CLAIM_TOKENS)
    name = model_info(TARGET_DIR).name
    claims = [Claim(c.id, name, c.prompt_token_ids, c.output_token_ids, claimed, provider=provider) for c in done]
    return score_chunk(claims, _verifier())
