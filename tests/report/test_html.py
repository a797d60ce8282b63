import base64
import re
from html.parser import HTMLParser

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from verinfer._version import __version__
from verinfer.scores import SCORES, likelihood_score
from verinfer.detect.verdict import Verdict
from verinfer.report.html import ReportContext, _slug, compute_auc_curves, write_report
from verinfer.report.plots import DPI, FIG_SIZE, LEGEND_SIZE, AucVsTokensPlot, ScoreHistogramPlot

PNG = b"\x89PNG\r\n\x1a\n"


def _provider_rows(name: str, n: int, flip: float, scale: float, rng) -> dict:
    """Synthetic per-token scores: a fraction `flip` of tokens differ from the replay, with
    exponential margins of `scale`; a few are filtered out (+inf)."""
    diff = rng.random(n) < flip
    margin = np.where(diff, rng.exponential(scale, n), 0.0)
    margin[rng.random(n) < 2e-4] = np.inf
    xent = rng.exponential(1.0 + scale, n)
    xent[np.isinf(margin)] = np.inf
    return {"claim_id": [f"{name}-{i // 50}" for i in range(n)], "provider": [name] * n,
            "position": (np.arange(n) % 50).astype(np.int32), "token_id": rng.integers(0, 97, n).astype(np.int32),
            "margin": margin, "exact_match": ~diff, "cross_entropy": xent, "likelihood": likelihood_score(margin, 0.1)}


@pytest.fixture(scope="module")
def table():
    rng = np.random.default_rng(0)
    parts = [_provider_rows("honest-a", 5000, 0.02, 0.1, rng), _provider_rows("honest-b", 5000, 0.03, 0.1, rng),
             _provider_rows("int4", 6000, 0.15, 0.3, rng), _provider_rows("temp-1.1", 6000, 0.03, 0.1, rng)]
    cols = {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}
    return pa.table(cols)


def test_compute_auc_curves(table):
    sizes = (1, 10, 100, 1000, 3000, 3001)
    curves = compute_auc_curves(table, ["honest-a", "honest-b"], batch_sizes=sizes, n_batches=300, seed=0)
    assert list(curves) == ["int4", "temp-1.1"]
    assert set(curves["int4"]) == set(SCORES)
    # int4 has 6000 tokens -> a 3000-token test split: 3001 is more than half the available tokens
    assert curves["int4"]["margin"][3001] is None and curves["int4"]["margin"][3000] is not None
    assert curves["int4"]["margin"][1000] == pytest.approx(1.0)
    assert curves["int4"]["margin"][1] < 0.7
    assert curves["int4"]["exact_match"][100] > 0.9
    # temp-1.1 here equals the honest distribution: near chance at every size
    assert all(a is None or a < 0.8 for a in curves["temp-1.1"]["margin"].values())
    again = compute_auc_curves(table, ["honest-a", "honest-b"], batch_sizes=sizes, n_batches=300, seed=0)
    assert again == curves  # deterministic in the seed
    d = compute_auc_curves(table.to_pydict(), ["honest-a", "honest-b"], scores=("margin",), batch_sizes=sizes,
                           n_batches=300, seed=0)
    assert d["int4"]["margin"] == curves["int4"]["margin"]  # dict of arrays = same table


class _Page(HTMLParser):
    """The parts of a report page the tests read: table rows by id (cell texts), <img> attributes,
    the text of elements by id."""

    def __init__(self, text: str):
        super().__init__()
        self.rows, self.imgs, self.by_id = {}, [], {}
        self._row = self._cell = None
        self._open: list[tuple[str, str | None]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a)
            return
        if tag == "tr" and a.get("id"):
            self._row = self.rows.setdefault(a["id"], [])
        if tag == "td" and self._row is not None:
            self._cell = []
        self._open.append((tag, a.get("id")))
        if a.get("id"):
            self.by_id.setdefault(a["id"], "")

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        if tag == "tr":
            self._row = None
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        for _, i in self._open:
            if i:
                self.by_id[i] += data


