"""Vendors dashboard: one self-contained HTML page for a multi-vendor audit of chat APIs at
temperature 0 (DiFR appendix D, figure 5; Moonshot's K2 Vendor Verifier table), from the
`vendors.json` that `apps.audit_chat` writes. Top to bottom: what was audited (claimed model,
trusted model and weights hash, date, verinfer version, target FPR, settings), a one-line summary,
a row per vendor (a vendor that could not be audited is shown with its error, not dropped), the
reference bands, the bands figure, and how to read it.

    doc = load_vendors("runs/audit/vendors.json")       # validated: VerinferError names the field
    fig = vendors_figure(doc)                             # bands as shaded spans, vendors as points
    render_vendors_html(doc, "runs/audit/vendors.html")   # + vendors_bands.png next to it

The page is `templates/vendors.html.j2` (jinja2, autoescaped: vendor names are user input); numbers
go through `report.format`; the figure is drawn like `report.plots` (Agg Figure, no pyplot state)
at the size the page shows it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import markupsafe
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from verinfer.detect.summary import interval
from verinfer.errors import VerinferError
from verinfer.io import atomic_write_text
from verinfer.report import format as fmt
from verinfer.scores import CROSS_ENTROPY, EXACT_MATCH, MARGIN
from verinfer.report.html import _environment
from verinfer.report.plots import DPI, FONT_SIZE, LEGEND_SIZE, _style, save_png

__all__ = ["VendorBandsPlot", "VendorsDoc", "load_vendors", "render_vendors_html", "validate_vendors",
           "vendors_figure"]

OK, FLAGGED, ERROR = "ok", "flagged", "error"
STATUS_COLOR = {OK: "#007700", FLAGGED: "#bb0000", ERROR: "#777777"}
STATUS_MARKER = {OK: "o", FLAGGED: "s", ERROR: "X"}
BAND_COLORS = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
FIG_SIZE = (12.8, 4.6)  # inches: 1280 x 460 px at DPI, three panels side by side, legend below
PNG_SUFFIX = "_bands.png"
MAX_TICK = 24  # characters of a vendor name under its point (the table has it whole)


# -- the input contract (vendors.json) ----------------------------------------------------------
class _Model(BaseModel):
    # strict: a file contract, "yes" is not a boolean nor "0.5" a number; extra keys are kept
    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


class Interval(_Model):
    """A mean with its 95% (bootstrap) confidence interval."""

    mean: float
    ci95: list[float] = Field(min_length=2, max_length=2)

    @model_validator(mode="after")
    def _ordered(self) -> "Interval":
        lo, hi = self.ci95
        if lo > hi:
            raise ValueError(f"ci95 [{lo}, {hi}] is not an interval (lo > hi)")
        return self


class Band(_Model):
    """A reference band: verinfer's own greedy run of one local configuration, summarized like a vendor."""

    margin: Interval
    cross_entropy: Interval
    mismatch: Interval
    n_tokens: int = Field(ge=0)
    description: str


class VendorVerdict(_Model):
    flagged: bool
    p_value: float
    decision: str
    decided_at_tokens: int | None = None


class Vendor(_Model):
    """One vendor's row. `verdict` is None when it could not be audited (then `error` says why)."""

    name: str = Field(min_length=1)
    base_url: str
    served_model: str
    verdict: VendorVerdict | None
    mode: Literal["greedy", "seeded", "unseeded"] = "greedy"  # what its claims were judged in
    note: str | None = None           # unseeded: why (the vendor ignores seeds, ...)
    nearest_band: str | None = None
    exact_match: float | None = None
    margin: Interval | None = None
    cross_entropy: Interval | None = None
    mismatch: Interval | None = None  # written by apps.audit_chat; else 1 - exact_match is shown
    n_tokens: int = Field(ge=0)
    n_requests: int = Field(ge=0)
    tokens_to_decide: int | None = None
    requests_to_decide: int | None = None
    retokenized: float | None = None
    resegmented: float | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _judged_or_failed(self) -> "Vendor":
        if self.verdict is None and not self.error:
            raise ValueError("has neither a verdict nor an error (a vendor that could not be audited says why)")
        return self

    @property
    def status(self) -> str:
        return ERROR if self.verdict is None or self.error else FLAGGED if self.verdict.flagged else OK


