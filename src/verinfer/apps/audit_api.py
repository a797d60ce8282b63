"""Audit any OpenAI-compatible endpoint (verinfer serve, vLLM, a provider's API).

    collect  seeded prompts (token ids) go out through the official `openai` client; the
             endpoint's prompt and output token ids come back (vLLM's `return_token_ids`; verinfer
             serve always sends them) and become claims. Text is never re-tokenized: an endpoint
             that returns no token ids cannot be audited and says so.
    replay   the trusted local model replays the claims (audit/replay.py)
    audit    a detector calibrated on verinfer's own honest runs (providers/simulated.py HONEST, same
             prompt distribution and sampling settings, other prompts) gives the verdict.

Modes (`mode`):
- `seeded`: temperature > 0 with a per-request seed; the claims name the noise backend the
  endpoint samples with (vllm-cpu for vLLM on CPU and for verinfer serve).
- `greedy`: temperature 0, for endpoints that do not honour seeds (DiFR appendix D): no seed
  synchronization is needed; besides the verdict, the endpoint's mean clipped margin and
  cross-entropy are placed among reference bands from verinfer's own bf16, fp8-KV and 4-bit
  greedy runs replayed by the same bf16 verifier.
- `auto`: send the first prompt twice with the same seed; identical token ids -> seeded,
  otherwise greedy. Seeded: the probe's tokens are replayed by the trusted model under every known
  noise backend (`recognise_noise`) and the claims name the one that reproduces the most of them
  (--noise first on ties; kept when none reproduces at least RECOGNISE_MIN of them): an endpoint
  sampling with vllm-cpu, keyed, vLLM MRv2's keyed Gumbel, ... is audited with its own noise.

Claims are written atomically (whole file replaced) after every response (`apps.collect`), next to
a manifest of the audit's settings and requests.json (the requests sent; a prompt answered without
output tokens is not asked again): a dead endpoint costs nothing already collected, and rerunning
the same command resumes where it stopped. A response is checked against the trusted model before it is
saved (`providers.openai_http.check_token_reply`: ids in its vocabulary, at most max_tokens, the
prompt sent, a finish reason that fits): a bad one is an error and is never saved, so it cannot
poison the resume.

`sequential` (seeded mode): the detector is the glrt (calibrated first, on gap scores); every
answer is replayed as it arrives and the anytime-valid e-process of `detect.sequential` is updated;
requests stop once it flags (the false-positive rate stays at most target_fpr whenever it stops).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from verinfer.apps.collect import collect
from verinfer.apps.pipeline import VERIFIER_NUMERICS, reference_engines, score, scores_current, verifier_engine
from verinfer.audit.replay import StreamRows, score_chunk
from verinfer.models.prompts import CALIB_SEED_OFFSET, prompts_for
from verinfer.claims import Claim, write_claims
from verinfer.io import atomic_write_text, check_writable
from verinfer.progress import progress_bar
from verinfer.detect import Detector
from verinfer.detect.sequential import SequentialAudit, StreamingAudit
from verinfer.detect.cache import DetectorCache
from verinfer.detect.summary import interval, margin_clip, nearest_band, summarize
from verinfer.detect.calibrate import calibrate
from verinfer.detect.verdict import Verdict
from verinfer.providers.openai_http import Endpoint, EndpointError, openai_client, probe_seed_replies, request_completion
from verinfer.providers.simulated import HONEST, MISCONFIGURED, PROVIDERS, request_seed, run_provider
from verinfer.scores import CLAIM_ID, CROSS_ENTROPY, EXACT_MATCH, MARGIN, load_score_tables
from verinfer.errors import VerinferError
from verinfer.registry import Registry
from verinfer.models.load import model_info
from verinfer.sampling.noise import NOISE_BACKENDS
from verinfer.sampling.params import SamplingParams

MODES = ("auto", "seeded", "greedy")
# reference band -> the simulated provider that runs it (the chat audits' bands with token-id prompts)
BANDS: Registry[str] = Registry("reference band", {"bf16": "honest-bf16-b8", "fp8-kv": "fp8-kv", "int4": "int4"})
DETECTOR = "clipped-mean"  # on the margin; its clip_ also clips the margin `summarize` reports
SEQUENTIAL_DETECTOR = "glrt"  # the e-process of --sequential runs on its per-token evidence
GREEDY_DETECTOR = "greedy"  # temperature-0 claims: mismatches counted, margins capped where honest near-ties end
RECOGNISE_MIN = 0.75  # auto mode: a noise backend is recognised when it reproduces this share of the probe
PLAIN_NOISES = tuple(n for n in NOISE_BACKENDS.names() if n != "speculative-keyed")  # what an endpoint can sample with


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


@dataclass
class ApiAuditResult:
    verdict: Verdict
    mode: str
    claims: Path
    scores: Path
    report: Path
    n_claims: int
    n_tokens: int
    exact_match: float
    bands: dict | None = None
    timings: dict = field(default_factory=dict)


# --- collection with resume -------------------------------------------------------------------
def _manifest(cfg: ApiAuditConfig, mode: str, prompts: list[list[int]]) -> dict:
    h = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
    return {"base_url": cfg.base_url, "model": cfg.model, "mode": mode, "n": cfg.n, "max_tokens": cfg.max_tokens,
            "seed": cfg.seed, "temperature": cfg.temperature if mode == "seeded" else 0.0, "top_k": cfg.top_k,
            "top_p": cfg.top_p, "min_p": cfg.min_p, "noise": cfg.noise, "ignore_eos": cfg.ignore_eos,
            "prompts_sha256": h}


def probe_params(cfg: ApiAuditConfig) -> SamplingParams:
    """The seeded request `--mode auto` sends twice: temperature >= 1 so a seed matters."""
    return SamplingParams(max(cfg.temperature, 1.0), cfg.top_k, cfg.top_p, cfg.min_p, request_seed(cfg.seed, 10**6),
                          min(16, cfg.max_tokens), cfg.noise)


def recognise_noise(prompt_ids: list[int], output_ids: list[int], params: SamplingParams, engine, model_name: str,
                    candidates: tuple[str, ...] = PLAIN_NOISES) -> tuple[str | None, dict[str, float]]:
    """The noise backend an endpoint samples with, from one seeded reply: its tokens replayed by the
    trusted model (`engine`) under each candidate backend. (best, {backend: exact match}); best is
    the first candidate with the highest exact match, None when it is below RECOGNISE_MIN (no
    known backend reproduces the reply: a wrong model or settings, which the audit then flags)."""
    if not output_ids:
        return None, {}
    claims = [Claim(f"probe-{name}", model_name, list(prompt_ids), list(output_ids), replace(params, noise=name))
              for name in candidates]
    table = score_chunk(claims, engine)
    ids = np.asarray(table[CLAIM_ID].to_pylist())
    exact = np.asarray(table[EXACT_MATCH].to_numpy(zero_copy_only=False), dtype=bool)
    rates = {name: float(exact[ids == f"probe-{name}"].mean()) for name in candidates}
    best = max(candidates, key=lambda n: rates[n])  # max keeps the first of equals
    return (best if rates[best] >= RECOGNISE_MIN else None), rates


def claimed_params(cfg: ApiAuditConfig, mode: str, i: int) -> SamplingParams:
    if mode == "greedy":
        return SamplingParams(0.0, -1, 1.0, 0.0, None, cfg.max_tokens, cfg.noise)
    return SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, request_seed(cfg.seed, i),
                          cfg.max_tokens, cfg.noise)


class CompletionsSource:
    """audit-api's requests (`apps.collect.Source`): token-id prompts to a completions endpoint, one
    at a time; a reply is checked against the trusted model (`openai_http.request_completion`)
    before it becomes a claim, and one with no output tokens is none."""

    concurrency = 1

    def __init__(self, client, cfg: ApiAuditConfig, mode: str, prompts: list[list[int]], local_name: str):
        self.client, self.cfg, self.mode, self.prompts, self.local_name = client, cfg, mode, prompts, local_name
        self.manifest = _manifest(cfg, mode, prompts)
        self.vocab_size = model_info(cfg.model_dir).vocab_size  # every reply's ids are checked against it

    def __len__(self) -> int:
        return len(self.prompts)

    def claim_id(self, i: int) -> str:
        return f"api-{i:05d}"

    def send(self, i: int) -> tuple[list[int], list[int], str]:
        params = claimed_params(self.cfg, self.mode, i)
        return request_completion(self.client, self.cfg.endpoint, self.prompts[i], params,
                                  f"request {i} (claim {self.claim_id(i)})", vocab_size=self.vocab_size)

    def claim(self, i: int, reply: tuple[list[int], list[int], str]) -> Claim | None:
        p_ids, o_ids, finish = reply
        if not o_ids:
            return None
        return Claim(self.claim_id(i), self.local_name, p_ids, o_ids, claimed_params(self.cfg, self.mode, i),
                     provider=f"api:{self.cfg.model}", extra={"finish_reason": finish})

    def interrupted(self, what: str, saved: int, path: Path) -> str:
        return f"{what} ({saved} of {len(self)} claims collected, saved in {path})"

    def check_collected(self, claims: list[Claim]) -> None:
        if not claims:
            raise EndpointError(f"the endpoint returned no output tokens for any of {len(self)} prompts",
                                where=self.cfg.base_url, fix="check max_tokens and the model the endpoint serves")


def collect_claims(client, cfg: ApiAuditConfig, mode: str, prompts: list[list[int]], local_name: str,
                   progress=None, stop=None) -> tuple[Path, list[Claim]]:
    """Query every prompt not yet in out_dir/claims.jsonl and save after each answer
    (`apps.collect.collect` of a `CompletionsSource`: under a lock, resumable, a reply without
    output tokens never asked again). A reply that cannot be the trusted model's
    (`openai_http.check_token_reply`) is an EndpointError and nothing of it is saved; the claims
    saved before it stay, and a rerun resumes after them. stop(claims): called after each answer
    (and once on resumed claims); True ends the collection."""
    claims, _ = collect(CompletionsSource(client, cfg, mode, prompts, local_name), cfg.out_dir, progress, stop)
    return Path(cfg.out_dir) / "claims.jsonl", claims


# --- calibration and reference bands ----------------------------------------------------------
def _local_claims(names: list[str], cfg: ApiAuditConfig, mode: str, prompts: list[list[int]], out: Path,
                  base_seed: int, show_progress: bool = True) -> list[Path]:
    """Claims of verinfer's own simulated providers on these prompts (cached in `out`)."""
    advertised = claimed_params(cfg, mode, 0)
    paths = []
    for name in names:
        p = out / f"{name}.jsonl"
        if not p.is_file():
            with progress_bar(f"{out.name}: generate {name}", len(prompts), show_progress) as adv:
                claims = run_provider(PROVIDERS[name], cfg.model_dir, prompts, advertised, base_seed=base_seed,
                                      device=cfg.device, progress=adv)
            write_claims(p, [c for c in claims if c.output_token_ids])
        paths.append(p)
    return paths