PROVIDER_COLUMNS = ["provider", "role", "verdict", "tokens", "p", "exact match", "pooled / threshold",
                    "auc at audited size", "auc >= 0.99 from"]


def _row(page: _Page, provider: str) -> dict:
    return dict(zip(PROVIDER_COLUMNS, page.rows[f"provider-{provider}"]))


def _verdicts(table, honest, providers, max_tokens=1000):
    from verinfer.detect.clipped_mean import ClippedMeanDetector

    det = ClippedMeanDetector().fit(table.filter(pc.is_in(table["provider"], pa.array(honest))))
    return [det.verdict(table.filter(pc.equal(table["provider"], p)), max_tokens=max_tokens).with_(
        provider=p, honest=p in honest) for p in providers]


def test_write_report(table, tmp_path):
    honest = ["honest-a", "honest-b"]
    verdicts = _verdicts(table, honest, ("honest-a", "int4", "temp-1.1"))
    assert verdicts[1].flagged
    curves = compute_auc_curves(table, honest, batch_sizes=(1, 10, 100, 1000), n_batches=200)
    out = write_report(table, tmp_path / "rep", honest, verdicts, curves, batch_sizes=(1, 10, 100, 1000))
    assert out == tmp_path / "rep" / "report.html"
    text = out.read_text()
    for s in ("Verdict details", "FLAGGED", "AUC at 1% FPR", "int4", "temp-1.1", "cross_entropy"):
        assert s in text
    pngs = sorted(p.name for p in out.parent.glob("*.png"))
    i4, t11 = _slug("int4"), _slug("temp-1.1")
    assert pngs == sorted([f"auc_{i4}.png", "auc_overview.png", f"auc_{t11}.png", f"hist_{i4}_cross_entropy.png",
                           f"hist_{i4}_margin.png", f"hist_{t11}_cross_entropy.png", f"hist_{t11}_margin.png"])
    page = _Page(text)
    # self-contained: every PNG is embedded in the page (and also written next to it)
    assert sorted(i["data-file"] for i in page.imgs) == pngs
    for img in page.imgs:
        png = base64.b64decode(img["src"].removeprefix("data:image/png;base64,"))
        assert png[:8] == PNG and png == (out.parent / img["data-file"]).read_bytes()
    assert not list(out.parent.glob(".*tmp"))  # atomic writes left nothing behind
    row = _row(page, "int4")
    assert row["verdict"] == "FLAGGED" and row["tokens"] == "1,000" and row["role"] == "audited"
    em = float(np.mean(table.filter(pc.equal(table["provider"], "int4"))["exact_match"].to_numpy()))
    assert row["exact match"] == f"{em:.4f}"
    assert _row(page, "honest-b")["verdict"] == "not audited"


def test_report_names_what_was_audited_and_summarizes_first(table, tmp_path):
    honest = ["honest-a", "honest-b"]
    verdicts = _verdicts(table, honest, ("honest-a", "honest-b", "int4", "temp-1.1"))
    ctx = ReportContext(model="testbed-target", weights_sha256="0123456789abcdef",
                        sampling="temperature 1.0, top_k 50, top_p 0.95", created="2025-01-02 03:04 UTC")
    text = write_report(table, tmp_path, honest, verdicts, {}, batch_sizes=(1, 10), context=ctx).read_text()
    page = _Page(text)
    assert page.by_id["model"] == "testbed-target" and page.by_id["weights"] == "0123456789abcdef"
    assert page.by_id["sampling"] == "temperature 1.0, top_k 50, top_p 0.95"
    assert page.by_id["created"] == "2025-01-02 03:04 UTC" and page.by_id["version"] == __version__
    assert " ".join(page.by_id["summary"].split()) == (
        "1 of 2 audited providers flagged (int4); 0 of 2 honest reference providers flagged. "
        "Each judged on 1,000 tokens at a 1% target false-positive rate.")
    assert text.index('id="summary"') < text.index('id="providers"') < text.index("Evidence")
    default = _Page(write_report(table, tmp_path / "d", honest, verdicts, {}, batch_sizes=(1,)).read_text())
    assert default.by_id["model"] == default.by_id["weights"] == default.by_id["sampling"] == "not recorded"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", default.by_id["created"])


