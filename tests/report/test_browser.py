"""The report page as a user sees it: headless Chromium loads a report, a probe script checks that
every image decodes and is shown at its drawn size and that the summary is on the first screen, and
a screenshot (with the page) is kept under runs/ci/ as a CI artifact.

Skipped where Chromium is absent, except when VERINFER_REQUIRE_CHROMIUM=1 (.ci/run installs
Debian's `chromium` and sets it: there a missing browser is a failure, not a skip)."""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from verinfer.detect.clipped_mean import ClippedMeanDetector
from verinfer.report.html import ReportContext, compute_auc_curves, write_report

from tests.report.chromium import ARTIFACTS, WINDOW, run_chromium as _chromium

BROKEN = '<img alt="probe: a broken image" src="data:image/png;base64,AAAA">'
PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const s = document.getElementById("summary"), r = s.getBoundingClientRect(), cs = getComputedStyle(s);
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({
    images: imgs.length,
    broken: imgs.filter(i => !i.complete || i.naturalWidth === 0).map(i => i.alt),
    scaled: imgs.filter(i => i.naturalWidth && i.clientWidth !== i.naturalWidth)
                .map(i => `${i.alt}: ${i.clientWidth} of ${i.naturalWidth} px`),
    summary: {text: s.innerText, top: r.top, bottom: r.bottom, height: r.height, display: cs.display,
              visibility: cs.visibility, viewport: window.innerHeight},
  });
  document.body.appendChild(out);
});
</script>
"""


def _table(rng) -> pa.Table:
    """Per-token scores of two honest providers and two misconfigurations (as tests/report/test_html)."""
    cols: dict[str, list] = {}
    for name, flip, scale in (("honest-a", 0.02, 0.1), ("honest-b", 0.03, 0.1), ("int4", 0.15, 0.3),
                              ("wrong-seed", 0.6, 1.0)):
        n = 3000
        diff = rng.random(n) < flip
        margin = np.where(diff, rng.exponential(scale, n), 0.0)
        for k, v in (("provider", [name] * n), ("margin", margin), ("exact_match", ~diff),
                     ("cross_entropy", rng.exponential(1.0 + scale, n))):
            cols.setdefault(k, []).extend(list(v))
    return pa.table(cols)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    table = _table(np.random.default_rng(0))
    honest = ["honest-a", "honest-b"]
    det = ClippedMeanDetector().fit(table.filter(pc.is_in(table["provider"], pa.array(honest))))
    verdicts = [det.verdict(table.filter(pc.equal(table["provider"], p)), max_tokens=1000).with_(
        provider=p, honest=p in honest) for p in ("honest-a", "honest-b", "int4", "wrong-seed")]
    ctx = ReportContext(model="synthetic scores (tests/report/test_browser.py)", weights_sha256="none",
                        sampling="temperature 1.0, top_k 50, top_p 0.95")
    curves = compute_auc_curves(table, honest, batch_sizes=(1, 10, 100, 1000), n_batches=200)
    return write_report(table, tmp_path_factory.mktemp("browser"), honest, verdicts, curves,
                        batch_sizes=(1, 10, 100, 1000), context=ctx)


def _probe(page: Path, tmp_path: Path) -> dict:
    dom = _chromium(f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=10000", "--dump-dom",
                    page.as_uri(), profile=tmp_path / "profile").stdout
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert m, f"the probe script did not run; the DOM ends with: {dom[-500:]}"
    return json.loads(html.unescape(m.group(1)))


def test_every_image_loads_at_its_size_and_the_summary_is_on_the_first_screen(report, tmp_path):
    text = report.read_text()
    probe = tmp_path / "probe.html"
    # the probe must be able to fail: a deliberately broken image is reported, and only that one
    probe.write_text(text.replace("</body>", BROKEN + PROBE + "</body>"))
    p = _probe(probe, tmp_path)
    n_images = text.count("<img ")
    assert n_images == 7  # overview + 2 misconfigurations x (AUC curves, margin and cross-entropy histograms)
    assert p["images"] == n_images + 1 and p["broken"] == ["probe: a broken image"]
    assert p["scaled"] == []  # each plot is shown at the pixel size it was drawn at, not shrunk
    s = p["summary"]
    assert s["display"] != "none" and s["visibility"] == "visible" and s["height"] > 0
    assert 0 <= s["top"] and s["bottom"] <= s["viewport"]  # visible without scrolling
    assert re.match(r"2 of 2 audited providers flagged \((int4, wrong-seed)\); 0 of 2 honest reference", s["text"])


def test_screenshot_is_kept_as_a_ci_artifact(report, tmp_path):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "report_screenshot.png"
    shot.unlink(missing_ok=True)
    _chromium("--window-size=1400,3600", f"--screenshot={shot}", report.as_uri(), profile=tmp_path / "profile")
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1400, 3600)
    shutil.copyfile(report, ARTIFACTS / "report.html")  # self-contained: the page the screenshot shows
