"""Terminal rendering of what the commands return (rich): the verdicts table of `verinfer audit`,
`demo` and `audit-api`. The HTML report is `report/`."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from verinfer.detect.verdict import Verdict


def print_verdicts(verdicts: list[Verdict]) -> None:
    """One row per verdict (provider, truth, verdict, tokens, pooled, threshold, p-value, FPRs,
    tokens to flag), then what each ok verdict with a stated power established."""
    t = Table(title="verinfer audit: DiFR verdicts",
              caption="FPR: the target, the rate at the threshold on resampled honest batches, and on held-out honest "
                      "claims at calibration; to flag: tokens at which the provider's excess over honest, if it "
                      "persisted, would be flagged")
    for col in ("provider", "truth", "verdict", "tokens", "pooled", "threshold", "p-value", "FPR", "to flag"):
        t.add_column(col, no_wrap=True, min_width=7 if col in ("verdict", "p-value") else None)
    for v in verdicts:
        truth = {True: "honest", False: "misconfigured", None: "?"}[v.honest]
        fpr = f"{v.target_fpr:.0%}" + (f" / {v.threshold_fpr:.2%}" if "threshold_fpr" in v.reported else "") + \
            (f" / {v.heldout_fpr:.1%}" if "heldout_fpr" in v.reported else "")
        t.add_row(escape(v.provider), truth, "[red]FLAGGED[/red]" if v.flagged else "[green]ok[/green]",
                  str(v.n_tokens), f"{v.pooled:.2g}", f"{v.threshold:.2g}",
                  (f"{v.p_value:.2g}" if v.p_value > 0 else "<1e-300"), fpr, more_tokens(v))
    console = Console(width=max(160, Console().width))
    console.print(t)
    for v in verdicts:  # what an ok verdict established (the power against a stated deviation)
        if not v.flagged and v.get("power"):
            console.print(f"{escape(v.provider)}: {escape(v.decision)}", soft_wrap=True)


def more_tokens(v: Verdict) -> str:
    """'-' when flagged, 'none (no excess)' when more tokens would not flag it, else ~N."""
    if v.flagged or "more_tokens_needed" not in v.reported:
        return "-"
    return "none (no excess)" if v.more_tokens_needed is None else f"~{v.more_tokens_needed}"