def test_summary_without_verdicts_says_what_the_curves_separate(table, tmp_path):
    curves = {"int4": {"margin": {10: 0.8, 100: 0.995}, "exact_match": {10: 0.7, 100: 0.999}},
              "temp-1.1": {"margin": {10: 0.5, 100: 0.51}}}
    page = _Page(write_report(table, tmp_path, ["honest-a", "honest-b"], None, curves, batch_sizes=(10, 100)).read_text())
    assert " ".join(page.by_id["summary"].split()) == (
        "No detector verdicts in this report (audit with `verinfer audit`). AUC@1%FPR reaches 0.99 for int4 at "
        "100 tokens (margin); not within the tokens available: temp-1.1.")


def _verdict(provider, flagged, pooled, threshold, p, n=1000, honest=False):
    return Verdict.of(provider=provider, honest=honest, flagged=flagged, pooled=pooled, threshold=threshold,
                      p_value=p, p_value_method="normal", n_tokens=n, target_fpr=0.01, threshold_fpr=0.0098,
                      score="margin", clip=0.321, more_tokens_needed=None if flagged else 2500,
                      decision="flagged" if flagged else "ok")


def test_p_values_and_small_pooled_values_keep_their_digits(table, tmp_path):
    """The wrong-seed p-value underflows to 0: the page says <1e-300 (as the CLI does), not 0; pooled
    scores and thresholds of order 1e-5 keep significant digits instead of printing 0.0000."""
    verdicts = [_verdict("honest-a", False, 3.1e-05, 4.24e-05, 0.412, honest=True),
                _verdict("int4", True, 0.0123, 4.24e-05, 0.0), _verdict("temp-1.1", False, 2.9e-05, 4.24e-05, 7.1e-3)]
    page = _Page(write_report(table, tmp_path, ["honest-a", "honest-b"], verdicts, {}, batch_sizes=(1,)).read_text())
    assert _row(page, "int4")["p"] == "<1e-300"
    assert _row(page, "honest-a")["pooled / threshold"] == "3.1e-05 / 4.24e-05 (margin)"
    assert _row(page, "temp-1.1")["p"] == "0.0071"
    assert "0.0000" not in " ".join(" ".join(r) for r in page.rows.values())


def test_auc_at_the_audited_size_reconciles_verdict_and_tokens_to_detect(table, tmp_path):
    """fp8-kv flagged on 1000 tokens while AUC@1%FPR reaches 0.99 only at 3000: the row gives the AUC
    at the audited size next to the batch size that reaches the bar, and the page says why they differ."""
    curves = {"int4": {"margin": {100: 0.7, 1000: 0.981, 3000: 0.995}, "exact_match": {100: 0.6, 1000: 0.97}},
              "temp-1.1": {"margin": {100: 0.5, 1000: 0.52}}}
    verdicts = [_verdict("int4", True, 0.0123, 0.004, 1e-5), _verdict("temp-1.1", False, 0.003, 0.004, 0.3)]
    text = write_report(table, tmp_path, ["honest-a", "honest-b"], verdicts, curves,
                        batch_sizes=(100, 1000, 3000)).read_text()
    page = _Page(text)
    row = _row(page, "int4")
    assert row["verdict"] == "FLAGGED" and row["auc at audited size"] == "0.981 at 1,000"
    assert row["auc >= 0.99 from"] == "3,000 tokens (margin)"
    assert _row(page, "temp-1.1")["auc >= 0.99 from"] == "not within the tokens available"
    assert "one batch can cross the threshold before almost every batch does" in " ".join(text.split())
    assert "tokens to detect" not in text  # the old, unexplained column name


