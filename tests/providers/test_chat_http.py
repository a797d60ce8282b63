"""Chat endpoints (providers.chat_http): the request an audit sends, the replies it accepts and the
ones it refuses with a reason; the API key comes from the environment only."""

import json

import pytest

from verinfer.errors import VerinferError
from verinfer.providers.chat_http import ChatEndpoint, chat_request, parse_chat_reply
from verinfer.providers.openai_http import EndpointError
from verinfer.sampling.params import SamplingParams

GREEDY = SamplingParams(0.0, -1, 1.0, 0.0, None, 32, "vllm-cpu")
SEEDED = SamplingParams(0.7, -1, 0.9, 0.0, 5, 32, "vllm-cpu")
MSGS = [{"role": "user", "content": "hi"}]


def reply(**choice) -> bytes:
    c = {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop", **choice}
    return json.dumps({"id": "x", "model": "m", "choices": [c], "usage": {"completion_tokens": 2}}).encode()


def test_request_sends_the_audits_fields_and_passes_extra_through():
    ep = ChatEndpoint("v", "http://h/v1", "m", extra={"provider": {"order": ["acme"]}})
    body = chat_request(ep, MSGS, GREEDY)
    assert body == {"model": "m", "messages": MSGS, "max_tokens": 32, "temperature": 0.0, "top_p": 1.0,
                    "provider": {"order": ["acme"]}}  # no seed at temperature 0
    assert chat_request(ep, MSGS, SEEDED)["seed"] == 5
    with pytest.raises(VerinferError, match="override the audit's own request fields"):
        ChatEndpoint("v", "http://h/v1", "m", extra={"temperature": 1.0})


def test_key_comes_from_the_named_environment_variable(monkeypatch):
    ep = ChatEndpoint("v", "http://h/v1", "m", api_key_env="VENDOR_KEY_FOR_TEST")
    monkeypatch.delenv("VENDOR_KEY_FOR_TEST", raising=False)
    with pytest.raises(VerinferError, match="VENDOR_KEY_FOR_TEST is not set"):
        ep.api_key()
    monkeypatch.setenv("VENDOR_KEY_FOR_TEST", "sk-secret")
    assert ep.api_key() == "sk-secret"
    assert "sk-secret" not in json.dumps(ep.public())


def test_a_usable_reply_keeps_text_finish_usage_and_returned_ids():
    r = parse_chat_reply(reply(token_ids=[5, 6], prompt_token_ids=[1, 2, 3]), "v", "request 0")
    assert (r.text, r.finish_reason, r.usage, r.served_model) == ("Hello", "stop", {"completion_tokens": 2}, "m")
    assert (r.output_token_ids, r.prompt_token_ids) == ([5, 6], [1, 2, 3])
    plain = parse_chat_reply(reply(finish_reason="length"), "v", "request 0")
    assert plain.output_token_ids is None and plain.finish_reason == "length"


@pytest.mark.parametrize("body, message", [
    (b"<html>502</html>", "not JSON"),
    (json.dumps({"choices": []}).encode(), "not a usable chat completion"),
    (reply(message={"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]}), "tool call"),
    (reply(message={"role": "assistant", "content": None}), "no text"),
    (reply(finish_reason="content_filter"), "cut or filtered by the provider"),
    (reply(token_ids=[-1]), "not a usable chat completion"),
])
def test_unusable_replies_are_refused_with_the_reason(body, message):
    with pytest.raises(EndpointError, match=message):
        parse_chat_reply(body, "v", "request 3")


def test_429_and_503_are_retried_after_the_servers_retry_after():
    """A vendor that answers 429 (Retry-After: 1) and then 503 once is retried with backoff; the
    reply that follows is used. A vendor that keeps failing is an EndpointError naming it."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from verinfer.providers.chat_http import request_chat

    answers = [(429, {"Retry-After": "1"}), (503, {}), (200, {})]
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(time.monotonic())
            code, headers = answers.pop(0) if answers else (500, {})
            body = reply() if code == 200 else json.dumps({"error": {"message": "busy"}}).encode()
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ep = ChatEndpoint("busy", f"http://127.0.0.1:{server.server_address[1]}/v1", "m", max_retries=3)
        r = request_chat(ep.client(), ep, MSGS, GREEDY)
        assert r.text == "Hello" and len(seen) == 3
        assert seen[1] - seen[0] >= 0.9  # waited as the server asked
        with pytest.raises(EndpointError, match="HTTP 500") as e:
            request_chat(ChatEndpoint("busy", ep.base_url, "m", max_retries=1).client(), ep, MSGS, GREEDY)
        assert e.value.where == "busy"
    finally:
        server.shutdown()


def test_a_reply_keeps_its_reasoning_block_and_vllms_stop_reason():
    import json as _json

    from verinfer.providers.chat_http import parse_chat_reply

    def body(**choice):
        c = {"message": {"content": "4", **choice.pop("message", {})}, "finish_reason": "stop", **choice}
        return _json.dumps({"choices": [c]}).encode()

    r = parse_chat_reply(body(message={"reasoning_content": "2+2"}, stop_reason=None), "v", "request 0")
    assert (r.reasoning, r.model_end) == ("2+2", True)
    r = parse_chat_reply(body(message={"reasoning": "add"}, stop_reason="\n"), "v", "request 0")
    assert (r.reasoning, r.model_end) == ("add", False)
    assert parse_chat_reply(body(), "v", "request 0").model_end is None
