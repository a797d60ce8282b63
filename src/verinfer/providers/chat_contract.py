"""What a chat audit can audit: one contract for the fields of a chat request and the features of
its reply, shared by the live path (audit-api --chat, audit-vendors: the `extra` fields an auditor
sends with each request, checked when the vendor is read) and the log path (audit-log: the fields
a logged request carried, checked line by line). Every field is in exactly one of four groups:

    audit's own   model, messages, max_tokens / max_completion_tokens, temperature, top_p, top_k,
                  min_p, seed, n (1), stream (false): the audit sets them (live) or reads them (log)
    neutral       NEUTRAL_FIELDS: fields that do not change which tokens the model emits (metadata,
                  routing, logprob requests, ...), plus a vendor's own such fields the auditor names
                  (`neutral`: a vendors file's `neutral_fields`, audit-log's --neutral-field)
    understood    fields replayed as the vendor applied them:
                    stop                 a reply that stopped may end where a stop string began:
                                         it gets no end token, and the replay re-cuts its last
                                         token where the reference's spells the text and a stop
                                         string after it (`retokenize`); vLLM's stop_reason null
                                         marks the model's own end (`cut_by_stop`)
                    NEUTRAL_VALUES       penalties, min_tokens, response_format, tool_choice,
                                         logit_bias, ... at the value that changes nothing
    refused       everything else, each with its kind (REFUSED_KINDS) and the fix, before any
                  claim is scored: tools, constrained decoding, penalties, template fields, a stop
                  string kept in the text, and any field this contract does not know

and every reply feature is understood or refused:

    stop cut          `cut_by_stop` (above)
    cut mid-character finish "length" inside a multi-byte character: the text ends in U+FFFD, the
                      detokenizer's stand-in for the partial character; it is scored up to its last
                      whole character (`retokenize.whole_token_text`), the partial token dropped
    stripped space    a vendor that strips the reply's leading or trailing whitespace: the replay
                      re-cuts the boundary tokens where the reference's carry exactly that
                      whitespace (`retokenize`)
    reasoning         a reasoning block (`reasoning_content`, `reasoning`): audited as the model's
                      template renders it before the text (`reasoning_reply`), refused where the
                      template has no reasoning segment

A refusal is a ContractError with `kind`; `chat_log.ChatLogError` is one (a log's line), and the
live path raises it when a vendor is read, naming the vendor and the field.
"""

from __future__ import annotations

import json
import math

from verinfer.errors import VerinferError

AUDIT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                "min_p", "seed", "n", "stream")
NEUTRAL_FIELDS = (  # change nothing the model emits: who asked, where it was routed, what is logged or returned
    "user", "metadata", "store", "service_tier", "logprobs", "top_logprobs", "stream_options", "return_token_ids",
    "request_id", "safety_identifier", "prompt_cache_key", "priority", "cache_salt", "provider", "route", "models",
    "prediction", "parallel_tool_calls", "modalities", "spaces_between_special_tokens", "return_tokens_as_token_ids",
    "prompt_logprobs", "usage", "web_search_options", "kv_transfer_params")
TOOL_FIELDS = ("tools", "functions", "tool_choice", "function_call")  # tool_choice / function_call "none" is no tool
# fields that constrain decoding when set (any value but null, false, {}, [], and response_format
# {"type": "text"}); min_tokens suppresses the end tokens until it is reached
CONSTRAINED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "json_schema", "regex", "ebnf", "grammar", "logit_bias",
                      "allowed_token_ids", "bad_words", "logits_processors", "min_tokens", "stop_token_ids",
                      "ignore_eos")
PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}  # field: neutral value
# fields that change the prompt the provider renders (a log reader keeps them; a greedy replay refuses them)
TEMPLATE_FIELDS = ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                   "echo", "add_special_tokens", "documents", "reasoning", "reasoning_effort", "include_reasoning",
                   "transforms")
STOP_FIELDS = ("stop", "include_stop_str_in_output", "skip_special_tokens")

