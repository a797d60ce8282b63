"""A seeded or greedy audit of a completions endpoint that returns token ids, on the audit core:
what `verinfer audit-api` asks, and how its mode, detector and bands are decided.

    mode         `seeded`: temperature > 0 with a per-request seed, the claims naming the noise
                 backend the endpoint samples with; `greedy`: temperature 0 (DiFR appendix D) for
                 endpoints that do not honour seeds; `auto` (`probed_mode`): the first prompt sent
                 twice with one seed, identical ids -> seeded, with the noise backend that
                 reproduces the reply (`recognise_noise`), else greedy
    detector     clipped-mean on the margin (glrt with --sequential, greedy in greedy mode)
                 calibrated on verinfer's honest runs (`core.local_runs.simulated_claims`, same
                 prompt distribution and settings, other prompts), cached beside its settings:
                 a user-given --detector made for other settings is an error before any request
    bands        greedy mode: the endpoint's summary placed among verinfer's own bf16, fp8-KV and
                 4-bit greedy runs replayed by the same verifier (`local_runs.TOKEN_BANDS`)
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from verinfer.core.auditor import AuditCore
from verinfer.core.local_runs import TOKEN_BANDS as BANDS, simulated_claims
from verinfer.audit.replay import score_chunk
from verinfer.core.sources import CompletionsSource
from verinfer.claims import Claim
from verinfer.detect import Detector
from verinfer.detect.cache import DetectorCache
from verinfer.detect.calibrate import calibrate
from verinfer.detect.summary import margin_clip, summarize
from verinfer.errors import VerinferError
from verinfer.io import atomic_write_text
from verinfer.models.prompts import CALIB_SEED_OFFSET, prompts_for
from verinfer.providers.openai_http import Endpoint, probe_seed_replies
from verinfer.providers.simulated import HONEST, request_seed
from verinfer.sampling.noise import NOISE_BACKENDS
from verinfer.sampling.params import SamplingParams
from verinfer.scores import CLAIM_ID, EXACT_MATCH, load_score_tables

MODES = ("auto", "seeded", "greedy")
DETECTOR = "clipped-mean"  # on the margin; its clip_ also clips the margin `summarize` reports
SEQUENTIAL_DETECTOR = "glrt"  # the e-process of --sequential runs on its per-token evidence
GREEDY_DETECTOR = "greedy"  # temperature-0 claims: mismatches counted, margins capped where honest near-ties end
RECOGNISE_MIN = 0.75  # auto mode: a noise backend is recognised when it reproduces this share of the probe
PLAIN_NOISES = tuple(n for n in NOISE_BACKENDS.names() if n != "speculative-keyed")  # what an endpoint can sample with
# (sglang-seeded and -sorted included: SGLang's --enable-deterministic-inference with the request's seed)
FIXED_SEEDS = {  # the seeds a vendor whose replies do not change with the request's seed is tried with, in order
    42: "SGLang --enable-deterministic-inference: a request without a seed (or one it drops) samples with 42",
    0: "a server that seeds every request with one global seed, left at the common default 0",
}


@dataclass(frozen=True)
class ApiAuditConfig:
    base_url: str
    model: str                        # the name the endpoint serves
    model_dir: Path                   # the trusted local copy of that model
    out_dir: Path
    n: int = 32
    max_tokens: int = 64
    seed: int = 0
    mode: str = "auto"
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.95
    min_p: float = 0.0
    noise: str = "vllm-cpu"
    ignore_eos: bool = False          # vLLM / verinfer serve extension; fixed-length outputs
    api_key: str = "EMPTY"
    timeout: float = 120.0
    max_retries: int = 2
    honest: tuple[str, ...] = tuple(HONEST)
    calib_n: int | None = None        # prompts per honest calibration run (default: max(n, 64))
    detector: Path | None = None      # reuse (or create) a calibrated detector here
    target_fpr: float = 0.01
    device: str = "cpu"
    threads: int | None = None        # torch threads of the auditor (None: torch's default)
    matmul: str = "native"            # verifier matmuls: native bf16 | fp32 (Numerics.matmul, faster on CPU)
    sequential: bool = False          # glrt e-process, stop sending requests once it flags (seeded mode)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.base_url, self.model, self.api_key, self.timeout, self.max_retries, self.ignore_eos)

    @property
    def n_calib(self) -> int:
        return self.calib_n or max(self.n, 64)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"need n >= 1 and max_tokens >= 1, got {self.n}, {self.max_tokens}")
        unknown = [h for h in self.honest if h not in HONEST]
        if unknown:
            raise ValueError(f"unknown honest configurations {unknown}; choose from {', '.join(HONEST)}")
        if self.mode != "greedy" and self.temperature <= 0:
            raise ValueError("temperature must be > 0 for a seeded audit; use --mode greedy for temperature 0")
        if self.sequential and self.mode == "greedy":
            raise ValueError("--sequential needs seeded claims (their post-Gumbel gaps); not --mode greedy")

    @property
    def detector_name(self) -> str:
        return SEQUENTIAL_DETECTOR if self.sequential else DETECTOR

    def detector_for(self, mode: str) -> str:
        """The detector of an audit in `mode`: greedy claims get the greedy detector (detect.greedy)."""
        return GREEDY_DETECTOR if mode == "greedy" and not self.sequential else self.detector_name


def collect_manifest(cfg: ApiAuditConfig, mode: str, prompts: list[list[int]]) -> dict:
    """What identifies an endpoint's collection: where, what was asked, the prompts' digest."""
    h = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
    return {"base_url": cfg.base_url, "model": cfg.model, "mode": mode, "n": cfg.n, "max_tokens": cfg.max_tokens,
            "seed": cfg.seed, "temperature": cfg.temperature if mode == "seeded" else 0.0, "top_k": cfg.top_k,
            "top_p": cfg.top_p, "min_p": cfg.min_p, "noise": cfg.noise, "ignore_eos": cfg.ignore_eos,
            "prompts_sha256": h}


def probe_params(cfg: ApiAuditConfig) -> SamplingParams:
    """The seeded request `--mode auto` sends twice: temperature >= 1 so a seed matters."""
    return SamplingParams(max(cfg.temperature, 1.0), cfg.top_k, cfg.top_p, cfg.min_p, request_seed(cfg.seed, 10**6),
                          min(16, cfg.max_tokens), cfg.noise)


def probe_candidates(noise: str) -> tuple[str, ...]:
    """The noise backends a seed probe tries, in order: the declared `noise` first, then the other
    PLAIN_NOISES (what `audit-api --mode auto` and the sampled chat audits both try)."""
    return (noise,) + tuple(n for n in PLAIN_NOISES if n != noise)


def recognise_claim_noise(claim: Claim, engine, candidates: tuple[str, ...] = PLAIN_NOISES,
                          retokenizer=None) -> tuple[str | None, dict[str, float]]:
    """The noise backend a seeded reply was sampled with: the claim replayed by the trusted model
    (`engine`) under each candidate backend. (best, {backend: exact match}); best is the first
    candidate with the highest exact match, None when it is below RECOGNISE_MIN (no known backend
    reproduces the reply: a wrong model or settings, or a sampler verinfer does not know).
    retokenizer: a chat claim derived from text is re-cut under each candidate
    (`audit.replay.recut_claims`), so the ids compared are the sampled ones, not the canonical ones.
    Backends that refuse the probe's settings (SGLang's seeded sampler and min-p) are not candidates."""
    candidates = tuple(n for n in candidates if claim.sampling.min_p == 0 or NOISE_BACKENDS[n].supports_min_p)
    if not claim.output_token_ids:
        return None, {}
    claims = [replace(claim, id=f"probe-{name}", sampling=replace(claim.sampling, noise=name)) for name in candidates]
    table = score_chunk(claims, engine, retokenizer=retokenizer)
    ids = np.asarray(table[CLAIM_ID].to_pylist())
    exact = np.asarray(table[EXACT_MATCH].to_numpy(zero_copy_only=False), dtype=bool)
    rates = {name: float(exact[ids == f"probe-{name}"].mean()) for name in candidates}
    best = max(candidates, key=lambda n: rates[n])  # max keeps the first of equals
    return (best if rates[best] >= RECOGNISE_MIN else None), rates


def recognise_noise(prompt_ids: list[int], output_ids: list[int], params: SamplingParams, engine, model_name: str,
                    candidates: tuple[str, ...] = PLAIN_NOISES) -> tuple[str | None, dict[str, float]]:
    """`recognise_claim_noise` of one seeded token-id reply (a completions endpoint's)."""
    return recognise_claim_noise(Claim("probe", model_name, list(prompt_ids), list(output_ids), params), engine,
                                 candidates)


def recognise_fixed_seed(claim: Claim | None, engine, candidates: tuple[str, ...] = PLAIN_NOISES,
                         seeds: tuple[int, ...] = tuple(FIXED_SEEDS), retokenizer=None) -> dict:
    """The one seed a vendor whose replies do not change with the seed (`seed_probe`'s `fixed_noise`)
    samples every request with: the probe's claim with its seed replaced by each of `seeds` (default
    FIXED_SEEDS, in order) replayed under each candidate backend (`recognise_claim_noise`); the first
    seed some backend reproduces (exact match >= RECOGNISE_MIN) wins. {"fixed_seed": seed or None,
    "noise": backend or None, "fixed_seed_exact_match": {str(seed): {backend: exact match}}}."""
    found: dict = {"fixed_seed": None, "noise": None, "fixed_seed_exact_match": {}}
    for seed in seeds if claim is not None else ():
        best, rates = recognise_claim_noise(replace(claim, sampling=replace(claim.sampling, seed=int(seed))), engine,
                                            candidates, retokenizer)
        found["fixed_seed_exact_match"][str(seed)] = rates
        if best is not None:
            return {**found, "fixed_seed": int(seed), "noise": best}
    return found


def seed_probe(ask, engine, candidates: tuple[str, ...], retokenizer=None) -> dict:
    """The one seed probe of every audit that sends requests (audit-api --mode auto, the sampled chat
    audits): `ask(i)` sends probe request i and returns (reply, claim of it): requests 0 and 1 carry
    the same seed, request 2 another. `honours_seeds`: the same seed gave the same reply and another
    seed another one (a vendor that ignores seeds answers the same seed differently, or every seed
    alike); then the noise backend that reproduces the reply (`recognise_claim_noise`: `noise`,
    `recognised`, `probe_exact_match`). `fixed_noise` (with request 2 sent): the reply does not change
    with the seed (the same seed the same reply, another seed the same reply too): the vendor samples
    every request with one seed of its own (or a cache answers), so its replies share one noise stream
    and are no independent draws (`recognise_fixed_seed` looks for that seed). ask(2) returning None
    skips the second seed (token ids compared alone, as audit-api does); a claim of None (a reply with
    nothing to score) is recognised as no backend."""
    (a, claim), (b, _) = ask(0), ask(1)
    other = ask(2)
    same_seed, seed_matters = a == b, other is None or other[0] != a
    record = {"probe": "same seed twice" + ("" if other is None else ", another seed once"),
              "same_seed_same_reply": same_seed, "honours_seeds": same_seed and seed_matters}
    if other is not None:
        record.update(other_seed_other_reply=seed_matters, fixed_noise=same_seed and not seed_matters)
    if record["honours_seeds"]:
        best, rates = (recognise_claim_noise(claim, engine, candidates, retokenizer) if claim is not None
                       else (None, {}))
        record.update(noise=best, recognised=best is not None, probe_exact_match=rates)
    return record


def claimed_params(cfg: ApiAuditConfig, mode: str, i: int) -> SamplingParams:
    if mode == "greedy":
        return SamplingParams(0.0, -1, 1.0, 0.0, None, cfg.max_tokens, cfg.noise)
    return SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, request_seed(cfg.seed, i),
                          cfg.max_tokens, cfg.noise)


