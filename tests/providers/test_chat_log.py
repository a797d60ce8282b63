"""Chat logs (providers.chat_log): the accepted shapes read into concrete exchanges, and every kind of
exchange that cannot be audited refused with its kind and file:line (or skipped and counted)."""

import json

import pytest

from verinfer.providers import chat_log
from verinfer.providers.chat_log import (FILE_KINDS, UNUSABLE_KINDS, ChatExchange, ChatLogError, iter_chat_log,
                                         read_chat_log)

REQ = {"model": "org/m", "messages": [{"role": "user", "content": "2+2?"}], "temperature": 0, "max_tokens": 8}
RESP = {"id": "r1", "object": "chat.completion", "model": "org/m-served",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}


def reply(content="4", finish="stop", **msg) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content, **msg},
                         "finish_reason": finish}]}


def line(req=None, resp=None, **over) -> str:
    return json.dumps({"request": {**REQ, **(req or {})}, "response": {**RESP, **(resp or {})}, **over})


def log(tmp_path, *lines: str | bytes, name="log.jsonl"):
    p = tmp_path / name
    p.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return p


def test_plain_exchange_every_field(tmp_path):
    p = log(tmp_path, line())
    (ex,) = read_chat_log(p)
    assert ex == ChatExchange(
        id="r1", model="org/m", messages=({"role": "user", "content": "2+2?"},), text="4", finish_reason="stop",
        sampling={"temperature": 0.0, "top_p": 1.0, "top_k": None, "min_p": None, "seed": None, "max_tokens": 8,
                  "extra": {}},
        usage={"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}, served_model="org/m-served",
        output_token_ids=None, prompt_token_ids=None, source=f"{p}:1", reasoning=None)
    assert isinstance(ex.sampling["temperature"], float)


def test_batch_api_wrapped_request_and_response(tmp_path):
    obj = {"request": {"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions", "body": REQ},
           "response": {"status_code": 200, "request_id": "req_9", "body": {**RESP, "id": "chatcmpl-b"}}}
    p = log(tmp_path, json.dumps(obj))
    (ex,) = read_chat_log(p)
    assert (ex.id, ex.model, ex.served_model, ex.text, ex.finish_reason) == ("chatcmpl-b", "org/m", "org/m-served",
                                                                            "4", "stop")
    assert ex.messages == ({"role": "user", "content": "2+2?"},)
    assert ex.sampling["extra"] == {} and ex.sampling["max_tokens"] == 8  # the body's fields, not the envelope's


def test_text_parts_are_joined_in_messages_and_reply(tmp_path):
    msgs = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]},
            {"role": "assistant", "content": "5"}, {"role": "user", "content": "Again?", "name": "bob"}]
    p = log(tmp_path, line(req={"messages": msgs}, resp=reply([{"type": "text", "text": "4"}, {"type": "text",
                                                                                            "text": "!"}])))
    (ex,) = read_chat_log(p)
    assert ex.messages == ({"role": "developer", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "5"}, {"role": "user", "content": "Again?"})
    assert ex.text == "4!"


def test_vllm_token_ids_choice_first_then_top_level(tmp_path):
    ids = {"choices": [{"message": {"content": "4"}, "finish_reason": "length", "token_ids": [19, 2],
                        "stop_reason": None}], "prompt_token_ids": [1, 2, 3]}
    in_choice = {"choices": [{"message": {"content": "4"}, "finish_reason": "stop", "token_ids": [19, 7],
                              "prompt_token_ids": [5, 6]}], "prompt_token_ids": [1, 2, 3]}
    a, b = read_chat_log(log(tmp_path, line(resp={**ids, "id": "a"}), line(resp={**in_choice, "id": "b"})))
    assert (a.output_token_ids, a.prompt_token_ids, a.finish_reason) == ((19, 2), (1, 2, 3), "length")
    assert (b.output_token_ids, b.prompt_token_ids) == ((19, 7), (5, 6))


def test_sampling_defaults_and_extra(tmp_path):
    bare = {"model": "org/m", "messages": [{"role": "user", "content": "hi"}]}
    full = {**bare, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3, "max_tokens": 64,
            "max_completion_tokens": 32, "n": 1, "logprobs": True, "stream": False,
            "chat_template_kwargs": {"enable_thinking": False}, "user": "u-1"}
    nulls = {**bare, "temperature": None, "top_p": None, "max_tokens": None}
    a, b, c = read_chat_log(log(tmp_path, *(json.dumps({"request": r, "response": {**RESP, "id": str(i)}})
                                           for i, r in enumerate((bare, full, nulls)))))
    default = {"temperature": 1.0, "top_p": 1.0, "top_k": None, "min_p": None, "seed": None, "max_tokens": None,
               "extra": {}}
    assert a.sampling == default and c.sampling == default
    assert b.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3, "max_tokens": 32,
                          "extra": {"n": 1, "logprobs": True, "chat_template_kwargs": {"enable_thinking": False},
                                    "user": "u-1"}}


