"""The report's figures, drawn on `matplotlib.figure.Figure` objects (Agg canvas, no pyplot global
state) by small plot classes that own an Axes, in the style of scikit-learn's Display objects:

    AucVsTokensPlot(ax).plot(curves[misconf], title=...)      # one line per score, labelled target
    ScoreHistogramPlot(ax).plot(honest, misconf, "margin", m)  # log-y histograms, titled

Every figure is one panel of FIG_SIZE inches at DPI: 640 x 400 pixels, the size the report shows it
at (never scaled down), so the 10-point text and 9-point legends read as drawn.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from verinfer.io import atomic_write

TARGET_AUC = 0.99
DPI = 100
FIG_SIZE = (6.4, 4.0)  # inches: 640 x 400 px at DPI
FONT_SIZE = 10
LEGEND_SIZE = 9


def new_figure() -> Figure:
    """One panel at the report's display size, with its font sizes."""
    fig = Figure(figsize=FIG_SIZE, dpi=DPI, layout="constrained")
    fig.add_subplot()
    return fig


def _style(ax: Axes) -> None:
    ax.tick_params(labelsize=FONT_SIZE - 1)
    ax.xaxis.label.set_size(FONT_SIZE)
    ax.yaxis.label.set_size(FONT_SIZE)
    ax.title.set_size(FONT_SIZE + 1)


class AucVsTokensPlot:
    """AUC@1%FPR against tokens per batch (log x), one line per score, for one misconfiguration;
    the target (dashed) and chance (dotted) levels are labelled in the legend."""

    def __init__(self, ax: Axes):
        self.ax = ax

    def plot(self, curves: Mapping[str, Mapping], title: str | None = None,
             target: float = TARGET_AUC) -> "AucVsTokensPlot":
        ax = self.ax
        for score, by_batch in curves.items():
            pts = sorted((int(b), a) for b, a in by_batch.items() if a is not None)
            if pts:
                ax.plot([b for b, _ in pts], [a for _, a in pts], marker="o", ms=4, lw=1.6, label=score)
        ax.axhline(target, color="grey", lw=1.0, ls="--", label=f"target AUC {target:g}")
        ax.axhline(0.5, color="grey", lw=0.8, ls=":", label="chance (0.5)")
        ax.set_xscale("log")
        ax.set_ylim(0.45, 1.02)
        ax.set_xlabel("tokens per batch")
        ax.set_ylabel("AUC @ 1% FPR")
        ax.grid(True, which="major", alpha=0.3)
        if title:
            ax.set_title(title)
        ax.legend(fontsize=LEGEND_SIZE, loc="best", framealpha=0.9)
        _style(ax)
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
            label = f"{name} (n={vals.size:,}, inf {1 - fin.size / max(vals.size, 1):.2%})"
            if fin.size:
                ax.hist(fin, bins=edges, density=True, histtype="step", lw=1.6, color=color, label=label)
        ax.set_yscale("log")
        ax.set_xlabel(f"{score} per token (higher = more divergent)")
        ax.set_ylabel("density (log)")
        ax.set_title(f"{score}: honest vs {misconf_name}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=LEGEND_SIZE, loc="upper right", framealpha=0.9)
        _style(ax)
        return self


def save_png(fig: Figure, path: Path) -> bytes:
    """Write the figure as PNG at its own DPI (atomic) and return the bytes written."""
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=fig.dpi))
    return Path(path).read_bytes()
