"""What the `verinfer` commands print: each function turns what an apps/ function returned into
terminal text; `verdicts` draws the rich table of `audit`, `demo` and `audit-api` (the HTML report
is report/'s)."""

from __future__ import annotations

from collections import Counter

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from verinfer.detect.verdict import Verdict


def generated(g, req) -> str:
    """The line `verinfer generate` prints for an `apps.generate.Generated`."""
    if g.job == "vllm":
        return f"wrote {g.claims} vLLM claims, {g.tokens} tokens ({g.details['tokens_per_s']:.0f} tokens/s) -> {g.out}"
    if g.job == "speculative":
        return (f"wrote {g.claims} speculative ({req.speculative}, threshold {req.threshold}, gamma {req.gamma}) "
                f"claims, {g.tokens} tokens, {g.details['accepted']} accepted draft tokens, "
                f"~{g.tokens / max(1, g.details['rounds']):.2f} tokens per target forward -> {g.out}")
    if g.job == "deterministic":
        return f"wrote {g.claims} {req.deterministic} greedy completions -> {g.out}"
    return f"wrote {g.claims} claims, {g.tokens} tokens -> {g.out}"


def scored(r, reference_url: str | None, reference_model: str | None, reference_logprobs: int) -> str:
    """What `verinfer score` prints for an `apps.files.ScoreOutcome`."""
    if r.speculative is not None:
        s = r.speculative
        lines = [f"speculative claims: {s['tokens']} tokens, accepted fraction {s['accepted_fraction']:.3f}, "
                 f"mean accept -log min(1,p/q) {s['mean_accept_nll']:.4f}, {s['violations']} violations of "
                 f"standard speculative sampling -> {r.out}"]
        return "\n".join(lines + [f"  violation in claim {cid}" for cid in s["claims_with_violations"][:10]])
    text = f"scored {r.scored.tokens} tokens of {r.scored.claims} claims -> {r.out}"
    if reference_url is not None:
        text += (f"\nreference {reference_url} ({reference_model}, {reference_logprobs} logprobs): "
                 f"{r.scored.tokens - r.approximate} tokens exact, {r.approximate} approximate (column "
                 f"approximate_reason says why)")
    return text


def warn(text: str) -> None:
    typer.secho(f"warning: {text}", fg="yellow", err=True)


def calibration(res, out: Path) -> None:
    """What `verinfer calibrate` prints for an `apps.files.CalibrationOutcome`."""
    det, cal = res.detector, res.detector.calibration_
    for w in res.warnings:
        warn(w)
    typer.echo(f"calibrated on every token given, {sum(cal.tokens.values())} tokens of {len(res.honest)} honest "
               "configuration(s):")
    for name in res.honest:
        typer.echo(f"  {name}: {cal.tokens[name]} tokens, {cal.claims[name]} claims")
    for w in getattr(det, "warnings_", []):
        warn(w)
    h = cal.heldout
    if h is not None and h.batches:
        typer.echo(f"FPR: target {det.target_fpr:g}; on held-out honest claims {h.fpr:.2%} ({h.flagged}/{h.batches} "
                   f"batches of {h.batch_tokens} tokens, {h.folds} folds; 95% upper bound {h.fpr_upper95:.2%})")
    if getattr(det, "provenance_", None) is None:
        warn("the scores record no provenance (an older `verinfer score`): audit cannot check that scores come from "
             "the same model and settings")
    typer.echo(f"detector ({det.summary()}) -> {out}")


def api_audit(res) -> None:
    """What `verinfer audit-api` prints for an `apps.audit_api.ApiAuditResult`."""
    verdicts([res.verdict])
    typer.echo(f"mode {res.mode}: {res.n_claims} claims, {res.n_tokens} tokens, exact match {res.exact_match:.4f}"
               + (f", nearest reference band: {res.verdict.get('nearest_band')}" if res.bands else "")
               + f"\nreport: {res.report}")


def vendors(res) -> None:
    """What `verinfer audit-vendors` / `audit-log` / `audit-api --chat` print for an
    `apps.audit_chat.ChatAuditResult`: a row per vendor, then where the dashboard is."""
    modes = {getattr(v, "mode", "greedy") for v in res.vendors if not v.error}
    t = Table(title="verinfer: chat endpoints " + ("sampled (" + "; ".join(
        what for m, what in (("seeded", "seeded: Token-DiFR on each seeded sample"),
                             ("unseeded", "unseeded: the tokens' place in the reference's distribution"))
        if m in modes) + ")" if modes & {"seeded", "unseeded"} else "at temperature 0"),
              caption="verdict: anytime-valid at the target FPR (requests stop once a vendor is flagged); nearest band: "
                      "the local configuration whose margin and cross-entropy the vendor's resemble")
    for col in ("vendor", "verdict", "mode", "nearest band", "exact match", "tokens", "requests", "decided at",
                "re-cut"):
        t.add_column(col, no_wrap=True)
    for v in res.vendors:
        mode = getattr(v, "mode", "greedy")
        if v.error:
            t.add_row(escape(v.name), "[yellow]error[/yellow]", mode, "", "", "", "", "", "")
            continue
        decided = "-" if v.tokens_to_decide is None else f"{v.tokens_to_decide} tok / {v.requests_to_decide} req"
        t.add_row(escape(v.name), "[red]FLAGGED[/red]" if v.flagged else "[green]ok[/green]", mode,
                  escape(str(v.nearest_band)),
                  f"{v.exact_match:.4f}", str(v.n_tokens), str(v.n_requests), decided,
                  "-" if v.resegmented is None else f"{v.resegmented:.1%}")
    console = Console(width=max(140, Console().width))
    console.print(t)
    for v in res.vendors:
        if v.error:
            console.print(f"[yellow]{escape(v.name)}[/yellow]: {escape(v.error)}", soft_wrap=True)
    if getattr(res, "skipped", None):
        kinds = Counter(kind for _, kind, _ in res.skipped)
        typer.echo(f"skipped {len(res.skipped)} exchange(s) of the log: " + ", ".join(
            f"{n} {k}" for k, n in kinds.most_common()) + f" (each with its line and reason in {res.path})")
    typer.echo(f"dashboard: {res.html or res.path}")


