"""Simulated providers: the engine run the way an honest or a misconfigured provider would run it.

Honest variation (all compute the same function; only floating-point order differs): batch size
and composition (mixed-length padded batches), bf16 vs fp32, sdpa vs eager attention, thread
count, chunked prefill. Every honest provider decodes token by token while the verifier
prefills, which alone moves bf16 logits on CPU (docs/architecture.md).

Misconfigurations (DiFR paper section 5.1): 4-bit weights (simulated group-wise RTN), fp8 e4m3
KV cache (simulated cast), temperature 1.1 instead of 1.0, wrong seed, and a sampling bug that
draws 1% of tokens uniformly from the top-k. The claim always states the advertised settings.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

from verinfer.claims import Claim
from verinfer.engine.engine import Completion, Engine, Request
from verinfer.fingerprint import encode
from verinfer.models.load import load_model, model_info
from verinfer.numerics import Numerics
from verinfer.registry import Registry
from verinfer.sampling.params import SamplingParams, misconfigured
from verinfer.sampling.bug import buggy_sampler


@dataclass(frozen=True)
class ProviderConfig:
    name: str
    numerics: Numerics = Numerics()
    batch_size: int = 8
    honest: bool = True
    temperature: float | None = None  # sample at this temperature while claiming the advertised one
    seed_offset: int = 0              # sample with seed + offset while claiming seed
    bug_rate: float = 0.0             # fraction of tokens drawn uniformly from the top-k
    bug_k: int | None = None          # None: the request's top_k
    description: str = ""

    def run_params(self, claimed: SamplingParams) -> SamplingParams:
        """What this provider really samples with when it claims `claimed`: its temperature and
        seed offset applied (sampling.params.misconfigured)."""
        return misconfigured(claimed, self.temperature, self.seed_offset)


# The advertised specification of the demo (the paper's reference: T=1, top-k 50, top-p 0.95).
DEFAULT_SPEC = dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.0, noise="vllm-cpu")

HONEST: Registry[ProviderConfig] = Registry("honest provider", {
    # split-K GEMMs (numerics/kernels.split_k_parts), as `verinfer serve` and a GPU server: its batch
    # effects do not depend on the CPU (bf16 GEMMs with AMX are row-invariant).
    "honest-bf16-b8": ProviderConfig("honest-bf16-b8", Numerics(dtype="bf16", matmul="split-k"), batch_size=8,
                                     description="bf16, sdpa, batches of 8 mixed-length requests, split-K GEMMs"),
    "honest-bf16-b1": ProviderConfig("honest-bf16-b1", Numerics(dtype="bf16"), batch_size=1,
                                     description="bf16, one request at a time"),
    "honest-fp32-b4": ProviderConfig("honest-fp32-b4", Numerics(dtype="fp32"), batch_size=4,
                                     description="fp32 weights and activations, batches of 4"),
    "honest-bf16-eager-t1": ProviderConfig("honest-bf16-eager-t1", Numerics(dtype="bf16", attn="eager", threads=1),
                                           batch_size=16, description="bf16, eager attention, 1 thread, batches of 16"),
    # Chunks of 13, not 16: CPU GEMMs tile rows in blocks of 16, so chunks of 16 tokens reproduced
    # unchunked prefill bitwise (all 128 demo claims equal to honest-bf16-b8 with library GEMMs). On
    # CPUs with AMX bf16 GEMMs are row-invariant and chunks of 13 reproduced it too (24 of 24 claims).
    # tests/providers/test_simulated.py checks that every honest configuration differs.
    "honest-bf16-chunk13": ProviderConfig("honest-bf16-chunk13", Numerics(dtype="bf16", prefill_chunk=13),
                                          batch_size=8, description="bf16, prompts prefilled in chunks of 13 tokens"),
})
MISCONFIGURED: Registry[ProviderConfig] = Registry("misconfiguration", {
    "int4": ProviderConfig("int4", Numerics(dtype="bf16", weight_bits=4), honest=False,
                           description="4-bit weights (simulated group-wise RTN, group 32)"),
    "fp8-kv": ProviderConfig("fp8-kv", Numerics(dtype="bf16", kv_cache="fp8_e4m3"), honest=False,
                             description="fp8 e4m3 KV cache (simulated cast)"),
    "temp-1.1": ProviderConfig("temp-1.1", honest=False, temperature=1.1,
                               description="samples at temperature 1.1, claims 1.0"),
    "wrong-seed": ProviderConfig("wrong-seed", honest=False, seed_offset=1,
                                 description="samples with seed+1, claims seed"),
    "sampling-bug": ProviderConfig("sampling-bug", honest=False, bug_rate=0.01,
                                   description="1% of tokens drawn uniformly from the top-k"),
})
PROVIDERS: Registry[ProviderConfig] = Registry("provider", {**HONEST, **MISCONFIGURED})


def get_provider(name: str) -> ProviderConfig:
    """The simulated provider called `name` (unknown: UnknownNameError listing the providers)."""
    return PROVIDERS.get(name)


def request_seed(base_seed: int, index: int) -> int:
    """A per-request seed, stable across runs and providers (providers share prompts and seeds)."""
    h = hashlib.sha256(f"{base_seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 2


def bug_sampler(cfg: ProviderConfig, seed: int):
    """The provider's sampler: honest, with the simulated sampling bug at cfg.bug_rate."""
    return buggy_sampler(cfg.bug_rate, seed, cfg.bug_k)


