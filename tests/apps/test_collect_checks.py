"""Replies checked against the trusted model before they are saved (issue 34): a misbehaving
endpoint's token ids outside the vocabulary (999999, 10**20; bools and floats), more output tokens
than max_tokens (2,000,000 for 3), prompt ids other than those sent, or a finish reason that does
not fit are an error naming the endpoint, the request, the field and the value; nothing of the bad
reply is written, the replies saved before it are kept, and a rerun against a good endpoint
resumes after them. `verinfer audit-api`'s collection (`collect_claims`) and the chat audit's with
the endpoint's own ids (`collect_vendor`, tokens="returned"); stub servers on loopback."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("openai")

from tests.server.test_audit_api_replies import StubEndpoint, _reply  # noqa: E402
from verinfer.apps.audit_api import ApiAuditConfig, collect_claims  # noqa: E402
from verinfer.claims import read_claims  # noqa: E402
from verinfer.models.load import model_info  # noqa: E402
from verinfer.models.prompts import prompts_for  # noqa: E402
from verinfer.models.testbed import TARGET_DIR  # noqa: E402
from verinfer.providers.openai_http import EndpointError, openai_client  # noqa: E402

pytestmark = pytest.mark.skipif(not (TARGET_DIR / "config.json").is_file(), reason="testbed not built")

V = 2048  # the testbed's vocabulary (config.json vocab_size; checked below)
FIX = "nothing of this reply was saved"


def _changed_prompt(req):
    return _reply(prompt_token_ids=req["prompt"][:-1] + [(req["prompt"][-1] + 1) % V])(req)


BAD = {  # kind: (the reply of request 2 at max_tokens 3, what the error says)
    "id-999999": (_reply(token_ids=[5, 999999, 7]), f"choices[0].token_ids[1] is 999999, not a token id of the "
                                                     f"trusted model (an int in [0, {V}))"),
    "id-1e20-int": (_reply(token_ids=[5, 6, 10**20]), "choices[0].token_ids[2] is 100000000000000000000"),
    "id-1e20-float": (_reply(token_ids=[5, 1e20, 7]), "token_ids"),  # pydantic refused floats already
    "id-bool": (_reply(token_ids=[5, True, 7]), "token_ids"),        # and bools
    "2M-tokens": (_reply(token_ids=[5] * 2_000_000), "choices[0].token_ids holds 2000000 tokens, more than the "
                                                      "max_tokens=3 asked"),
    "prompt-changed": (_changed_prompt, "prompt_token_ids differ from the ids sent"),
    "prompt-out-of-vocab": (lambda req: _reply(prompt_token_ids=req["prompt"][:-1] + [V])(req),
                            "] is 2048, not a token id"),
    "length-but-short": (_reply(token_ids=[5, 6]), "finish_reason 'length' with 2 output tokens, not the "
                                                   "max_tokens=3 asked"),
    "finish-filtered": (_reply(finish_reason="content_filter"), "finish_reason 'content_filter'"),
}


def test_the_vocabulary_is_the_trusted_models():
    assert model_info(TARGET_DIR).vocab_size == V


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_reply_is_refused_unsaved_and_a_rerun_resumes(kind, tmp_path):
    bad, what = BAD[kind]
    stub = StubEndpoint(good=2, bad=bad)
    cfg = ApiAuditConfig(stub.base_url, "m", TARGET_DIR, tmp_path / "a", n=4, max_tokens=3, mode="seeded",
                         max_retries=0)
    cfg.out_dir.mkdir()
    prompts = prompts_for(TARGET_DIR, 4, 0)
    try:
        with pytest.raises(EndpointError) as e:
            collect_claims(openai_client(cfg.endpoint), cfg, "seeded", prompts, "testbed")
        msg = e.value.message
        assert what in msg and stub.base_url in msg and "request 2 (claim api-00002)" in msg, msg
        assert "2 of 4 claims collected" in msg and (FIX in msg or "usable completion" in msg), msg  # pydantic's
        path = cfg.out_dir / "claims.jsonl"
        assert [c.id for c in read_claims(path)] == ["api-00000", "api-00001"]
        assert path.stat().st_size < 20_000  # nothing of the bad reply
        stub.good = 100  # the endpoint repaired, at the same address: the rerun resumes
        _, claims = collect_claims(openai_client(cfg.endpoint), cfg, "seeded", prompts, "testbed")
    finally:
        stub.close()
    assert [c.id for c in claims] == [f"api-{i:05d}" for i in range(4)] and len(stub.requests) == 3 + 2
    assert all(c.output_token_ids == [5, 6, 7] for c in claims)


def test_the_check_alone():
    """`check_token_reply` in isolation: what passes (a stop before max_tokens, no prompt returned)."""
    from verinfer.providers.openai_http import check_token_reply

    kw = dict(vocab_size=V, max_tokens=3, request="request 0", where="http://x/v1")
    check_token_reply([5, 6, 7], "length", **kw)
    check_token_reply([5, 6, 7], None, **kw)                       # no finish reason reads as "length"
    check_token_reply([5, 2], "stop", prompt_ids=[1, 2], sent=[1, 2], **kw)
    check_token_reply([5], "stop", prompt_ids=[1, 2], **kw)        # nothing sent to compare (chat)
    for ids, finish, what in (([5, V], "length", "token_ids[1] is 2048"), ([5, -1, 7], "length", "is -1"),
                              ([5, 6.0, 7], "length", "is 6.0"), ([5, False, 7], "length", "is False"),
                              ([5, 6, 7, 8], "stop", "holds 4 tokens"), ([], "length", "with 0 output tokens"),
                              ([5], "tool_calls", "finish_reason 'tool_calls'")):
        with pytest.raises(EndpointError, match=re.escape(what)):
            check_token_reply(ids, finish, **kw)


# --- the chat audit with the endpoint's ids ---------------------------------------------------
def chat_reply(**choice) -> dict:
    c = {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "length",
         "token_ids": [5, 6, 7], "prompt_token_ids": [1, 2, 3], **choice}
    return {"id": "x", "object": "chat.completion", "model": "m", "choices": [c]}


def StubChat(good: int, bad: dict) -> StubEndpoint:
    """/v1/chat/completions on a free loopback port: the first `good` requests get chat_reply(),
    later ones chat_reply(**bad)."""
    body = lambda **choice: json.dumps(chat_reply(**choice)).encode()  # noqa: E731
    return StubEndpoint(good, bad=lambda req: (body(**bad), "application/json"), reply=lambda req: body())


CHAT_BAD = {
    "id-999999": ({"token_ids": [5, 999999, 7]}, "choices[0].token_ids[1] is 999999"),
    "id-1e20-int": ({"token_ids": [10**20, 6, 7]}, "choices[0].token_ids[0] is 100000000000000000000"),
    "too-many": ({"token_ids": [5] * 100_000}, "holds 100000 tokens, more than the max_tokens=3 asked"),
    "prompt-out-of-vocab": ({"prompt_token_ids": [1, V]}, "prompt_token_ids[1] is 2048"),
    "length-but-short": ({"token_ids": [5]}, "finish_reason 'length' with 1 output tokens"),
}


@pytest.mark.parametrize("kind", list(CHAT_BAD))
def test_chat_returned_ids_are_checked_before_they_are_saved(kind, tmp_path):
    from verinfer.apps.audit_chat import ChatAuditConfig, collect_vendor
    from verinfer.models.prompts import chat_messages
    from verinfer.providers.chat_http import ChatEndpoint
    from verinfer.retokenize import Retokenizer

    bad, what = CHAT_BAD[kind]
    stub = StubChat(good=2, bad=bad)
    cfg = ChatAuditConfig(TARGET_DIR, tmp_path, n=4, max_tokens=3, tokens="returned")
    endpoint = ChatEndpoint("acme", stub.base_url, "m", concurrency=1, max_retries=0)
    conv, retok, out = chat_messages(4, 0), Retokenizer.for_model(TARGET_DIR), tmp_path / "acme"
    try:
        with pytest.raises(EndpointError) as e:
            collect_vendor(endpoint, cfg, conv, retok, out)
        msg = e.value.message
        assert what in msg and "request 2 of vendor 'acme'" in msg and FIX in msg, msg
        assert "2 of 4 replies saved" in msg and e.value.where == "acme", msg
        assert [c.id for c in read_claims(out / "claims.jsonl")] == ["acme-00000", "acme-00001"]
        assert (out / "claims.jsonl").stat().st_size < 20_000
        stub.good = 100
        claims, _ = collect_vendor(endpoint, cfg, conv, retok, out)
    finally:
        stub.close()
    assert [c.id for c in claims] == [f"acme-{i:05d}" for i in range(4)] and len(stub.requests) == 3 + 2
    assert all(c.output_token_ids == [5, 6, 7] and c.prompt_token_ids == [1, 2, 3] for c in claims)
