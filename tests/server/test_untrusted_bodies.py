"""Whatever bytes a client sends, the answer is a 400 in the OpenAI error shape, never a 500
(issue 34 item 2): lone UTF-16 surrogates in any string of either endpoint, bytes that are not
UTF-8, JSON nested beyond what a parser can follow."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient

from verinfer.models.testbed import TARGET_DIR
from verinfer.server import app as server_app
from verinfer.server.registry import load_registry

MODEL = "target"
HOLE = "@@HOLE@@"  # where the bad string goes in a body
COMPLETION = {"model": MODEL, "prompt": [5, 6], "max_tokens": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def client():
    app = server_app.create_app(load_registry(TARGET_DIR), server_app.ServeConfig(TARGET_DIR))
    return TestClient(app, raise_server_exceptions=False)  # a server error is a 500 reply, as a client sees it


def raw_body(body: dict, bad: str) -> bytes:
    """The JSON of `body` with the string HOLE (a value or a key) replaced by `bad`, a JSON string
    literal written by hand (json.dumps cannot write a lone surrogate escape unasked)."""
    return json.dumps(body).replace(f'"{HOLE}"', bad).encode()


def post_raw(client, path: str, content: bytes):
    return client.post(path, content=content, headers={"content-type": "application/json"})


def openai_error(r) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    return r.json()["error"]


# (endpoint, body with HOLE where the bad string goes, the field the error names)
FIELDS = [
    ("/v1/completions", {**COMPLETION, "prompt": HOLE}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["ok", HOLE]}, "prompt.1"),
    ("/v1/completions", {**COMPLETION, "model": HOLE}, "model"),
    ("/v1/completions", {**COMPLETION, "stop": HOLE}, "stop"),
    ("/v1/completions", {**COMPLETION, "stop": [HOLE]}, "stop.0"),
    ("/v1/completions", {**COMPLETION, "user": HOLE}, "user"),
    ("/v1/completions", {**COMPLETION, "suffix": HOLE}, "suffix"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {HOLE: 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "stream_options": {HOLE: True}}, "stream_options"),
    ("/v1/completions", {**COMPLETION, HOLE: 1}, "a field name"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": HOLE}]}, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a"},
                                                   {"role": "user", "content": "b", "name": HOLE}]},
     "messages.1.name"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": HOLE, "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "hi", "tool_call_id": HOLE}]},
     "messages.0.tool_call_id"),
    ("/v1/chat/completions", {**CHAT, "model": HOLE}, "model"),
    ("/v1/chat/completions", {**CHAT, "user": HOLE}, "user"),
    ("/v1/chat/completions", {**CHAT, "stop": [HOLE]}, "stop.0"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {HOLE: 1}}, "logit_bias"),
]


@pytest.mark.parametrize("bad", [r'"a\ud800b"', r'"\udfff"', r'"x\udc00\ud800"'])
@pytest.mark.parametrize("path, body, field", FIELDS)
def test_a_lone_surrogate_in_any_string_is_a_400_naming_the_field(client, path, body, field, bad):
    err = openai_error(post_raw(client, path, raw_body(body, bad)))
    assert "surrogate" in err["message"] and f"`{field}`" in err["message"], err
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["param"] == (None if field == "a field name" else field)


def test_a_surrogate_sent_as_utf8_bytes_is_a_400(client):
    """ED A0 80: the UTF-8 pattern of U+D800, which Python's JSON decoder lets through."""
    body = json.dumps({**COMPLETION, "prompt": HOLE}).encode().replace(f'"{HOLE}"'.encode(), b'"a\xed\xa0\x80b"')
    err = openai_error(post_raw(client, "/v1/completions", body))
    assert "surrogate" in err["message"] and err["param"] == "prompt"


def test_a_surrogate_pair_is_text(client):
    """A high-low pair of escapes is one character (U+1F600): no error."""
    r = post_raw(client, "/v1/completions", raw_body({**COMPLETION, "prompt": HOLE}, r'"smile \ud83d\ude00"'))
    assert r.status_code == 200, r.text
    r = post_raw(client, "/v1/chat/completions",
                 raw_body({**CHAT, "messages": [{"role": "user", "content": HOLE}]}, r'"\ud83d\ude00"'))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_bytes_that_are_not_utf8_are_a_400(client, path, body):
    content = raw_body({**body, "user": HOLE}, '"a\xffb"').replace(b"\xc3\xbf", b"\xff")
    assert b"\xff" in content
    err = openai_error(post_raw(client, path, content))
    assert "UTF-8" in err["message"], err


@pytest.mark.parametrize("content", [
    b"[" * 100_000 + b"]" * 100_000,
    json.dumps({**COMPLETION, "prompt": HOLE}).replace(f'"{HOLE}"', "[" * 100_000 + "]" * 100_000).encode(),
    json.dumps({**COMPLETION, "logit_bias": {"1": HOLE}}).replace(f'"{HOLE}"', '{"a":' * 50_000 + "1" + "}" * 50_000
                                                                  ).encode(),
])
def test_json_nested_100000_deep_is_a_400(client, content):
    assert len(content) < 1 << 20  # under the body limit: the parser, not the size check, meets it
    err = openai_error(post_raw(client, "/v1/completions", content))
    assert "nested" in err["message"], err


@pytest.mark.parametrize("depth", [500, 900])
def test_json_nested_as_deep_as_the_parser_goes_is_a_400(client, depth):
    """Deep but parseable: the checks after parsing (walking the strings, pydantic) hold too."""
    nest = lambda inner: "[" * depth + inner + "]" * depth  # noqa: E731
    for path, body in (("/v1/completions", {**COMPLETION, "prompt": HOLE}),
                       ("/v1/completions", {**COMPLETION, "logit_bias": {"1": HOLE}}),
                       ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "x": HOLE}]})):
        for inner in ('"ok"', r'"\ud800"'):
            r = post_raw(client, path, raw_body(body, nest(inner)))
            assert r.status_code in (200, 400), (path, depth, inner, r.status_code, r.text[:300])
            if r.status_code == 400:
                assert r.json()["error"]["message"]


def test_framework_errors_have_the_openai_shape(client):
    """Unknown routes and methods answer in the same error shape as everything else."""
    r = client.post("/v1/nope", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405 and "POST" in r.headers["allow"]
