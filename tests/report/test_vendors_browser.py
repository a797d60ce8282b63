"""The vendors dashboard as a user sees it: headless Chromium loads the page, a probe script reports
its vendor rows and whether the bands figure decodes at its drawn size, and a screenshot (with the
page) is kept under runs/ci/ as a CI artifact (the harness of tests/report/test_browser.py).

Skipped where Chromium is absent, except when VERINFER_REQUIRE_CHROMIUM=1 (.ci/run installs
Debian's `chromium` and sets it: there a missing browser is a failure, not a skip)."""

from __future__ import annotations

import html
import json
import re
import shutil

from tests.report.chromium import ARTIFACTS, WINDOW, run_chromium as _chromium
from tests.report.test_vendors import vendors_doc
from verinfer.report.vendors import render_vendors_html

PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = [...document.images];
  const s = document.getElementById("summary"), r = s.getBoundingClientRect();
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({
    rows: [...document.querySelectorAll("#vendors tbody tr")].map(tr => ({
      name: tr.dataset.vendor, status: tr.dataset.status, verdict: tr.cells[2].innerText.trim(),
      cells: tr.cells.length})),
    bands: [...document.querySelectorAll("#bands tbody tr")].map(tr => tr.dataset.band),
    images: imgs.map(i => ({alt: i.alt, ok: i.complete && i.naturalWidth > 0, width: i.naturalWidth,
                            shown: i.clientWidth})),
    scripts: document.scripts.length,
    summary: {text: s.innerText, bottom: r.bottom, viewport: window.innerHeight},
  });
  document.body.appendChild(out);
});
</script>
"""


def test_vendors_page_shows_every_vendor_row_and_the_figure(tmp_path):
    page = render_vendors_html(vendors_doc(), tmp_path / "vendors.html")
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = _chromium(f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=10000", "--dump-dom",
                    probe.as_uri(), profile=tmp_path / "profile").stdout
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert m, f"the probe script did not run; the DOM ends with: {dom[-500:]}"
    p = json.loads(html.unescape(m.group(1)))
    assert p["rows"] == [
        {"name": "honest-cloud", "status": "ok", "verdict": "ok", "cells": 13},
        {"name": "cheap-<script>alert(1)</script>", "status": "flagged", "verdict": "FLAGGED", "cells": 13},
        {"name": "dead $vendor", "status": "error", "verdict": "error", "cells": 4}]  # error spans the rest
    assert p["bands"] == ["bf16", "int4"]
    assert p["scripts"] == 1  # only the probe: the vendor name's <script> is text, not a script
    [img] = p["images"]
    assert img["ok"] and img["width"] == img["shown"] == 1280  # decodes, shown at its drawn size
    assert p["summary"]["text"].startswith("1 of 3 vendors consistent with honest inference of acme/chat-7b")
    assert 0 < p["summary"]["bottom"] <= p["summary"]["viewport"]  # on the first screen

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "vendors_screenshot.png"
    shot.unlink(missing_ok=True)
    _chromium("--window-size=1400,2400", f"--screenshot={shot}", page.as_uri(), profile=tmp_path / "profile")
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (1400, 2400)
    shutil.copyfile(page, ARTIFACTS / "vendors.html")  # self-contained: the page the screenshot shows