def detector_meta(cfg: ApiAuditConfig, mode: str, info) -> dict:
    meta = {"mode": mode, "model_weights_sha256": info.weights_sha256, "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature if mode == "seeded" else 0.0, "top_k": cfg.top_k, "top_p": cfg.top_p,
            "min_p": cfg.min_p, "noise": cfg.noise, "honest": list(cfg.honest), "verifier_matmul": cfg.matmul}
    return {**meta, "detector": cfg.detector_for(mode)} if cfg.sequential or mode == "greedy" else meta


def detector_path(cfg: ApiAuditConfig) -> Path:
    return Path(cfg.detector) if cfg.detector else Path(cfg.out_dir) / "detector.json"


def reusable_detector(cfg: ApiAuditConfig, modes: tuple[str, ...], info,
                      noises: tuple[str, ...] | None = None) -> Detector | None:
    """The detector saved at cfg.detector (or out_dir/detector.json) when it was made for this model
    and these settings in one of `modes` (its `.meta.json` sidecar says); None when there is none
    yet (it is fit and saved there). Any other detector is an error: audit_api calls this before the
    first request, so a settings mismatch costs nothing collected. noises: the backends the claims may
    name (auto mode, before the probe recognises one; default cfg.noise)."""
    cache = DetectorCache(detector_path(cfg))
    det_path = cache.path
    if not det_path.is_file():
        return None
    metas = [detector_meta(replace(cfg, noise=n), m, info) for m in modes for n in (noises or (cfg.noise,))]
    old = cache.saved_meta()
    if old not in metas:
        ref = next((m for m in metas if isinstance(old, dict) and m["mode"] == old.get("mode")), metas[0])
        diff = ("no .meta.json sidecar" if not isinstance(old, dict)
                else "different " + ", ".join(k for k in ref if old.get(k) != ref[k]))
        raise VerinferError(f"this detector was calibrated for other settings ({diff})",
                            where=str(det_path), fix="pass another --detector path (it is created if missing)")
    det = cache.load()
    want = cfg.detector_for(old["mode"])
    if det.NAME != want:
        raise VerinferError(f"audit-api{' --sequential' if cfg.sequential else ''} in {old['mode']} mode uses {want} "
                            f"detectors, this is a {det.NAME} detector", where=str(det_path),
                            fix="pass another --detector path (it is created if missing)")
    return det