def _detector_meta(cfg: ApiAuditConfig, mode: str, info) -> dict:
    meta = {"mode": mode, "model_weights_sha256": info.weights_sha256, "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature if mode == "seeded" else 0.0, "top_k": cfg.top_k, "top_p": cfg.top_p,
            "min_p": cfg.min_p, "noise": cfg.noise, "honest": list(cfg.honest), "verifier_matmul": cfg.matmul}
    return {**meta, "detector": cfg.detector_for(mode)} if cfg.sequential or mode == "greedy" else meta


def _detector_path(cfg: ApiAuditConfig) -> Path:
    return Path(cfg.detector) if cfg.detector else Path(cfg.out_dir) / "detector.json"


def reusable_detector(cfg: ApiAuditConfig, modes: tuple[str, ...], info,
                      noises: tuple[str, ...] | None = None) -> Detector | None:
    """The detector saved at cfg.detector (or out_dir/detector.json) when it was made for this model
    and these settings in one of `modes` (its `.meta.json` sidecar says); None when there is none
    yet (it is fit and saved there). Any other detector is an error: audit_api calls this before the
    first request, so a settings mismatch costs nothing collected. noises: the backends the claims may
    name (auto mode, before the probe recognises one; default cfg.noise)."""
    cache = DetectorCache(_detector_path(cfg))
    det_path = cache.path
    if not det_path.is_file():
        return None
    metas = [_detector_meta(replace(cfg, noise=n), m, info) for m in modes for n in (noises or (cfg.noise,))]
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


