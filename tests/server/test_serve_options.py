"""`verinfer serve` options are checked when the server is configured (issue 34 item 1): a limit
that would make every request hang (--max-concurrent 0) or get 413 (--max-body-bytes -5) is a
usage error naming the option, and the server never starts."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from typer.testing import CliRunner

from verinfer.cli.main import app
from verinfer.errors import VerinferError
from verinfer.models.testbed import TARGET_DIR
from verinfer.server import app as server_app
from verinfer.server.protocol import Limits

BAD_LIMITS = [  # (field, bad value, where the error points)
    ("max_concurrent", 0, "--max-concurrent"),
    ("max_concurrent", -1, "--max-concurrent"),
    ("max_waiting", -1, "--max-waiting"),
    ("max_tokens", 0, "--max-tokens"),
    ("max_body_bytes", -5, "--max-body-bytes"),
    ("max_body_bytes", 100, "--max-body-bytes"),  # too small for the smallest request
    ("max_prompts", 0, "Limits.max_prompts"),
    ("max_prompt_chars", 0, "Limits.max_prompt_chars"),
    ("max_logprobs", -1, "Limits.max_logprobs"),
    ("max_concurrent", 1.5, "--max-concurrent"),
    ("max_concurrent", True, "--max-concurrent"),
]


@pytest.mark.parametrize("field, value, where", BAD_LIMITS)
def test_limits_refuse_values_that_break_every_request(field, value, where):
    with pytest.raises(VerinferError) as e:
        Limits(**{field: value})
    assert e.value.where == where
    assert repr(value) in e.value.what and e.value.fix


def test_limits_accept_their_edges():
    Limits(max_concurrent=1, max_waiting=0, max_tokens=1, max_body_bytes=1024, max_prompts=1, max_prompt_chars=1,
           max_logprobs=0)


def test_serve_config_names_a_bad_noise_option():
    with pytest.raises(VerinferError) as e:
        server_app.ServeConfig(TARGET_DIR, noise="nope")
    assert e.value.where == "--noise" and "'nope'" in e.value.what


@pytest.fixture
def never_started(monkeypatch):
    """Fail the test if the server loads models or opens a port."""
    import uvicorn

    def started(*a, **k):
        pytest.fail("the server was started")

    monkeypatch.setattr(uvicorn, "run", started)
    monkeypatch.setattr(server_app, "load_registry", started)


@pytest.mark.parametrize("args, option", [
    (["--max-concurrent", "0"], "--max-concurrent"),
    (["--max-body-bytes", "-5"], "--max-body-bytes"),
    (["--max-waiting", "-1"], "--max-waiting"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--threads", "0"], "--threads"),
])
def test_cli_refuses_bad_options_before_starting(never_started, args, option):
    r = CliRunner().invoke(app, ["serve", *args])
    assert r.exit_code == 2, r.output
    assert option in r.output and args[1] in r.output


def test_cli_never_reaches_serve_with_a_bad_limit(monkeypatch):
    """The limits are checked where the config is built, before `serve` is called at all."""
    monkeypatch.setattr(server_app, "serve", lambda *a, **k: pytest.fail("serve() was called"))
    r = CliRunner().invoke(app, ["serve", "--max-concurrent", "0"])
    assert r.exit_code == 2 and "--max-concurrent" in r.output