def _local_runs(core: AuditCore, cfg: ApiAuditConfig, names: list[str], mode: str, sub: str) -> list[Path]:
    """Claims of verinfer's own simulated providers `names` on fresh prompts (other seeds than the
    endpoint's) with the endpoint's advertised settings in `mode`; cached in out_dir/sub."""
    base = cfg.seed + CALIB_SEED_OFFSET
    prompts = prompts_for(cfg.model_dir, cfg.n_calib, base)
    return simulated_claims(names, cfg.model_dir, prompts, claimed_params(cfg, mode, 0), core.out / sub, base,
                            cfg.device, core.show)


def calibrated_detector(core: AuditCore, cfg: ApiAuditConfig, mode: str) -> tuple[Detector, dict]:
    """A clipped-mean margin detector (glrt with cfg.sequential, greedy in greedy mode) fit on
    verinfer's honest runs; loaded from cfg.detector if it exists and was made for the same model
    and settings (`reusable_detector`), else fit and saved there."""
    det = reusable_detector(cfg, (mode,), core.info)
    if det is not None:
        return det, {}
    t0 = time.perf_counter()
    paths = _local_runs(core, cfg, list(cfg.honest), mode, f"calibration-{mode}" + ("-gaps" if cfg.sequential else ""))
    t1 = time.perf_counter()
    table = load_score_tables([core.score_file(p) for p in paths])
    det = calibrate(table, list(cfg.honest), detector=cfg.detector_for(mode), target_fpr=cfg.target_fpr, seed=cfg.seed)
    DetectorCache(detector_path(cfg)).save(det, detector_meta(cfg, mode, core.info))
    return det, {"calibration_generate_s": t1 - t0, "calibration_score_s": time.perf_counter() - t1}


