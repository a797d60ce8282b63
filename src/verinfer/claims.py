"""Claims: what a provider returns and an auditor checks. JSONL, one request per line:

    {"id": str, "model": str, "prompt_token_ids": [int], "output_token_ids": [int],
     "sampling": {"temperature": float, "top_k": int, "top_p": float, "min_p": float,
                  "seed": int | null, "noise": str | null},
     "provider": str (optional; who served it),
     "activations": {...} (optional; Activation-DiFR fingerprints, verinfer.fingerprint),
     "spec": {"method", "threshold", "gamma", "draft", "events"} (optional; speculative claims),
     "chat": {"messages": [{"role", "content"}], "text": str, "finish_reason": "stop" | "length",
              "tokens": "returned" | "derived", "usage": {...} | null} (optional; a chat reply)}

`sampling.temperature` is required; at temperature > 0 every other `sampling` field is too (a
missing one is an error naming it, never a default); at temperature 0 (greedy) the filters, seed
and noise change nothing and may be absent. `"seed": null` written out at temperature > 0 marks a
sampled claim without a usable seed: it is audited in mode "unseeded" (`SamplingParams.unseeded`;
the reference's distribution alone, sampling/pit.py), where an absent seed stays an error; such a
claim draws no noise, so its `noise` may be null (or absent) and is not checked. A
line is at most MAX_LINE_BYTES (16 MiB): a longer one is refused with its line number before it
is read whole or parsed.

Token ids are what is scored. A chat reply (`chat`) keeps the messages and the text it was made
from and says how its ids were obtained: returned by the endpoint, or derived from the text with
the model's chat template and tokenizer (`verinfer.retokenize`; the replay then re-cuts a derived
claim where the reference segments the same text differently). The wire format is the pydantic models below (`ClaimRecord`
and its parts); `iter_claims` / `read_claims` validate every line against them and raise a
ClaimError naming file:line and the field, with what to do; `write_claims` writes atomically.
In memory a claim is the plain `Claim` dataclass (sampling as the engine's SamplingParams).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from verinfer.errors import ClaimError, UnknownNameError
from verinfer.io import atomic_write_text
from verinfer.retokenize import DERIVED, RETURNED, TOKEN_SOURCES, Retokenizer
from verinfer.sampling.noise import NOISE_BACKENDS
from verinfer.sampling.params import SamplingParamError, SamplingParams, check_sampling

TokenIds = list[StrictInt]
MAX_LINE_BYTES = 16 << 20  # the longest claims line read (a 32k-token claim with fingerprints is < 1 MiB)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff: a JSON escape of a UTF-16 surrogate


GREEDY_DEFAULTS = {"top_k": -1, "top_p": 1.0, "min_p": 0.0, "noise": "vllm-cpu"}


class SamplingRecord(BaseModel):
    """The sampling settings the provider claims; finite numbers only (NaN / inf are refused).
    The ranges are sampling.params.check_sampling's, the one validation SamplingParams runs too.
    `temperature` is always required; at temperature > 0 so are top_k, top_p, min_p, noise and seed
    (a missing one names itself); at temperature 0 (greedy) they change nothing and may be absent."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    temperature: float
    top_k: StrictInt | None = None  # None: absent, allowed only at temperature 0 (`_in_range`)
    top_p: float | None = None
    min_p: float | None = None
    seed: StrictInt | None = None
    noise: str | None = None

    @property
    def unseeded(self) -> bool:
        """Sampled (temperature > 0) with `"seed": null` stated: audited without a seed."""
        return self.temperature > 0 and self.seed is None and "seed" in self.model_fields_set

    @model_validator(mode="after")
    def _in_range(self) -> "SamplingRecord":
        missing = [k for k, v in GREEDY_DEFAULTS.items() if getattr(self, k) is None
                   and not (k == "noise" and self.unseeded)]  # an unseeded claim draws no noise: null or absent
        if missing and self.temperature > 0:
            raise ValueError(f"`sampling.{missing[0]}` is missing: at temperature > 0 it changes what is sampled, so "
                             "the claim must state it (no default is assumed)")
        for k in missing:  # greedy: the filters keep the argmax and no noise is drawn
            setattr(self, k, GREEDY_DEFAULTS[k])
        try:
            check_sampling(temperature=self.temperature, top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                           noise=self.noise, unseeded=self.unseeded)
        except SamplingParamError as e:  # name the field the way the reader names every field
            raise ValueError(f"`sampling.{e.field}` {e.detail}") from None
        except UnknownNameError as e:
            raise ValueError(f"`sampling.noise` {self.noise!r} is not a known noise backend "
                             f"(use one of {', '.join(NOISE_BACKENDS)})") from None
        return self


