"""`verinfer audit-api` against a stub endpoint that answers bad bodies (an HTML page, `{}`,
`choices: null`, `choices: []`, invalid JSON, float or string token ids): each is an error naming
the endpoint and the request, exit 2 without a traceback, and the claims file the audit keeps for
its resume stays valid (nothing of the bad reply is saved)."""

from __future__ import annotations

import pytest

pytest.importorskip("openai")

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from typer.testing import CliRunner

from verinfer.core.completions import ApiAuditConfig, detector_meta
from verinfer.claims import read_claims
from verinfer.cli.main import app
from verinfer.models.load import model_info
from verinfer.models.testbed import TARGET_DIR

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built")


def good_reply(req: dict) -> bytes:
    return json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": req["model"],
                       "choices": [{"index": 0, "text": "", "finish_reason": "length", "token_ids": [5, 6, 7],
                                    "prompt_token_ids": req["prompt"]}]}).encode()


class StubEndpoint:
    """An OpenAI-compatible endpoint on a free loopback port: the first `good` requests get
    `reply(request)` (default: a valid completion, token ids 5, 6, 7), every later one gets
    `bad(request) -> (body, content type)`."""

    def __init__(self, good: int, bad, reply=good_reply):
        stub = self
        self.good, self.bad, self.requests = good, bad, []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(req)
                if len(stub.requests) <= stub.good:
                    body, ctype = reply(req), "application/json"
                else:
                    body, ctype = stub.bad(req)
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _reply(**choice) -> callable:
    def bad(req):
        c = {"index": 0, "text": "", "finish_reason": "length", "token_ids": [5, 6, 7],
             "prompt_token_ids": req["prompt"], **choice}
        return json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": req["model"],
                           "choices": [c]}).encode(), "application/json"
    return bad


BAD = {
    "html": (lambda req: (b"<html><body>502 Bad Gateway</body></html>", "text/html"), "not JSON"),
    "invalid-json": (lambda req: (b'{"choices": [', "application/json"), "not JSON"),
    "empty-object": (lambda req: (b"{}", "application/json"), "choices"),
    "choices-null": (lambda req: (b'{"choices": null}', "application/json"), "choices"),
    "choices-empty": (lambda req: (b'{"choices": []}', "application/json"), "choices"),
    "float-ids": (_reply(token_ids=[5, 6.5, 7]), "token_ids"),
    "string-ids": (_reply(token_ids=[5, "6", 7]), "token_ids"),
    "negative-ids": (_reply(token_ids=[5, -1, 7]), "token_ids"),
    "null-ids": (_reply(token_ids=None), "token_ids"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_reply_is_an_error_naming_endpoint_and_request_and_claims_stay_valid(kind, tmp_path):
    bad, field = BAD[kind]
    stub = StubEndpoint(good=2, bad=bad)
    out = tmp_path / "a"
    try:
        r = CliRunner().invoke(app, ["audit-api", "--base-url", stub.base_url, "--model", "m", "--out", str(out),
                                     "--mode", "seeded", "--n", "4", "--max-tokens", "3", "--timeout", "5"],
                               catch_exceptions=False)
    finally:
        stub.close()
    assert r.exit_code == 2, r.output
    assert stub.base_url in r.output and "request 2 (claim api-00002)" in r.output, r.output
    assert field in r.output, r.output
    assert "2 of 4 claims collected" in r.output, r.output
    assert f"audit-api: requests to {stub.base_url} 1/4" in r.output  # its progress (was silent)
    claims = read_claims(out / "claims.jsonl")  # the resumable file stays valid
    assert [c.id for c in claims] == ["api-00000", "api-00001"]
    assert all(c.output_token_ids == [5, 6, 7] for c in claims)


@pytest.mark.parametrize("mode", ["seeded", "auto"])
def test_a_saved_detector_for_other_settings_fails_before_the_first_request(mode, tmp_path):
    """A --detector calibrated for another max_tokens is refused before any request is sent (it
    failed after collecting every claim); in auto mode before the seed probe too."""
    det = tmp_path / "det.json"
    det.write_text("{}")  # the sidecar is compared first: its settings are what differ
    other = ApiAuditConfig("http://x/v1", "m", TARGET_DIR, tmp_path, max_tokens=64)
    det.with_name(det.name + ".meta.json").write_text(json.dumps(detector_meta(other, "seeded",
                                                                                model_info(TARGET_DIR))))
    stub = StubEndpoint(good=100, bad=None)
    try:
        r = CliRunner().invoke(app, ["audit-api", "--base-url", stub.base_url, "--model", "m", "--out",
                                     str(tmp_path / "a"), "--mode", mode, "--n", "4", "--max-tokens", "3",
                                     "--detector", str(det)], catch_exceptions=False)
    finally:
        stub.close()
    assert r.exit_code == 2 and "calibrated for other settings (different max_tokens)" in r.output, r.output
    assert str(det) in r.output and stub.requests == []
