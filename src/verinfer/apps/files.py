"""The file jobs behind `verinfer score`, `calibrate`, `audit` and `report`: each command of the CLI
calls one function here and renders what it returns. Every input file is read once."""

from __future__ import annotations

import itertools
import json
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc

from verinfer.apps import speculative
from verinfer.apps.pipeline import audit, score
from verinfer.audit.replay import Scored
from verinfer.claims import iter_claims
from verinfer.detect import Detector, load_detector
from verinfer.detect.calibrate import calibrate
from verinfer.detect.record import ALLOW_UNRECORDED_CALIBRATION
from verinfer.detect.verdict import Verdict, combine_verdicts
from verinfer.errors import VerinferError
from verinfer.io import atomic_write_text, output
from verinfer.scores import ALLOW_UNRECORDED, APPROXIMATE, PROVIDER, check_provenance, common_provenance, load_score_tables


@dataclass(frozen=True)
class ScoreOutcome:
    """What `score_file` did: replayed plain claims (`scored`, and with a remote reference how many
    rows are approximate) or checked speculative claims (`speculative`: the summary of
    `apps.speculative.score_file`)."""

    out: Path
    scored: Scored | None = None
    approximate: int | None = None
    speculative: dict | None = None


def score_file(claims_path: Path, model_dir: Path, out: Path, *, draft_dir: Path, device: str = "cpu",
               model_names: tuple[str, ...] = (), reference_url: str | None = None, show_progress: bool = True,
               **replay) -> ScoreOutcome:
    """Score a claims file: speculative claims (a `spec` field, seen on the first claim) are checked
    against standard speculative sampling with the draft; plain claims are replayed (`replay`: the
    options of `apps.pipeline.score`). The file is read once: its first claim decides the kind and
    the stream goes on from there."""
    stream = iter_claims(claims_path)
    first = next(stream, None)
    claims = itertools.chain([first] if first is not None else [], stream)
    if first is not None and "spec" in first.extra:
        if reference_url is not None:
            raise VerinferError("speculative claims cannot be scored from a reference server", where=str(claims_path),
                                fix="their check needs the draft model too: score them locally (drop --reference-url)")
        summary = speculative.score_file(claims_path, model_dir, draft_dir, out, device=device,
                                         model_names=model_names, show_progress=show_progress, claims=claims)
        return ScoreOutcome(Path(out), speculative=summary)
    r = score(claims_path, model_dir, out, device=device, model_names=model_names, reference_url=reference_url,
              show_progress=show_progress, claims=claims, **replay)
    approx = (pc.sum(r.table()[APPROXIMATE]).as_py() or 0) if reference_url is not None else None
    return ScoreOutcome(Path(out), scored=r, approximate=approx)


@dataclass(frozen=True)
class CalibrationOutcome:
    detector: Detector
    honest: list[str]
    warnings: list[str] = field(default_factory=list)


def calibrate_files(scores: list[Path], out: Path, *, detector: str = "clipped-mean", seed: int = 0,
                    target_fpr: float = 0.01, fpr_batch_tokens: int = 250, **options) -> CalibrationOutcome:
    """Fit a detector on honest scores files (each file one honest configuration of its null; files
    replayed with other models or settings refused, naming both), measure its held-out FPR, save it
    to `out`. warnings: what the fit warned about (e.g. few honest configurations)."""
    with output(out, "detector file", inputs=scores):
        common_provenance(scores)
        table = load_score_tables(scores)
        honest = sorted(set(table[PROVIDER].to_pylist()))
        with warnings.catch_warnings(record=True) as caught:  # the GLRT's few-honest-groups warning
            warnings.simplefilter("always")
            det = calibrate(table, honest, detector=detector, seed=seed, target_fpr=target_fpr,
                            fpr_batch_tokens=fpr_batch_tokens, **options)
        det.save(out)
    return CalibrationOutcome(det, honest, [str(w.message) for w in caught])


@dataclass(frozen=True)
class AuditOutcome:
    verdicts: list[Verdict]
    notes: list[str]  # what could not be checked (provenance not recorded)

    @property
    def flagged(self) -> bool:
        return any(v.flagged for v in self.verdicts)