class VendorsDoc(_Model):
    """vendors.json, as `apps.audit_chat` writes it (module docstring)."""

    title: str
    model: str
    trusted_model: str
    trusted_weights_sha256: str
    created: str
    verinfer_version: str
    target_fpr: float = Field(gt=0, lt=1)
    mode: Literal["greedy", "seeded", "unseeded", "mixed"]  # the claims' modes (apps.audit_chat: "mixed" when several)
    settings: dict
    bands: dict[str, Band]
    vendors: list[Vendor] = Field(min_length=1)

    @field_validator("created")
    @classmethod
    def _iso(cls, v: str) -> str:
        try:
            datetime.fromisoformat(v)
        except ValueError:
            raise ValueError(f"{v!r} is not an ISO 8601 time (e.g. 2025-01-02T03:04:05+00:00)") from None
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "VendorsDoc":
        names = [v.name for v in self.vendors]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"vendor names must be unique; repeated: {dup}")
        for v in self.vendors:
            if v.nearest_band is not None and v.nearest_band not in self.bands:
                raise ValueError(f"vendor {v.name!r}: nearest_band {v.nearest_band!r} is not one of the bands "
                                 f"{list(self.bands)}")
        return self


def _loc(loc: tuple, data) -> str:
    """A pydantic error location as a field path: vendors[1] ('acme').verdict.flagged."""
    out, node = "", data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and 0 <= part < len(node) else None
            if isinstance(node, Mapping) and isinstance(node.get("name"), str):
                out += f" ({node['name']!r})"
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, Mapping) else None
    return out or "(the document)"


def _plain(x):
    """The results as JSON would give them back: numpy scalars as Python numbers, tuples as lists
    (the audit passes its dict in memory; strict validation would refuse an np.int64 token count)."""
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if type(x).__module__ == "numpy" and hasattr(x, "item"):
        return x.item()
    return x


def validate_vendors(results, where: str | Path | None = None) -> VendorsDoc:
    """The audit's results (vendors.json as a dict) checked against the contract; a malformed one
    raises VerinferError naming each wrong field (up to 5) and the value found."""
    if isinstance(results, VendorsDoc):
        return results
    results = _plain(results)
    try:
        return VendorsDoc.model_validate(results)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        lines = []
        for err in errs[:5]:
            shown = err["type"] != "missing" and not isinstance(err["input"], (Mapping, list))  # a value, not a record
            got = f" (got {json.dumps(err['input'], default=str)[:60]})" if shown else ""
            lines.append(f"{_loc(err['loc'], results)}: {err['msg'].removeprefix('Value error, ')}{got}")
        more = f"; and {len(errs) - 5} more" if len(errs) > 5 else ""
        raise VerinferError("malformed vendors results: " + "; ".join(lines) + more,
                            where=str(where) if where else "vendors.json",
                            fix="write it with `verinfer audit-vendors` (apps.audit_chat), or correct the field "
                                "named") from None


def load_vendors(path: str | Path) -> VendorsDoc:
    """Read and validate a vendors.json."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise VerinferError("no such file", where=str(p), fix="run `verinfer audit-vendors` first") from None
    except json.JSONDecodeError as e:
        raise VerinferError(f"not JSON ({e.msg})", where=f"{p}:{e.lineno}") from None
    return validate_vendors(data, where=p)


# -- the figure ----------------------------------------------------------------------------------
PANELS = (("margin", "mean clipped margin"), ("cross_entropy", "mean cross-entropy"),
          ("mismatch", "mismatch rate (1 - exact match)"))


def _label(s: str) -> str:
    """A user string as matplotlib draws it literally ('$' would start mathtext)."""
    return s.replace("$", r"\$")


def _vendor_value(v: Vendor, score: str) -> tuple[float, float, float] | None:
    """(mean, lo, hi) of a vendor's score; mismatch falls back to 1 - exact_match (no CI)."""
    iv = getattr(v, score)
    if iv is not None:
        return iv.mean, *iv.ci95
    if score == "mismatch" and v.exact_match is not None:
        m = 1.0 - v.exact_match
        return m, m, m
    return None


