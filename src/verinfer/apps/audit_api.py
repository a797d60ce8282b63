"""`verinfer audit-api`: audit any OpenAI-compatible completions endpoint that returns token ids
(verinfer serve, vLLM, a provider's API), an adapter of the audit core.

    mode      seeded, greedy or auto (the endpoint probed once): `core.completions`
    collect   seeded token-id prompts through the official `openai` client, the endpoint's prompt and
              output ids checked against the trusted model before they are saved
              (`core.sources.CompletionsSource`, `core.collect`: resumable, a dead endpoint costs
              nothing already collected, rerunning the same command resumes). Text is never
              re-tokenized: an endpoint that returns no token ids cannot be audited and says so.
    replay    the trusted local model replays the claims once (`core.auditor.AuditCore`)
    verdict   a detector calibrated on verinfer's own honest runs; with `sequential` (seeded mode)
              the glrt's anytime-valid e-process judges every answer as it arrives and requests stop
              once it flags (the false-positive rate stays at most target_fpr whenever it stops);
              greedy mode places the endpoint among reference bands (bf16, fp8-KV, 4-bit)

Outputs in out_dir: claims.jsonl (with collect.json, requests.json), scores.parquet, detector.json
(or --detector), report.json and report.md.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from verinfer.core.collect import collect
from verinfer.core.completions import (ApiAuditConfig, calibrated_detector, completions_source, probe_candidates,
                                        probed_mode, recognise_noise, reference_bands, reusable_detector)
from verinfer.core.auditor import AuditCore
from verinfer.claims import Claim
from verinfer.detect.summary import interval, margin_clip, nearest_band, summarize
from verinfer.detect.verdict import Verdict
from verinfer.errors import VerinferError
from verinfer.io import atomic_write_text, check_writable
from verinfer.models.load import model_info
from verinfer.models.prompts import prompts_for
from verinfer.providers.openai_http import openai_client
from verinfer.scores import CROSS_ENTROPY, EXACT_MATCH, MARGIN


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


def collect_claims(client, cfg: ApiAuditConfig, mode: str, prompts: list[list[int]], local_name: str,
                   progress=None, stop=None) -> tuple[Path, list[Claim]]:
    """(out_dir/claims.jsonl, claims): `core.collect.collect` of the endpoint's
    `completions_source` (under a lock, resumable, a reply without output tokens never asked again;
    a reply that cannot be the trusted model's is an EndpointError and nothing of it is saved).
    stop(claims): called after each answer (and once on resumed claims); True ends the collection."""
    source = completions_source(client, cfg, mode, prompts, local_name, model_info(cfg.model_dir).vocab_size)
    claims, _ = collect(source, cfg.out_dir, progress, stop)
    return Path(cfg.out_dir) / "claims.jsonl", claims


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
    info = model_info(cfg.model_dir)
    prompts = prompts_for(cfg.model_dir, cfg.n, cfg.seed)
    client = openai_client(cfg.endpoint)
    noises = probe_candidates(cfg.noise) if cfg.mode == "auto" else (cfg.noise,)
    reusable_detector(cfg, ("seeded", "greedy") if cfg.mode == "auto" else (cfg.mode,), info, noises)
    core = AuditCore(cfg.model_dir, cfg.out_dir, matmul=cfg.matmul, device=cfg.device, show_progress=show_progress,
                     gaps=cfg.sequential)
    mode, cfg = probed_mode(cfg, client, prompts[0], core, noises)
    t_probe = time.perf_counter()
    if cfg.sequential and mode == "greedy":
        raise VerinferError("the endpoint does not honour seeds (auto mode chose greedy): --sequential needs seeded "
                            "claims", where=cfg.base_url, fix="audit it without --sequential (greedy mode)")
    reusable_detector(cfg, (mode,), info)  # auto: the probe decided the mode and the noise
    det, ctimes, stop = None, {}, None
    claims_path, scores_path = core.out / "claims.jsonl", core.out / "scores.parquet"
    if cfg.sequential:  # calibrate first: each answer is judged as it arrives
        det, ctimes = calibrated_detector(core, cfg, mode)
        stop = core.stream(det, cfg.target_fpr, claims_path, scores_path)
    t_calib = time.perf_counter()
    claims, _ = core.collect(completions_source(client, cfg, mode, prompts, info.name, info.vocab_size), core.out,
                             f"audit-api: requests to {cfg.base_url}", stop)
    t_collect = time.perf_counter()
    table = core.scores(claims_path, scores_path, keep_parts=cfg.sequential)
    t_score = time.perf_counter()
    if det is None:
        det, ctimes = calibrated_detector(core, cfg, mode)
    verdict = (stop.audit.verdict(table) if stop else det.verdict(table)).with_(provider=f"api:{cfg.model}", honest=None)
    if stop:
        verdict = verdict.with_(requests_sent=len(claims), requests_planned=len(prompts))
    point = None if cfg.sequential else summarize(table, margin_clip(det), seed=cfg.seed)
    bands = reference_bands(core, cfg, det) if mode == "greedy" else None
    if bands is not None:
        verdict = verdict.with_(nearest_band=nearest_band(point, bands))
    timings = {"probe_s": t_probe - t0, "collect_s": t_collect - t_calib, "score_s": t_score - t_collect, **ctimes,
               "total_s": time.perf_counter() - t0}
    report = _report(cfg, info, mode, verdict, claims, table, point, bands, timings)
    rpath = core.out / "report.json"
    atomic_write_text(rpath, json.dumps(report, indent=1, default=float) + "\n")
    atomic_write_text(core.out / "report.md", render_markdown(report))
    return ApiAuditResult(verdict, mode, claims_path, scores_path, rpath, len(claims), int(table.num_rows),
                          report[EXACT_MATCH], bands, timings)


def _report(cfg: ApiAuditConfig, info, mode: str, verdict: Verdict, claims: list[Claim], table, point: dict | None,
            bands: dict | None, timings: dict) -> dict:
    """report.json: the endpoint, the trusted model, the verdict and what it rests on (no API key)."""
    exact = float(np.mean(np.asarray(table[EXACT_MATCH].to_numpy(zero_copy_only=False), dtype=bool)))
    return {"base_url": cfg.base_url, "model": cfg.model, "trusted_model": info.name,
            "trusted_weights_sha256": info.weights_sha256, "mode": mode, "verdict": verdict.to_dict(),
            "n_claims": len(claims), "n_tokens": int(table.num_rows), "exact_match": exact, "endpoint": point,
            "reference_bands": bands, "settings": {k: (str(v) if isinstance(v, Path) else v)
                                                   for k, v in asdict(cfg).items() if k != "api_key"},
            "timings": timings}


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


__all__ = ["ApiAuditConfig", "ApiAuditResult", "audit_api", "collect_claims", "recognise_noise", "render_markdown"]