def calibrated_detector(cfg: ApiAuditConfig, mode: str, info, engine, score_fn,
                        show_progress: bool = True) -> tuple[Detector, dict]:
    """A clipped-mean margin detector (glrt with cfg.sequential, greedy in greedy mode) fit on
    verinfer's honest runs; loaded from cfg.detector if it
    exists and was made for the same model and settings (`reusable_detector`), else fit and saved
    there."""
    det = reusable_detector(cfg, (mode,), info)
    if det is not None:
        return det, {}
    calib_dir = Path(cfg.out_dir) / (f"calibration-{mode}" + ("-gaps" if cfg.sequential else ""))
    base = cfg.seed + CALIB_SEED_OFFSET
    prompts = prompts_for(cfg.model_dir, cfg.n_calib, base)
    t0 = time.perf_counter()
    paths = _local_claims(list(cfg.honest), cfg, mode, prompts, calib_dir, base, show_progress)
    t1 = time.perf_counter()
    spaths = [score_fn(p, p.with_suffix(".parquet")) for p in paths]
    table = load_score_tables(spaths)
    det = calibrate(table, list(cfg.honest), detector=cfg.detector_for(mode), target_fpr=cfg.target_fpr, seed=cfg.seed)
    DetectorCache(_detector_path(cfg)).save(det, _detector_meta(cfg, mode, info))
    return det, {"calibration_generate_s": t1 - t0, "calibration_score_s": time.perf_counter() - t1}


