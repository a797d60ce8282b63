"""The Python API: exported from `verinfer` without importing torch until used; the CLI's chat
commands call the same functions."""

import subprocess
import sys

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
