"""A claim producer over HTTP: any OpenAI-compatible completions endpoint (verinfer serve, vLLM,
a provider's API), through the official `openai` client. Prompts go out as token ids; the
endpoint's prompt and output token ids come back (vLLM's `return_token_ids`; verinfer serve
always sends them). Text is never re-tokenized: an endpoint that returns no token ids cannot be
audited and says so. Every reply is validated (pydantic: JSON, at least one choice, integer token
ids >= 0) and checked against the trusted model and the request (`check_token_reply`: ids in the
vocabulary, at most max_tokens of them, the prompt sent, a finish reason that fits) before anything
of it is kept."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from verinfer.openai_client import EndpointError, endpoint_errors, new_client
from verinfer.sampling.params import SamplingParams


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str                 # the name the endpoint serves
    api_key: str = "EMPTY"
    timeout: float = 120.0
    max_retries: int = 2
    ignore_eos: bool = False   # vLLM / verinfer serve extension; fixed-length outputs


def openai_client(endpoint: Endpoint):
    """The official client for the endpoint (`openai_client.new_client`)."""
    return new_client(endpoint.base_url, endpoint.api_key, timeout=endpoint.timeout, max_retries=endpoint.max_retries)


TokenId = Annotated[StrictInt, Field(ge=0)]


class CompletionChoice(BaseModel):
    """choices[0] of a completion reply: the fields an audit reads (others are allowed)."""
    model_config = ConfigDict(extra="allow")
    token_ids: list[TokenId] | None = None
    prompt_token_ids: list[TokenId] | None = None
    finish_reason: str | None = None


class CompletionReply(BaseModel):
    """A completion reply as an audit needs it: at least one choice, integer token ids >= 0."""
    model_config = ConfigDict(extra="allow")
    choices: list[CompletionChoice] = Field(min_length=1)
    prompt_token_ids: list[TokenId] | None = None


def parse_reply(body: bytes, where: str, request: str) -> CompletionReply:
    """Validate a completion reply's body before anything of it is kept: an EndpointError naming
    the endpoint (`where`) and the request when it is not JSON or not a usable reply."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        shown = body[:120].decode("utf-8", "replace").strip()
        raise EndpointError(f"{request}: the reply is not JSON ({e.msg}; body starts {shown!r})", where=where,
                            fix="check --base-url: it must be an OpenAI-compatible API ending in /v1, not a web "
                                "page or a proxy's error page") from None
    try:
        return CompletionReply.model_validate(data)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']} (got {_short(err['input'])})"
                        for err in e.errors()[:3])
        raise EndpointError(f"{request}: the reply is not a usable completion ({bad})", where=where,
                            fix="audit an OpenAI-compatible completions endpoint that returns integer token ids "
                                "(verinfer serve; vLLM >= 0.10.2 with return_token_ids)") from None


FINISH_REASONS = ("stop", "length")
UNSAVED = "(nothing of this reply was saved)"
NOT_FAITHFUL = f"it is not a faithful completions server: audit another endpoint {UNSAVED}"


def check_token_reply(output_ids: list, finish_reason: str | None, *, vocab_size: int, max_tokens: int,
                      request: str, where: str, prompt_ids: list | None = None, sent: list[int] | None = None) -> None:
    """Refuse token ids that cannot be the trusted model's answer to the request: an EndpointError
    naming the request, the field and the value unless
      - every output id (and returned prompt id) is an int in [0, vocab_size) (not a bool or a float),
      - there are at most max_tokens output ids,
      - the returned prompt ids, where the endpoint sends them and `sent` is known, are the ones sent,
      - finish_reason is "stop" or "length" (None reads as "length"), and "length" comes with exactly
        max_tokens output ids (verinfer serve and vLLM refuse prompt + max_tokens over their context
        before generating, so nothing else cuts a reply short).
    vocab_size is the trusted model's (config.json); the count is checked before the ids are read."""
    if len(output_ids) > max_tokens:
        raise EndpointError(f"{request}: choices[0].token_ids holds {len(output_ids)} tokens, more than the "
                            f"max_tokens={max_tokens} asked", where=where,
                            fix=f"the endpoint ignores max_tokens; {NOT_FAITHFUL}")
    for field_name, ids in (("choices[0].token_ids", output_ids), ("prompt_token_ids", prompt_ids)):
        j = _first_bad_id(ids or (), vocab_size)
        if j is not None:
            raise EndpointError(f"{request}: {field_name}[{j}] is {_short(ids[j])}, not a token id of the trusted "
                                f"model (an int in [0, {vocab_size}))", where=where,
                                fix="the endpoint serves a model with another vocabulary than the trusted model's "
                                    "(config.json), or garbles its ids: audit it against the model it serves, or "
                                    f"another endpoint {UNSAVED}")
    if prompt_ids is not None and sent is not None and list(prompt_ids) != list(sent):
        j = next((j for j, (a, b) in enumerate(zip(prompt_ids, sent)) if a != b), min(len(prompt_ids), len(sent)))
        raise EndpointError(f"{request}: prompt_token_ids differ from the ids sent (sent {len(sent)} ids, got "
                            f"{len(prompt_ids)}; first difference at position {j})", where=where,
                            fix=f"the endpoint re-tokenized or templated the prompt: audit a raw completions endpoint "
                                f"{UNSAVED}")
    finish = finish_reason or "length"
    if finish not in FINISH_REASONS:
        raise EndpointError(f"{request}: finish_reason {finish_reason!r}, not 'stop' or 'length'", where=where,
                            fix=f"the reply was cut by the endpoint, not by the model; {NOT_FAITHFUL}")
    if finish == "length" and len(output_ids) != max_tokens:
        raise EndpointError(f"{request}: finish_reason {finish_reason!r} with {len(output_ids)} output tokens, "
                            f"not the max_tokens={max_tokens} asked", where=where,
                            fix=f"the endpoint cut the reply short of max_tokens; {NOT_FAITHFUL}")


