"""Logs of past chat exchanges as claims' raw material: the OpenAI chat-completions request and
response JSON that clients and gateways log, one exchange per line (JSONL).

    {"request":  {"model", "messages": [{"role", "content"}], "temperature", "top_p", "seed",
                  "max_tokens" | "max_completion_tokens", ...},
     "response": {"id", "model", "choices": [{"message": {"content"}, "finish_reason",
                  "token_ids"?}], "usage", "prompt_token_ids"?}}

The response may be wrapped as the OpenAI Batch API writes it ({"status_code", "body": {...}}),
and the request likewise ({"body": {...}}); text content parts ([{"type": "text", "text"}]) are
joined. Each usable exchange becomes a `ChatExchange`; the others are refused with a ChatLogError
naming file:line, the reason (`kind`, one of UNUSABLE_KINDS) and what to do, or, with
skip_unusable, counted in `skipped` as (file:line, kind, message).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from verinfer.errors import VerinferError

UNUSABLE_KINDS = {
    "not-json": "the line is not JSON (a cut-off last line: the log was truncated)",
    "shape": "the line is not an object with a request and a response",
    "error-response": "the request failed (an error response): there is no reply to audit",
    "streaming": "a streamed response: log the assembled reply, not its chunks",
    "several-choices": "n > 1 or several choices: one reply per exchange is audited",
    "tool-calls": "tools or tool calls: the provider templates tool schemas into the prompt in a way the "
                  "auditor cannot reproduce",
    "non-text": "images, audio or files in the messages: only text is re-tokenized",
    "constrained": "constrained decoding (response_format, logit_bias, guided decoding) changes the distribution",
    "no-text": "the reply has no text",
    "finish-reason": "the reply was not ended by the model or by max_tokens (a content filter, a tool call)",
    "role": "a message role other than system, user, assistant (or developer)",
    "sampled": "sampled at temperature > 0: replayed only with the provider's seed and sampler (audit-log "
               "audits greedy exchanges)",
}
ROLES = ("system", "developer", "user", "assistant")
CONSTRAINED = ("response_format", "logit_bias", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs")
TOOLS = ("tools", "functions", "tool_choice", "function_call")


class ChatLogError(VerinferError):
    """An exchange of a chat log that cannot be audited; `kind` says why (UNUSABLE_KINDS)."""

    def __init__(self, what: str, *, kind: str, where: str | None = None, fix: str | None = None):
        super().__init__(what, where=where, fix=fix)
        self.kind = kind


@dataclass(frozen=True)
class ChatExchange:
    id: str
    model: str
    messages: tuple[dict, ...]
    text: str
    finish_reason: str
    sampling: dict
    usage: dict | None
    served_model: str | None
    output_token_ids: tuple[int, ...] | None
    prompt_token_ids: tuple[int, ...] | None
    source: str
    reasoning: str | None = None


class _Choice(BaseModel):
    model_config = ConfigDict(extra="allow")
    message: dict | None = None
    finish_reason: str | None = None
    token_ids: list[StrictInt] | None = None
    prompt_token_ids: list[StrictInt] | None = None


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    object: str | None = None
    model: str | None = None
    choices: list[_Choice] = []
    usage: dict | None = None
    prompt_token_ids: list[StrictInt] | None = None
    error: dict | str | None = None


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ChatLogError(f"a message holds a {kind or type(part).__name__!s} part", kind="non-text",
                                   where=where, fix="audit text-only conversations")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ChatLogError(f"a message's content is {type(content).__name__}, not text", kind="non-text", where=where,
                       fix="audit text-only conversations")


def _unwrap(obj, where: str) -> dict:
    if isinstance(obj, dict) and "body" in obj and isinstance(obj["body"], dict):
        if int(obj.get("status_code", 200)) >= 400:
            raise ChatLogError(f"the request failed with HTTP {obj.get('status_code')}", kind="error-response",
                               where=where, fix="drop failed exchanges (or use --skip-unusable)")
        return obj["body"]
    if not isinstance(obj, dict):
        raise ChatLogError("request and response must be JSON objects", kind="shape", where=where,
                           fix='one {"request": {...}, "response": {...}} per line')
    return obj


def parse_exchange(obj, where: str, lineno: int) -> ChatExchange:
    """One logged exchange, validated (a ChatLogError with its kind otherwise)."""
    if not isinstance(obj, dict) or "request" not in obj or "response" not in obj:
        raise ChatLogError("not an exchange: a line needs `request` and `response`", kind="shape", where=where,
                           fix='one {"request": {...}, "response": {...}} per line (OpenAI chat-completions JSON)')
    req, raw = _unwrap(obj["request"], where), _unwrap(obj["response"], where)
    if req.get("stream") or raw.get("object") == "chat.completion.chunk":
        raise ChatLogError("a streamed exchange", kind="streaming", where=where,
                           fix="log the assembled response (one chat.completion object), not its chunks")
    try:
        resp = _Response.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise ChatLogError(f"response `{'.'.join(map(str, err['loc']))}` {err['msg']}", kind="shape",
                           where=where, fix="log the chat.completion JSON the endpoint returned") from None
    if resp.error is not None:
        raise ChatLogError("an error response", kind="error-response", where=where,
                           fix="drop failed exchanges (or use --skip-unusable)")
    if (req.get("n") or 1) > 1 or len(resp.choices) > 1:
        raise ChatLogError(f"{max(req.get('n') or 1, len(resp.choices))} choices", kind="several-choices",
                           where=where, fix="log exchanges with n = 1")
    if any(req.get(k) for k in TOOLS):
        raise ChatLogError("the request offers tools", kind="tool-calls", where=where,
                           fix="audit exchanges without tools")
    bad = [k for k in CONSTRAINED if req.get(k)]
    if bad:
        raise ChatLogError(f"constrained decoding ({', '.join(bad)})", kind="constrained", where=where,
                           fix="audit unconstrained exchanges")
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(req.get("model"), str):
        raise ChatLogError("the request needs `model` and a non-empty `messages` list", kind="shape", where=where,
                           fix="log the chat-completions request body")
    msgs = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            kind = "tool-calls" if role in ("tool", "function") else "role"
            raise ChatLogError(f"a message with role {role!r}", kind=kind, where=where,
                               fix="audit conversations of system, user and assistant messages")
        if m.get("tool_calls") or m.get("function_call"):
            raise ChatLogError("an assistant message with tool calls", kind="tool-calls", where=where,
                               fix="audit exchanges without tools")
        msgs.append({"role": m["role"], "content": _text(m.get("content"), where)})
    if not resp.choices:
        raise ChatLogError("the response has no choices", kind="shape", where=where,
                           fix="log the chat.completion JSON the endpoint returned")
    choice = resp.choices[0]
    msg = choice.message or {}
    if msg.get("tool_calls") or msg.get("function_call") or choice.finish_reason in ("tool_calls", "function_call"):
        raise ChatLogError("the reply is a tool call", kind="tool-calls", where=where,
                           fix="audit exchanges without tools")
    content = msg.get("content")
    if content is None or content == "":
        raise ChatLogError("the reply has no text", kind="no-text", where=where, fix="drop it")
    if choice.finish_reason not in ("stop", "length"):
        raise ChatLogError(f"finish_reason {choice.finish_reason!r}", kind="finish-reason", where=where,
                           fix="audit replies ended by the model (stop) or by max_tokens (length)")
    sampling = {"temperature": float(req.get("temperature", 1.0)), "top_p": float(req.get("top_p", 1.0)),
                "top_k": req.get("top_k"), "min_p": req.get("min_p"), "seed": req.get("seed"),
                "max_tokens": req.get("max_completion_tokens", req.get("max_tokens")),
                "extra": {k: v for k, v in req.items()
                          if k not in ("model", "messages", "stream", "temperature", "top_p", "top_k", "min_p",
                                       "seed", "max_tokens", "max_completion_tokens", "n")}}
    prompt = choice.prompt_token_ids if choice.prompt_token_ids is not None else resp.prompt_token_ids
    return ChatExchange(resp.id or f"log-{lineno:06d}", req["model"], tuple(msgs), _text(content, where),
                        choice.finish_reason, sampling, resp.usage, resp.model,
                        None if choice.token_ids is None else tuple(choice.token_ids),
                        None if prompt is None else tuple(prompt), where,
                        msg.get("reasoning_content") or msg.get("reasoning"))


def iter_chat_log(path: str | Path, *, skip_unusable: bool = False, skipped: list | None = None) -> Iterator[ChatExchange]:
    """The log's usable exchanges in order (ids unique: a repeated response id becomes log-<line>).
    An unusable one raises its ChatLogError, or with skip_unusable is appended to `skipped` as
    (file:line, kind, message)."""
    p = Path(path)
    if not p.is_file():
        raise VerinferError("no such chat log", where=str(p), fix="pass a JSONL file of chat exchanges")
    seen: set[str] = set()
    n = 0
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{p}:{lineno}"
            try:
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                    cut = not raw.endswith(b"\n")
                    raise ChatLogError(f"not valid JSON ({getattr(e, 'msg', type(e).__name__)})", kind="not-json",
                                       where=where, fix="the log looks truncated (last line cut off)" if cut
                                       else "fix or drop the line") from None
                ex = parse_exchange(obj, where, lineno)
            except ChatLogError as e:
                if not skip_unusable:
                    raise
                if skipped is not None:
                    skipped.append((where, e.kind, e.what))
                continue
            if ex.id in seen:
                ex = ChatExchange(f"log-{lineno:06d}", *[getattr(ex, k) for k in list(ex.__dataclass_fields__)[1:]])
            seen.add(ex.id)
            n += 1
            yield ex
    if n == 0:
        raise ChatLogError("the log holds no exchange that can be audited", kind="shape", where=str(p),
                           fix="see the reasons above (--skip-unusable lists them)")


def read_chat_log(path: str | Path, **kw) -> list[ChatExchange]:
    return list(iter_chat_log(path, **kw))
