import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from verinfer.report.html import AucVsTokensPlot, ScoreHistogramPlot, compute_auc_curves, write_report
from verinfer.audit.scores import SCORES, likelihood_score

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


def test_write_report(table, tmp_path):
    from verinfer.detect.clipped_mean import ClippedMeanDetector

    honest = ["honest-a", "honest-b"]
    det = ClippedMeanDetector().fit(table.filter(pc.is_in(table["provider"], pa.array(honest))))
    verdicts = [{**det.verdict(table.filter(pc.equal(table["provider"], p)), max_tokens=1000), "provider": p,
                 "honest": p in honest} for p in ("honest-a", "int4", "temp-1.1")]
    assert verdicts[1]["flagged"]
    curves = compute_auc_curves(table, honest, batch_sizes=(1, 10, 100, 1000), n_batches=200)
    out = write_report(table, tmp_path / "rep", honest, verdicts, curves, batch_sizes=(1, 10, 100, 1000))
    assert out == tmp_path / "rep" / "report.html"
    html = out.read_text()
    for s in ("Verdicts", "FLAGGED", "AUC at 1% FPR", "int4", "temp-1.1", "tokens to detect", "cross_entropy"):
        assert s in html
    pngs = sorted(p.name for p in out.parent.glob("*.png"))
    assert pngs == ["auc_int4.png", "auc_temp-1.1.png", "hist_int4.png", "hist_temp-1.1.png"]
    for name in pngs:
        assert f'src="{name}"' in html
        assert (out.parent / name).read_bytes()[:8] == PNG
    assert not list(out.parent.glob(".*tmp"))  # atomic writes left nothing behind


def test_write_report_computes_curves_when_missing(table, tmp_path):
    small = table.filter(pc.is_in(table["provider"], value_set=pa.array(["honest-a", "int4"])))
    out = write_report(small, tmp_path, ["honest-a"], None, None, batch_sizes=(1, 100))
    html = out.read_text()
    assert "Verdicts" not in html and "auc_int4.png" in html and (tmp_path / "hist_int4.png").is_file()


def test_plot_classes_own_an_axes():
    from matplotlib.figure import Figure

    fig = Figure()
    ax1, ax2 = fig.subplots(1, 2)
    p = AucVsTokensPlot(ax1).plot({"margin": {1: 0.5, 10: 0.8, 100: 1.0, 1000: None},
                                   "exact_match": {"1": 0.5, "10": 0.6}}, title="x")
    assert p.ax is ax1 and ax1.get_xscale() == "log" and len(ax1.get_lines()) == 3  # 2 curves + target line
    assert list(ax1.get_lines()[0].get_xdata()) == [1, 10, 100]
    h = ScoreHistogramPlot(ax2).plot(np.r_[np.zeros(10), 1.0, np.inf], np.r_[np.ones(5), 2.0], "margin", "int4")
    assert h.ax is ax2 and ax2.get_yscale() == "log"
    assert any("inf 8.33%" in t.get_text() for t in ax2.get_legend().get_texts())