class VendorBandsPlot:
    """One score (DiFR figure 5): each reference band a horizontal shaded span (its 95% CI) with a
    line at its mean, each vendor a point with its 95% CI, colored by verdict; a vendor without
    numbers gets its x slot and an 'error'/'no data' mark. `points`: {vendor: (x, mean)} drawn."""

    def __init__(self, ax: Axes):
        self.ax = ax
        self.points: dict[str, tuple[int, float]] = {}

    def plot(self, doc: VendorsDoc, score: str, ylabel: str, title: str | None = None) -> "VendorBandsPlot":
        ax = self.ax
        for i, (name, b) in enumerate(doc.bands.items()):
            iv, color = getattr(b, score), BAND_COLORS[i % len(BAND_COLORS)]
            ax.axhspan(iv.ci95[0], iv.ci95[1], color=color, alpha=0.18, lw=0, gid=f"band:{name}")
            ax.axhline(iv.mean, color=color, lw=1.2, alpha=0.9)
        for status in (OK, FLAGGED, ERROR):
            xs, ys, err = [], [], [[], []]
            for x, v in enumerate(doc.vendors):
                val = _vendor_value(v, score) if v.status == status else None
                if val is None:
                    continue
                m, lo, hi = val
                xs.append(x), ys.append(m), err[0].append(max(m - lo, 0.0)), err[1].append(max(hi - m, 0.0))
                self.points[v.name] = (x, m)
            if xs:
                ax.errorbar(xs, ys, yerr=err, fmt=STATUS_MARKER[status], ms=6, color=STATUS_COLOR[status],
                            ecolor=STATUS_COLOR[status], elinewidth=1.4, capsize=3, zorder=3, gid=f"vendors:{status}")
        for x, v in enumerate(doc.vendors):
            if v.name not in self.points:  # not audited: mark its slot at the bottom
                ax.annotate("error" if v.error else "no data", (x, 0), xycoords=("data", "axes fraction"),
                            xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                            fontsize=LEGEND_SIZE, color=STATUS_COLOR[ERROR], style="italic")
        names = [v.name if len(v.name) <= MAX_TICK else v.name[: MAX_TICK - 1] + "\u2026" for v in doc.vendors]
        slanted = len(names) > 3 or max(map(len, names)) > 10  # side by side they would overlap
        ax.set_xticks(range(len(names)), [_label(n) for n in names], rotation=30 if slanted else 0,
                      ha="right" if slanted else "center", rotation_mode="anchor")
        for tick, v in zip(ax.get_xticklabels(), doc.vendors):
            tick.set_color(STATUS_COLOR[v.status])
        ax.set_xlim(-0.6, len(doc.vendors) - 0.4)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        if title:
            ax.set_title(title)
        _style(ax)
        return self


def vendors_figure(results) -> Figure:
    """The bands figure: one panel per score (mean clipped margin, mean cross-entropy, mismatch
    rate), reference bands as shaded spans, vendors as points with 95% CIs colored by verdict; one
    legend below the panels. FIG_SIZE at DPI (1280 px wide: the page shows it unscaled)."""
    doc = validate_vendors(results)
    fig = Figure(figsize=FIG_SIZE, dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(PANELS))
    for ax, (score, label) in zip(axes, PANELS):
        VendorBandsPlot(ax).plot(doc, score, label, title=label)
    handles = [Line2D([], [], ls="", marker=STATUS_MARKER[s], color=STATUS_COLOR[s], label=f"vendor: {s}")
               for s in (OK, FLAGGED, ERROR) if any(v.status == s for v in doc.vendors)]
    handles += [Patch(facecolor=BAND_COLORS[i % len(BAND_COLORS)], alpha=0.35,
                      label=_label(f"band: {name}" + (f" ({b.description})" if b.description else "")))
                for i, (name, b) in enumerate(doc.bands.items())]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 4), fontsize=LEGEND_SIZE,
               frameon=False)
    fig.suptitle(_label(f"{doc.model}: vendors against reference bands (95% CIs)"), fontsize=FONT_SIZE + 1)
    return fig


# -- the page ------------------------------------------------------------------------------------
def _when(created: str) -> str:
    t = datetime.fromisoformat(created)
    if t.tzinfo is not None:
        return t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return t.strftime("%Y-%m-%d %H:%M")


def _setting(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=str)


def summarize_vendors(doc: VendorsDoc) -> str:
    """The page's one-line summary: how many vendors are consistent with honest inference, which
    were flagged, which could not be audited, and at what target false-positive rate."""
    by = {s: [v.name for v in doc.vendors if v.status == s] for s in (OK, FLAGGED, ERROR)}
    n = len(doc.vendors)
    line = f"{len(by[OK])} of {n} vendor{'s' if n != 1 else ''} consistent with honest inference of {doc.model}"
    line += f"; {len(by[FLAGGED])} flagged" + (f" ({', '.join(by[FLAGGED])})" if by[FLAGGED] else "")
    if by[ERROR]:
        line += f"; {len(by[ERROR])} could not be audited ({', '.join(by[ERROR])})"
    return line + f". Each verdict is a calibrated test at a {fmt.share(doc.target_fpr)} target false-positive rate."