REFUSED_KINDS = {
    "tool-calls": "tools, tool calls or tool messages: the provider templates tool schemas and calls into the "
                  "prompt in its own, unpublished way, so the prompt the model saw cannot be rebuilt",
    "constrained": "constrained decoding (response_format json_object/json_schema, structured outputs, guided "
                   "decoding, grammars, logit_bias, allowed/bad words, min_tokens, stop_token_ids, ignore_eos) "
                   "masks or shifts the logits: the reply is not the model's distribution",
    "penalty": "presence, frequency or repetition penalties shift every logit by the reply's own history; "
               "the reference replay does not apply them",
    "stop-string": "the reply keeps the stop string in its text (include_stop_str_in_output) or special tokens "
                   "(skip_special_tokens false): its text is not the model's tokens decoded",
    "template-fields": "the request changed the chat template (chat_template, chat_template_kwargs, reasoning "
                       "settings, ...): the prompt the provider built is not the model's own",
    "unknown-field": "a request field this contract does not know: it may change the tokens, so the reply "
                     "cannot be replayed as the vendor made it",
    "reasoning": "a reply with a reasoning block, and the model's chat template has no reasoning segment: where "
                 "the block sat in the model's tokens is unknown",
}


class ContractError(VerinferError):
    """A request field or reply feature a chat audit cannot replay; `kind` is a key of REFUSED_KINDS
    (chat_log adds the kinds of a log's lines)."""

    def __init__(self, what: str, *, kind: str, where: str | None = None, fix: str | None = None):
        super().__init__(what, where=where, fix=fix)
        self.kind = kind


def is_set(v: object) -> bool:
    """A request field that takes effect: anything but null, false, and empty containers."""
    return v is not None and v is not False and v != {} and v != [] and v != ""


def _shown(fields: dict, keys: list[str]) -> str:
    return ", ".join(f"{k}={json.dumps(fields[k], default=str)[:40]}" for k in keys)


def check_request(fields: dict, where: str, fix_tail: str = "") -> None:
    """Refuse the fields that make any reply to this request unauditable, whatever the audit:
    tools, constrained decoding, penalties off their neutral values, a stop string kept in the text.
    `fix_tail` is appended to each fix (a log's "or pass --skip-unusable")."""
    tail = f", {fix_tail}" if fix_tail else ""
    tools = [k for k in TOOL_FIELDS if is_set(fields.get(k)) and fields[k] != "none"]
    if tools:
        raise ContractError(f"the request offers tools ({', '.join(tools)})", kind="tool-calls", where=where,
                            fix=f"audit exchanges without tools{tail}")
    fmt = fields.get("response_format")
    bound = [k for k in CONSTRAINED_FIELDS if is_set(fields.get(k))
             and not (k == "response_format" and isinstance(fmt, dict) and fmt.get("type") == "text")
             and not (k == "min_tokens" and fields[k] == 0)]
    if bound:
        raise ContractError(f"constrained decoding ({_shown(fields, bound)})", kind="constrained", where=where,
                            fix=f"audit unconstrained requests{tail}")
    for k, neutral in PENALTIES.items():
        v = fields.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ContractError(f"request `{k}` is {v!r}, not a number", kind="shape", where=where,
                                fix="send (or log) the request as the API takes it")
        if v != neutral:
            raise ContractError(f"request `{k}` is {v} (neutral: {neutral:g})", kind="penalty", where=where,
                                fix=f"audit requests without penalties{tail}")
    kept = [k for k in ("include_stop_str_in_output",) if is_set(fields.get(k))]
    kept += [k for k in ("skip_special_tokens",) if k in fields and fields[k] is not True and fields[k] is not None]
    if kept:
        raise ContractError(f"the reply text keeps what the model's tokens do not decode to ({_shown(fields, kept)})",
                            kind="stop-string", where=where, fix=f"remove {', '.join(kept)}{tail}")
    stop = fields.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise ContractError(f"request `stop` is {json.dumps(stop, default=str)[:60]}, not a string or a list of "
                            "strings", kind="shape", where=where, fix="send (or log) the request as the API takes it")


