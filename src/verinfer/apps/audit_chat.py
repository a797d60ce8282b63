"""Audit the chat endpoints people buy from, one vendor or several side by side, at temperature 0 or
at any sampling with per-request seeds, from the text they return: `verinfer audit-vendors` and
`audit-api --chat`, adapters of the audit core (`core.chat.ChatAudit` on `core.auditor.AuditCore`;
the sources in `core.sources`).

    prompts, calibration, bands   `core.chat.ChatAudit` (computed once per sampling, cached in out_dir)
    each vendor                   its mode (greedy, seeded, or by the seed probe; a vendor that ignores
                                  seeds, or whose seeded sampler no known backend reproduces, is judged
                                  unseeded by `cfg.unseeded_detector`, its row saying why),
                                  collected (resumable, `core.collect`), streamed as an anytime-valid
                                  e-process (requests stop once it flags), replayed once, judged
                                  (`detect.judge.judge_vendor`)
    outputs                       out_dir/vendors.json (the dashboard's input), vendors.md and
                                  vendors.html (`report.vendors`)

Outputs in out_dir: calibration/ and bands/ (local runs, scored), vendors/<name>/ (claims.jsonl,
collect.json, scores.parquet), detector.json, vendors.json, vendors.md and vendors.html. Rerunning
the same command resumes; another audit's directory is refused.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from verinfer._version import __version__
from verinfer.core.chat import (BAND_ENGINES, JUDGED_MODES, TOKEN_MODES, ChatAudit, ChatAuditConfig, VendorResult,
                                chat_source)
from verinfer.core.collect import StopRule, collect
from verinfer.core.local_runs import CHAT_BANDS as BANDS
from verinfer.claims import Claim
from verinfer.errors import VerinferError
from verinfer.io import atomic_write_json, atomic_write_text
from verinfer.providers.chat_http import ChatEndpoint, read_vendors
from verinfer.retokenize import Retokenizer


@dataclass
class ChatAuditResult:
    vendors: list[VendorResult]
    bands: dict
    path: Path                        # vendors.json
    html: Path | None
    timings: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)  # a log's exchanges left out: (file:line, kind, why)
    modes: dict = field(default_factory=dict)    # claims judged per mode: greedy, seeded, unseeded

    def vendor(self, name: str) -> VendorResult:
        return next(v for v in self.vendors if v.name == name)


def collect_vendor(endpoint: ChatEndpoint, cfg: ChatAuditConfig, conversations: list[list[dict]],
                   retok: Retokenizer, out: Path, progress=None, stop: StopRule | None = None) -> tuple[list[Claim], int]:
    """(claims, requests sent) of one vendor: `core.collect.collect` of its `core.chat.chat_source`
    (resumable, `endpoint.concurrency` requests in flight; stop(claims) after each new claim)."""
    return collect(chat_source(endpoint, cfg, conversations, retok), out, progress, stop)


def audit_vendors(vendors: list[ChatEndpoint], cfg: ChatAuditConfig, *, show_progress: bool = True,
                  title: str | None = None) -> ChatAuditResult:
    """Audit each vendor with the same prompts against one calibrated detector and one set of
    reference bands; writes vendors.json, vendors.md and vendors.html in cfg.out_dir."""
    names = [v.name for v in vendors]
    if len(set(names)) != len(names) or not vendors:
        raise VerinferError(f"vendor names must be unique and at least one given, got {names}")
    t0 = time.perf_counter()
    audit = ChatAudit(cfg, show_progress)
    rows = []
    for ep in vendors:
        t = time.perf_counter()
        rows.append(audit.vendor(ep))
        audit.timings[f"vendor_{ep.name}_s"] = time.perf_counter() - t
    audit.timings["total_s"] = time.perf_counter() - t0
    return write_results(audit, rows,
                          title or f"verinfer audit of {len(vendors)} chat endpoint(s) serving {vendors[0].model}",
                          {"endpoints": [v.public() for v in vendors]})


def write_results(audit: ChatAudit, rows: list[VendorResult], title: str, source: dict) -> ChatAuditResult:
    """vendors.json (the dashboard's input), vendors.md and vendors.html in the audit's directory.
    Every row is a verdict (or an error), in whichever mode it was judged (`mode`; an unseeded row's
    `note` says why it is unseeded); `modes` counts the claims each mode judged. The bands and
    detector shown are those of the first sampling judged (greedy first); `detectors` lists each
    sampling's."""
    cfg = audit.cfg
    judged = rows
    modes = {m: sum(r.n_claims for r in rows if r.mode == m and not r.error) for m in JUDGED_MODES}
    modes = {**modes, **source.pop("modes", {})}
    keys = sorted(audit.seen, key=lambda k: k != "greedy")
    det, bands = audit.seen[keys[0]] if keys else (None, {})
    doc = {"title": title, "model": rows[0].served_model if rows else "", "trusted_model": audit.info.name,
           "trusted_weights_sha256": audit.info.weights_sha256,
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "verinfer_version": __version__,
           "target_fpr": cfg.target_fpr, "mode": _mode(modes), "modes": modes, "settings": cfg.settings(),
           "detector": {"summary": det.summary() if det else None, "heldout": _heldout(det) if det else None},
           "detectors": {k: d.summary() for k, (d, _) in audit.seen.items()},
           "bands": bands, "bands_by_sampling": {k: b for k, (_, b) in audit.seen.items()},
           "vendors": [asdict(r) for r in judged], **source,
           "timings": audit.timings}
    from verinfer.report.vendors import render_vendors_html, render_vendors_markdown  # matplotlib: load when writing

    path = atomic_write_json(cfg.out_dir / "vendors.json", doc)
    md = render_vendors_markdown(doc) if judged else f"# {title}\n\nNo vendor could be scored.\n"
    atomic_write_text(cfg.out_dir / "vendors.md", md)
    html = render_vendors_html(doc, cfg.out_dir / "vendors.html") if judged else None
    return ChatAuditResult(judged, bands, path, html, audit.timings, list(source.get("skipped", [])), modes)


def _mode(modes: dict) -> str:
    """The audit's mode: the one mode of every judged claim, or "mixed"."""
    used = [m for m, n in modes.items() if n]
    return used[0] if len(used) == 1 else "mixed" if used else "greedy"


def audit_endpoint(base_url: str, model: str, cfg: ChatAuditConfig, *, name: str = "endpoint",
                   api_key_env: str | None = None, extra: dict | str | None = None, concurrency: int = 4,
                   timeout: float = 120.0, show_progress: bool = True) -> ChatAuditResult:
    """Audit one chat endpoint (`audit_vendors` with one vendor). api_key_env: the environment
    variable holding its key (default OPENAI_API_KEY when set); extra: request fields passed
    through (a dict, or JSON text)."""
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError as e:
            raise VerinferError(f"--extra is not JSON ({e.msg} at column {e.colno})",
                                fix='e.g. --extra \'{"provider": {"order": ["acme"]}}\'') from None
        if not isinstance(extra, dict):
            raise VerinferError("--extra must be a JSON object", fix='e.g. --extra \'{"return_token_ids": true}\'')
    if api_key_env is None and os.environ.get("OPENAI_API_KEY"):
        api_key_env = "OPENAI_API_KEY"
    ep = ChatEndpoint(name, base_url, model, api_key_env, dict(extra or {}), concurrency, timeout)
    return audit_vendors([ep], cfg, show_progress=show_progress, title=f"verinfer audit of {model} at {base_url}")


def _heldout(det) -> dict | None:
    cal = getattr(det, "calibration_", None)
    held = cal and cal.heldout
    return None if not held else {"fpr": held.fpr, "batches": held.batches, "batch_tokens": held.batch_tokens}


__all__ = ["BANDS", "BAND_ENGINES", "ChatAuditConfig", "ChatAuditResult", "TOKEN_MODES", "VendorResult",
           "audit_endpoint", "audit_vendors", "collect_vendor", "read_vendors", "write_results"]
