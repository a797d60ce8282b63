"""Audit report: one self-contained HTML page an auditor can send on (the PNGs are embedded, and
also written next to it). Top to bottom: what was audited (model, weights hash, sampling, date,
verinfer version), a one-line summary, one row per provider (verdict, tokens, p-value, exact
match), then the evidence: verdict details, AUC@1%FPR-vs-tokens curves per misconfiguration and
score (DiFR figure 1 style), score histograms honest vs each misconfiguration, the scored data.

The page is `templates/report.html.j2` (jinja2); numbers go through `report.format`; figures are
`report.plots` objects at the size the page shows them.
"""

from __future__ import annotations

import base64
import hashlib
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import jinja2
import numpy as np
import pyarrow as pa

from verinfer._version import __version__
from verinfer.scores import CROSS_ENTROPY, EXACT_MATCH, MARGIN, PROVIDER, SCORES, divergence
from verinfer.detect.metrics import auc_vs_tokens, tokens_to_detect
from verinfer.detect.verdict import Verdict
from verinfer.errors import VerinferError
from verinfer.io import atomic_write_text
from verinfer.report import format as fmt
from verinfer.report.plots import TARGET_AUC, AucVsTokensPlot, ScoreHistogramPlot, new_figure, save_png

__all__ = ["AucVsTokensPlot", "ReportContext", "ScoreHistogramPlot", "compute_auc_curves", "summarize",
           "write_report"]

BATCH_SIZES = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000)
HIST_SCORES = (MARGIN, CROSS_ENTROPY)
NOT_RECORDED = "not recorded"


# -- what was audited ----------------------------------------------------------------------------
def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


@dataclass(frozen=True)
class ReportContext:
    """What the report says was audited. Fields the caller cannot know stay "not recorded"
    (`verinfer report` reads scores files, which record no model unless --model names it)."""

    model: str = NOT_RECORDED
    weights_sha256: str = NOT_RECORDED
    sampling: str = NOT_RECORDED
    created: str = field(default_factory=_now)
    version: str = __version__

    @classmethod
    def for_model(cls, model_dir: str | Path, sampling: Mapping | None = None, **kw) -> "ReportContext":
        """The model's name and weights hash from its directory (`models.load.model_info`);
        sampling: the advertised settings, e.g. {"temperature": 1.0, "top_k": 50, ...}."""
        from verinfer.models.load import model_info

        info = model_info(model_dir)
        text = ", ".join(f"{k} {v}" for k, v in sampling.items()) if sampling else NOT_RECORDED
        return cls(model=info.name, weights_sha256=info.weights_sha256, sampling=text, **kw)


