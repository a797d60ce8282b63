"""The server app in process (no port): body limits and client disconnects at the ASGI level."""

from __future__ import annotations

import asyncio
import json

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


def post_then_disconnect(app, path: str, body: dict) -> list[dict]:
    """POST `body` to the ASGI `app` at `path` from a client that disconnects right after sending
    it; the ASGI messages the app sent back."""
    raw = json.dumps(body).encode()
    sent, out = [], []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": raw, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(msg):
        out.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    return out


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": [[5, 6], [7]], "max_tokens": 200, "ignore_eos": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                              "ignore_eos": True}),
])
def test_a_disconnected_client_stops_its_non_streaming_generation(app, monkeypatch, path, body):
    """The client goes away right after sending its request: the server stops decoding for it
    within a step or two (it used to decode all 200 tokens for nobody)."""
    steps = []
    real = server_app.generate_steps

    def counting(*a, **k):
        for s in real(*a, **k):
            steps.append(s)
            yield s

    monkeypatch.setattr(server_app, "generate_steps", counting)
    out = post_then_disconnect(app, path, body)
    n_jobs = len(body.get("prompt", [None]))
    assert 1 <= len(steps) <= 2 * n_jobs, f"{len(steps)} steps decoded for a client that was gone"
    assert out[0]["status"] == 499