def test_plots_are_drawn_at_the_size_the_page_shows_them(table, tmp_path):
    """One 640 x 400 px panel per PNG, shown at that size (the old histogram PNG held two panels
    1144 px wide squeezed into 560 px, with 7-point legends)."""
    out = write_report(table, tmp_path, ["honest-a", "honest-b"], None, None, batch_sizes=(1, 100))
    page = _Page(out.read_text())
    w, h = round(FIG_SIZE[0] * DPI), round(FIG_SIZE[1] * DPI)
    assert (w, h) == (640, 400) and len(page.imgs) == 7  # overview + 2 x (AUC, 2 histograms)
    for img in page.imgs:
        png = (tmp_path / img["data-file"]).read_bytes()
        assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (w, h)
        assert (img["width"], img["height"]) == (str(w), str(h)) and img["alt"]
    assert re.search(r"\.figs img\{max-width:100%", out.read_text())
    assert re.search(r"body\{[^}]*max-width:(\d+)px", out.read_text()).group(1) >= str(2 * w)


def test_write_report_computes_curves_when_missing(table, tmp_path):
    small = table.filter(pc.is_in(table["provider"], value_set=pa.array(["honest-a", "int4"])))
    out = write_report(small, tmp_path, ["honest-a"], None, None, batch_sizes=(1, 100))
    text = out.read_text()
    i4 = _slug("int4")
    assert "Verdict details" not in text and f"auc_{i4}.png" in text and (tmp_path / f"hist_{i4}_margin.png").is_file()


def test_plot_classes_own_an_axes_and_label_what_they_draw():
    from matplotlib.figure import Figure

    fig = Figure()
    ax1, ax2 = fig.subplots(1, 2)
    p = AucVsTokensPlot(ax1).plot({"margin": {1: 0.5, 10: 0.8, 100: 1.0, 1000: None},
                                   "exact_match": {"1": 0.5, "10": 0.6}}, title="x")
    assert p.ax is ax1 and ax1.get_xscale() == "log" and len(ax1.get_lines()) == 4  # 2 curves, target, chance
    assert list(ax1.get_lines()[0].get_xdata()) == [1, 10, 100]
    labels = [t.get_text() for t in ax1.get_legend().get_texts()]
    assert labels == ["margin", "exact_match", "target AUC 0.99", "chance (0.5)"]  # the dashed line is named
    assert ax1.get_title() == "x"
    h = ScoreHistogramPlot(ax2).plot(np.r_[np.zeros(10), 1.0, np.inf], np.r_[np.ones(5), 2.0], "margin", "int4")
    assert h.ax is ax2 and ax2.get_yscale() == "log" and ax2.get_title() == "margin: honest vs int4"
    texts = ax2.get_legend().get_texts()
    assert any("inf 8.33%" in t.get_text() for t in texts)
    assert min(t.get_fontsize() for t in [*texts, *ax1.get_legend().get_texts()]) >= LEGEND_SIZE >= 9


def test_context_for_model_reads_name_and_weights_hash():
    from verinfer.models.load import model_info
    from verinfer.models.testbed import TARGET_DIR

    if not (TARGET_DIR / "config.json").is_file():
        pytest.skip("testbed not built")
    info = model_info(TARGET_DIR)
    ctx = ReportContext.for_model(TARGET_DIR, {"temperature": 1.0, "top_k": 50}, created="today")
    assert (ctx.model, ctx.weights_sha256, ctx.sampling, ctx.created) == (info.name, info.weights_sha256,
                                                                       "temperature 1.0, top_k 50", "today")
    assert ReportContext.for_model(TARGET_DIR).sampling == "not recorded"
