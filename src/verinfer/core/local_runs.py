"""The auditor's own runs of the trusted model: the honest runs a detector is calibrated on and the
reference bands (DiFR figure 5) a vendor is placed among. Each run is cached as a claims file in
the audit's directory, so a rerun generates nothing again.

    simulated_claims   token-id prompts through verinfer's simulated providers (audit-api: honest
                       configurations, and the bf16 / fp8-KV / 4-bit bands of `TOKEN_BANDS`)
    chat_run_claims    chat conversations as a `Band` runs them (its numerics, an extra system
                       prompt, another chat template), greedy on verinfer's engine or local vLLM,
                       or seeded (each conversation its own seed) on verinfer's engine,
                       then each reply claimed from its text against the plain conversation, as a
                       vendor's reply is (`CHAT_BANDS`, and the honest configurations as bands);
                       unseeded params: sampled with the seeds all the same (noise SAMPLE_NOISE), and
                       claimed without them, as an unseeded vendor's reply is
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from verinfer.claims import Claim, write_claims
from verinfer.numerics import Numerics
from verinfer.progress import progress_bar
from verinfer.providers.simulated import HONEST, PROVIDERS, ProviderConfig, provider_generate, run_provider
from verinfer.registry import Registry
from verinfer.retokenize import PLAIN_CHAT_TEMPLATE, Retokenizer
from verinfer.sampling.params import SamplingParams

SAMPLE_NOISE = "vllm-cpu"  # the sampler of a local run whose claims state no seed (any honest sampler would do)
BAND_SYSTEM_PROMPT = "You are a helpful assistant. Keep your answers short and follow the instructions."
# reference band -> the simulated provider that runs it (audit-api's greedy bands, token-id prompts)
TOKEN_BANDS: Registry[str] = Registry("reference band", {"bf16": "honest-bf16-b8", "fp8-kv": "fp8-kv", "int4": "int4"})


@dataclass(frozen=True)
class Band:
    """A local configuration an auditor runs as a reference: a provider's numerics, and what it does
    to the conversation (an extra system message, another chat template). The claim always states
    the plain conversation, as a vendor's does."""

    provider: ProviderConfig
    description: str
    system_prompt: str | None = None
    chat_template: str | None = None
    vllm_run: str = "honest"          # the same configuration on real vLLM (providers.vllm.VLLM_RUNS)

    @classmethod
    def honest(cls, name: str) -> "Band":
        """An honest configuration (providers.simulated.HONEST) run as a band: calibration runs."""
        return cls(HONEST.get(name), HONEST.get(name).description)


CHAT_BANDS: Registry[Band] = Registry("reference band", {
    "bf16": Band(HONEST.get("honest-bf16-b8"), "honest: bf16, batches of 8"),
    "fp8-kv": Band(ProviderConfig("fp8-kv", Numerics(dtype="bf16", kv_cache="fp8_e4m3"), honest=False),
                   "fp8 e4m3 KV cache", vllm_run="fp8-kv"),
    "int8": Band(ProviderConfig("int8", Numerics(dtype="bf16", weight_bits=8), honest=False),
                 "8-bit weights (RTN, group 32)", vllm_run="int8"),
    "int4": Band(ProviderConfig("int4", Numerics(dtype="bf16", weight_bits=4), honest=False),
                 "4-bit weights (RTN, group 32)", vllm_run="int4"),
    "system-prompt": Band(HONEST.get("honest-bf16-b8"), "an extra system prompt", system_prompt=BAND_SYSTEM_PROMPT),
    "template": Band(HONEST.get("honest-bf16-b8"), "another chat template (plain 'role: content')",
                     chat_template=PLAIN_CHAT_TEMPLATE),
})


