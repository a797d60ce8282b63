"""Per-request sampling settings, shared by the engine, the samplers and the claims format."""

from __future__ import annotations

from dataclasses import asdict, dataclass

NOISE_BACKENDS = ("vllm-cpu", "vllm-v1-exponential", "keyed", "inverse-cdf", "speculative-keyed")


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks the sampler for.

    temperature 0 means greedy (no noise is drawn, the generator does not advance).
    top_k <= 0, top_p >= 1 and min_p <= 0 switch that filter off.
    seed is required whenever temperature > 0 (a replay without it is impossible).
    noise names the backend that turns the seed into per-step noise (sampling/noise.py).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    noise: str = "vllm-cpu"

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.noise not in NOISE_BACKENDS:
            raise ValueError(f"unknown noise backend {self.noise!r}; choose one of {NOISE_BACKENDS}")
        if self.temperature > 0 and self.seed is None:
            raise ValueError("seed is required when temperature > 0 (set sampling.seed)")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)
