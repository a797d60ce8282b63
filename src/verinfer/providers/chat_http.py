"""A claim producer over HTTP for the endpoints people buy from: OpenAI-compatible chat APIs
(`/v1/chat/completions`: hosted open-weight APIs, routers that pin a provider, a company's gateway,
vLLM, SGLang), which take messages and return text.

    request  {"model", "messages", "max_tokens", "temperature", "top_p", "top_k" / "min_p" (where they
              filter: vLLM's extensions), "seed" (sampled requests only), **extra}   (extra: the vendor's own fields, passed through: e.g. OpenRouter's
              {"provider": {"order": ["X"], "allow_fallbacks": false}}, vLLM's
              {"return_token_ids": true}, stop strings; checked against `chat_contract` when
              the vendor is read: a field the replay cannot rebuild is refused there)
    reply    choices[0].message.content, finish_reason, usage; choices[0].token_ids and
             prompt_token_ids where the endpoint returns them (vLLM with return_token_ids); the
             reasoning block (reasoning_content / reasoning) and vLLM's stop_reason

The API key is read from the environment variable the vendor names (`ChatEndpoint.api_key_env`),
never from the command line, and never written anywhere. Retries: the official `openai` client
retries refused connections, timeouts, 429 and 5xx with exponential backoff and honours the
server's Retry-After (`max_retries`). Every reply is validated (pydantic) before anything of it is
kept; a reply an audit cannot use (tool calls, no text, a finish reason other than stop/length,
n > 1) is an EndpointError saying so.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from verinfer.errors import VerinferError
from verinfer.providers.chat_contract import check_request, model_end_of, replay_refusal
from verinfer.openai_client import EndpointError, endpoint_errors, new_client
from verinfer.providers.openai_http import TokenId, _short
from verinfer.sampling.noise import NOISE_BACKENDS
from verinfer.sampling.params import SamplingParams

RESERVED = ("model", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stream")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "noise", "mode", "fixed_seed")  # a vendor's own audit sampling


@dataclass(frozen=True)
class ChatEndpoint:
    """One vendor: where to send, the model name it serves, the environment variable holding its
    key (None: no key), extra request fields, and how many requests may be in flight."""

    name: str
    base_url: str
    model: str
    api_key_env: str | None = None
    extra: dict = field(default_factory=dict)
    concurrency: int = 4
    timeout: float = 120.0
    max_retries: int = 5
    neutral_fields: tuple[str, ...] = ()  # the vendor's own `extra` fields the auditor declares neutral
    sampling: dict = field(default_factory=dict)  # SAMPLING_KEYS this vendor is audited at (else the audit's)

    def __post_init__(self):
        unknown = [k for k in self.sampling if k not in SAMPLING_KEYS]
        if unknown:
            raise VerinferError(f"vendor {self.name!r}: unknown sampling fields {unknown}",
                                fix=f"use {', '.join(SAMPLING_KEYS)}")
        clash = [k for k in self.extra if k in RESERVED]
        if clash:
            raise VerinferError(f"vendor {self.name!r}: extra fields {clash} would override the audit's own request "
                                "fields", fix=f"remove them from `extra` (the audit sets {', '.join(RESERVED)})")
        # the chat contract, as for a log's requests: refused before any request is sent
        where = f"vendor {self.name!r} (extra)"
        check_request(self.extra, where)  # a ContractError (a VerinferError) names the vendor and the field
        bad = replay_refusal(self.extra, where, tuple(self.neutral_fields))
        if bad is not None:
            raise bad
        if self.concurrency < 1:
            raise VerinferError(f"vendor {self.name!r}: concurrency must be >= 1, got {self.concurrency}")

    def api_key(self) -> str:
        if self.api_key_env is None:
            return "EMPTY"
        key = os.environ.get(self.api_key_env)
        if not key:
            raise VerinferError(f"vendor {self.name!r}: the environment variable {self.api_key_env} is not set",
                                fix=f"export {self.api_key_env}=... (verinfer reads keys from the environment only)")
        return key

    def client(self):
        return new_client(self.base_url, self.api_key(), timeout=self.timeout, max_retries=self.max_retries)

    def public(self) -> dict:
        """What may be written into outputs (the key's variable name, never its value)."""
        return {"name": self.name, "base_url": self.base_url, "model": self.model, "api_key_env": self.api_key_env,
                "extra": self.extra, **({"sampling": self.sampling} if self.sampling else {})}


class ChatMessageOut(BaseModel):
    model_config = ConfigDict(extra="allow")
    content: str | None = None
    tool_calls: list | None = None
    function_call: dict | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    message: ChatMessageOut
    finish_reason: str | None = None
    token_ids: list[TokenId] | None = None
    prompt_token_ids: list[TokenId] | None = None


class ChatCompletion(BaseModel):
    model_config = ConfigDict(extra="allow")
    choices: list[ChatChoice] = Field(min_length=1)
    model: str | None = None
    usage: dict | None = None
    prompt_token_ids: list[TokenId] | None = None


@dataclass(frozen=True)
class ChatReply:
    """A chat reply as an audit keeps it."""

    text: str
    finish_reason: str
    usage: dict | None
    served_model: str | None
    output_token_ids: list[int] | None
    prompt_token_ids: list[int] | None
    reasoning: str | None = None
    model_end: bool | None = None  # vLLM's stop_reason of a reply that stopped (`chat_contract.model_end_of`)


def chat_request(endpoint: ChatEndpoint, messages: list[dict], params: SamplingParams) -> dict:
    """The request body (without the key): sampling as asked; `seed` only when sampling is seeded,
    `top_k` / `min_p` only where they filter (vLLM's and SGLang's extensions of the chat API)."""
    body = {"model": endpoint.model, "messages": list(messages), "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p}
    if not params.greedy:
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.min_p > 0:
            body["min_p"] = params.min_p
        if params.seed is not None:
            body["seed"] = params.seed
    return {**body, **endpoint.extra}


def parse_chat_reply(body: bytes, where: str, request: str) -> ChatReply:
    """Validate a chat completion's body: one choice with text, stopped or cut at max_tokens."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        shown = body[:120].decode("utf-8", "replace").strip()
        raise EndpointError(f"{request}: the reply is not JSON ({e.msg}; body starts {shown!r})", where=where,
                            fix="check the base URL: an OpenAI-compatible API ending in /v1") from None
    try:
        reply = ChatCompletion.model_validate(data)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']} (got {_short(err['input'])})"
                        for err in e.errors()[:3])
        raise EndpointError(f"{request}: the reply is not a usable chat completion ({bad})", where=where,
                            fix="audit an OpenAI-compatible /v1/chat/completions endpoint") from None
    if len(reply.choices) > 1:
        raise EndpointError(f"{request}: the reply holds {len(reply.choices)} choices, the audit asked for one",
                            where=where, fix="remove `n` from the vendor's extra fields")
    choice = reply.choices[0]
    msg = choice.message
    if msg.tool_calls or msg.function_call:
        raise EndpointError(f"{request}: the reply is a tool call, not text", where=where,
                            fix="audit prompts without tools (tool schemas are templated by the provider unseen)")
    if msg.content is None:
        raise EndpointError(f"{request}: the reply has no text (message.content is null)", where=where,
                            fix="check that the model name is a chat model the endpoint serves")
    if choice.finish_reason not in ("stop", "length"):
        raise EndpointError(f"{request}: finish_reason {choice.finish_reason!r}: the reply was cut or filtered by "
                            "the provider, not by the model", where=where,
                            fix="use other prompts; a content filter's cut cannot be audited")
    prompt = choice.prompt_token_ids if choice.prompt_token_ids is not None else reply.prompt_token_ids
    return ChatReply(msg.content, choice.finish_reason, reply.usage, reply.model,
                     None if choice.token_ids is None else list(choice.token_ids),
                     None if prompt is None else list(prompt),
                     msg.reasoning_content if msg.reasoning_content is not None else msg.reasoning,
                     model_end_of(data["choices"][0]))


def request_chat(client, endpoint: ChatEndpoint, messages: list[dict], params: SamplingParams,
                 request: str = "request") -> ChatReply:
    """One chat completion, validated (`parse_chat_reply`); `request` names it in errors."""
    body = chat_request(endpoint, messages, params)
    known = {k: body.pop(k) for k in ("model", "messages", "max_tokens", "temperature", "top_p", "seed") if k in body}
    with endpoint_errors(request, endpoint.name, target=endpoint.base_url,
                         reach_fix="check the vendor's base URL; rerun the same command to resume",
                         status_fix="check the vendor's model name, key and extra fields"):
        raw = client.chat.completions.with_raw_response.create(**known, extra_body=body or None)
    return parse_chat_reply(raw.http_response.content, endpoint.name, request)


class VendorRecord(BaseModel):
    """One [[vendor]] table of a vendors file."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    base_url: str = Field(pattern=r"^https?://")
    model: str = Field(min_length=1)
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    extra: dict = Field(default_factory=dict)
    neutral_fields: list[str] = Field(default_factory=list)
    concurrency: int = Field(4, ge=1, le=256)
    timeout: float = Field(120.0, gt=0)
    max_retries: int = Field(5, ge=0, le=20)
    # the sampling this vendor is audited at (default: the audit's --temperature, --top-p, ...); noise: the
    # sampler it declares (the probe's first candidate; with mode "seeded" no probe is sent)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    noise: str | None = None
    mode: Literal["auto", "seeded", "greedy"] | None = None
    fixed_seed: int | None = Field(None, ge=0)  # the one seed it samples every request with, whatever the request's

    @field_validator("noise")
    @classmethod
    def _known_noise(cls, v):
        if v is not None and v not in NOISE_BACKENDS:
            raise ValueError(f"unknown noise backend {v!r} (use one of {', '.join(NOISE_BACKENDS)})")
        return v


class VendorsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    vendor: list[VendorRecord] = Field(min_length=1)


def read_vendors(path: str | Path) -> list[ChatEndpoint]:
    """The vendors of a TOML file, one [[vendor]] table each:

        [[vendor]]
        name = "acme"                                  # letters, digits, . _ - (a directory name)
        base_url = "https://api.acme.example/v1"
        model = "HuggingFaceTB/SmolLM2-135M-Instruct"   # the name the vendor serves
        api_key_env = "ACME_API_KEY"                   # the key's environment variable (never the key)
        concurrency = 4                                # requests in flight (default 4)
        extra = { provider = { order = ["acme"], allow_fallbacks = false } }   # passed through
        neutral_fields = []                            # extra fields of the vendor's own that change no token
        temperature = 0.7                              # optional: audited at this sampling (else the audit's:
        top_p = 0.95                                   #   --temperature, --top-p, --top-k, --min-p)
        noise = "vllm-cpu"                             # optional: the sampler it declares (the probe tries it first)
        mode = "auto"                                  # optional: auto (probe) | seeded (trust noise) | greedy
        fixed_seed = 42                                # optional: the one seed it samples every request with

    `extra` is checked against the chat contract (`chat_contract`): a field that changes the tokens
    in a way the replay cannot rebuild is refused here, before any request is sent.
    A VerinferError names the file, the vendor and the field."""
    p = Path(path)
    if not p.is_file():
        raise VerinferError("no such vendors file", where=str(p), fix="write one [[vendor]] table per endpoint "
                                                                     "(see `verinfer audit-vendors --help`)")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise VerinferError(f"not valid TOML ({e})", where=str(p), fix="check the file's syntax") from None
    try:
        vendors = VendorsFile.model_validate(data).vendor
    except ValidationError as e:
        err = e.errors()[0]
        loc = err["loc"]
        who = f"vendor {loc[1] + 1}" if len(loc) > 1 and loc[0] == "vendor" and isinstance(loc[1], int) else "file"
        fld = ".".join(str(x) for x in loc[2:]) or ".".join(str(x) for x in loc)
        raise VerinferError(f"{who}: `{fld}` {err['msg']} (got {str(err.get('input'))[:60]!r})", where=str(p),
                            fix="each [[vendor]] needs name, base_url and model; optional api_key_env, concurrency, "
                                "timeout, max_retries, extra, neutral_fields, temperature, top_p, top_k, min_p, noise, "
                                "mode, fixed_seed") from None
    names = [v.name for v in vendors]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise VerinferError(f"vendor names repeat: {dup}", where=str(p), fix="give each vendor its own name")
    try:
        eps = []
        for v in vendors:
            d = v.model_dump()
            sampling = {k: d.pop(k) for k in SAMPLING_KEYS}
            eps.append(ChatEndpoint(**{**d, "neutral_fields": tuple(v.neutral_fields)},
                                    sampling={k: x for k, x in sampling.items() if x is not None}))
        return eps
    except VerinferError as e:
        raise VerinferError(e.what, where=f"{p}: {e.where}", fix=e.fix) from None
