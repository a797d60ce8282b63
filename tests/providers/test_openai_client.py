"""The one openai client factory and the one mapping of its failures (`verinfer.openai_client`):
the errors the callers raise, word for word, on openai's own exception objects (no server)."""

from __future__ import annotations

import sys

import httpx2
import openai
import pytest

from verinfer.errors import VerinferError
from verinfer.openai_client import INSTALL_FIX, EndpointError, endpoint_errors, new_client
from verinfer.providers import openai_http

URL = "http://127.0.0.1:9/v1"
REQ = httpx2.Request("POST", URL + "/completions")


def status_error(code: int, body: dict) -> openai.APIStatusError:
    return openai.APIStatusError("refused", response=httpx2.Response(code, json=body, request=REQ), body=body)


def raised(exc: Exception, *args, **kw) -> VerinferError:
    with pytest.raises(VerinferError) as e:
        with endpoint_errors(*args, **kw):
            raise exc
    return e.value


def test_new_client_is_the_official_client_with_the_settings_asked():
    c = new_client(URL, "sk-test", timeout=7.5, max_retries=3)
    assert isinstance(c, openai.OpenAI)
    assert str(c.base_url) == URL + "/" and c.api_key == "sk-test" and c.timeout == 7.5 and c.max_retries == 3
    ep = openai_http.Endpoint(URL, "m", timeout=2.0, max_retries=0)
    c = openai_http.openai_client(ep)
    assert (str(c.base_url), c.api_key, c.timeout, c.max_retries) == (URL + "/", "EMPTY", 2.0, 0)


def test_without_the_openai_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` raises ImportError
    with pytest.raises(VerinferError) as e:
        new_client(URL, timeout=1.0, max_retries=0)
    assert e.value.what == "the `openai` package is not installed" and e.value.fix == INSTALL_FIX
    assert isinstance(e.value.__cause__, ImportError)


def test_unreachable_names_the_request_the_target_and_the_cause():
    e = raised(openai.APIConnectionError(request=REQ), "request 3", URL, reach_fix="start it", status_fix="-")
    assert type(e) is EndpointError and e.where == URL and e.fix == "start it"
    assert e.what == f"request 3: cannot reach {URL} (APIConnectionError: Connection error.)"
    assert isinstance(e.__cause__, openai.APIConnectionError)
    e = raised(openai.APITimeoutError(request=REQ), "r", "vendor-a", target=URL, reach_fix="f", status_fix="-")
    assert e.where == "vendor-a" and e.what == f"r: cannot reach {URL} (APITimeoutError: Request timed out.)"
    e = raised(openai.APIConnectionError(request=REQ), None, "w", target="the server after 4 retries",
               reach_fix="f", status_fix="-")
    assert e.what == "cannot reach the server after 4 retries (APIConnectionError: Connection error.)"


def test_http_status_carries_the_servers_message_and_each_callers_fix():
    bad = status_error(400, {"error": {"message": "max_tokens is too large"}})
    e = raised(bad, "request 1", URL, reach_fix="-", status_fix="check --model", answered="the endpoint answered ")
    assert e.what == "request 1: the endpoint answered HTTP 400: max_tokens is too large"
    assert e.fix == "check --model" and e.where == URL and e.__cause__ is bad
    seen = []
    e = raised(status_error(404, {"message": "no model m"}), "r", URL, reach_fix="-",
               status_fix=lambda code, msg: seen.append((code, msg)) or f"fix for {code}")
    assert seen == [(404, "no model m")] and e.what == "r: HTTP 404: no model m" and e.fix == "fix for 404"


def test_special_statuses_replace_the_wording_and_others_fall_back():
    def special(code, msg):
        return (f"the server refuses it (HTTP {code}: {msg})", "restart it") if "max allowed" in msg else None

    class Refused(VerinferError):
        pass

    kw = dict(reach_fix="-", status_fix="check the log", answered="the server answered ", special=special,
              error=Refused)
    e = raised(status_error(400, {"error": {"message": "20 > max allowed 5"}}), None, "w", **kw)
    assert type(e) is Refused and (e.what, e.fix) == ("the server refuses it (HTTP 400: 20 > max allowed 5)",
                                                      "restart it")
    e = raised(status_error(500, {"error": {"message": "boom"}}), None, "w", **kw)
    assert type(e) is Refused and (e.what, e.fix) == ("the server answered HTTP 500: boom", "check the log")


def test_other_errors_pass_through_unchanged():
    with pytest.raises(ValueError, match="not openai's"):
        with endpoint_errors("r", URL, reach_fix="-", status_fix="-"):
            raise ValueError("not openai's")
    assert openai_http.EndpointError is EndpointError  # the name callers import from providers is the same class