def simulated_claims(names: list[str], model_dir: Path, prompts: list[list[int]], advertised: SamplingParams,
                     out: Path, base_seed: int, device: str = "cpu", show_progress: bool = True) -> list[Path]:
    """Claims of verinfer's own simulated providers `names` on these prompts, as they advertise
    `advertised` (request seeds from base_seed); cached at out/<name>.jsonl."""
    paths = []
    for name in names:
        p = out / f"{name}.jsonl"
        if not p.is_file():
            with progress_bar(f"{out.name}: generate {name}", len(prompts), show_progress) as adv:
                claims = run_provider(PROVIDERS[name], model_dir, prompts, advertised, base_seed=base_seed,
                                      device=device, progress=adv)
            write_claims(p, [c for c in claims if c.output_token_ids])
        paths.append(p)
    return paths


def _generate(band: Band, model_dir: Path, prompts: list[list[int]], params: list[SamplingParams], out: Path,
              engine: str, device: str, progress) -> list[tuple[list[int], str]]:
    """(output ids, finish reason) of each prompt, sampled with its params as the band runs it (local
    vLLM: greedy)."""
    if engine == "vllm":
        from verinfer.providers.vllm import VllmRun, generate_greedy

        out.mkdir(parents=True, exist_ok=True)
        return generate_greedy(model_dir, VllmRun.named(band.vllm_run), prompts, [p.max_tokens for p in params], out,
                               progress=progress)
    return [(list(c.output_token_ids), c.finish_reason) for c in
            provider_generate(band.provider, model_dir, prompts, params, device=device, progress=progress)]


def chat_run_claims(band: Band, name: str, model_dir: Path, params: SamplingParams, conversations: list[list[dict]],
                    retok: Retokenizer, out: Path, model_name: str, *, max_tokens: list[int] | None = None,
                    engine: str = "verinfer", device: str = "cpu", show_progress: bool = True,
                    seeds: list[int] | None = None) -> Path:
    """Claims of a local run (cached at out/<name>.jsonl): the conversations as the band runs them
    (its system prompt, its template), sampled with `params` (each with its max_tokens,
    params.max_tokens by default, and at temperature > 0 its seed of `seeds`; on verinfer's engine,
    or engine "vllm": on local vLLM, greedy only), then each reply claimed as a vendor's is, from its
    text, against the plain conversation, as a claim of `model_name`. Unseeded params
    (`SamplingParams.unseeded`): each conversation is sampled with its seed of `seeds` and
    SAMPLE_NOISE, and claimed with `params` (no seed, no noise): an honest unseeded reply."""
    path = out / f"{name}.jsonl"
    if path.is_file():
        return path
    run_retok = Retokenizer(retok.tokenizer, retok.end_token_id, band.chat_template)
    run_msgs = [([{"role": "system", "content": band.system_prompt}] if band.system_prompt else []) + list(m)
                for m in conversations]
    prompts = [run_retok.prompt_ids(m) for m in run_msgs]
    each = [replace(params, max_tokens=m) for m in (max_tokens or [params.max_tokens] * len(prompts))]
    claimed = each
    if not params.greedy:
        if seeds is None or len(seeds) != len(prompts) or engine != "verinfer":
            raise ValueError("a sampled local run needs one seed per conversation and verinfer's engine")
        sampled = {"unseeded": False, "noise": SAMPLE_NOISE} if params.unseeded else {}
        each = [replace(p, seed=s, **sampled) for p, s in zip(each, seeds)]
        claimed = claimed if params.unseeded else each
    with progress_bar(f"{out.name}: generate {name}", len(prompts), show_progress) as adv:
        done = _generate(band, model_dir, prompts, each, out, engine, device, adv)
    claims = []
    for i, (msgs, (ids, finish)) in enumerate(zip(conversations, done)):
        stopped = finish == "stop"
        text = retok.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
        if not text:
            continue
        claims.append(Claim.from_chat(f"{name}-{i:05d}", model_name, msgs, text, "stop" if stopped else "length",
                                      claimed[i], retok, returned=(prompts[i], ids), provider=name))
    out.mkdir(parents=True, exist_ok=True)
    write_claims(path, claims)
    return path


__all__ = ["BAND_SYSTEM_PROMPT", "Band", "CHAT_BANDS", "TOKEN_BANDS", "chat_run_claims", "simulated_claims"]
