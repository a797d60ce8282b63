"""`verinfer audit-log`: a log of chat exchanges audited like vendors, an adapter of the audit core.

    source       the log's exchanges (`core.sources.log_sources`: one source per model the replies
                 name, keyed by the exact name; each exchange a claim; exchanges a greedy replay
                 cannot use are refused, or skipped and counted with --skip-unusable)
    collect      each vendor's claims saved through the one collector (`core.collect`) into
                 out_dir/vendors/<vendor>/ under its lock and manifest: a directory that holds
                 another log's claims is refused, never mixed
    calibrate    the honest calibration and the reference bands run locally on the log's own
                 conversations, each with its reply's length as max_tokens (`core.chat.ChatAudit`)
    judge        a row per vendor (`detect.judge.judge_vendor`), written like audit-vendors'
"""

from __future__ import annotations

import time
from pathlib import Path

from verinfer.apps.audit_chat import ChatAuditResult, write_results
from verinfer.core.chat import ChatAudit, ChatAuditConfig, VendorResult
from verinfer.core.sources import log_sources, vendor_dir_name
from verinfer.io import check_writable
from verinfer.models.load import model_info
from verinfer.retokenize import Retokenizer


def audit_log(log: Path, cfg: ChatAuditConfig, *, skip_unusable: bool = False, neutral: tuple[str, ...] = (),
              show_progress: bool = True) -> ChatAuditResult:
    """Audit a log of chat exchanges: a row per model the replies name, judged like a vendor; the
    honest calibration and the reference bands run locally on the log's own conversations (each
    with the reply's length as max_tokens). Skipped exchanges are counted in vendors.json."""
    t0 = time.perf_counter()
    check_writable(cfg.out_dir, "audit directory", directory=True)
    retok = Retokenizer.for_model(cfg.model_dir)
    skipped: list = []
    info = model_info(cfg.model_dir)
    sources = log_sources(log, info.name, cfg.params, cfg.tokens, retok, skip_unusable=skip_unusable,
                          skipped=skipped, max_positions=info.max_positions, neutral=neutral)
    every = [c for s in sources.values() for c in s.claims]
    conv = [c.chat["messages"] for c in every]
    lengths = [c.sampling.max_tokens for c in every]
    audit = ChatAudit(cfg, show_progress, conversations=conv, max_tokens=lengths)
    # collected first (nothing is sent): a directory holding another log's claims is refused before any compute
    dirs = {vendor: audit.out / "vendors" / vendor_dir_name(vendor) for vendor in sources}
    collected = {vendor: audit.core.collect(source, dirs[vendor], f"{vendor}: claims")
                 for vendor, source in sources.items()}
    audit.calibration = (conv[: cfg.calib_n], lengths[: cfg.calib_n])
    det = audit.detector()
    bands = audit.bands(det)
    rows = [audit.judge(VendorResult(vendor, str(log), vendor), claims, sent, dirs[vendor], det, bands)
            for vendor, (claims, sent) in collected.items()]
    audit.timings["total_s"] = time.perf_counter() - t0
    return write_results(audit, det, bands, rows, f"verinfer audit of the chat log {Path(log).name}",
                         {"log": str(log), "exchanges": len(every), "skipped": [list(s) for s in skipped]})


__all__ = ["audit_log"]