def reference_bands(cfg: ApiAuditConfig, det: Detector, score_fn, n_boot: int = 1000,
                    show_progress: bool = True) -> dict:
    """Greedy mode: mean clipped margin and mean cross-entropy (with a 95% bootstrap interval over
    claims) of verinfer's own bf16, fp8-KV and 4-bit greedy runs replayed by the bf16 verifier."""
    base = cfg.seed + CALIB_SEED_OFFSET
    prompts = prompts_for(cfg.model_dir, cfg.n_calib, base)
    paths = _local_claims(list(BANDS.values()), cfg, "greedy", prompts, Path(cfg.out_dir) / "bands", base,
                          show_progress)
    bands = {}
    for band, path in zip(BANDS, paths):
        t = load_score_tables([score_fn(path, path.with_suffix(".parquet"))])
        bands[band] = summarize(t, margin_clip(det), n_boot=n_boot, seed=cfg.seed)
    return bands


def probed_mode(cfg: ApiAuditConfig, client, prompt: list[int], engine, info, noises: tuple[str, ...]):
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
    p_ids, a, b = probe_seed_replies(client, cfg.endpoint, prompt, probe, vocab_size=info.vocab_size)
    mode = "seeded" if a == b else "greedy"
    record = {"mode": mode, "probe": "same seed twice"}
    if mode == "seeded":
        best, rates = recognise_noise(p_ids, a, probe, engine, info.name, noises)
        cfg = replace(cfg, noise=best or cfg.noise)
        record.update(noise=cfg.noise, recognised=best is not None, probe_exact_match=rates)
    atomic_write_text(mode_file, json.dumps(record))
    return mode, cfg