def test_reasoning_kept(tmp_path):
    a, b = read_chat_log(log(tmp_path, line(resp={**reply("4", reasoning_content="2+2 is 4."), "id": "a"}),
                             line(resp={**reply("4", reasoning="Add."), "id": "b"})))
    assert (a.reasoning, a.text, b.reasoning) == ("2+2 is 4.", "4", "Add.")


def test_ids_unique_first_holder_keeps_its_id(tmp_path):
    no_id = {k: v for k, v in RESP.items() if k != "id"}
    lines = [line(), line(), json.dumps({"request": REQ, "response": no_id}), line(resp={"id": "log-000005"}),
             line(resp={"id": "log-000003"}), line(resp={"id": 42})]
    got = read_chat_log(log(tmp_path, *lines))
    assert [g.id for g in got] == ["r1", "log-000002", "log-000003", "log-000005", "log-000005-2", "42"]


def test_empty_reply_that_stopped_is_kept(tmp_path):
    (ex,) = read_chat_log(log(tmp_path, line(resp=reply(""))))
    assert (ex.text, ex.finish_reason) == ("", "stop")  # the model ended at once: its end token is audited


@pytest.mark.parametrize("near_miss", [
    {"response_format": {"type": "text"}}, {"logit_bias": {}}, {"tool_choice": "none"}, {"presence_penalty": 0},
    {"frequency_penalty": 0.0}, {"repetition_penalty": 1.0}, {"min_tokens": 0}, {"stop": []}, {"tools": []},
    {"stream": False}, {"n": 1}])
def test_neutral_settings_are_accepted(tmp_path, near_miss):
    (ex,) = read_chat_log(log(tmp_path, line(req=near_miss)))
    assert ex.sampling["extra"] == ({} if "stream" in near_miss else near_miss)


def test_stop_strings_are_read_with_what_the_response_says_of_the_end(tmp_path):
    """A stop string is understood (chat contract), not refused: vLLM's stop_reason null marks the
    model's own end, a string the stop string that cut it; without the field the end is unknown."""
    def resp(**why):
        return {"choices": [{"message": {"content": "4"}, "finish_reason": "stop", **why}]}
    a, b, c = read_chat_log(log(tmp_path, *(line(req={"stop": ["###"]}, resp={**resp(**w), "id": str(i)})
                                           for i, w in enumerate(({"stop_reason": None}, {"stop_reason": "###"}, {})))))
    assert a.finish_reason == "stop" and a.sampling["extra"] == {"stop": ["###"]}
    assert (a.model_end, b.model_end, c.model_end) == (True, False, None)