def replay_refusal(fields: dict, where: str, neutral: tuple[str, ...] = (), fix_tail: str = "") -> ContractError | None:
    """Why a replay (greedy or seeded) cannot rebuild what the vendor did with these request fields (None if it
    can): a changed chat template, or a field no group of the contract holds (`neutral`: the
    vendor's own fields the auditor declares neutral)."""
    tail = f", {fix_tail}" if fix_tail else ""
    changed = [k for k in TEMPLATE_FIELDS if k in fields]
    if changed:
        return ContractError(f"the request changed the chat template ({_shown(fields, changed)})",
                             kind="template-fields", where=where,
                             fix=f"audit requests that use the model's own chat template{tail}")
    known = {*AUDIT_FIELDS, *NEUTRAL_FIELDS, *TOOL_FIELDS, *CONSTRAINED_FIELDS, *PENALTIES, *STOP_FIELDS, *neutral}
    unknown = sorted(k for k in fields if k not in known)
    if unknown:
        return ContractError(f"request fields the audit does not know: {', '.join(unknown)}", kind="unknown-field",
                             where=where, fix="remove them, or where one does not change the tokens (routing, "
                                              f"metadata) declare it neutral: a vendor's neutral_fields = "
                                              f"[\"{unknown[0]}\"], audit-log's --neutral-field {unknown[0]}{tail}")
    return None


def stop_strings(fields: dict) -> list[str]:
    """The request's stop strings as a list (none: [])."""
    stop = fields.get("stop")
    return [stop] if isinstance(stop, str) and stop else [s for s in (stop or []) if isinstance(s, str) and s]


def cut_by_stop(finish_reason: str, stops: list[str], model_end: bool | None) -> bool:
    """Whether a reply may end where a stop string began rather than at the model's end token: it
    stopped, the request had stop strings, and the response does not say the model ended it
    (`model_end`: vLLM's stop_reason null is True, a stop string there is False, absent is None)."""
    return finish_reason == "stop" and bool(stops) and model_end is not True


def model_end_of(choice: dict) -> bool | None:
    """What a choice's vLLM `stop_reason` says of a reply that stopped: None (the field absent:
    unknown), True (null: the model's own end token), False (a stop string or stop token)."""
    if "stop_reason" not in choice:
        return None
    return choice["stop_reason"] is None


def reasoning_reply(tokenizer, messages: list[dict], reasoning: str, text: str, where: str,
                    chat_template: str | None = None) -> str:
    """The text the model generated for a reply with a reasoning block: the assistant turn as its own
    chat template renders it (the reasoning segment, then the text), without the end of turn. A
    template that does not render the block (SmolLM2's) is refused: kind "reasoning"."""
    turn = [*messages, {"role": "assistant", "content": text, "reasoning_content": reasoning}]
    try:
        head = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                             chat_template=chat_template)
        full = tokenizer.apply_chat_template(turn, tokenize=False, chat_template=chat_template)
    except Exception as e:  # jinja2 errors: a template that does not take these messages
        raise ContractError(f"the chat template cannot render the reply's reasoning ({type(e).__name__}: {e})",
                            kind="reasoning", where=where, fix="audit replies without reasoning") from e
    seg = full[len(head):] if full.startswith(head) else None
    at = -1 if seg is None else seg.find(reasoning)
    end = -1 if seg is None else seg.rfind(text) if text else at + len(reasoning)
    if not reasoning or at < 0 or end < at:
        raise ContractError("the reply has a reasoning block and the model's chat template has no reasoning segment",
                            kind="reasoning", where=where,
                            fix="audit replies without reasoning (ask the vendor to turn it off)")
    return seg[: end + len(text)] if text else seg[:end]


__all__ = ["AUDIT_FIELDS", "CONSTRAINED_FIELDS", "ContractError", "NEUTRAL_FIELDS", "PENALTIES", "REFUSED_KINDS",
           "TEMPLATE_FIELDS", "TOOL_FIELDS", "check_request", "cut_by_stop", "is_set", "model_end_of",
           "reasoning_reply", "replay_refusal", "stop_strings"]
