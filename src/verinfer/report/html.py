"""Audit report: AUC@1%FPR-vs-tokens curves per misconfiguration and score (DiFR figure 1 style),
score histograms honest vs each misconfiguration, a verdict table; one self-contained HTML file
with the PNGs next to it.

Figures are drawn on `matplotlib.figure.Figure` objects (Agg canvas, no pyplot global state) by
small plot classes that own an Axes, in the style of scikit-learn's Display objects:

    AucVsTokensPlot(ax).plot(curves[misconf])          # one line per score
    ScoreHistogramPlot(ax).plot(honest, misconf, ...)  # log-y histograms
"""

from __future__ import annotations

import html
import re
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from verinfer.io import atomic_write, atomic_write_text
from verinfer.detect.metrics import auc_vs_tokens, tokens_to_detect
from verinfer.audit.scores import SCORES, divergence
from verinfer.errors import VerinferError

BATCH_SIZES = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000)
HIST_SCORES = ("margin", "cross_entropy")
TARGET_AUC = 0.99


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
    cols = _columns(table, ["provider", *scores])
    prov = cols["provider"].astype(str)
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


# -- plots ---------------------------------------------------------------------------------------
class AucVsTokensPlot:
    """AUC@1%FPR against tokens per batch (log x), one line per score, for one misconfiguration."""

    def __init__(self, ax: Axes):
        self.ax = ax

    def plot(self, curves: Mapping[str, Mapping], title: str | None = None,
             target: float = TARGET_AUC) -> "AucVsTokensPlot":
        ax = self.ax
        for score, by_batch in curves.items():
            pts = sorted((int(b), a) for b, a in by_batch.items() if a is not None)
            if pts:
                ax.plot([b for b, _ in pts], [a for _, a in pts], marker="o", ms=3, lw=1.4, label=score)
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_ylim(0.45, 1.02)
        ax.set_xlabel("tokens per batch")
        ax.set_ylabel("AUC @ 1% FPR")
        ax.grid(True, which="major", alpha=0.3)
        if title:
            ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
        return self


class ScoreHistogramPlot:
    """Density histograms (log y) of one score, honest vs one misconfiguration; the share of
    infinite values (claimed token filtered out) is given in the legend."""

    def __init__(self, ax: Axes):
        self.ax = ax

    def plot(self, honest, misconf, score: str, misconf_name: str = "misconfigured",
             bins: int = 60) -> "ScoreHistogramPlot":
        ax = self.ax
        h, m = np.asarray(honest, dtype=np.float64), np.asarray(misconf, dtype=np.float64)
        hf, mf = h[np.isfinite(h)], m[np.isfinite(m)]
        both = np.r_[hf, mf]
        edges = np.histogram_bin_edges(both, bins=bins) if both.size else np.linspace(0, 1, bins + 1)
        for vals, fin, name, color in ((h, hf, "honest", "tab:blue"), (m, mf, misconf_name, "tab:red")):
            label = f"{name} (n={vals.size}, inf {1 - fin.size / max(vals.size, 1):.2%})"
            if fin.size:
                ax.hist(fin, bins=edges, density=True, histtype="step", lw=1.4, color=color, label=label)
        ax.set_yscale("log")
        ax.set_xlabel(score)
        ax.set_ylabel("density")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        return self


def _save(fig: Figure, path: Path) -> None:
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


# -- report --------------------------------------------------------------------------------------
def _fmt(x, spec: str = ".4f") -> str:
    if x is None:
        return "&mdash;"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (float, np.floating)):
        return format(float(x), spec)
    return html.escape(str(x))


