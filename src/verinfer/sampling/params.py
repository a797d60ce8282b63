"""Per-request sampling settings, shared by the engine, the samplers and the claims format.

`check_sampling` is the one validation of sampling settings: SamplingParams runs it on
construction and the claims reader (claims.SamplingRecord) runs it on every claim line.
`stop_reason` is the one stop rule of every decoder (engine, speculative, target-only), and
`misconfigured` the one rule of what a misconfigured provider really samples with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Collection

from verinfer.sampling.noise import NOISE_BACKENDS

SEEDED, GREEDY, UNSEEDED = "seeded", "greedy", "unseeded"
AUDIT_MODES = (SEEDED, GREEDY, UNSEEDED)  # `SamplingParams.audit_mode`; recorded per scored token (scores.MODE)
MAX_TEMPERATURE = 100.0  # beyond it logits / temperature leave no usable distribution (and 1e308 overflows)


class SamplingParamError(ValueError):
    """A sampling setting out of range: `field` names it, `detail` says what is wrong with it."""

    def __init__(self, field: str, detail: str):
        self.field, self.detail = field, detail
        super().__init__(f"{field} {detail}")


def check_sampling(*, temperature: float, top_p: float, min_p: float, seed: int | None, noise: str | None,
                   max_tokens: int | None = None, unseeded: bool = False) -> None:
    """Raise SamplingParamError for the first setting out of range (top_k: any value; <= 0 is off).
    unseeded: a sampled claim whose seed is unknown (audited distributionally, sampling/pit.py):
    temperature > 0 and no seed; it draws no noise, so its `noise` may be None and is not checked
    (neither the name nor a backend's limits, SGLang's refusal of min-p: the claim is judged from
    the reference's filtered distribution alone)."""
    if not (0.0 <= temperature <= MAX_TEMPERATURE):
        raise SamplingParamError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if not (0.0 < top_p <= 1.0):
        raise SamplingParamError("top_p", f"must be in (0, 1], got {top_p}")
    if not (0.0 <= min_p <= 1.0):
        raise SamplingParamError("min_p", f"must be in [0, 1], got {min_p}")
    if max_tokens is not None and max_tokens < 1:
        raise SamplingParamError("max_tokens", f"must be >= 1, got {max_tokens}")
    if not unseeded:
        if noise is None:
            raise SamplingParamError("noise", "is missing: a greedy or seeded claim names its noise backend (only an "
                                              "unseeded claim, `\"seed\": null` at temperature > 0, may leave it null)")
        backend = NOISE_BACKENDS.get(noise)  # an unknown name raises, listing the backends
    if not unseeded and min_p > 0 and not backend.supports_min_p:
        raise SamplingParamError("min_p", f"must be 0 with noise {noise!r}, got {min_p}: SGLang's seeded sampler "
                                          "refuses min-p (an assert in top_k_top_p_min_p_sampling_from_probs_torch), "
                                          "so no such reply exists to replay")
    if unseeded:
        if temperature == 0:
            raise SamplingParamError("temperature", "is 0 in an unseeded claim: an unseeded claim is sampled "
                                                    "(temperature > 0); a greedy one needs no seed")
        if seed is not None:
            raise SamplingParamError("seed", f"is {seed} in an unseeded claim (a claim with a seed is replayed seeded)")
    elif temperature > 0 and seed is None:
        raise SamplingParamError("seed", "is missing but temperature > 0: a seeded replay needs the seed the sampler "
                                         "drew with (set the seed, sample at temperature 0, or mark the claim "
                                         "unseeded: `\"seed\": null` in a claims file)")
    if seed is not None and not (0 <= seed < 2**63):
        raise SamplingParamError("seed", f"must be in [0, 2**63), got {seed}")


def stop_reason(token: int, n_out: int, max_tokens: int, stop_token_ids: Collection[int]) -> str | None:
    """Why a sequence ends after emitting `token` as its n_out-th output token: "stop" (a stop
    token, checked first), "length" (max_tokens reached), or None (it goes on)."""
    if token in stop_token_ids:
        return "stop"
    if n_out >= max_tokens:
        return "length"
    return None


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks the sampler for.

    temperature 0 means greedy (no noise is drawn, the generator does not advance).
    top_k <= 0, top_p >= 1 and min_p <= 0 switch that filter off.
    seed is required whenever temperature > 0 (a replay without it is impossible), unless
    unseeded: a sampled claim whose seed is unknown (`"seed": null` in a claims file), audited
    from the reference's distribution alone (audit mode "unseeded", sampling/pit.py); it cannot
    be generated or replayed seeded.
    noise names the backend that turns the seed into per-step noise (sampling/noise.py); an
    unseeded claim draws none: its noise may be None (and is never read).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    noise: str | None = "vllm-cpu"
    unseeded: bool = False

    def __post_init__(self):
        check_sampling(temperature=self.temperature, top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                       noise=self.noise, max_tokens=self.max_tokens, unseeded=self.unseeded)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def audit_mode(self) -> str:
        """How a claim with these settings is audited: "greedy" (temperature 0), "unseeded" (sampled,
        no usable seed) or "seeded" (the seed replays the sampler's noise)."""
        return GREEDY if self.greedy else UNSEEDED if self.unseeded else SEEDED

    def without_seed(self) -> "SamplingParams":
        """These settings as a sampled reply whose seed is unknown is claimed with: unseeded, no seed,
        no noise (a vendor that ignores seeds; honest runs for an unseeded detector)."""
        return replace(self, seed=None, noise=None, unseeded=True)

    def to_dict(self) -> dict:
        return asdict(self)


def misconfigured(claimed: SamplingParams, temperature: float | None = None, seed_offset: int = 0) -> SamplingParams:
    """What a misconfigured sampler really uses when it claims `claimed`: `temperature` instead of
    the claimed one (None: the claimed one) and seed + seed_offset; a greedy request draws no
    noise, so it is left as claimed. The one rule of the simulated providers, the server's
    --misconfig and the vLLM runs."""
    if claimed.greedy:
        return claimed
    if claimed.unseeded:
        return replace(claimed, temperature=claimed.temperature if temperature is None else temperature)
    return replace(claimed, temperature=claimed.temperature if temperature is None else temperature,
                   seed=(claimed.seed + seed_offset) % 2**63)
