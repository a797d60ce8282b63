"""Logs of past chat exchanges as the raw material of claims: the OpenAI chat-completions request
and response JSON that clients and gateways log, one exchange per line (JSONL). This module
parses and validates; tokenizing the exchanges into claims is the caller's (core.sources.log_sources).

    {"request":  {"model": str, "messages": [{"role": "system" | "developer" | "user" | "assistant",
                                              "content": str | [{"type": "text", "text": str}]}],
                  "temperature"?, "top_p"?, "top_k"?, "min_p"?, "seed"?,
                  "max_completion_tokens"? | "max_tokens"?, ...any other field (kept in sampling.extra)},
     "response": {"id"?: str, "object"?: "chat.completion", "model"?: str,
                  "choices": [{"message": {"content": str, "reasoning_content"? | "reasoning"?: str},
                               "finish_reason": "stop" | "length",
                               "token_ids"?: [int], "prompt_token_ids"?: [int]}],
                  "usage"?: {...}, "prompt_token_ids"?: [int]}}

The response may be wrapped as the OpenAI Batch API writes it ({"status_code": 200, "body": {...}}),
and the request likewise ({"body": {...}}: a Batch input line, joined to its output by custom_id).
Text content parts are joined; a message's other fields (`name`, ...) are dropped. `token_ids` /
`prompt_token_ids` are what vLLM returns with `return_token_ids`. Lines are read as bytes and
decoded one by one (a text reader decodes ahead and names the wrong line); blank lines are skipped,
CRLF line ends and a leading byte-order mark are fine.

Each usable exchange becomes a `ChatExchange`. Its `id` is the response id, except where an earlier
exchange of the file already has that id: then, and for a response without an id, it is
"log-<line>" (log-000007; log-000007-2 in the odd case that a response id already reads so). The
first holder keeps its id, so appending to a log never renames an exchange read before. `model` is
the request's (the response's where the request names none), `served_model` the response's.
`sampling` holds what the request asked, with OpenAI's defaults (temperature 1.0, top_p 1.0) and
None where the request left a field out; max_tokens is max_completion_tokens, else max_tokens.
Everything else the request holds (but messages, model, stream) is in `sampling["extra"]`: among
it TEMPLATE_FIELDS (chat_template_kwargs, ...), which change the prompt the provider rendered; the
caller decides what it can rebuild. `reasoning` is the reply's reasoning block (`reasoning_content`:
vLLM, DeepSeek; `reasoning`: OpenRouter), kept because token-DiFR audits every token the model
generated, the reasoning block included; `text` is the reply without it.

An exchange that cannot be audited is refused with a ChatLogError naming file:line, what is wrong
and what to do; its `kind` is one of UNUSABLE_KINDS, which says why such an exchange cannot be
audited. With skip_unusable=True it is appended to `skipped` as (file:line, kind, message) and
reading goes on. Kinds of the file itself (FILE_KINDS): no such file, and no usable exchange.

    not-json         not UTF-8 JSON; a cut-off last line says the log was truncated while written
    shape            no request or response, no messages or choices, a field of the wrong type
                     (a Batch API output line alone has no request: join its input line)
    error-response   HTTP status >= 400 or an `error` object: no reply was made
    streaming        stream=true or chat.completion.chunk: chunks are not one reply; log the
                     assembled response
    several-choices  n > 1: how the provider derives each choice's randomness from the one seed is
                     its own, and a claim is one reply to one prompt
    tool-calls       tools offered, a tool call replied, tool messages: the provider templates tool
                     schemas and calls into the prompt its own, unpublished way
    non-text         image, audio or file parts: the encoders' tokens are the provider's, not text
                     the auditor can re-tokenize
    constrained      response_format json_object/json_schema, structured outputs, guided decoding,
                     grammars, logit_bias, allowed/bad words, min_tokens: the logits were masked or
                     shifted, so the reply is not the model's distribution
    penalty          presence/frequency/repetition penalties shift the logits by the reply's own
                     history; the reference replay does not
    no-text          content null (a refusal, a tool call) or empty and cut at max_tokens: nothing
                     to audit (an empty reply that stopped is kept: its end token is audited)
    finish-reason    content_filter, tool_calls, null: the provider, not the model, ended the reply
    stop-string      include_stop_str_in_output, skip_special_tokens false: the text is not the
                     model's tokens decoded (a reply cut by a `stop` string is understood, not
                     refused: `model_end` keeps vLLM's stop_reason, `chat_contract.cut_by_stop`)
    role             a role other than system, developer, user, assistant: no template renders it
    bad-text         text that is not valid Unicode (a lone surrogate, \\ud800 in the JSON): no
                     tokenizer encodes it (an endpoint answers such a request with 400)
    too-long         a line over MAX_LINE_BYTES (16 MiB, the claims files' limit); the rest of the
                     line is passed over and reading goes on with the next
    over-length      the reply's token count (its token_ids, else usage.completion_tokens) exceeds
                     the request's max_tokens (the caller bounds one without max_tokens by the
                     model's context)
    reasoning        a reply with a reasoning block the model's template does not render (raised by
                     `chat_contract.reasoning_reply`, kept here)
    template-fields  the request changed the chat template (chat_template, chat_template_kwargs, ...):
                     the auditor re-derives the prompt with the model's own (raised by `unusable_for_replay`)
    unknown-field    a request field the chat contract does not know (raised by `unusable_for_replay`
                     unless declared neutral)

Which request fields and reply features an audit understands is `providers/chat_contract.py`'s,
the same for this log's lines and a live audit's requests. Sampled exchanges are not refused: the
sampling fields are the audit's own (`chat_contract.AUDIT_FIELDS`), read into `sampling`; the caller
judges an exchange seeded where it has a seed and a declared sampler, else unseeded
(`core.sources.exchange_params`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from verinfer.claims import MAX_LINE_BYTES
from verinfer.providers.chat_contract import (REFUSED_KINDS, ContractError, check_request, is_set,
                                              model_end_of, replay_refusal)

UNUSABLE_KINDS = {
    "not-json": "the line is not UTF-8 JSON (a cut-off last line: the log was truncated while written)",
    "shape": "not an exchange: a line needs a request (model, messages) and a chat.completion response "
             "(choices); a field of the wrong type",
    "error-response": "the request failed (HTTP status >= 400 or an `error` object): there is no reply to audit",
    "streaming": "a streamed exchange (stream=true, chat.completion.chunk): its chunks are not one reply; log "
                 "the assembled response",
    "several-choices": "n > 1 or several choices: how the provider derives each choice's randomness from the one "
                       "seed is its own, and a claim is one reply to one prompt",
    "non-text": "images, audio or files in the messages or the reply: only text can be re-tokenized, and the "
                "encoder's tokens are the provider's",
    "no-text": "the reply has no text (content null, or empty and cut at max_tokens): nothing to audit",
    "finish-reason": "the reply was ended neither by the model (stop) nor by max_tokens (length): a content "
                     "filter, a tool call, or no reason, so its end cannot be scored",
    "role": "a message role other than system, developer, user, assistant: the chat template cannot render it",
    "bad-text": "text that is not valid Unicode (a lone UTF-16 surrogate such as \\ud800 in the JSON): no "
                "tokenizer encodes it, and an endpoint refuses it (HTTP 400)",
    "too-long": "a line longer than 16 MiB (the claims files' limit): no exchange an audit replays is that long",
    "over-length": "the reply has more tokens than its request allowed (max_tokens) or than the model's context: "
                   "it is not a reply to this request",
    **REFUSED_KINDS,  # the chat contract's, shared with the live path (providers/chat_contract.py)
}
FILE_KINDS = {
    "no-file": "the chat log does not exist",
    "no-exchange": "the chat log holds no exchange that can be audited",
}
ROLES = ("system", "developer", "user", "assistant")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_completion_tokens")
SKIP = "or pass skip_unusable (--skip-unusable) to skip such exchanges"


class ChatLogError(ContractError):
    """A chat log, or one of its exchanges, that cannot be audited; `kind` says why (a key of
    UNUSABLE_KINDS, or FILE_KINDS for the file itself)."""


@dataclass(frozen=True)
class ChatExchange:
    """One usable exchange of a chat log (see the module docstring for each field's origin)."""

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
    model_end: bool | None = None  # vLLM's stop_reason of a reply that stopped (`chat_contract.model_end_of`)


TokenIds = list[StrictInt]


class _Request(BaseModel):
    """The request fields read here; the others pass through to sampling["extra"]."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str | None = None
    messages: list = Field(min_length=1)
    n: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    content: str | list | None = None
    tool_calls: list | None = None
    function_call: dict | None = None
    refusal: str | None = None
    audio: dict | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(BaseModel):
    model_config = ConfigDict(extra="allow")
    message: _Message | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string or stop token that ended the reply
    token_ids: list[StrictInt] | None = None
    prompt_token_ids: list[StrictInt] | None = None


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | StrictInt | None = None
    object: str | None = None
    model: str | None = None
    choices: list[_Choice] = Field(min_length=1)
    usage: dict | None = None
    prompt_token_ids: list[StrictInt] | None = None


def _refuse(kind: str, what: str, where: str, fix: str) -> ChatLogError:
    return ChatLogError(what, kind=kind, where=where, fix=fix)


def _shape(e: ValidationError, part: str, where: str, fix: str) -> ChatLogError:
    """The first validation error of the request or response, as the field's dotted path."""
    err = e.errors()[0]
    fld = ".".join(str(x) for x in err["loc"]) or part
    got = "" if err["type"] == "missing" else f" (got {json.dumps(err.get('input'), default=str)[:80]})"
    return _refuse("shape", f"{part} `{fld}`: {err['msg']}{got}", where, fix)


def _unwrap(part: str, obj: object, where: str) -> dict:
    """The request or response body, unwrapped from the Batch API's {"status_code", "body"}."""
    if isinstance(obj, list) and part == "response":
        raise _refuse("streaming", "the response is a list (streamed chunks?), not one chat.completion", where,
                      f"log the assembled response (one chat.completion object), {SKIP}")
    if not isinstance(obj, dict):
        raise _refuse("shape", f"`{part}` is {type(obj).__name__}, not a JSON object", where,
                      'one {"request": {...}, "response": {...}} per line')
    status = obj.get("status_code")
    if status is not None and (not isinstance(status, int) or isinstance(status, bool)):
        raise _refuse("shape", f"`{part}.status_code` is {status!r}, not an HTTP status", where,
                      "log the Batch API's output as written")
    if isinstance(status, int) and status >= 400:
        body = obj.get("body")
        err = body.get("error") if isinstance(body, dict) else None
        said = (err.get("message") if isinstance(err, dict) else err) or ""
        raise _refuse("error-response", f"the request failed with HTTP {status}" + (f": {str(said)[:160]}" if said
                      else ""), where, f"drop failed exchanges, {SKIP}")
    if "body" in obj:
        if not isinstance(obj["body"], dict):
            raise _refuse("shape", f"`{part}.body` is {type(obj['body']).__name__}, not a JSON object", where,
                          "log the Batch API's request and response bodies as written")
        return obj["body"]
    return obj


def _text(content: object, what: str, where: str) -> str:
    """Message content as text: a string, or text parts joined; any other part is non-text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                shown = kind if kind != "text" else "text part without a `text` string"
                raise _refuse("non-text", f"{what} holds a {shown} part", where,
                              f"audit text-only conversations, {SKIP}")
            parts.append(part["text"])
        return "".join(parts)
    raise _refuse("shape", f"{what} content is {type(content).__name__}, not text", where,
                  "message content is a string or a list of text parts")


def _check_request(req: dict, where: str) -> None:
    """Refuse what the request alone makes unauditable (`chat_contract.check_request`), as this log's line."""
    try:
        check_request(req, where, SKIP)
    except ContractError as e:
        raise ChatLogError(e.what, kind=e.kind, where=where, fix=e.fix) from None


def _messages(raw: list, where: str) -> tuple[dict, ...]:
    out = []
    for i, m in enumerate(raw):
        what = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _refuse("shape", f"{what} is not a {{'role', 'content'}} object (got {str(m)[:60]!r})", where,
                          "log the chat-completions request body")
        role = m["role"]
        if role in ("tool", "function"):
            raise _refuse("tool-calls", f"{what} has role {role!r} (a tool's result)", where,
                          f"audit exchanges without tools, {SKIP}")
        if role not in ROLES:
            raise _refuse("role", f"{what} has role {role!r}, not one of {', '.join(ROLES)}", where,
                          f"audit conversations of {', '.join(ROLES)} messages, {SKIP}")
        if is_set(m.get("tool_calls")) or is_set(m.get("function_call")):
            raise _refuse("tool-calls", f"{what} ({role}) holds tool calls", where,
                          f"audit exchanges without tools, {SKIP}")
        if m.get("content") is None:
            raise _refuse("shape", f"{what} ({role}) has no content", where,
                          "message content is a string or a list of text parts")
        out.append({"role": role, "content": _text(m["content"], what, where)})
    return tuple(out)


def _reply_text(choice, raw: dict, req: dict, where: str) -> str:
    """The text of a reply the audit can score, or the ChatLogError of why not (no message, a tool
    call, audio, no text, another finish reason, an empty reply cut at max_tokens, a stop string)."""
    msg = choice.message
    if msg is None:
        raise _refuse("shape", "response `choices.0.message` is missing", where,
                      "log the chat.completion JSON the endpoint returned")
    if is_set(msg.tool_calls) or is_set(msg.function_call) or choice.finish_reason in ("tool_calls", "function_call"):
        raise _refuse("tool-calls", "the reply is a tool call, not text", where,
                      f"audit exchanges without tools, {SKIP}")
    if msg.audio is not None:
        raise _refuse("non-text", "the reply is audio", where, f"audit text-only replies, {SKIP}")
    if msg.content is None:
        said = f" (refusal: {msg.refusal[:80]!r})" if msg.refusal else ""
        raise _refuse("no-text", f"the reply has no text (message.content is null){said}", where,
                      f"nothing to audit: drop it, {SKIP}")
    text = _text(msg.content, "the reply", where)
    if choice.finish_reason not in ("stop", "length"):
        raise _refuse("finish-reason", f"finish_reason {choice.finish_reason!r}, not 'stop' or 'length'", where,
                      f"audit replies ended by the model (stop) or by max_tokens (length), {SKIP}")
    if text == "" and choice.finish_reason == "length":
        raise _refuse("no-text", "the reply is empty and was cut at max_tokens (its tokens went elsewhere, e.g. "
                      "hidden reasoning)", where, f"nothing to audit: drop it, {SKIP}")
    return text


def parse_exchange(obj: object, where: str, lineno: int) -> ChatExchange:
    """One decoded log line as a ChatExchange, or a ChatLogError with its kind. The id is the
    response's (or log-<lineno> without one); `iter_chat_log` makes ids unique in the file."""
    if not isinstance(obj, dict) or "request" not in obj or "response" not in obj:
        has = sorted(obj)[:6] if isinstance(obj, dict) else type(obj).__name__
        batch = isinstance(obj, dict) and "custom_id" in obj
        raise _refuse("shape", f"not an exchange: a line needs `request` and `response` (got {has})", where,
                      'a Batch API output line has no request: join it with its input line by custom_id, as '
                      '{"request": <input line>, "response": <output line\'s response>}' if batch else
                      'one {"request": {...}, "response": {...}} per line (OpenAI chat-completions JSON)')
    if is_set(obj.get("error")):  # a Batch API output line that failed
        raise _refuse("error-response", f"the exchange failed: {json.dumps(obj['error'], default=str)[:160]}", where,
                      f"drop failed exchanges, {SKIP}")
    req, raw = _unwrap("request", obj["request"], where), _unwrap("response", obj["response"], where)
    if is_set(raw.get("error")):
        err = raw["error"]
        said = err.get("message") if isinstance(err, dict) else err
        raise _refuse("error-response", f"an error response: {str(said)[:160]}", where,
                      f"drop failed exchanges, {SKIP}")
    chunks = raw.get("object") == "chat.completion.chunk" or any(
        isinstance(c, dict) and "delta" in c and "message" not in c for c in raw.get("choices") or [])
    if req.get("stream") is True or chunks:
        raise _refuse("streaming", "a streamed exchange" + (" (chat.completion.chunk)" if chunks else
                      " (stream=true)"), where,
                      f"log the assembled response (one chat.completion object), not its chunks, {SKIP}")
    n_req = req.get("n") if isinstance(req.get("n"), int) and not isinstance(req.get("n"), bool) else 1
    n_choices = len(raw["choices"]) if isinstance(raw.get("choices"), list) else 1
    if n_req > 1 or n_choices > 1:
        raise _refuse("several-choices", f"{max(n_req, n_choices)} choices (request n = {req.get('n')}, "
                      f"{n_choices} in the response)", where, f"log exchanges with n = 1, {SKIP}")
    _check_request(req, where)
    try:
        rq = _Request.model_validate(req)
    except ValidationError as e:
        raise _shape(e, "request", where, "log the chat-completions request body as sent") from None
    try:
        resp = _Response.model_validate(raw)
    except ValidationError as e:
        raise _shape(e, "response", where, "log the chat.completion JSON the endpoint returned") from None
    messages = _messages(rq.messages, where)
    choice = resp.choices[0]
    msg, text = choice.message, _reply_text(choice, raw, req, where)
    reasoning = msg.reasoning_content if msg.reasoning_content is not None else msg.reasoning
    _check_unicode([(f"messages[{i}]", m["content"]) for i, m in enumerate(messages)]
                   + [("the reply", text), ("the reply's reasoning", reasoning or "")], where)
    n_out = len(choice.token_ids) if choice.token_ids is not None else (resp.usage or {}).get("completion_tokens")
    asked = rq.max_completion_tokens if rq.max_completion_tokens is not None else rq.max_tokens
    if isinstance(n_out, int) and not isinstance(n_out, bool) and asked is not None and n_out > asked:
        raise _refuse("over-length", f"the reply has {n_out} tokens, more than the request's max_tokens {asked}",
                      where, f"log the response this request received, {SKIP}")
    model = rq.model or resp.model
    if not model:
        raise _refuse("shape", "neither the request nor the response names the model", where,
                      "log the chat-completions request body (it has `model`)")
    prompt = choice.prompt_token_ids if choice.prompt_token_ids is not None else resp.prompt_token_ids
    sampling = {"temperature": 1.0 if rq.temperature is None else float(rq.temperature),
                "top_p": 1.0 if rq.top_p is None else float(rq.top_p), "top_k": rq.top_k,
                "min_p": None if rq.min_p is None else float(rq.min_p), "seed": rq.seed,
                "max_tokens": rq.max_completion_tokens if rq.max_completion_tokens is not None else rq.max_tokens,
                "extra": {k: v for k, v in req.items() if k not in ("messages", "model", "stream", *SAMPLING_FIELDS)}}
    rid = "" if resp.id is None else str(resp.id)
    return ChatExchange(rid or f"log-{lineno:06d}", model, messages, text, choice.finish_reason, sampling,
                        resp.usage, resp.model, None if choice.token_ids is None else tuple(choice.token_ids),
                        None if prompt is None else tuple(prompt), where, reasoning,
                        model_end_of(raw["choices"][0]))


def _check_unicode(texts: list[tuple[str, str]], where: str) -> None:
    """Refuse text no tokenizer can encode: a lone surrogate (JSON lets `\\ud800` stand alone)."""
    for what, text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _refuse("bad-text", f"{what} is not valid Unicode (a lone surrogate U+{ord(text[e.start]):04X} at "
                          f"character {e.start})", where, f"log the text as sent (valid UTF-8), {SKIP}") from None


def unusable_for_replay(ex, neutral: tuple[str, ...] = ()) -> ChatLogError | None:
    """Why a logged exchange cannot be replayed (None if it can): request fields the replay cannot
    rebuild (`chat_contract.replay_refusal`: template fields, fields the contract does not know and
    the auditor did not declare `neutral`). Its sampling is the audit's own, never a refusal (a
    sampled exchange is judged seeded or unseeded by the caller). A reasoning block is the
    caller's to render (`chat_contract.reasoning_reply`)."""
    e = replay_refusal(ex.sampling.get("extra", {}), ex.source, neutral, "or pass --skip-unusable")
    return None if e is None else ChatLogError(e.what, kind=e.kind, where=e.where, fix=e.fix)


def _decode(raw: bytes, where: str) -> object:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _refuse("not-json", f"not UTF-8 text ({e.reason} at byte {e.start} of the line)", where,
                      "chat logs are UTF-8 JSONL") from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        cut = not raw.endswith(b"\n")
        raise _refuse("not-json", f"not valid JSON ({e.msg} at column {e.colno})"
                      + ("; the file looks truncated (its last line is cut off)" if cut else ""), where,
                      "the log was cut while written: drop the last line, or log again" if cut
                      else f"fix or drop the line, {SKIP}") from None
    except RecursionError:
        raise _refuse("not-json", "JSON nested too deeply to read", where, f"fix or drop the line, {SKIP}") from None


def iter_chat_log(path: str | Path, *, skip_unusable: bool = False,
                  skipped: list | None = None) -> Iterator[ChatExchange]:
    """The log's usable exchanges in file order, ids unique (see the module docstring). An unusable
    exchange raises its ChatLogError; with skip_unusable it is appended to `skipped` as
    (file:line, kind, message) and reading goes on. A log with no usable exchange raises."""
    p = Path(path)
    if p.is_dir():
        raise ChatLogError("a directory, not a chat log", kind="no-file", where=str(p),
                           fix="pass the JSONL file of chat exchanges inside it")
    if not p.is_file():
        raise ChatLogError("no such chat log", kind="no-file", where=str(p),
                           fix="pass a JSONL file of chat exchanges, one {\"request\", \"response\"} per line")
    seen: set[str] = set()
    dropped: Counter[str] = Counter()
    with open(p, "rb") as f:  # decoded line by line: a text reader decodes ahead and names the wrong line
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark, as Windows tools write
            if not raw.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                if len(raw) > MAX_LINE_BYTES:
                    _pass_over_line(f, raw)
                    raise _refuse("too-long", f"the line is longer than {MAX_LINE_BYTES >> 20} MiB", where,
                                  f"no audited exchange is that long: drop the line, {SKIP}")
                ex = parse_exchange(_decode(raw, where), where, lineno)
            except ChatLogError as e:
                if not skip_unusable:
                    raise
                dropped[e.kind] += 1
                if skipped is not None:
                    skipped.append((where, e.kind, e.what))
                continue
            if ex.id in seen:  # a repeated response id: the line's own (a response id may be log-<n> too)
                new, k = f"log-{lineno:06d}", 1
                while new in seen:
                    k += 1
                    new = f"log-{lineno:06d}-{k}"
                ex = replace(ex, id=new)
            seen.add(ex.id)
            yield ex
    if not seen:
        why = ", ".join(f"{n} {k}" for k, n in dropped.most_common())
        raise ChatLogError("the chat log holds no exchange that can be audited"
                           + (f" ({sum(dropped.values())} skipped: {why})" if dropped else " (it is empty)"),
                           kind="no-exchange", where=str(p),
                           fix="audit a log of text chat exchanges ended by stop or length (UNUSABLE_KINDS says "
                               "why each skipped kind cannot be audited)" if dropped else
                               "pass a JSONL file of chat exchanges, one {\"request\", \"response\"} per line")


def _pass_over_line(f, head: bytes) -> None:
    """Read on to the end of a line whose first MAX_LINE_BYTES + 1 bytes were `head`."""
    chunk = head
    while chunk and not chunk.endswith(b"\n"):
        chunk = f.readline(MAX_LINE_BYTES + 1)


def read_chat_log(path: str | Path, **kw) -> list[ChatExchange]:
    """Every usable exchange of a chat log (`iter_chat_log`; keywords skip_unusable, skipped)."""
    return list(iter_chat_log(path, **kw))