def _first_bad_id(ids, vocab_size: int) -> int | None:
    """The index of the first entry that is not an int in [0, vocab_size), else None."""
    return next((j for j, x in enumerate(ids) if type(x) is not int or not 0 <= x < vocab_size), None)


def _short(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def request_completion(client, cfg: Endpoint, prompt: list[int], params: SamplingParams,
                       request: str = "request", *, vocab_size: int) -> tuple[list[int], list[int], str]:
    """One completion; returns (prompt ids, output ids, finish reason) as the endpoint reports them,
    validated (`parse_reply`) and checked against the trusted model's vocab_size and the request
    (`check_token_reply`). `request` names it in errors (e.g. 'request 3 (claim api-00003)')."""
    extra = {"return_token_ids": True}
    if params.top_k > 0:
        extra["top_k"] = params.top_k
    if params.min_p > 0:
        extra["min_p"] = params.min_p
    if cfg.ignore_eos:
        extra["ignore_eos"] = True
    kwargs = dict(model=cfg.model, prompt=prompt, max_tokens=params.max_tokens, temperature=params.temperature,
                  top_p=params.top_p, extra_body=extra)
    if params.seed is not None:
        kwargs["seed"] = params.seed
    with endpoint_errors(request, cfg.base_url, answered="the endpoint answered ",
                         reach_fix="start the server or check --base-url; rerun the same command to resume",
                         status_fix="check --model and the sampling options the endpoint accepts"):
        raw = client.completions.with_raw_response.create(**kwargs)
    reply = parse_reply(raw.http_response.content, cfg.base_url, request)
    choice = reply.choices[0]
    if choice.token_ids is None:
        raise EndpointError(f"{request}: the endpoint returned no output token ids (choices[0].token_ids)",
                            where=cfg.base_url,
                            fix="verinfer never re-tokenizes text: audit an endpoint that returns token ids "
                                "(verinfer serve; vLLM >= 0.10.2 with return_token_ids)")
    prompt_ids = next((p for p in (choice.prompt_token_ids, reply.prompt_token_ids) if p is not None), None)
    check_token_reply(choice.token_ids, choice.finish_reason, vocab_size=vocab_size, max_tokens=params.max_tokens,
                      request=request, where=cfg.base_url, prompt_ids=prompt_ids, sent=prompt)
    return list(prompt if prompt_ids is None else prompt_ids), list(choice.token_ids), choice.finish_reason or "length"


def probe_seed_replies(client, endpoint: Endpoint, prompt: list[int], params: SamplingParams, *,
                       vocab_size: int) -> tuple[list[int], list[int], list[int]]:
    """The same seeded request sent twice: (prompt ids, first output ids, second output ids)."""
    p, a, _ = request_completion(client, endpoint, prompt, params, "the seed probe (first of two)", vocab_size=vocab_size)
    b = request_completion(client, endpoint, prompt, params, "the seed probe (second of two)", vocab_size=vocab_size)[1]
    return p, a, b


def probe_seeds(client, endpoint: Endpoint, prompt: list[int], params: SamplingParams, *, vocab_size: int) -> bool:
    """True if the endpoint gives the same tokens twice for the same seeded request."""
    _, a, b = probe_seed_replies(client, endpoint, prompt, params, vocab_size=vocab_size)
    return a == b