# --- the whole audit --------------------------------------------------------------------------
def audit_api(cfg: ApiAuditConfig, *, show_progress: bool = True) -> ApiAuditResult:
    """The whole audit: outputs and a saved detector's settings are checked before the first
    request; a progress bar for each long phase (requests, replay, calibration runs)."""
    t0 = time.perf_counter()
    check_writable(cfg.out_dir, "audit directory", directory=True)
    if cfg.detector:
        check_writable(cfg.detector, "detector file")
    if cfg.threads is not None:
        import torch

        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = model_info(cfg.model_dir)
    prompts = prompts_for(cfg.model_dir, cfg.n, cfg.seed)
    client = openai_client(cfg.endpoint)
    noises = (cfg.noise,) + tuple(n for n in PLAIN_NOISES if n != cfg.noise) if cfg.mode == "auto" else (cfg.noise,)
    reusable_detector(cfg, ("seeded", "greedy") if cfg.mode == "auto" else (cfg.mode,), info, noises)
    engine = verifier_engine(cfg.model_dir, VERIFIER_NUMERICS.with_(matmul=cfg.matmul), device=cfg.device)
    mode, cfg = probed_mode(cfg, client, prompts[0], engine, info, noises)
    t_probe = time.perf_counter()
    if cfg.sequential and mode == "greedy":
        raise VerinferError("the endpoint does not honour seeds (auto mode chose greedy): --sequential needs seeded "
                            "claims", where=cfg.base_url, fix="audit it without --sequential (greedy mode)")
    reusable_detector(cfg, (mode,), info)  # auto: the probe decided the mode and the noise

    refs = reference_engines(cfg.model_dir, engine, cfg.device) if cfg.sequential else None

    def score_fn(cpath: Path, spath: Path, keep_parts: bool = False) -> Path:
        """The replay of a claims file (skipped when `spath` is newer; the parts a sequential
        audit's stop rule replayed are read, not replayed again). keep_parts: the endpoint's
        claims, which a resumed audit extends."""
        if not scores_current(cpath, spath):
            score(cpath, cfg.model_dir, spath, engine=engine, show_progress=show_progress, gaps=cfg.sequential,
                  references=refs, keep_parts=keep_parts)
        return spath

    det, ctimes, stop = None, {}, None
    if cfg.sequential:  # calibrate first: each answer is judged as it arrives
        det, ctimes = calibrated_detector(cfg, mode, info, engine, score_fn, show_progress)
        stop = StreamingAudit(SequentialAudit(det, alpha=cfg.target_fpr), StreamRows(lambda claims: score(
            out / "claims.jsonl", cfg.model_dir, out / "scores.parquet", engine=engine, show_progress=False, gaps=True,
            references=refs, claims=claims, growing=True)))
    t_calib = time.perf_counter()
    with progress_bar(f"audit-api: requests to {cfg.base_url}", len(prompts), show_progress) as adv:
        claims_path, claims = collect_claims(client, cfg, mode, prompts, info.name, adv, stop=stop)
    t_collect = time.perf_counter()
    scores_path = score_fn(claims_path, out / "scores.parquet", keep_parts=cfg.sequential)
    t_score = time.perf_counter()
    if det is None:
        det, ctimes = calibrated_detector(cfg, mode, info, engine, score_fn, show_progress)
    table = load_score_tables([scores_path])
    verdict = (stop.audit.verdict(table) if stop else det.verdict(table)).with_(provider=f"api:{cfg.model}",
                                                                               honest=None)
    if stop:
        verdict = verdict.with_(requests_sent=len(claims), requests_planned=len(prompts))
    bands = None
    point = None if cfg.sequential else summarize(table, margin_clip(det), seed=cfg.seed)
    if mode == "greedy":
        bands = reference_bands(cfg, det, score_fn, show_progress=show_progress)
        verdict = verdict.with_(nearest_band=nearest_band(point, bands))
    timings = {"probe_s": t_probe - t0, "collect_s": t_collect - t_calib, "score_s": t_score - t_collect, **ctimes,
               "total_s": time.perf_counter() - t0}
    exact = float(np.mean(np.asarray(table[EXACT_MATCH].to_numpy(zero_copy_only=False), dtype=bool)))
    report = {"base_url": cfg.base_url, "model": cfg.model, "trusted_model": info.name,
              "trusted_weights_sha256": info.weights_sha256, "mode": mode, "verdict": verdict.to_dict(),
              "n_claims": len(claims), "n_tokens": int(table.num_rows), "exact_match": exact, "endpoint": point,
              "reference_bands": bands, "settings": {k: (str(v) if isinstance(v, Path) else v)
                                                     for k, v in asdict(cfg).items() if k != "api_key"},
              "timings": timings}
    rpath = out / "report.json"
    atomic_write_text(rpath, json.dumps(report, indent=1, default=float) + "\n")
    atomic_write_text(out / "report.md", render_markdown(report))
    return ApiAuditResult(verdict, mode, claims_path, scores_path, rpath, len(claims), int(table.num_rows), exact,
                          bands, timings)


def render_markdown(r: dict) -> str:
    v = r["verdict"]
    lines = [f"# verinfer audit of {r['model']} at {r['base_url']}", "",
             f"Mode: {r['mode']}; trusted model {r['trusted_model']} (weights sha256 {r['trusted_weights_sha256']}).", "",
             "| verdict | tokens | pooled | threshold | p-value | exact match |", "|---|---|---|---|---|---|",
             f"| {'FLAGGED' if v['flagged'] else 'ok'} | {v['n_tokens']} | {v['pooled']:.4g} | {v['threshold']:.4g} | "
             f"{v['p_value']:.3g} | {r[EXACT_MATCH]:.4f} |", "", v.get("decision", ""), ""]
    if r.get("reference_bands"):
        lines += ["Reference bands (verinfer's own greedy runs, replayed by the bf16 verifier; 95% bootstrap CI):", "",
                  "| run | mean clipped margin | mean cross-entropy |", "|---|---|---|"]
        rows = {**r["reference_bands"], f"**{r['model']}**": r["endpoint"]}
        for name, b in rows.items():
            lines.append(f"| {name} | {interval(b, MARGIN)} | {interval(b, CROSS_ENTROPY)} |")
        lines += ["", f"Nearest band: {v.get('nearest_band')}", ""]
    return "\n".join(lines)


__all__ = ["ApiAuditConfig", "ApiAuditResult", "audit_api", "collect_claims", "recognise_noise", "MISCONFIGURED"]