def reference_bands(core: AuditCore, cfg: ApiAuditConfig, det: Detector, n_boot: int = 1000) -> dict:
    """Greedy mode: mean clipped margin and mean cross-entropy (with a 95% bootstrap interval over
    claims) of verinfer's own bf16, fp8-KV and 4-bit greedy runs replayed by the bf16 verifier."""
    paths = _local_runs(core, cfg, list(BANDS.values()), "greedy", "bands")
    return {band: summarize(core.scores(path), margin_clip(det), n_boot=n_boot, seed=cfg.seed)
            for band, path in zip(BANDS, paths)}


def probed_mode(cfg: ApiAuditConfig, client, prompt: list[int], core: AuditCore, noises: tuple[str, ...]):
    """(mode, cfg): auto mode asks the endpoint the same seeded prompt twice: the same reply means it
    honours seeds (seeded, with the noise backend that reproduces the reply, `recognise_noise`),
    another means greedy. The answer is kept in out_dir/mode.json, so a rerun asks nothing."""
    if cfg.mode != "auto":
        return cfg.mode, cfg
    mode_file = Path(cfg.out_dir) / "mode.json"
    if mode_file.is_file():
        saved = json.loads(mode_file.read_text())
        return saved["mode"], replace(cfg, noise=saved.get("noise", cfg.noise))
    probe = probe_params(cfg)
    replies = {}

    def ask(i: int):
        if i == 2:
            return None
        if not replies:
            replies.update(zip("pab", probe_seed_replies(client, cfg.endpoint, prompt, probe,
                                                         vocab_size=core.info.vocab_size)))
        reply = replies["a" if i == 0 else "b"]
        return reply, Claim("probe", core.info.name, list(replies["p"]), list(reply), probe)

    probed = seed_probe(ask, core.engine, noises)
    mode = "seeded" if probed["honours_seeds"] else "greedy"
    record = {"mode": mode, "probe": "same seed twice"}
    if mode == "seeded":
        cfg = replace(cfg, noise=probed["noise"] or cfg.noise)
        record.update(noise=cfg.noise, recognised=probed["recognised"], probe_exact_match=probed["probe_exact_match"])
    atomic_write_text(mode_file, json.dumps(record))
    return mode, cfg


def completions_source(client, cfg: ApiAuditConfig, mode: str, prompts: list[list[int]],
                       local_name: str, vocab_size: int) -> CompletionsSource:
    """The endpoint's requests as a collection source: prompt i asks `claimed_params(cfg, mode, i)`."""
    return CompletionsSource(client, cfg.endpoint, prompts, [claimed_params(cfg, mode, i) for i in range(len(prompts))],
                             local_name, vocab_size, collect_manifest(cfg, mode, prompts))


__all__ = ["ApiAuditConfig", "BANDS", "FIXED_SEEDS", "MODES", "PLAIN_NOISES", "calibrated_detector", "claimed_params",
           "collect_manifest", "completions_source", "detector_meta", "probe_candidates", "probe_params",
           "probed_mode", "recognise_claim_noise", "recognise_fixed_seed", "recognise_noise", "reference_bands",
           "reusable_detector", "seed_probe"]
