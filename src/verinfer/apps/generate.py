"""`verinfer generate`: one typed request, dispatched to one of four jobs.

    job            when                        writes
    vllm           engine == "vllm"            claims from real vLLM (`providers.vllm`)
    speculative    speculative is a rule       claims with a `spec` field (`apps.speculative`)
    deterministic  deterministic is a policy   greedy completions equal to batch size 1 (`apps.determinism`)
    simulated      otherwise                   claims of a simulated honest / misconfigured provider

The request is validated once (`GenerateRequest`); `generate` returns what was written (`Generated`)
for the CLI to render. unseeded: a sampled simulated or vLLM job's claims are written without their
seeds (`"seed": null`, no noise): what a vendor that ignores seeds is claimed with, and the honest
runs an unseeded detector (`calibrate --detector pit-uniformity`) is calibrated on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from verinfer.apps import determinism, pipeline, speculative
from verinfer.claims import read_claims, write_claims
from verinfer.fingerprint import FingerprintSpec
from verinfer.providers.simulated import DEFAULT_SPEC

ENGINES = ("verinfer", "vllm")


@dataclass(frozen=True)
class GenerateRequest:
    model_dir: Path
    out: Path
    provider: str = "honest-bf16-b8"
    n: int = 32
    max_tokens: int = 64
    seed: int = 0
    sampling: dict = field(default_factory=lambda: dict(DEFAULT_SPEC))  # temperature, top_k, top_p, min_p, noise
    device: str = "cpu"
    engine: str = "verinfer"
    fingerprint: str | None = None      # "k=16,stride=4[,layer=-1,seed=0,dtype=fp16|int8]" (simulated)
    deterministic: str | None = None    # a determinism policy
    tau_file: Path = determinism.DEFAULT_TAU_FILE
    speculative: str | None = None      # an acceptance rule
    threshold: float = 0.5
    gamma: int = 4
    draft_confidence: float = 0.0       # dynamic draft length (SpeculativeDecoder)
    draft_dir: Path | None = None
    judge: Path | None = None           # AutoJudge head JSON (`verinfer speculative train-autojudge`)
    unseeded: bool = False              # write the claims without seeds (module docstring)

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be verinfer or vllm, got {self.engine!r}")
        if self.fingerprint is not None:
            if self.job != "simulated":
                raise ValueError(f"--fingerprint attaches Activation-DiFR fingerprints to simulated providers' "
                                 f"claims, not to {self.job} generation: drop it")
            FingerprintSpec.parse(self.fingerprint)  # a bad spec fails before any generation
        if not 0.0 <= self.draft_confidence < 1.0:  # before any model loads
            raise ValueError(f"--draft-confidence must be in [0, 1) (a draft probability), got {self.draft_confidence}")
        if self.draft_confidence and self.job != "speculative":
            raise ValueError(f"--draft-confidence sets the speculative decoder's draft length, not {self.job} "
                             "generation: add --speculative RULE or drop it")
        if self.unseeded and (self.job not in ("simulated", "vllm") or not self.sampling["temperature"] > 0):
            raise ValueError("--unseeded writes a sampled provider's claims without seeds: it needs --temperature > 0 "
                             f"and a simulated or vLLM provider (this is {self.job} generation at temperature "
                             f"{self.sampling['temperature']}); drop --unseeded")

    @property
    def job(self) -> str:
        if self.engine == "vllm":
            return "vllm"
        return "speculative" if self.speculative else "deterministic" if self.deterministic else "simulated"


@dataclass(frozen=True)
class Generated:
    """What a generate job wrote: `claims` requests and `tokens` output tokens to `out`; details:
    the job's own figures (vllm: tokens_per_s; speculative: accepted, rounds)."""

    job: str
    out: Path
    claims: int
    tokens: int
    details: dict = field(default_factory=dict)


def generate(req: GenerateRequest) -> Generated:
    """Run the request's job (module docstring)."""
    done = JOBS[req.job](req)
    if req.unseeded:
        write_claims(req.out, [replace(c, sampling=c.sampling.without_seed()) for c in read_claims(req.out)])
    return done


def _vllm(req: GenerateRequest) -> Generated:
    gen = pipeline.generate_with_vllm(req.provider, req.model_dir, req.out, n=req.n, max_tokens=req.max_tokens,
                                      seed=req.seed, spec=req.sampling)
    return Generated("vllm", req.out, len(gen.claims), gen.n_tokens, {"tokens_per_s": gen.tokens_per_s})


def _speculative(req: GenerateRequest) -> Generated:
    from verinfer.models.testbed import DRAFT_DIR

    claims = speculative.generate_claims_file(req.model_dir, req.draft_dir or DRAFT_DIR, req.out,
                                              rule=req.speculative, threshold=req.threshold, gamma=req.gamma,
                                              n=req.n, max_tokens=req.max_tokens, seed=req.seed,
                                              temperature=req.sampling["temperature"], judge_path=req.judge,
                                              device=req.device, draft_confidence=req.draft_confidence)
    events = [c.extra["spec"]["events"] for c in claims]
    return Generated("speculative", req.out, len(claims), sum(len(c.output_token_ids) for c in claims),
                     {"accepted": sum(e.count("a") for e in events),
                      "rounds": sum(e.count("r") + e.count("b") for e in events)})


def _deterministic(req: GenerateRequest) -> Generated:
    claims = determinism.generate(req.model_dir, req.out, policy=req.deterministic, n=req.n,
                                  max_tokens=req.max_tokens, seed=req.seed, tau_file=req.tau_file, device=req.device)
    return Generated("deterministic", req.out, len(claims), sum(len(c.output_token_ids) for c in claims))


def _simulated(req: GenerateRequest) -> Generated:
    fp_spec = FingerprintSpec.parse(req.fingerprint) if req.fingerprint else None
    claims = pipeline.generate(req.provider, req.model_dir, req.out, n=req.n, max_tokens=req.max_tokens,
                               seed=req.seed, device=req.device, fingerprint=fp_spec, spec=req.sampling)
    return Generated("simulated", req.out, len(claims), sum(len(c.output_token_ids) for c in claims))


JOBS = {"vllm": _vllm, "speculative": _speculative, "deterministic": _deterministic, "simulated": _simulated}