def _ci(iv: Interval | None):
    """mean, then its 95% CI on a second line (markup: every part is a number)."""
    if iv is None:
        return fmt.DASH
    return markupsafe.Markup('{} <span class="sub">[{}, {}]</span>').format(
        fmt.sig(iv.mean), fmt.sig(iv.ci95[0]), fmt.sig(iv.ci95[1]))


def _environment_vendors():
    env = _environment()
    env.filters.update(ci=_ci)
    return env


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _mode_text(doc: dict) -> str:
    """How the vendors were sampled: temperature 0, or the modes of a sampled audit (apps.audit_chat)."""
    if doc.get("mode", "greedy") == "greedy":
        return "temperature 0"
    modes = doc.get("modes") or {}
    return "modes " + ", ".join(f"{m} {n} claims" for m, n in modes.items() if n) if modes else f"mode {doc['mode']}"


def render_vendors_markdown(doc: dict) -> str:
    """vendors.md: a vendors.json (audit-vendors, audit-api --chat, audit-log) as markdown tables."""
    lines = [f"# {doc['title']}", "",
             f"Trusted model {doc['trusted_model']} (weights sha256 {doc['trusted_weights_sha256'][:16]}...), "
             f"{_mode_text(doc)}, target FPR {doc['target_fpr']}; detector: {doc['detector']['summary']}.", "",
             "| vendor | verdict | mode | nearest band | exact match | mean margin | mean cross-entropy | tokens | "
             "requests | tokens to decide | requests to decide | re-cut |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in doc["vendors"]:
        if v["error"]:
            lines.append(f"| {v['name']} | error: {v['error'][:80]} | {v.get('mode', 'greedy')} |  |  |  |  |  |  |  |  |  |")
            continue
        lines.append(f"| {v['name']} | {'FLAGGED' if v['verdict']['flagged'] else 'ok'} | {v.get('mode', 'greedy')} | "
                     f"{v['nearest_band']} | "
                     f"{v[EXACT_MATCH]:.4f} | {v[MARGIN]['mean']:.4g} | {v[CROSS_ENTROPY]['mean']:.4g} | "
                     f"{v['n_tokens']} | {v['n_requests']} | {v['tokens_to_decide'] or '-'} | "
                     f"{v['requests_to_decide'] or '-'} | {_rate(v['resegmented'])} |")
    notes = [f"- {v['name']}: {v['note']}" for v in doc["vendors"] if v.get("note") and not v["error"]]
    if notes:
        lines += ["", "Notes (an unseeded row is judged from the trusted model's distribution alone, by the "
                      "unseeded detector calibrated on honest sampled runs):", "", *notes]
    lines += ["", "Reference bands (verinfer's own greedy runs, replayed like a vendor; 95% bootstrap CI):", "",
              "| band | what | mean clipped margin | mean cross-entropy | mismatch |", "|---|---|---|---|---|"]
    for name, b in doc["bands"].items():
        lines.append(f"| {name} | {b['description']} | {interval(b, MARGIN)} | {b[CROSS_ENTROPY]['mean']:.4g} | "
                     f"{b['mismatch']['mean']:.4f} |")
    return "\n".join(lines) + "\n"



def render_vendors_html(results, out_path: str | Path) -> Path:
    """Write the vendors dashboard to out_path (atomic; self-contained, the figure embedded) and
    the figure as <stem>_bands.png next to it; return out_path. `results`: vendors.json as a dict
    (validated: a malformed one raises VerinferError naming the field) or a VendorsDoc."""
    doc = validate_vendors(results)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    png_name = out.stem + PNG_SUFFIX
    png = save_png(vendors_figure(doc), out.parent / png_name)
    image = {"file": png_name, "data_uri": "data:image/png;base64," + base64.b64encode(png).decode(),
             "width": int.from_bytes(png[16:20], "big"), "height": int.from_bytes(png[20:24], "big"),
             "title": f"{doc.model}: mean clipped margin, mean cross-entropy and mismatch rate of each vendor "
                      "against the reference bands (95% CIs)"}
    nearest = {b: [v.name for v in doc.vendors if v.nearest_band == b] for b in doc.bands}
    page = _environment_vendors().get_template("vendors.html.j2").render(
        doc=doc, created=_when(doc.created), summary=summarize_vendors(doc), image=image, nearest=nearest,
        settings={str(k): _setting(v) for k, v in doc.settings.items()})
    atomic_write_text(out, page)
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m verinfer.report.vendors VENDORS_JSON [OUT_HTML]: (re)draw a dashboard."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    src = Path(args[0])
    try:
        path = render_vendors_html(load_vendors(src), args[1] if len(args) > 1 else src.with_suffix(".html"))
    except VerinferError as e:
        print(e.message, file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