class SpecRecord(BaseModel):
    """Speculative decoding claims (DiFR appendix F): per output token a = accepted draft token,
    r = correction after a rejection, b = bonus token; t = the target's own first token, which a
    feature-level draft head's claims start with (draft_kind "head"; spec_claims.check_events)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    method: str
    gamma: StrictInt = Field(ge=1)
    events: str = Field(pattern=r"^t?[arb]*$")
    threshold: float | None = None
    draft: str | None = None


class ActivationsRecord(BaseModel):
    """Activation-DiFR fingerprints; the payload is checked against the model in verinfer.fingerprint."""

    model_config = ConfigDict(extra="allow")
    format: str
    k: StrictInt = Field(ge=1)
    stride: StrictInt = Field(ge=1)
    layer: StrictInt
    seed: StrictInt
    dtype: Literal["fp16", "int8"]
    positions: TokenIds
    data: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class ChatRecord(BaseModel):
    """A chat reply's origin: the messages sent, the text returned, and how the ids were obtained."""

    model_config = ConfigDict(extra="allow")
    messages: list[ChatMessage] = Field(min_length=1)
    text: str
    finish_reason: Literal["stop", "length"]
    tokens: Literal["returned", "derived"]
    usage: dict | None = None


class ClaimRecord(BaseModel):
    """One line of a claims file."""

    model_config = ConfigDict(extra="allow")
    id: str | StrictInt
    model: str
    prompt_token_ids: TokenIds = Field(min_length=1)
    output_token_ids: TokenIds = Field(min_length=1)
    sampling: SamplingRecord
    provider: str | None = None
    activations: ActivationsRecord | None = None
    spec: SpecRecord | None = None
    chat: ChatRecord | None = None


FIX = {
    "prompt_token_ids": "send token ids; for text replies of a chat endpoint use `verinfer claims from-log` or "
                        "`verinfer audit-api --chat`",
    "output_token_ids": "send token ids (an empty output has nothing to audit); for text replies of a chat endpoint "
                        "use `verinfer claims from-log` or `verinfer audit-api --chat`",
    "chat": "see the claims schema in docs/architecture.md, section Claims",
    "sampling": "see the claims schema in docs/architecture.md, section Claims",
}


def _claim_error(e: ValidationError, where: str) -> ClaimError:
    """The first validation error as file:line, the field's dotted path, and what to do."""
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"] if not isinstance(x, int)]
    fld = ".".join(loc)
    if err["type"] == "missing":
        return ClaimError(f"missing field `{fld}`", where=where, fix="see the claims schema in docs/architecture.md, section Claims")
    msg = err["msg"].removeprefix("Value error, ")
    if loc and loc[-1].endswith("token_ids"):
        msg = "must be a list of integer token ids" if err["type"] != "too_short" else "is empty: nothing to audit"
    if msg.startswith("`"):  # a model-level check that names its own field
        return ClaimError(msg, where=where, fix=FIX.get(loc[0] if loc else "", "see the claims schema in docs/architecture.md, section Claims"))
    return ClaimError(f"`{fld}` {msg} (got {err.get('input')!r:.80})", where=where,
                      fix=FIX.get(loc[0] if loc else "", "see the claims schema in docs/architecture.md, section Claims"))