# -- data ----------------------------------------------------------------------------------------
def _columns(scores_table, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The requested columns (those present) of a pyarrow Table or dict of arrays, as numpy."""
    if isinstance(scores_table, pa.Table):
        return {n: scores_table[n].to_numpy() for n in names if n in scores_table.column_names}
    if isinstance(scores_table, Mapping):
        return {n: np.asarray(scores_table[n]) for n in names if n in scores_table}
    raise TypeError(f"expected a pyarrow.Table or a dict of arrays, got {type(scores_table).__name__}")


def _providers_in_order(provider: np.ndarray) -> list[str]:
    _, first = np.unique(provider.astype(str), return_index=True)
    return [str(provider[i]) for i in np.sort(first)]


def compute_auc_curves(table, honest_providers: list[str], scores: Iterable[str] = SCORES,
                       batch_sizes: Iterable[int] = BATCH_SIZES, clip_q: float = 0.999, n_batches: int = 1000,
                       seed: int = 0) -> dict[str, dict[str, dict[int, float | None]]]:
    """{misconfiguration: {score: {batch size: AUC@1%FPR or None}}} by `metrics.auc_vs_tokens`.

    The honest pool is every row whose provider is in `honest_providers`; every other provider is a
    misconfiguration. Batch sizes larger than half the available tokens (a test split) are None.
    Scores whose column is absent are skipped. Deterministic in `seed`."""
    honest = set(honest_providers)
    cols = _columns(table, [PROVIDER, *scores])
    prov = cols[PROVIDER].astype(str)
    is_honest = np.isin(prov, list(honest))
    if not is_honest.any():
        raise VerinferError(f"no scored tokens from the honest providers {sorted(honest)}",
                            fix="score honest runs first, or name the honest providers correctly")
    present = [s for s in scores if s in cols]
    curves: dict[str, dict[str, dict[int, float | None]]] = {}
    for m in (p for p in _providers_in_order(prov) if p not in honest):
        is_m = prov == m
        curves[m] = {}
        for s in present:
            v = divergence(cols, s)
            rng = np.random.default_rng([seed, zlib.crc32(m.encode()), zlib.crc32(s.encode())])
            curves[m][s] = auc_vs_tokens(v[is_honest], v[is_m], batch_sizes, clip_q, n_batches, rng)
    return curves


def _first_detection(by_score: Mapping) -> tuple[int, str] | None:
    """(tokens, score) of the smallest batch size at which any score reaches the target AUC."""
    hits = [(t, i, s) for i, (s, by_batch) in enumerate(by_score.items())
            if (t := tokens_to_detect(by_batch, TARGET_AUC)) is not None]
    return min(hits)[::2] if hits else None  # ties: the first score (SCORES order: margin first)


def _auc_at(by_batch: Mapping | None, n_tokens: int) -> tuple[int, float] | None:
    """(batch size, AUC) at the largest evaluated batch size <= n_tokens."""
    pts = sorted((int(b), a) for b, a in (by_batch or {}).items() if a is not None and int(b) <= n_tokens)
    return pts[-1] if pts else None


# -- summary -------------------------------------------------------------------------------------
def _names(names: list[str]) -> str:
    return f" ({', '.join(names)})" if names else ""


def summarize(verdicts: list[dict] | None, curves: Mapping, honest: Iterable[str]) -> str:
    """The page's one-line summary of the verdicts (their `_verdict_view`s): how many providers were
    flagged (and which), on how many tokens at what target FPR; without verdicts, which
    misconfigurations the curves separate."""
    honest = set(honest)
    if verdicts:
        audited = [d for d in verdicts if d.get("provider") not in honest]
        ref = [d for d in verdicts if d.get("provider") in honest]
        flagged = [d["provider"] for d in audited if d["flagged"]]
        ref_flagged = [d["provider"] for d in ref if d["flagged"]]
        n = sorted({int(d["n_tokens"]) for d in verdicts})
        size = f"{fmt.tokens(n[0])} tokens" if len(n) == 1 else f"{fmt.tokens(n[0])}-{fmt.tokens(n[-1])} tokens"
        fprs = sorted({float(d["target_fpr"]) for d in verdicts})
        line = f"{len(flagged)} of {len(audited)} audited providers flagged{_names(flagged)}"
        if ref:
            line += f"; {len(ref_flagged)} of {len(ref)} honest reference providers flagged{_names(ref_flagged)}"
        return line + f". Each judged on {size} at a {' / '.join(fmt.share(f) for f in fprs)} target false-positive rate."
    found = {m: d for m in curves if (d := _first_detection(curves[m]))}
    missed = [m for m in curves if m not in found]
    parts = [f"{m} at {fmt.tokens(t)} tokens ({s})" for m, (t, s) in found.items()]
    line = "No detector verdicts in this report (audit with `verinfer audit`). "
    line += (f"AUC@1%FPR reaches {TARGET_AUC:g} for " + ", ".join(parts)) if parts else \
        f"No misconfiguration reaches AUC@1%FPR {TARGET_AUC:g}"
    return line + (f"; not within the tokens available: {', '.join(missed)}." if missed and parts else ".")


# -- rows ----------------------------------------------------------------------------------------
VERDICT_KEYS = ("provider", "honest", "flagged", "n_tokens", "pooled", "threshold", "p_value", "p_value_method",
                "target_fpr", "threshold_fpr", "score", "clip")


def _verdict_view(v: Verdict) -> dict:
    """A verdict with every key the page reads (None where a detector does not report it) and
    `more`: the tokens a decision would still need ('-' when flagged or not reported)."""
    view = {k: v.get(k) for k in VERDICT_KEYS}
    if v.flagged or "more_tokens_needed" not in v.reported:
        view["more"] = fmt.DASH
    else:
        more = v.more_tokens_needed
        view["more"] = "none (no excess)" if more is None else f"~{fmt.tokens(more)}"
    return view


def _provider_rows(cols: dict, honest: set[str], verdicts: list[dict], curves: Mapping) -> list[dict]:
    prov = cols[PROVIDER].astype(str)
    by_name = {d.get("provider"): d for d in verdicts}
    names = _providers_in_order(prov) + [p for p in by_name if p not in set(prov)]
    rows = []
    for p in names:
        sel = prov == p
        d = by_name.get(p)
        row = {"provider": p, "role": "honest reference" if p in honest else "audited",
               "scored": int(sel.sum()),
               "exact_match": float(np.mean(cols[EXACT_MATCH][sel])) if EXACT_MATCH in cols and sel.any() else None,
               "verdict": d, "auc": None, "detect": _first_detection(curves[p]) if p in curves else None}
        if d is not None and p in curves:
            row["auc"] = _auc_at(curves[p].get(d.get("score") or MARGIN), int(d["n_tokens"]))
        rows.append(row)
    return rows


def _data_rows(cols: dict, honest: set[str]) -> list[dict]:
    prov = cols[PROVIDER].astype(str)
    rows = []
    for p in _providers_in_order(prov):
        sel = prov == p
        margin = cols[MARGIN][sel].astype(np.float64) if MARGIN in cols else np.empty(0)
        fin = margin[np.isfinite(margin)]
        rows.append({"provider": p, "role": "honest reference" if p in honest else "audited",
                     "tokens": int(sel.sum()), "mean_margin": float(fin.mean()) if fin.size else None,
                     "filtered": 1 - fin.size / margin.size if margin.size else None})
    return rows


def _auc_rows(curves: Mapping, batch_sizes: list[int]) -> list[dict]:
    rows = []
    for m, by_score in curves.items():
        for s, by_batch in by_score.items():
            auc = {int(b): a for b, a in by_batch.items()}
            rows.append({"misconf": m, "score": s, "auc": [auc.get(b) for b in batch_sizes],
                         "detect": tokens_to_detect(auc, TARGET_AUC)})
    return rows


# -- figures -------------------------------------------------------------------------------------
def _slug(name: str) -> str:
    """A file-name part for a provider name, one per name: its first 40 characters made safe
    ([A-Za-z0-9_.-]) and 8 hex digits of its sha256 ("a/b", "a_b" and "a b" get different files; a
    100,000-character name a short one)."""
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name[:40])}-{digest}"


@dataclass(frozen=True)
class Image:
    """A PNG written next to the page and embedded in it."""

    file: str
    title: str
    data_uri: str
    width: int
    height: int


def _image(fig, out: Path, file: str, title: str) -> Image:
    png = save_png(fig, out / file)
    w, h = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # the IHDR chunk
    return Image(file, title, "data:image/png;base64," + base64.b64encode(png).decode(), w, h)


def _short(name: str, n: int = 48) -> str:
    """A provider name as plots show it: whole up to n characters, else its start, an ellipsis and
    4 hex digits of its sha256 (a 1,000-character name would collapse the axes)."""
    return name if len(name) <= n else f"{name[:n - 6]}…{_slug(name)[-8:-4]}"


def _figures(cols: dict, honest: set[str], curves: Mapping, out: Path, overview_score: str) -> tuple:
    prov = cols[PROVIDER].astype(str)
    is_honest = np.isin(prov, list(honest))
    misconfs = [p for p in _providers_in_order(prov) if p not in honest]
    overview = None
    lines = {_short(m): by_score[overview_score] for m, by_score in curves.items() if overview_score in by_score}
    if lines:
        fig = new_figure()
        AucVsTokensPlot(fig.axes[0]).plot(lines, title=f"{overview_score}: AUC@1%FPR of every misconfiguration")
        overview = _image(fig, out, "auc_overview.png", f"{overview_score}, every misconfiguration")
    sections = []
    for m in sorted(set(misconfs) | set(curves), key=lambda x: (x not in curves, x)):
        imgs = []
        if m in curves:
            fig = new_figure()
            AucVsTokensPlot(fig.axes[0]).plot(curves[m], title=f"honest vs {_short(m)}: AUC@1%FPR by score")
            imgs.append(_image(fig, out, f"auc_{_slug(m)}.png", f"AUC@1%FPR vs tokens, honest vs {m}"))
        is_m = prov == m
        for s in (s for s in HIST_SCORES if s in cols and is_m.any()):
            v = divergence(cols, s)
            fig = new_figure()
            ScoreHistogramPlot(fig.axes[0]).plot(v[is_honest], v[is_m], s, _short(m))
            imgs.append(_image(fig, out, f"hist_{_slug(m)}_{s}.png", f"{s} histogram, honest vs {m}"))
        if imgs:
            sections.append({"name": m, "images": imgs})
    return overview, sections


# -- report --------------------------------------------------------------------------------------
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("verinfer.report", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(sig=fmt.sig, p=fmt.p_value, tokens=fmt.tokens, share=fmt.share)
    return env


def write_report(scores_table, out_dir: str | Path, honest_providers: list[str],
                 verdicts: list[Verdict] | None = None, auc_curves: dict | None = None,
                 batch_sizes: Iterable[int] = BATCH_SIZES, context: ReportContext | None = None) -> Path:
    """Write out_dir/report.html (self-contained) and its PNGs (auc_overview.png,
    auc_<misconf>.png, hist_<misconf>_<score>.png, each <misconf> a `_slug` of the provider name); return the HTML path. `auc_curves` as returned
    by `compute_auc_curves` (computed here if None); `context`: what was audited (every field
    "not recorded" if None)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    batch_sizes = [int(b) for b in batch_sizes]
    honest = set(honest_providers)
    verdicts = [_verdict_view(d) for d in verdicts or []]
    cols = _columns(scores_table, [PROVIDER, EXACT_MATCH, *SCORES])
    if auc_curves is None:
        auc_curves = compute_auc_curves(scores_table, list(honest_providers), batch_sizes=batch_sizes)
    overview_score = next((d["score"] for d in verdicts if d.get("score")), MARGIN)
    overview, sections = _figures(cols, honest, auc_curves, out, overview_score)
    page = _environment().get_template("report.html.j2").render(
        context=context or ReportContext(), summary=summarize(verdicts, auc_curves, honest),
        honest=sorted(honest), providers=_provider_rows(cols, honest, verdicts, auc_curves), verdicts=verdicts,
        auc_rows=_auc_rows(auc_curves, batch_sizes), batch_sizes=batch_sizes, target_auc=TARGET_AUC,
        overview=overview, sections=sections, data=_data_rows(cols, honest))
    path = out / "report.html"
    atomic_write_text(path, page)
    return path