BATCH_OUT = {"id": "batch_req_1", "custom_id": "q-1", "response": {"status_code": 200, "body": RESP}, "error": None}
BAD = {  # kind -> lines that are refused with it (each as line 2 of a log, after a good line)
    "not-json": ['{"request": {', b'{"request": "\xff"}', "[" * 100_000],
    "shape": [json.dumps({"request": REQ}), "[1, 2]", json.dumps(BATCH_OUT), line(resp={"choices": []}),
              line(req={"messages": []}), line(req={"temperature": "hot"}), line(req={"seed": 1.5}),
              line(req={"model": 7}), json.dumps({"request": {"messages": REQ["messages"]}, "response":
                                                  {k: v for k, v in RESP.items() if k != "model"}}),
              line(req={"messages": ["hi"]}), line(req={"messages": [{"role": "user"}]}),
              line(resp={"choices": [{"finish_reason": "stop"}]}), line(resp={"choices": [{"message": {"content": 4},
                                                                                          "finish_reason": "stop"}]}),
              line(resp={"choices": [{"message": {"content": "4"}, "finish_reason": "stop", "token_ids": ["a"]}]}),
              json.dumps({"request": REQ, "response": {"status_code": "ok", "body": RESP}})],
    "error-response": [json.dumps({"request": REQ, "response": {"status_code": 429, "body": {
                           "error": {"message": "Rate limit reached"}}}}),
                       json.dumps({"request": REQ, "response": {"error": {"message": "model not found"}}}),
                       json.dumps({**BATCH_OUT, "request": REQ, "error": {"code": "batch_expired"}})],
    "streaming": [line(req={"stream": True}), line(resp={"object": "chat.completion.chunk"}),
                  line(resp={"choices": [{"index": 0, "delta": {"content": "4"}, "finish_reason": None}]}),
                  json.dumps({"request": REQ, "response": [RESP, RESP]})],
    "several-choices": [line(req={"n": 2}), line(resp={"choices": RESP["choices"] * 2})],
    "tool-calls": [line(req={"tools": [{"type": "function", "function": {"name": "f"}}]}),
                   line(req={"tool_choice": "auto"}), line(req={"functions": [{"name": "f"}]}),
                   line(resp=reply(None, "tool_calls", tool_calls=[{"id": "t", "type": "function"}])),
                   line(resp=reply("4", "stop", function_call={"name": "f"})),
                   line(resp=reply("4", "tool_calls")),
                   line(req={"messages": [{"role": "tool", "content": "42", "tool_call_id": "t"}]}),
                   line(req={"messages": [{"role": "function", "content": "42", "name": "f"}]}),
                   line(req={"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]}]})],
    "non-text": [line(req={"messages": [{"role": "user", "content": [
                     {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}),
                 line(req={"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}),
                 line(req={"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}),
                 line(req={"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
                 line(resp=reply(None, audio={"id": "a", "data": "..."}))],
    "constrained": [line(req={"response_format": {"type": "json_object"}}),
                    line(req={"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                    line(req={"logit_bias": {"1234": -100}}), line(req={"guided_json": {"type": "object"}}),
                    line(req={"structured_outputs": {"regex": "[0-9]+"}}), line(req={"min_tokens": 5}),
                    line(req={"bad_words": ["five"]}), line(req={"allowed_token_ids": [19]})],
    "penalty": [line(req={"presence_penalty": 0.5}), line(req={"frequency_penalty": -0.2}),
                line(req={"repetition_penalty": 1.1})],
    "no-text": [line(resp=reply(None)), line(resp=reply(None, refusal="I can't help with that.")),
                line(resp=reply("", "length"))],
    "finish-reason": [line(resp=reply("4", "content_filter")), line(resp=reply("4", None)),
                      line(resp={"choices": [{"message": {"content": "4"}}]})],
    "stop-string": [line(req={"include_stop_str_in_output": True}), line(req={"skip_special_tokens": False})],
    "role": [line(req={"messages": [{"role": "narrator", "content": "x"}]}),
             line(req={"messages": [{"role": "User", "content": "x"}]})],
    # issue 45's hostile-input pass: these were an internal error (exit 3), or accepted
    "bad-text": [line(req={"messages": [{"role": "user", "content": "hi \ud800"}]}), line(resp=reply("4\udfff")),
                 line(resp=reply("4", reasoning_content="\udc80"))],
    "too-long": [b'{"request": "' + b"x" * (16 << 20) + b'"}'],
    "over-length": [line(resp={"choices": [{"message": {"content": "4"}, "finish_reason": "length",
                                            "token_ids": list(range(9))}]}),
                    line(resp={"usage": {"completion_tokens": 2_000_000}})],
}
CASES = [(kind, i) for kind, lines in BAD.items() for i in range(len(lines))]


def test_every_kind_is_tested_and_explained():
    # sampled, reasoning, template-fields and unknown-field are the replay's (`unusable_for_replay`,
    # chat_contract.reasoning_reply; tests/core/test_sources.py): kept by this reader
    assert set(BAD) == set(UNUSABLE_KINDS) - {"sampled", "reasoning", "template-fields", "unknown-field"}
    assert set(FILE_KINDS) == {"no-file", "no-exchange"}
    assert all(len(v) > 40 for v in UNUSABLE_KINDS.values())
    doc = chat_log.__doc__
    assert all(f"\n    {k} " in doc for k in UNUSABLE_KINDS)  # the docstring says why each cannot be audited


@pytest.mark.parametrize("kind, i", CASES, ids=[f"{k}-{i}" for k, i in CASES])
def test_each_unusable_kind_is_refused_with_file_and_line(tmp_path, kind, i):
    p = log(tmp_path, line(), BAD[kind][i], line(resp={"id": "r3"}))
    with pytest.raises(ChatLogError) as e:
        read_chat_log(p)
    assert e.value.kind == kind, e.value.message
    assert e.value.where == f"{p}:2" and str(e.value).startswith(f"{p}:2: ") and e.value.fix
    assert "truncated" not in e.value.message  # not the last line


def test_messages_say_what_was_found(tmp_path):
    def refusal(bad: str) -> ChatLogError:
        with pytest.raises(ChatLogError) as e:
            read_chat_log(log(tmp_path, bad))
        return e.value

    assert refusal(BAD["error-response"][0]).what == "the request failed with HTTP 429: Rate limit reached"
    assert (refusal(BAD["role"][0]).what
            == "messages[0] has role 'narrator', not one of system, developer, user, assistant")
    assert refusal(BAD["shape"][5]).what.startswith("request `temperature`: ")
    assert "custom_id" in refusal(BAD["shape"][2]).fix  # a Batch output line: join it with its input line
    assert refusal(BAD["non-text"][0]).what == "messages[0] holds a image_url part"
    assert refusal(BAD["penalty"][0]).what == "request `presence_penalty` is 0.5 (neutral: 0)"
    assert "log the assembled response" in refusal(BAD["streaming"][0]).fix
    assert "include_stop_str_in_output=true" in refusal(BAD["stop-string"][0]).what
    assert "refusal: \"I can't help with that.\"" in refusal(BAD["no-text"][1]).what


def test_skip_mode_collects_every_kind_and_yields_the_good(tmp_path):
    bad = [b for lines in BAD.values() for b in lines]
    p = log(tmp_path, line(), *bad, "", line(resp={"id": "r9"}))
    skipped = []
    got = list(iter_chat_log(p, skip_unusable=True, skipped=skipped))
    assert [(g.id, g.source) for g in got] == [("r1", f"{p}:1"), ("r9", f"{p}:{len(bad) + 3}")]
    assert [(s, k) for s, k, _ in skipped] == [(f"{p}:{n}", k) for n, (k, _) in enumerate(CASES, 2)]
    assert all(isinstance(m, str) and m and not m.startswith(str(p)) for _, _, m in skipped)
    assert read_chat_log(p, skip_unusable=True) == got  # `skipped` is optional


def test_no_usable_exchange_raises_with_the_counts(tmp_path):
    p = log(tmp_path, BAD["streaming"][0], BAD["streaming"][1], BAD["role"][0], name="only-bad.jsonl")
    skipped = []
    with pytest.raises(ChatLogError) as e:
        list(iter_chat_log(p, skip_unusable=True, skipped=skipped))
    assert e.value.kind == "no-exchange" and e.value.where == str(p)
    assert e.value.what == "the chat log holds no exchange that can be audited (3 skipped: 2 streaming, 1 role)"
    assert len(skipped) == 3
    with pytest.raises(ChatLogError, match=r"\(it is empty\)") as e:
        read_chat_log(log(tmp_path, "", "  ", name="blank.jsonl"))
    assert e.value.kind == "no-exchange"


def test_missing_file(tmp_path):
    with pytest.raises(ChatLogError, match="no such chat log") as e:
        read_chat_log(tmp_path / "nope.jsonl")
    assert e.value.kind == "no-file" and e.value.where == str(tmp_path / "nope.jsonl")
    with pytest.raises(ChatLogError, match="a directory, not a chat log") as e:
        read_chat_log(tmp_path)
    assert e.value.kind == "no-file" and "JSONL file" in e.value.fix


def test_truncated_last_line_says_so(tmp_path):
    p = tmp_path / "cut.jsonl"
    p.write_text(line() + "\n" + line()[:40])
    with pytest.raises(ChatLogError, match="not valid JSON") as e:
        read_chat_log(p)
    assert e.value.kind == "not-json" and e.value.where == f"{p}:2"
    assert "the file looks truncated" in e.value.what and "cut while written" in e.value.fix
    skipped = []
    assert [x.id for x in read_chat_log(p, skip_unusable=True, skipped=skipped)] == ["r1"]
    assert skipped[0][:2] == (f"{p}:2", "not-json")


def test_lines_are_counted_as_bytes_with_blank_lines_and_non_ascii(tmp_path):
    wide = json.dumps({"request": {**REQ, "messages": [{"role": "user", "content": "é\u2028ü" * 3000}]},
                       "response": RESP}, ensure_ascii=False)  # raw multi-byte text and a U+2028 line separator
    p = log(tmp_path, wide, "",
            line(req={"messages": [{"role": "robot", "content": "x"}]}))
    with pytest.raises(ChatLogError) as e:
        read_chat_log(p)
    assert e.value.where == f"{p}:3" and e.value.kind == "role"


def test_byte_order_mark_and_crlf_line_ends(tmp_path):
    p = tmp_path / "win.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + line().encode() + b"\r\n\r\n" + line(resp={"id": "r2"}).encode() + b"\r\n")
    assert [(x.id, x.source) for x in read_chat_log(p)] == [("r1", f"{p}:1"), ("r2", f"{p}:3")]
