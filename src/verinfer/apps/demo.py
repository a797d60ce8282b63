"""The demo: ten simulated providers (five honest configurations, five misconfigurations) generate
claims on the testbed; verinfer scores them, calibrates a detector on honest runs only, audits
every provider and writes the HTML report. An adapter of the audit core: the claims files replayed
by one `core.auditor.AuditCore` (each once, resumable), the verdicts by `detect.judge`
(`apps.pipeline.audit`); the report (and matplotlib) is imported only here."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from verinfer.apps.pipeline import audit, generate
from verinfer.core.auditor import AuditCore
from verinfer.detect.calibrate import calibrate, split_claims
from verinfer.detect.verdict import Verdict
from verinfer.io import atomic_write_json, atomic_write_text, check_manifest, output
from verinfer.models.load import model_info
from verinfer.models.testbed import TARGET_DIR
from verinfer.providers.simulated import DEFAULT_SPEC, HONEST, PROVIDERS
from verinfer.report.html import ReportContext, compute_auc_curves, write_report
from verinfer.scores import load_score_tables


@dataclass
class DemoResult:
    verdicts: list[Verdict]
    report: Path
    seconds: float


def demo(out_dir: str | Path = "runs/demo", *, model_dir: str | Path | None = None, n: int = 128,
         max_tokens: int = 64, seed: int = 0, audit_tokens: int = 1000, show_progress: bool = True) -> DemoResult:
    """Generate honest and misconfigured claims on the testbed (or `model_dir`), score, calibrate,
    audit, report. Resumes the finished claims and scores in `out_dir` when they were made with the
    same model, n, max_tokens and seed (out_dir/demo.json); other settings are refused."""
    with output(out_dir, "demo directory", directory=True):
        return _demo(Path(out_dir), Path(model_dir or TARGET_DIR), n=n, max_tokens=max_tokens, seed=seed,
                     audit_tokens=audit_tokens, show_progress=show_progress)


def _demo(out: Path, model_dir: Path, *, n, max_tokens, seed, audit_tokens, show_progress) -> DemoResult:
    t0 = time.perf_counter()
    info = model_info(model_dir)
    manifest = dict(model=info.name, weights_sha256=info.weights_sha256, n=n, max_tokens=max_tokens, seed=seed)
    mpath = out / "demo.json"
    if mpath.is_file() or (out / "claims").is_dir():
        check_manifest(mpath, manifest, on_mismatch="error", where=out, what="a demo run with other settings")
    else:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(mpath, manifest)
    core = AuditCore(model_dir, out, show_progress=show_progress)
    paths = []
    for name in PROVIDERS:
        cpath = out / "claims" / f"{name}.jsonl"
        if not cpath.is_file():  # resumable: finished steps are kept
            generate(name, model_dir, cpath, n=n, max_tokens=max_tokens, seed=seed, show_progress=show_progress)
        paths.append(core.score_file(cpath, out / "scores" / f"{name}.parquet"))
    table = load_score_tables(paths)
    honest = list(HONEST)
    calib, held_out = split_claims(table, honest, seed=seed)  # honest providers are audited on claims not fit
    det = calibrate(calib, honest, seed=seed)
    det.save(out / "detector.json")
    verdicts = audit(table, det, list(PROVIDERS), held_out, max_tokens=audit_tokens)
    atomic_write_text(out / "verdicts.json", json.dumps([v.to_dict() for v in verdicts], indent=1, default=float))
    curves = compute_auc_curves(table, honest, seed=seed)
    context = ReportContext.for_model(model_dir, {**DEFAULT_SPEC, "max_tokens": max_tokens, "seed": seed})
    report = write_report(table, out, honest, verdicts, curves, context=context)
    return DemoResult(verdicts, report, time.perf_counter() - t0)