@dataclass
class Claim:
    id: str
    model: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    provider: str | None = None
    extra: dict = field(default_factory=dict)  # activations, spec, anything else carried along
    source: str | None = field(default=None, compare=False, repr=False)  # "file:line" it was read from

    @property
    def chat(self) -> dict | None:
        """The chat record (`ChatRecord` fields) of a chat reply, None for a token-id claim."""
        return self.extra.get("chat")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings that may have cut this chat reply (empty unless it stopped on a request
        that had some)."""
        return tuple((self.chat or {}).get("stop") or ())

    @property
    def derived(self) -> bool:
        """True if the output ids were derived from the reply's text (the replay may re-cut them)."""
        return (self.chat or {}).get("tokens") == DERIVED

    @classmethod
    def from_chat(cls, id: str, model: str, messages: list[dict], text: str, finish_reason: str,
                  sampling: SamplingParams, retokenizer: Retokenizer, *, tokens: str = DERIVED,
                  returned: tuple[list[int] | None, list[int] | None] = (None, None), usage: dict | None = None,
                  provider: str | None = None, extra: dict | None = None,
                  stop: list[str] | None = None) -> "Claim":
        """The claim of one chat reply. tokens="derived": prompt and output ids from the messages and
        the text (`Retokenizer`); "returned": the endpoint's (prompt ids, output ids) in `returned`
        (the prompt derived where the endpoint sent none). The endpoint's ids are kept beside
        derived ones (`chat.returned_output_token_ids`), which measures re-tokenization drift.
        stop: the request's stop strings; a reply that stopped may have been cut by one, so its
        derived ids get no end token (`chat.stop` records them; the replay re-cuts the last token
        where the reference's spells the text and a stop string after it). A ValueError if
        nothing is left to score (a cut reply without text)."""
        if tokens not in TOKEN_SOURCES:
            raise ValueError(f"tokens must be one of {TOKEN_SOURCES}, got {tokens!r}")
        r_prompt, r_output = returned
        if tokens == RETURNED and r_output is None:
            raise ValueError("tokens='returned' needs the endpoint's output token ids")
        prompt = list(r_prompt) if tokens == RETURNED and r_prompt is not None else retokenizer.prompt_ids(messages)
        cut = bool(stop) and finish_reason == "stop"
        output = list(r_output) if tokens == RETURNED else retokenizer.output_ids(text, finish_reason, stop_cut=cut)
        if not output:
            raise ValueError("a reply cut by a stop string before any text leaves no token to score")
        chat = {"messages": [dict(m) for m in messages], "text": text, "finish_reason": finish_reason,
                "tokens": tokens, "usage": usage}
        if cut:
            chat["stop"] = list(stop)
        if tokens == DERIVED and r_output is not None:
            chat["returned_output_token_ids"] = list(r_output)
        params = replace(sampling, max_tokens=max(1, len(output)))
        return cls(str(id), model, prompt, output, params, provider, {**(extra or {}), "chat": chat})

    def to_json(self) -> dict:
        s = self.sampling
        d = {"id": self.id, "model": self.model, "prompt_token_ids": self.prompt_token_ids,
             "output_token_ids": self.output_token_ids,
             "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                          "seed": s.seed, "noise": s.noise}}
        if self.provider is not None:
            d["provider"] = self.provider
        d.update(self.extra)
        return d


def parse_claim(obj: object, where: str) -> Claim:
    """Validate one decoded JSON line against ClaimRecord and build the in-memory Claim."""
    if not isinstance(obj, dict):
        raise ClaimError("a claim line must be a JSON object", where=where)
    try:
        rec = ClaimRecord.model_validate(obj)
    except ValidationError as e:
        raise _claim_error(e, where) from None
    s = rec.sampling
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=s.seed,
                            max_tokens=len(rec.output_token_ids), noise=s.noise, unseeded=s.unseeded)
    known = {"id", "model", "prompt_token_ids", "output_token_ids", "sampling", "provider"}
    return Claim(str(rec.id), rec.model, list(rec.prompt_token_ids), list(rec.output_token_ids), params, rec.provider,
                 {k: v for k, v in obj.items() if k not in known}, source=where)