def audit_files(inputs: list[Path], detector_paths: list[Path], *, model_dir: Path | None = None,
                model_names: tuple[str, ...] = (), provider: str | None = None, merge: bool = False,
                max_tokens: int | None = None, sequential: bool = False,
                json_out: Path | None = None, allow_unrecorded_provenance: bool = False,
                allow_unrecorded_calibration: bool = False) -> AuditOutcome:
    """Verdicts per provider of scores files (claims JSONL inputs are scored first, next to them,
    as `<name>.scores.parquet`, with `model_dir`), under every detector (combined when several);
    scores replayed with another model or settings than a detector's calibration are refused.
    json_out: also write the verdicts there. allow_unrecorded_provenance: audit scores or detectors
    that record no provenance (refused otherwise); each verdict then reports `provenance`: unchecked.
    allow_unrecorded_calibration: the same for a detector without its calibration record
    (`detect.record`); each verdict then reports `calibration`: unchecked."""
    held = output(json_out, "verdicts JSON", inputs=[*inputs, *detector_paths]) if json_out else nullcontext()
    with held:
        return _audit_files(inputs, detector_paths, model_dir=model_dir, model_names=model_names, provider=provider,
                            merge=merge, max_tokens=max_tokens, sequential=sequential, json_out=json_out,
                            allow_unrecorded=allow_unrecorded_provenance,
                            allow_unrecorded_calibration=allow_unrecorded_calibration)


def _audit_files(inputs, detector_paths, *, model_dir, model_names, provider, merge, max_tokens, sequential,
                 json_out, allow_unrecorded, allow_unrecorded_calibration) -> AuditOutcome:
    dets = [load_detector(d, allow_unrecorded=allow_unrecorded_calibration) for d in detector_paths]
    unchecked = [f"{p}: {det.unrecorded_}" for p, det in zip(detector_paths, dets) if det.unrecorded_]
    gaps = any(d.requires_gaps for d in dets)
    paths = []
    for p in inputs:
        if p.suffix == ".jsonl":
            paths.append(score(p, model_dir, p.with_suffix(".scores.parquet"), gaps=gaps, model_names=model_names).path)
        else:
            paths.append(p)
    notes = [n for det_path, det in zip(detector_paths, dets)
             for n in check_provenance(getattr(det, "provenance_", None), det_path, paths, allow_unrecorded)]
    table = load_score_tables(paths, labels=[p.stem for p in inputs], provider=provider, merge=merge)
    providers = sorted(set(table[PROVIDER].to_pylist()))
    verdicts = combine_verdicts([audit(table, det, providers, max_tokens=max_tokens, sequential=sequential)
                                 for det in dets])
    if notes:  # audited without provenance, as the user asked: every verdict says so
        verdicts = [v.with_(provenance=f"unchecked ({ALLOW_UNRECORDED})") for v in verdicts]
    if unchecked:  # a detector without its calibration record, as the user asked: the same
        verdicts = [v.with_(calibration=f"unchecked ({ALLOW_UNRECORDED_CALIBRATION})") for v in verdicts]
        notes = [*notes, *unchecked]
    if json_out:
        atomic_write_text(json_out, json.dumps([v.to_dict() for v in verdicts], indent=1, default=float))
    return AuditOutcome(verdicts, notes)


def report_files(scores: list[Path], out: Path, *, honest: list[str] | None = None,
                 model_dir: Path | None = None) -> Path:
    """The HTML report of scores files: AUC@1%FPR-vs-tokens curves and score histograms of every
    provider against the honest ones (default: the providers whose names start with 'honest')."""
    from verinfer.report.html import ReportContext, compute_auc_curves, write_report  # matplotlib: only here

    with output(out, "report directory", directory=True):
        table = load_score_tables(scores)
        names = sorted(set(table[PROVIDER].to_pylist()))
        hon = honest or [n for n in names if n.startswith("honest")]
        if not hon:
            raise VerinferError("no honest provider among the scores", fix="pass --honest NAME")
        context = ReportContext.for_model(model_dir) if model_dir is not None else ReportContext()
        return write_report(table, out, hon, None, compute_auc_curves(table, hon), context=context)
