"""The chat contract (verinfer.providers.chat_contract): each request field audited, neutral or
refused with its kind; stop cuts, mid-character cuts and reasoning blocks; the same refusals on the
live path (a vendor's `extra`) as on a log's lines."""

import pytest

from verinfer.errors import VerinferError
from verinfer.models.testbed import TARGET_DIR
from verinfer.providers.chat_contract import (REFUSED_KINDS, ContractError, check_request, cut_by_stop,
                                              model_end_of, reasoning_reply, replay_refusal, stop_strings)
from verinfer.providers.chat_http import ChatEndpoint
from verinfer.models.load import load_tokenizer

REFUSED = {  # kind -> request fields refused with it
    "tool-calls": [{"tools": [{"type": "function"}]}, {"tool_choice": "auto"}],
    "constrained": [{"response_format": {"type": "json_object"}}, {"logit_bias": {"5": 3}}, {"min_tokens": 4},
                    {"stop_token_ids": [7]}, {"ignore_eos": True}],
    "penalty": [{"presence_penalty": 0.1}, {"frequency_penalty": -1}, {"repetition_penalty": 1.05}],
    "stop-string": [{"include_stop_str_in_output": True}, {"skip_special_tokens": False}],
}
NEUTRAL = [{"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"repetition_penalty": 1.0}, {"min_tokens": 0},
           {"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"logit_bias": {}}, {"stop": ["\n"]},
           {"skip_special_tokens": True}, {"include_stop_str_in_output": False}, {"user": "u"},
           {"provider": {"order": ["x"]}}, {"logprobs": True, "top_logprobs": 5}, {"return_token_ids": True}]


@pytest.mark.parametrize("kind, fields", [(k, f) for k, fs in REFUSED.items() for f in fs])
def test_fields_that_change_the_tokens_are_refused_live_and_in_logs(kind, fields):
    with pytest.raises(ContractError) as e:
        check_request(fields, "here")
    assert e.value.kind == kind and next(iter(fields)) in e.value.what and kind in REFUSED_KINDS
    with pytest.raises(VerinferError, match=next(iter(fields))):  # the live path: when the vendor is read
        ChatEndpoint("v", "http://h/v1", "m", extra=fields)


@pytest.mark.parametrize("fields", NEUTRAL)
def test_neutral_values_and_fields_are_accepted(fields):
    check_request(fields, "here")
    assert replay_refusal(fields, "here") is None
    ChatEndpoint("v", "http://h/v1", "m", extra=fields)


@pytest.mark.parametrize("stop", [7, ["\n", 3], {"s": 1}])
def test_a_malformed_stop_is_refused_with_its_value(stop):
    with pytest.raises(VerinferError, match="request `stop`"):
        ChatEndpoint("v", "http://h/v1", "m", extra={"stop": stop})


def test_template_fields_and_unknown_fields_are_refused_for_a_replay():
    assert replay_refusal({"chat_template_kwargs": {"enable_thinking": True}}, "w").kind == "template-fields"
    assert replay_refusal({"reasoning_effort": "high"}, "w").kind == "template-fields"
    e = replay_refusal({"vendor_magic": 1, "user": "u"}, "w")
    assert e.kind == "unknown-field" and e.what.endswith("vendor_magic") and "--neutral-field vendor_magic" in e.fix
    assert replay_refusal({"vendor_magic": 1}, "w", neutral=("vendor_magic",)) is None
    with pytest.raises(VerinferError, match="vendor_magic"):
        ChatEndpoint("v", "http://h/v1", "m", extra={"vendor_magic": 1})
    ChatEndpoint("v", "http://h/v1", "m", extra={"vendor_magic": 1}, neutral_fields=("vendor_magic",))


def test_stop_cuts():
    assert stop_strings({"stop": "###"}) == ["###"] and stop_strings({"stop": ["a", ""]}) == ["a"]
    assert stop_strings({}) == [] and stop_strings({"stop": None}) == []
    assert cut_by_stop("stop", ["\n"], None) and cut_by_stop("stop", ["\n"], False)
    assert not cut_by_stop("stop", ["\n"], True)      # vLLM's stop_reason null: the model's own end token
    assert not cut_by_stop("length", ["\n"], None) and not cut_by_stop("stop", [], None)
    assert (model_end_of({}), model_end_of({"stop_reason": None}), model_end_of({"stop_reason": "\n"})) == (
        None, True, False)


THINK = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and "
         "m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
         "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_reasoning_reply_is_audited_as_its_template_renders_it():
    tok = load_tokenizer(TARGET_DIR)
    msgs = [{"role": "user", "content": "2+2?"}]
    got = reasoning_reply(tok, msgs, "Two and two.", "4", "w", THINK)
    assert got == "<think>\nTwo and two.\n</think>\n\n4"
    with pytest.raises(ContractError) as e:  # SmolLM2-like: the template drops the block
        reasoning_reply(tok, msgs, "Two and two.", "4", "w", PLAIN)
    assert e.value.kind == "reasoning" and "no reasoning segment" in e.value.what