def iter_claims(path: str | Path) -> Iterator[Claim]:
    """Stream a claims JSONL file, one validated Claim per non-blank line (memory stays bounded);
    ids must be unique."""
    p = Path(path)
    if not p.is_file():
        raise ClaimError("no such claims file", where=str(p))
    seen: dict[str, int] = {}
    with open(p, "rb") as f:  # decoded line by line: a text reader decodes ahead and names the wrong line
        lineno = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            lineno += 1
            if len(raw) > MAX_LINE_BYTES:
                raise ClaimError(f"the line is longer than {MAX_LINE_BYTES >> 20} MiB (a claim is far smaller)",
                                 where=f"{p}:{lineno}", fix="split the file into one claim per line; a line this "
                                                            "long is not a claim verinfer can audit") from None
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ClaimError(f"not UTF-8 text ({e.reason} at byte {e.start} of the line)",
                                 where=f"{p}:{lineno}", fix="claims files are UTF-8 JSONL") from None
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            c = parse_claim(decode_line(line, raw, where), where)
            if c.id in seen:
                raise ClaimError(f"duplicate claim id {c.id!r} (first at line {seen[c.id]})", where=where)
            seen[c.id] = lineno
            yield c
    if not seen:
        raise ClaimError("the claims file holds no claims", where=str(p))


def decode_line(line: str, raw: bytes, where: str) -> object:
    """One JSON line, or a ClaimError naming it: invalid JSON, a number too long to read (Python
    refuses integers over 4300 digits), nesting too deep to read, or a lone UTF-16 surrogate (a
    string that is not text)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        hint = "the file looks truncated (last line cut off)" if not line.endswith("\n") else "fix or drop the line"
        raise ClaimError(f"not valid JSON ({e.msg} at column {e.colno})", where=where, fix=hint) from None
    except ValueError as e:  # int(text) past sys.get_int_max_str_digits()
        raise ClaimError(f"a number in the line cannot be read ({e})", where=where,
                         fix="token ids and seeds are integers below 2**63") from None
    except RecursionError:
        raise ClaimError("the line is nested too deeply to read", where=where,
                         fix="a claim is a flat JSON object (see docs/architecture.md, section Claims)") from None
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ClaimError("a string holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair): "
                             "it is not text", where=where, fix="write the text as UTF-8 (or as a surrogate pair)") from None
    return obj


def read_claims(path: str | Path) -> list[Claim]:
    """Read and validate a whole claims JSONL file (see `iter_claims`)."""
    return list(iter_claims(path))


def check_claims_fit(claims: Iterable[Claim], path: str | Path, *, model_name: str, vocab_size: int,
                     max_positions: int, aliases: Iterable[str] = ()) -> None:
    """Refuse claims made for another model, with out-of-vocabulary ids, or over the context.
    A claim's `model` must be `model_name` or one of `aliases` (the names the checkpoint records,
    ModelInfo.aliases, and those the user vouches for with --model-name)."""
    accepted = tuple(dict.fromkeys([model_name, *aliases]))
    for i, c in enumerate(claims):
        where = f"{c.source or path}: claim {c.id!r}"
        if c.model not in accepted:
            names = ", ".join(repr(a) for a in accepted)
            raise ClaimError(f"claim is for model {c.model!r} but the verifier loaded {model_name!r}, which answers "
                             f"to {names}", where=where,
                             fix=f"audit with the model the provider claims to serve (--model DIR or NAME); if "
                                 f"{c.model!r} is a name this checkpoint is served under, say so with "
                                 f"--model-name {c.model!r}")
        for fld, ids in (("prompt_token_ids", c.prompt_token_ids), ("output_token_ids", c.output_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ClaimError(f"`{fld}` has token id {bad[0]} outside the vocabulary [0, {vocab_size})",
                                 where=where, fix="the claim was tokenized for another tokenizer or model")
        n = len(c.prompt_token_ids) + len(c.output_token_ids)
        if n > max_positions:
            raise ClaimError(f"prompt + output is {n} tokens, over the model's context of {max_positions}",
                             where=where, fix="shorten the prompt or the generation")


def claims_text(claims: Iterable[Claim]) -> str:
    """A claims file's text: one compact JSON object a line."""
    return "".join(json.dumps(c.to_json(), separators=(",", ":")) + "\n" for c in claims)


def write_claims(path: str | Path, claims: Iterable[Claim]) -> None:
    atomic_write_text(path, claims_text(claims))
