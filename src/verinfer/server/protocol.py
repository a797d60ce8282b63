"""OpenAI-compatible request bodies (pydantic) and the limits a server enforces.

Supported: the OpenAI completions / chat completions fields that change what is sampled
(model, prompt | messages, max_tokens, temperature, top_p, seed, logprobs, stream, n=1) plus
vLLM's extensions top_k, min_p, ignore_eos and return_token_ids (token ids are always returned).
Fields that would change sampling in ways verinfer does not implement (penalties, logit_bias,
stop sequences, n > 1, echo, best_of) are accepted only at their no-op values, so a request is
never silently answered with something else than it asked for; unknown fields are refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from verinfer.errors import VerinferError

MIN_BODY_BYTES = 1024  # room for a small request: a model name, a prompt, a few sampling fields


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20        # request body
    max_prompts: int = 16                # prompts in one completions request
    max_prompt_chars: int = 100_000      # characters of one text prompt / all chat messages
    max_tokens: int = 1024               # cap on max_tokens (also capped by the model's context)
    max_logprobs: int = 20
    max_concurrent: int = 2              # generations running at once
    max_waiting: int = 64                # generations queued behind them; more get HTTP 503

    def __post_init__(self):
        for f in fields(self):
            check_limit(f.name, getattr(self, f.name), f.default)


# The smallest value of each limit that still lets a request through, and where it is set: the
# `verinfer serve` option, or the Limits field for those the command does not expose.
LIMIT_FLOORS = {
    "max_body_bytes": (MIN_BODY_BYTES, "--max-body-bytes"),
    "max_prompts": (1, "Limits.max_prompts"),
    "max_prompt_chars": (1, "Limits.max_prompt_chars"),
    "max_tokens": (1, "--max-tokens"),
    "max_logprobs": (0, "Limits.max_logprobs"),
    "max_concurrent": (1, "--max-concurrent"),
    "max_waiting": (0, "--max-waiting"),
}


def check_limit(name: str, value, default: int) -> None:
    """A VerinferError naming the option when `value` is no integer or below the limit's floor
    (max_concurrent 0 would queue every request forever, a tiny max_body_bytes refuse them all)."""
    lowest, where = LIMIT_FLOORS[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise VerinferError(f"must be an integer, got {value!r}", where=where,
                            fix=f"use a whole number for {where} (default {default})")
    if value < lowest:
        raise VerinferError(f"must be at least {lowest}, got {value!r}", where=where,
                            fix=f"use {lowest} or more for {where} (default {default})")


class FieldError(ValueError):
    """A bad value in a request body; `param` is its field's dotted path (None: the body itself),
    which the error reply names."""

    def __init__(self, param: str | None, message: str):
        self.param = param
        super().__init__(f"`{param or 'a field name'}`: {message}")


SURROGATE = re.compile("[\ud800-\udfff]")  # a str holds one only from a lone JSON escape: no UTF-8 encodes it


def json_strings(value) -> Iterator[tuple[tuple[str, ...], str, bool]]:
    """Every string of a parsed JSON value, keys before their values: (path of the value or of the
    object holding the key, the string, is it a key). Iterative: any nesting depth."""
    stack = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            yield path, v, False
        elif isinstance(v, dict):
            yield from ((path, k, True) for k in v if isinstance(k, str))
            stack.extend(((*path, str(k)), x) for k, x in reversed(v.items()) if isinstance(x, (str, dict, list)))
        elif isinstance(v, list):
            stack.extend(((*path, str(i)), x) for i, x in reversed(list(enumerate(v)))
                         if isinstance(x, (str, dict, list)))


def check_unicode(value) -> None:
    """A FieldError naming the first string of a request body (a value or a key, at any depth) that
    holds a lone UTF-16 surrogate, the JSON escape "\\ud800" without its pair: it is not text, so
    no tokenizer, log or reply can encode it."""
    for path, text, is_key in json_strings(value):
        m = SURROGATE.search(text)
        if m:
            what = "a key holds" if is_key else "holds"
            raise FieldError(".".join(path) or None,
                             f"{what} a lone UTF-16 surrogate \\u{ord(m.group()):04x} at character {m.start()}, "
                             "which is not Unicode text; send valid UTF-8 (a \\ud800-\\udfff escape must be "
                             "half of a high-low pair)")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, data):
        check_unicode(data)  # before any field is read: every endpoint, every string, extras included
        return data

    model: str = Field(min_length=1, max_length=256)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=1_000_000)   # vLLM: -1 (or 0) = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: Optional[dict] = None
    n: int = 1
    ignore_eos: bool = False
    return_token_ids: Optional[bool] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict] = None
    user: Optional[str] = Field(None, max_length=256)

    @model_validator(mode="after")
    def _no_ops_only(self):
        bad = []
        if self.n != 1:
            bad.append(("n", "n must be 1 (one choice per request; send several requests with their own seeds)"))
        if self.stop not in (None, "", []):
            bad.append(("stop", "stop sequences are not supported; cut the text client-side"))
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                bad.append((name, f"{name} is not supported; leave it at {neutral}"))
        if self.logit_bias:
            bad.append(("logit_bias", "logit_bias is not supported"))
        if self.stream_options and set(self.stream_options) - {"include_usage", "continuous_usage_stats"}:
            bad.append(("stream_options", "stream_options accepts include_usage only"))
        if bad:
            raise ValueError("; ".join(f"`{k}`: {m}" for k, m in bad))
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Body):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _checks(self):
        if self.echo:
            raise ValueError("`echo`: echo is not supported (prompt_token_ids are returned instead)")
        if self.best_of not in (None, 1):
            raise ValueError("`best_of`: must be 1")
        if self.suffix:
            raise ValueError("`suffix`: not supported")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str = Field(max_length=1_000_000)
    name: Optional[str] = None


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0)

    @model_validator(mode="after")
    def _checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs`: needs logprobs=true")
        return self

    @property
    def n_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None