def run_provider(cfg: ProviderConfig, model_dir: str | Path, prompts: list[list[int]], advertised: SamplingParams,
                 *, base_seed: int = 0, device: str = "cpu", progress=None, fingerprint=None) -> list[Claim]:
    """Generate claims for these prompts as provider `cfg` would, advertising `advertised`.
    fingerprint (verinfer.fingerprint.FingerprintSpec): attach Activation-DiFR fingerprints of the
    provider's own hidden states as the claim field `activations`."""
    info = model_info(model_dir)
    claimed = claimed_params(prompts, advertised, base_seed)
    completions = provider_generate(cfg, model_dir, prompts, claimed, base_seed=base_seed, device=device,
                                    progress=progress, hidden_layer=fingerprint.layer if fingerprint else None)
    claims = []
    for c, p in zip(completions, claimed):
        claim = Claim(c.id, info.name, c.prompt_token_ids, c.output_token_ids, p, provider=cfg.name)
        if fingerprint is not None:
            claim.extra["activations"] = encode(c.hidden_TD, fingerprint)
        claims.append(claim)
    return claims


def claimed_params(prompts: list[list[int]], advertised: SamplingParams, base_seed: int = 0) -> list[SamplingParams]:
    """The settings each request's claim states: the advertised ones with the request's own seed."""
    return [replace(advertised, seed=request_seed(base_seed, i)) for i in range(len(prompts))]


def provider_generate(cfg: ProviderConfig, model_dir: str | Path, prompts: list[list[int]],
                      claimed: list[SamplingParams], *, base_seed: int = 0, device: str = "cpu", progress=None,
                      hidden_layer: int | None = None) -> list[Completion]:
    """The engine's completions of provider `cfg` for these prompts, each request sampled with
    cfg.run_params of its claimed settings (hidden_layer: Completion.hidden_TD, engine.generate)."""
    info = model_info(model_dir)
    engine = Engine(load_model(model_dir, cfg.numerics, device), cfg.numerics, eos_token_id=info.eos_token_id)
    requests = [Request(f"{cfg.name}-{i:05d}", list(prompt), cfg.run_params(p))
                for i, (prompt, p) in enumerate(zip(prompts, claimed))]
    sampler = bug_sampler(cfg, base_seed + 7919) if cfg.bug_rate > 0 else None
    # Mixed-length batches: sort nothing, so each batch holds whatever prompts arrived together.
    return engine.generate(requests, batch_size=cfg.batch_size, sampler=sampler, progress=progress,
                           hidden_layer=hidden_layer)

