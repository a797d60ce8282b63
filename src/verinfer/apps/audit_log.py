"""`verinfer audit-log`: a log of chat exchanges audited like vendors, an adapter of the audit core.

    source       the log's exchanges (`core.sources.log_sources`: one source per model the replies
                 name and sampling: greedy exchanges, and seeded ones (a seed, and the sampler the
                 auditor declares: --noise, or per vendor a vendors file's `noise`; a log cannot be
                 probed); sampled exchanges without either are claimed unseeded (no seed, no noise)
                 and grouped by their sampling; exchanges a replay cannot use are refused, or
                 skipped and counted with --skip-unusable)
    collect      each group's claims saved through the one collector (`core.collect`) into
                 out_dir/vendors/<vendor>/ (sampled: <vendor>--<sampling key>/) under its lock and
                 manifest: a directory that holds another log's claims is refused, never mixed
    calibrate    the honest calibration and the reference bands run locally on the log's own
                 conversations of each sampling, each with its reply's length as max_tokens
                 (`core.chat.ChatAudit`; unseeded: the unseeded detector, on honest runs sampled
                 with seeds of the auditor's and claimed without them)
    judge        a row per vendor and sampling (`detect.judge.judge_vendor`), written like
                 audit-vendors'; `modes` counts the claims each mode judged
"""

from __future__ import annotations

import time
from pathlib import Path

from verinfer.apps.audit_chat import ChatAuditResult, write_results
from verinfer.core.chat import UNSEEDED_NOTE, ChatAudit, ChatAuditConfig, ChatSampling, VendorResult, cycled
from verinfer.core.sources import log_sources, vendor_dir_name
from verinfer.io import check_writable
from verinfer.models.load import model_info
from verinfer.providers.chat_http import read_vendors
from verinfer.providers.simulated import request_seed
from verinfer.retokenize import Retokenizer


def declared_noise(vendors_file: str | Path | None) -> dict[str, str]:
    """{vendor: noise backend} of a vendors file's [[vendor]] tables that declare `noise`, by their
    served `model` and by their `name` (a log names vendors by the model its replies name)."""
    out: dict[str, str] = {}
    for ep in read_vendors(vendors_file) if vendors_file else []:
        if "noise" in ep.sampling:
            out.setdefault(ep.model, ep.sampling["noise"])
            out.setdefault(ep.name, ep.sampling["noise"])
    return out


def audit_log(log: Path, cfg: ChatAuditConfig, *, skip_unusable: bool = False, neutral: tuple[str, ...] = (),
              noise: str | None = None, vendors_file: str | Path | None = None,
              show_progress: bool = True) -> ChatAuditResult:
    """Audit a log of chat exchanges: a row per model the replies name and sampling, judged like a
    vendor; the honest calibration and the reference bands run locally on the log's own
    conversations of that sampling (each with the reply's length as max_tokens). noise: the sampler
    every vendor's seeded exchanges were drawn with (vendors_file: per vendor); the other sampled
    exchanges are judged unseeded, a row per vendor and sampling. Skipped exchanges are counted in
    vendors.json; `modes` counts the claims each mode judged."""
    t0 = time.perf_counter()
    check_writable(cfg.out_dir, "audit directory", directory=True)
    retok = Retokenizer.for_model(cfg.model_dir)
    skipped: list = []
    info = model_info(cfg.model_dir)
    sources = log_sources(log, info.name, cfg.params, cfg.tokens, retok, skip_unusable=skip_unusable,
                          skipped=skipped, max_positions=info.max_positions, neutral=neutral, noise=noise,
                          noise_for=declared_noise(vendors_file))
    every = [c for s in sources.values() for c in s.claims]
    greedy = [c for c in every if c.sampling.greedy]
    conv = [c.chat["messages"] for c in greedy]
    lengths = [c.sampling.max_tokens for c in greedy]
    audit = ChatAudit(cfg, show_progress, conversations=conv or [c.chat["messages"] for c in every],
                      max_tokens=lengths)
    # collected first (nothing is sent): a directory holding another log's claims is refused before any compute
    dirs = {g: audit.out / "vendors" / _group_dir(s.manifest) for g, s in sources.items()}
    collected = {g: audit.core.collect(source, dirs[g], f"{g}: claims") for g, source in sources.items()}
    rows = []
    for key in sorted({ChatSampling.of(s.claims[0].sampling).key() for s in sources.values()},
                      key=lambda k: k != "greedy"):
        group = [g for g, s in sources.items() if ChatSampling.of(s.claims[0].sampling).key() == key]
        claims = [c for g in group for c in sources[g].claims]
        sampling = ChatSampling.of(claims[0].sampling)
        calib = ([c.chat["messages"] for c in claims][: cfg.calib_n], [c.sampling.max_tokens for c in claims][: cfg.calib_n])
        if sampling.unseeded:  # each conversation sampled again with other seeds, up to calib_n runs
            calib = cycled(*calib, cfg.calib_n)
        det = audit.detector(sampling, calib)
        seeds = ([c.sampling.seed for c in claims] if not (sampling.greedy or sampling.unseeded)
                 else [request_seed(cfg.seed, i) for i in range(len(claims))])  # unseeded: the bands' own seeds
        bands = audit.bands(det, sampling, [c.chat["messages"] for c in claims], [c.sampling.max_tokens for c in claims],
                            None if sampling.greedy else seeds)
        audit.seen[key] = (det, bands)
        for g in group:
            got, sent = collected[g]
            row = VendorResult(g, str(log), sources[g].manifest["vendor"], mode=got[0].sampling.audit_mode,
                               sampling=None if sampling.greedy else sampling.settings(),
                               note=_note(got, sources[g].manifest.get("repeated", 0)))
            rows.append(audit.judge(row, got, sent, dirs[g], det, bands, sampling=sampling, calibration=calib))
    audit.timings["total_s"] = time.perf_counter() - t0
    return write_results(audit, rows, f"verinfer audit of the chat log {Path(log).name}",
                         {"log": str(log), "exchanges": len(every), "skipped": [list(s) for s in skipped]})


def _group_dir(manifest: dict) -> str:
    d = vendor_dir_name(manifest["vendor"])
    return d if manifest.get("mode") not in ("seeded", "unseeded") else f"{d}--{manifest['sampling']}"


def _note(claims: list, repeated: int = 0) -> str | None:
    """Why a group's exchanges are judged unseeded (None for greedy and seeded ones), and how many of
    its replies repeated an earlier one byte for byte and were counted once (`core.sources.log_sources`)."""
    if not claims[0].sampling.unseeded:
        return None
    with_seed = sum("request_seed" in c.extra for c in claims)
    note = (f"{UNSEEDED_NOTE}: {len(claims) - with_seed} sampled without a seed, {with_seed} with a seed but no "
            "declared sampler (--noise or a vendors file's `noise`)")
    return note if not repeated else note + (
        f"; {repeated} repeated reply(ies) counted once (the byte-identical sampled reply to the same conversation: "
        "one draw, from a response cache or a sampler with one fixed seed; with a fixed seed its other replies share "
        "that noise too, which the unseeded test assumes they do not: declare its sampler and seed if it has one)")


__all__ = ["audit_log", "declared_noise"]
