"""Headless Chromium for the page tests (test_browser, test_vendors_browser): the browser, or a
skip where it is absent, except when VERINFER_REQUIRE_CHROMIUM=1 (.ci/run installs Debian's
`chromium` and sets it: there a missing browser is a failure, not a skip)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    if os.environ.get("VERINFER_REQUIRE_CHROMIUM") == "1":
        raise RuntimeError("VERINFER_REQUIRE_CHROMIUM=1 but no chromium on PATH: apt-get install -y chromium")
    pytest.skip("chromium not installed (apt-get install -y chromium)", allow_module_level=True)

ARTIFACTS = Path(__file__).resolve().parents[2] / "runs" / "ci"
WINDOW = (1400, 900)  # a laptop screen: the summary must be on it without scrolling


def run_chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
           f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