def verdicts(rows: list[Verdict]) -> None:
    """One row per verdict (provider, truth, verdict, tokens, pooled, threshold, p-value, FPRs,
    tokens to flag), then what each ok verdict with a stated power established."""
    t = Table(title="verinfer audit: DiFR verdicts",
              caption="FPR: the target, the rate at the threshold on resampled honest batches, and on held-out honest "
                      "claims at calibration; to flag: tokens at which the provider's excess over honest, if it "
                      "persisted, would be flagged")
    for col in ("provider", "truth", "verdict", "tokens", "pooled", "threshold", "p-value", "FPR", "to flag"):
        t.add_column(col, no_wrap=True, min_width=7 if col in ("verdict", "p-value") else None)
    for v in rows:
        truth = {True: "honest", False: "misconfigured", None: "?"}[v.honest]
        fpr = f"{v.target_fpr:.0%}" + (f" / {v.threshold_fpr:.2%}" if "threshold_fpr" in v.reported else "") + \
            (f" / {v.heldout_fpr:.1%}" if "heldout_fpr" in v.reported else "")
        t.add_row(escape(v.provider), truth, "[red]FLAGGED[/red]" if v.flagged else "[green]ok[/green]",
                  str(v.n_tokens), f"{v.pooled:.2g}", f"{v.threshold:.2g}",
                  (f"{v.p_value:.2g}" if v.p_value > 0 else "<1e-300"), fpr, more_tokens(v))
    console = Console(width=max(160, Console().width))
    console.print(t)
    for v in rows:  # what an ok verdict established (the power against a stated deviation)
        if not v.flagged and v.get("power"):
            console.print(f"{escape(v.provider)}: {escape(v.decision)}", soft_wrap=True)
    for v in rows:
        if v.get("provenance"):
            console.print(f"[yellow]{escape(v.provider)}: provenance {escape(str(v.get('provenance')))}: the scores' "
                          "model and settings were not checked against the detector's[/yellow]", soft_wrap=True)
        if v.get("calibration"):
            console.print(f"[yellow]{escape(v.provider)}: calibration {escape(str(v.get('calibration')))}: the "
                          "detector's settings and fitted values were not checked against its calibration[/yellow]",
                          soft_wrap=True)


def more_tokens(v: Verdict) -> str:
    """'-' when flagged, 'none (no excess)' when more tokens would not flag it, else ~N."""
    if v.flagged or "more_tokens_needed" not in v.reported:
        return "-"
    return "none (no excess)" if v.more_tokens_needed is None else f"~{v.more_tokens_needed}"


def probe(res) -> None:
    """What `verinfer determinism probe` prints for a `determinism.probe.ProbeResult`: a row
    per condition, the first divergences (at most 10), the summary and where the files are."""
    from verinfer.report.probe import CLASSES, condition_rows, flip_rows, summarize_probe

    doc = res.to_json()
    t = Table(title=f"verinfer determinism probe: {escape(res.model)} at {escape(res.base_url)}",
              caption="divergent: sequences that differ from the alone reference; near-tie: first divergence where "
                      "the reference's top-2 margin is under 1 logit; large-margin: at or above it")
    for col in ("condition", "sequences", "divergent", *CLASSES):
        t.add_column(col, no_wrap=True)
    for r in condition_rows(doc):
        t.add_row(r["condition"], str(r["sequences"]), f"[red]{r['divergent']}[/red]" if r["divergent"] else "0",
                  *(str(r[c]) for c in CLASSES))
    console = Console(width=max(120, Console().width))
    console.print(t)
    for r in flip_rows(doc)[:10]:
        console.print(escape(f"  {r['condition']}: prompt {r['prompt']} position {r['position']}: {r['reference']} -> "
                             f"{r['token']}, margin {r['margin']} ({r['class']})"), soft_wrap=True)
    typer.echo(f"{summarize_probe(doc)}\nresults: {res.paths.get('json')}  report: {res.paths.get('html')}")
