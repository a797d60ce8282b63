"""The audit pipeline as functions the CLI, the demo and the benchmarks share:
generate claims (simulated providers) -> score (replay) -> calibrate (honest only) -> audit -> report.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa

from verinfer.audit.score_file import (VERIFIER_NUMERICS, reference_engines, refuse_speculative, score,
                                       scores_current, verifier_engine)
from verinfer.claims import Claim, write_claims
from verinfer.detect import Detector
from verinfer.detect.judge import provider_verdicts
from verinfer.detect.verdict import Verdict
from verinfer.io import output
from verinfer.models.prompts import prompts_for
from verinfer.progress import progress_bar
from verinfer.providers import vllm
from verinfer.providers.simulated import DEFAULT_SPEC, HONEST, PROVIDERS, get_provider, run_provider
from verinfer.sampling.params import SamplingParams

# the replay lives in audit/score_file.py; its names stay importable from here for the apps above
__all__ = ["DEFAULT_SPEC", "VERIFIER_NUMERICS", "audit", "generate", "generate_with_vllm", "prompts_for",
           "reference_engines", "refuse_speculative", "score", "scores_current", "verifier_engine"]


def generate(provider: str, model_dir: str | Path, out: str | Path, *, n: int = 32, max_tokens: int = 64,
             seed: int = 0, spec: dict | None = None, device: str = "cpu", show_progress: bool = True,
             fingerprint=None) -> list[Claim]:
    with output(out, "claims file"):
        cfg = get_provider(provider)
        spec = {**DEFAULT_SPEC, **(spec or {})}
        advertised = SamplingParams(seed=0, max_tokens=max_tokens, **spec)
        prompts = prompts_for(model_dir, n, seed)
        with progress_bar(f"generate {provider}", len(prompts), show_progress) as adv:
            claims = run_provider(cfg, model_dir, prompts, advertised, base_seed=seed, device=device, progress=adv,
                                  fingerprint=fingerprint)
        write_claims(out, claims)
    return claims


def generate_with_vllm(provider: str, model_dir: str | Path, out: str | Path, *, n: int = 32, max_tokens: int = 64,
             seed: int = 0, spec: dict | None = None, work_dir: str | Path | None = None) -> "vllm.VllmGeneration":
    """`verinfer generate --engine vllm`: claims from real vLLM on the audit prompts (same prompts
    and per-request seeds as the simulated providers)."""
    with output(out, "claims file"):
        return _generate_with_vllm(provider, model_dir, out, n=n, max_tokens=max_tokens, seed=seed, spec=spec,
                                   work_dir=work_dir)


def _generate_with_vllm(provider, model_dir, out, *, n, max_tokens, seed, spec, work_dir) -> "vllm.VllmGeneration":
    spec = {**DEFAULT_SPEC, **(spec or {})}
    if spec.get("noise", "vllm-cpu") != "vllm-cpu":
        raise ValueError(f"vLLM on CPU samples with the vllm-cpu noise backend, not {spec['noise']!r}")
    spec["noise"] = "vllm-cpu"
    run = vllm.VllmRun.named(provider)
    advertised = SamplingParams(seed=0 if spec["temperature"] > 0 else None, max_tokens=max_tokens, **spec)
    prompts = prompts_for(model_dir, n, seed)
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        llm = vllm.make_llm(model_dir, run, tmp, seed=seed)
        gen = vllm.generate_claims(llm, model_dir, prompts, advertised, run, base_seed=seed)
    write_claims(out, gen.claims)
    return gen


def audit(table: pa.Table, detector: Detector, providers: list[str],
          held_out: dict[str, pa.Table] | None = None, max_tokens: int | None = None,
          sequential: bool = False) -> list[Verdict]:
    """`detect.judge.provider_verdicts`, with the truth of verinfer's simulated providers."""
    truth = {name: name in HONEST for name in PROVIDERS}
    return provider_verdicts(table, detector, providers, held_out, max_tokens, sequential, truth)
