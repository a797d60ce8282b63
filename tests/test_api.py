"""The Python API: exported from `verinfer` without importing torch until used; the CLI's chat
commands call the same functions."""

import subprocess
import sys

import pytest

import verinfer
from verinfer import api


def test_exports_are_the_api_functions():
    for name in ("audit_endpoint", "audit_vendors", "audit_log", "score_claims", "ChatEndpoint", "ChatAuditResult"):
        assert getattr(verinfer, name) is getattr(api, name)
    assert set(api.__all__) >= {"audit_endpoint", "audit_vendors", "audit_log", "score_claims"}


def test_import_verinfer_stays_cheap():
    code = "import sys, verinfer; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_cli_chat_commands_call_the_api():
    src = open(verinfer.__file__.replace("__init__.py", "cli/main.py")).read()
    for fn in ("audit_endpoint", "audit_vendors", "audit_log"):
        assert f"from verinfer.api import {fn}" in src


def test_the_api_and_the_cli_read_a_model_argument_the_same_way(tmp_path):
    from verinfer.cli.main import _model_dir
    from verinfer.errors import ModelError
    from verinfer.models.catalog import trusted_model_dir
    from verinfer.models.testbed import TARGET_DIR

    assert api.trusted_model_dir is trusted_model_dir  # one function, in models/, used by both
    for read in (trusted_model_dir, _model_dir):
        assert read(None) == TARGET_DIR
        assert read(str(tmp_path)) == tmp_path and read(tmp_path) == tmp_path
        with pytest.raises(ModelError, match="'no-such-model' is neither a directory nor a known model name"):
            read("no-such-model")
    src = open(verinfer.__file__.replace("__init__.py", "cli/main.py")).read()
    assert "resolve_model" not in src and "TARGET_DIR" not in src  # the CLI does not resolve models itself
