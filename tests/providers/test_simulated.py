"""Every honest demo configuration is a real numerical variation (issue 16 item 10): two honest
providers that produce identical claims calibrate the detector on the same data twice and claim
a variety of honest set-ups that is not there. honest-bf16-chunk16 (chunks of 16, a multiple of
the CPU GEMM's row tiles) reproduced honest-bf16-b8 on all 128 demo claims; this test failed then."""

from __future__ import annotations

import itertools

import pytest

from verinfer.models.prompts import prompts_for
from verinfer.models.testbed import TARGET_DIR
from verinfer.providers.simulated import DEFAULT_SPEC, HONEST, run_provider
from verinfer.sampling.params import SamplingParams

N_PROMPTS, MAX_TOKENS = 24, 64

# every honest provider on 24 prompts x 64 tokens (honest-bf16-b1 and -eager-t1 decode one claim at a time)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def honest_outputs() -> dict[str, list[list[int]]]:
    prompts = prompts_for(TARGET_DIR, N_PROMPTS, 0)
    advertised = SamplingParams(seed=0, max_tokens=MAX_TOKENS, **DEFAULT_SPEC)
    return {name: [c.output_token_ids for c in run_provider(cfg, TARGET_DIR, prompts, advertised)]
            for name, cfg in HONEST.items()}


def test_every_pair_of_honest_providers_differs(honest_outputs):
    same = [(a, b) for a, b in itertools.combinations(honest_outputs, 2)
            if honest_outputs[a] == honest_outputs[b]]
    assert not same, f"honest configurations with identical claims on {N_PROMPTS} prompts: {same}"


def test_honest_providers_agree_mostly(honest_outputs):
    """...and they stay honest: each pair agrees on most claims (only near ties flip)."""
    for a, b in itertools.combinations(honest_outputs, 2):
        equal = sum(x == y for x, y in zip(honest_outputs[a], honest_outputs[b]))
        assert equal >= N_PROMPTS // 2, (a, b, equal)