def _table(header: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _data_table(cols: dict, honest: set[str]) -> str:
    prov = cols["provider"].astype(str)
    rows = []
    for p in _providers_in_order(prov):
        sel = prov == p
        margin = cols["margin"][sel].astype(np.float64) if "margin" in cols else np.empty(0)
        em = f"{np.mean(cols['exact_match'][sel]):.4f}" if "exact_match" in cols else "&mdash;"
        fin = margin[np.isfinite(margin)]
        rows.append([html.escape(p), "honest" if p in honest else "audited", str(int(sel.sum())), em,
                     f"{fin.mean():.4g}" if fin.size else "&mdash;",
                     f"{1 - fin.size / margin.size:.3%}" if margin.size else "&mdash;"])
    return _table(["provider", "role", "tokens", "exact match", "mean finite margin", "filtered out (inf)"], rows)


def _verdict_table(verdicts: list[dict]) -> str:
    rows = []
    for d in verdicts:
        truth = {True: "honest", False: "misconfigured"}.get(d.get("honest"), "?")
        flag = '<b class="bad">FLAGGED</b>' if d["flagged"] else '<span class="ok">ok</span>'
        rows.append([_fmt(d.get("provider", "?")), truth, flag, str(d["n_tokens"]), _fmt(d["pooled"]),
                     _fmt(d["threshold"]), f"{d['p_value']:.3g} ({html.escape(str(d.get('p_value_method', '')))})",
                     f"{d['target_fpr']:.2%}", _fmt(d.get("score")), _fmt(d.get("clip"), ".4g")])
    return _table(["provider", "truth", "verdict", "tokens", "pooled (clipped mean)", "threshold",
                   "p-value (method)", "target FPR", "score", "clip"], rows)


def _auc_table(curves: Mapping, batch_sizes: list[int]) -> str:
    rows = []
    for m, by_score in curves.items():
        for s, by_batch in by_score.items():
            auc = {int(b): a for b, a in by_batch.items()}
            cells = []
            for b in batch_sizes:
                a = auc.get(b)
                cells.append("&mdash;" if a is None else
                             (f'<b>{a:.3f}</b>' if a >= TARGET_AUC else f"{a:.3f}"))
            ttd = tokens_to_detect(auc, TARGET_AUC)
            rows.append([html.escape(m), html.escape(s), *cells, "&mdash;" if ttd is None else str(ttd)])
    return _table(["misconfiguration", "score", *map(str, batch_sizes), "tokens to detect"], rows)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,td:nth-child(2){text-align:left}.bad{color:#b00}.ok{color:#070}
.figs{display:flex;flex-wrap:wrap;gap:8px}.figs img{max-width:560px;border:1px solid #eee}"""


def write_report(scores_table, out_dir: str | Path, honest_providers: list[str], verdicts: list[dict] | None = None,
                 auc_curves: dict | None = None, batch_sizes: Iterable[int] = BATCH_SIZES) -> Path:
    """Write out_dir/report.html and its PNGs (auc_<misconf>.png, hist_<misconf>.png); return the
    HTML path. `auc_curves` as returned by `compute_auc_curves` (computed here if None)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    batch_sizes = [int(b) for b in batch_sizes]
    honest = set(honest_providers)
    cols = _columns(scores_table, ["provider", "exact_match", *SCORES])
    if auc_curves is None:
        auc_curves = compute_auc_curves(scores_table, list(honest_providers), batch_sizes=batch_sizes)
    prov = cols["provider"].astype(str)
    is_honest = np.isin(prov, list(honest))
    misconfs = [p for p in _providers_in_order(prov) if p not in honest]

    figures = []
    for m in sorted(set(misconfs) | set(auc_curves), key=lambda x: (x not in auc_curves, x)):
        imgs = []
        if m in auc_curves:
            fig = Figure(figsize=(5.2, 3.6), layout="constrained")
            AucVsTokensPlot(fig.add_subplot()).plot(auc_curves[m], title=f"honest vs {m}")
            _save(fig, out / f"auc_{_slug(m)}.png")
            imgs.append(f"auc_{_slug(m)}.png")
        is_m = prov == m
        hist_scores = [s for s in HIST_SCORES if s in cols]
        if is_m.any() and hist_scores:
            fig = Figure(figsize=(5.2 * len(hist_scores), 3.6), layout="constrained")
            for ax, s in zip(fig.subplots(1, len(hist_scores), squeeze=False)[0], hist_scores):
                v = divergence(cols, s)
                ScoreHistogramPlot(ax).plot(v[is_honest], v[is_m], s, m)
            _save(fig, out / f"hist_{_slug(m)}.png")
            imgs.append(f"hist_{_slug(m)}.png")
        if imgs:
            figures.append(f"<h3>{html.escape(m)}</h3><div class=figs>" +
                           "".join(f'<img src="{html.escape(i)}" alt="{html.escape(i)}">' for i in imgs) + "</div>")

    parts = [
        "<!doctype html><html><head><meta charset=utf-8><title>verinfer audit report</title>",
        f"<style>{_CSS}</style></head><body><h1>verinfer audit report</h1>",
        f"<p>Honest providers (the null): {html.escape(', '.join(sorted(honest)))}. "
        "Scores are oriented so that higher = more divergent from the trusted replay "
        "(margin, cross-entropy, 1 &minus; exact match, &minus;likelihood).</p>",
        "<h2>Data</h2>", _data_table(cols, honest),
    ]
    if verdicts:
        parts += ["<h2>Verdicts</h2>", "<p>Flagged iff the clipped mean of the batch exceeds the "
                  "(1 &minus; target FPR) quantile of resampled honest batch means of the same size; the p-value "
                  "is the tail probability of the pooled score under that honest null.</p>", _verdict_table(verdicts)]
    parts += ["<h2>AUC at 1% FPR by tokens per batch</h2>",
              "<p>McClish-standardized partial AUC (FPR &le; 1%) of honest vs misconfigured batch means on a "
              "token-level 50/50 split: clipped at a quantile of the honest train split, batches drawn from the "
              "test splits (DiFR 5.2). 0.5 = chance or not more divergent than honest; bold = reaches "
              f"{TARGET_AUC}; &mdash; = batch larger than the tokens available.</p>",
              _auc_table(auc_curves, batch_sizes), "<h2>Plots</h2>", *figures, "</body></html>"]
    path = out / "report.html"
    atomic_write_text(path, "\n".join(parts) + "\n")
    return path
