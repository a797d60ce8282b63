"""Chat logs (providers.chat_log): the accepted shapes, and every kind of exchange that cannot be
audited refused with its kind and file:line (or skipped and counted)."""

import json

import pytest

from verinfer.providers.chat_log import UNUSABLE_KINDS, ChatLogError, iter_chat_log, read_chat_log

REQ = {"model": "org/m", "messages": [{"role": "user", "content": "2+2?"}], "temperature": 0, "max_tokens": 8}
RESP = {"id": "r1", "object": "chat.completion", "model": "org/m-served",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2}}


def line(req=None, resp=None, **over) -> str:
    obj = {"request": {**REQ, **(req or {})}, "response": {**RESP, **(resp or {})}, **over}
    return json.dumps(obj)


def log(tmp_path, *lines: str, name="log.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def test_accepted_shapes(tmp_path):
    batch = json.dumps({"request": {"body": REQ}, "response": {"status_code": 200, "body": {**RESP, "id": "r2"}}})
    parts = line(req={"messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]}]},
                 resp={"id": "r3", "choices": [{"message": {"content": "4"}, "finish_reason": "length",
                                                "token_ids": [19, 2]}], "prompt_token_ids": [1, 2, 3]})
    a, b, c, d = read_chat_log(log(tmp_path, line(), batch, parts, line()))
    assert (a.id, a.model, a.served_model, a.text, a.finish_reason) == ("r1", "org/m", "org/m-served", "4", "stop")
    assert a.messages == ({"role": "user", "content": "2+2?"},) and a.usage["completion_tokens"] == 2
    assert a.sampling["temperature"] == 0.0 and a.sampling["max_tokens"] == 8 and a.sampling["seed"] is None
    assert b.id == "r2" and a.output_token_ids is None and a.source.endswith("log.jsonl:1")
    assert c.messages[1]["content"] == "2+2?" and c.output_token_ids == (19, 2) and c.prompt_token_ids == (1, 2, 3)
    assert d.id == "log-000004"  # a repeated response id: the line's own id
    defaults = read_chat_log(log(tmp_path, line(req={"temperature": None} and {}), name="d.jsonl"))[0]
    assert defaults.sampling["top_p"] == 1.0


BAD = {
    "not-json": '{"request": {',
    "shape": json.dumps({"request": REQ}),
    "error-response": json.dumps({"request": REQ, "response": {"status_code": 429, "body": {"error": "rate"}}}),
    "streaming": line(req={"stream": True}),
    "several-choices": line(req={"n": 2}),
    "tool-calls": line(resp={"choices": [{"message": {"content": None, "tool_calls": [{"id": "t"}]},
                                          "finish_reason": "tool_calls"}]}),
    "non-text": line(req={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    "constrained": line(req={"response_format": {"type": "json_object"}}),
    "no-text": line(resp={"choices": [{"message": {"content": None}, "finish_reason": "stop"}]}),
    "finish-reason": line(resp={"choices": [{"message": {"content": "x"}, "finish_reason": "content_filter"}]}),
    "role": line(req={"messages": [{"role": "narrator", "content": "x"}]}),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_each_unusable_kind_is_refused_with_file_and_line(tmp_path, kind):
    with pytest.raises(ChatLogError) as e:
        read_chat_log(log(tmp_path, line(), BAD[kind]))
    assert e.value.kind == kind and e.value.where.endswith("log.jsonl:2") and e.value.fix
    assert kind in UNUSABLE_KINDS


def test_tools_in_the_request_and_a_tool_role_are_tool_calls(tmp_path):
    for bad in (line(req={"tools": [{"type": "function"}]}),
                line(req={"messages": [{"role": "tool", "content": "42"}]})):
        with pytest.raises(ChatLogError) as e:
            read_chat_log(log(tmp_path, bad))
        assert e.value.kind == "tool-calls"


def test_skip_mode_counts_every_kind_and_keeps_the_good(tmp_path):
    skipped = []
    got = list(iter_chat_log(log(tmp_path, line(), *BAD.values(), line(resp={"id": "r9"})), skip_unusable=True,
                             skipped=skipped))
    assert [g.id for g in got] == ["r1", "r9"]
    assert sorted(k for _, k, _ in skipped) == sorted(BAD)
    with pytest.raises(ChatLogError, match="no exchange that can be audited"):
        list(iter_chat_log(log(tmp_path, BAD["streaming"], name="only-bad.jsonl"), skip_unusable=True))


def test_truncated_last_line_says_so(tmp_path):
    p = tmp_path / "cut.jsonl"
    p.write_text(line() + "\n" + line()[:40])
    with pytest.raises(ChatLogError, match="not valid JSON") as e:
        read_chat_log(p)
    assert "truncated" in e.value.fix and e.value.where.endswith(":2")
