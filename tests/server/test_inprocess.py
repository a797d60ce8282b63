"""The server app in process (no port): body limits at the ASGI level."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient

from verinfer.models.testbed import TARGET_DIR
from verinfer.server import app as server_app
from verinfer.server.registry import load_registry

MODEL = "target"


@pytest.fixture(scope="module")
def app():
    return server_app.create_app(load_registry(TARGET_DIR), server_app.ServeConfig(TARGET_DIR))


def test_a_chunked_body_over_the_limit_gets_413(app):
    """No Content-Length (chunked transfer): the limit trips while the body streams in; the
    answer is 413 naming the limit, not FastAPI's 400 "error parsing the body"."""
    def chunks():
        yield b'{"model": "target", "prompt": "'
        for _ in range(20):
            yield b"x" * 65536  # 1.25 MiB in all
        yield b'", "max_tokens": 1}'

    r = TestClient(app).post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit of 1048576 bytes" in r.json()["error"]["message"]
    small = TestClient(app).post("/v1/completions", content=iter([b'{"model": "target", ', b'"prompt": [5], "max_tokens": 2}']),
                                 headers={"content-type": "application/json"})
    assert small.status_code == 200, small.text
    assert len(small.json()["choices"][0]["token_ids"]) == 2
