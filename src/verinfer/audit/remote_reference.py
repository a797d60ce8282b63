"""A trusted vLLM server as the replay reference: its prompt logprobs in place of a local forward.

Shape key: T = claimed output tokens of one claim, V = vocab, k = logprobs asked per position.

`verinfer score --reference-url URL --reference-model NAME` sends each claim's prompt + output
token ids to an OpenAI-compatible vLLM server as one completion request
    {"model": NAME, "prompt": [ids], "max_tokens": 1, "prompt_logprobs": k}
(vLLM's extra parameter; the server must be started with `--max-logprobs` >= k). vLLM answers, for
every prompt position j, the k largest log-softmax values of the raw logits of the next-token
distribution at j and the actual token's value, keyed by token id (choices[0].prompt_logprobs,
null at position 0). The row of output token t is position len(prompt) + t.

Each row becomes a logits row [V]: the returned logprobs at their ids, -inf elsewhere (the DiFR
authors' token-difr does the same), and the rows feed the local scoring functions unchanged
(`audit.replay.scores_table`: the Token-DiFR margin with the noise the claim's seed regenerates,
exact match, cross-entropy, likelihood, the signed-gap columns). log-softmax is the raw logits
minus one constant per row, which cancels in every gap and in the filters' softmax; what the row
cannot hold is the tokens outside the server's top-k. So a row is exact (to fp32 rounding of the
server's log-softmax) when the claim's filters keep only tokens it holds:
    greedy (T = 0), or top_k >= 1 with top_k < k, and the top_k-th largest returned logprob is
    strictly above the k-th (a tie at the k-th value could continue past what the server sent).
Top-p and min-p then act on the top-k survivors, all of them in the row (min-p's p / max p is
compared on the server's values: a token within 1e-4 of the cut is marked). Other rows are scored
the same way and marked: column `approximate` (bool) and `approximate_reason` (why; null where
exact). Greedy claims' cross_entropy is the server's -logprob of the claimed token (the full
softmax local replay uses). fp_l2 is null: a server returns no activations.

Unseeded claims (`"seed": null`, scored from the distribution alone: sampling/pit.py) need the
whole filtered distribution: their PIT sums the probabilities of every kept token above the claimed
one and their entropy every kept token's, so a row that may miss a kept token gives a wrong PIT, not
an approximate one. Such a claim is refused (`unseeded_refusal`) unless each of its rows is exact by
the rule above: before any request where its settings can never be (top_k off, or top_k >= k, with
a vocabulary larger than k), else when a fetched row is not (a tie at the k-th logprob, a token at
the min-p cut). The error names the claim; fix: score it locally, or ask for more logprobs than its
top_k.

A hosted reference that is not vLLM (protocol "echo"): OpenAI's completions API with
    {"model": NAME, "prompt": [ids], "max_tokens": 1, "echo": true, "logprobs": k}
echoes the prompt with, per position, the actual token's logprob (`token_logprobs`) and the top k
(`top_logprobs`), keyed by token *text* ("token_id:N" where the server is asked
return_tokens_as_token_ids, "bytes:\\x..." for partial characters). Texts map back to ids through
the model's tokenizer (each token's bytes, `retokenize.TokenBytes`; byte-level vocabularies spell
each token uniquely). Hosted APIs cap k (OpenAI: 5): rows are exact for greedy claims wherever the
top-1 is strictly above the k-th value, and marked approximate otherwise, as above.

Rows the reference refuses (`impossible_row`), both protocols, before any row is scored: a row
is the log-softmax of one distribution, so every value is finite (vLLM itself sends -9999.0 where
the log-softmax is -inf, `clamp_prompt_logprobs`, and JSON has no infinities: NaN, +inf and -inf are
all refused, the claimed token's too), each value is at most 0 and their probabilities sum to at
most 1, both within LOGSUMEXP_TOL (fp32 rounding of the server's log-softmax stays far below it), the
claimed token's logprob is in the row, and the row is not degenerate (all values exactly equal
over DEGENERATE_MIN or more tokens, or over 2 or more that hold the whole probability). A refused
row is a ReferenceServerError naming the claim (its claims file line), the output position and what
is wrong, and no scores are written: such a server is not a faithful model server.

Requests run `concurrency` at a time; the openai client retries refused connections, timeouts,
429 and 5xx with exponential backoff (`retries`). Parts are the same resumable `<out>.parts/` as
local replay (`audit.replay.score_claims`, which takes a RemoteReference in place of the Engine).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from verinfer.audit.replay import recut_claims, replay_batch_size, scores_table
from verinfer.claims import Claim
from verinfer.engine.engine import Replay
from verinfer.errors import VerinferError
from verinfer.models.llama import LlamaConfig
from verinfer.openai_client import endpoint_errors, new_client
from verinfer.retokenize import Retokenizer
from verinfer.sampling.params import SamplingParams
from verinfer.scores import CROSS_ENTROPY, DEFAULT_SIGMA, REMOTE_FIELDS

PROTOCOLS = ("prompt_logprobs", "echo")
# min-p compares p / max p with min_p in fp32 over the whole vocabulary; the row's log-softmax differs
# from the logits by a rounded constant, so a ratio this close to min_p may fall the other way
MIN_P_TOL = 1e-4
# a row's probabilities may sum past 1 by the rounding of the server's fp32 log-softmax (~1e-6)
LOGSUMEXP_TOL = 1e-3
# honest bf16 logits tie exactly: on the testbed 6.4% of rows tie their top 2 logprobs, 0.4% their
# top 5 and none of 1000 their top 8; a row of this many equal values is not a model's
DEGENERATE_MIN = 8
NOT_FAITHFUL = ("the reference server is not a faithful model server: score locally (`verinfer score` without "
                "--reference-url), or against a vLLM server of the trusted model")
START_SERVER = ("start it as `python -m vllm.entrypoints.openai.api_server --model MODEL --served-model-name NAME "
                "--max-logprobs K --dtype bfloat16`")


class ReferenceServerError(VerinferError):
    """The reference server could not be reached or answered something unusable."""


class TokenLogprob(BaseModel):
    """One entry of a prompt_logprobs row (vLLM's Logprob: rank and decoded_token may be absent)."""
    model_config = ConfigDict(extra="allow")
    logprob: float = Field(allow_inf_nan=True)  # checked by `impossible_row`
    rank: int | None = None


class PromptLogprobsChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None


class EchoLogprobs(BaseModel):
    model_config = ConfigDict(extra="allow")
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]


class EchoChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    logprobs: EchoLogprobs | None = None


class EchoReply(BaseModel):
    """A completions reply with echo and logprobs (OpenAI's legacy format)."""
    model_config = ConfigDict(extra="allow")
    choices: list[EchoChoice] = Field(min_length=1)


class PromptLogprobsReply(BaseModel):
    """A completion reply as the remote reference reads it."""
    model_config = ConfigDict(extra="allow")
    choices: list[PromptLogprobsChoice] = Field(min_length=1)


@dataclass(frozen=True)
class ReferenceSpec:
    """What identifies the reference in a resumable run's manifest and the scores' provenance, where
    an Engine has its Numerics (`audit.replay.replay_identity`)."""
    url: str
    model: str
    logprobs: int
    protocol: str = "prompt_logprobs"

    def to_dict(self) -> dict:
        d = {"reference_url": self.url, "reference_model": self.model, "prompt_logprobs": self.logprobs}
        return d if self.protocol == "prompt_logprobs" else {**d, "protocol": self.protocol}


def exactness(values_K: np.ndarray, params: SamplingParams, k: int) -> str | None:
    """None when the claim's filters keep only tokens of a row whose returned logprobs are
    values_K (any order; the top-k plus possibly the claimed token); else why the row is
    approximate (module docstring)."""
    if len(values_K) < k:  # the reply holds the whole vocabulary (V < k; `_rows` checks the count)
        return None
    if not params.greedy and params.top_k < 1:
        return f"top_k off: the sampling set may reach past the server's top {k} logprobs"
    cut = 1 if params.greedy else params.top_k
    if cut >= k:
        return f"top_k={cut} >= the {k} logprobs asked: ties at the cut may reach past them"
    v = np.sort(values_K)[::-1]
    if not v[cut - 1] > v[k - 1]:
        return f"a tie at the server's {k}-th logprob reaches the top-{cut} cut"
    if params.min_p > 0 and not params.greedy:
        ratio = np.exp((v[:cut] - v[0]) / params.temperature)  # p / max p, what min-p compares with min_p
        if np.any(np.abs(ratio - params.min_p) <= MIN_P_TOL * params.min_p):
            return "a token within rounding of the min-p cut"
    return None


def unseeded_refusal(params: SamplingParams, k: int, vocab_size: int) -> str | None:
    """Why the top-k logprob rows of an unseeded claim with these settings can never be exact (its PIT
    needs every token the filters keep; module docstring); None when they can (`exactness` then
    decides row by row) or the claim is not unseeded."""
    if not params.unseeded or vocab_size <= k:
        return None
    if params.top_k < 1:
        return f"top_k is off, so its kept set may reach past the server's top {k} logprobs"
    if params.top_k >= k:
        return f"its top_k={params.top_k} >= the {k} logprobs asked, so its kept set may reach past them"
    return None


def impossible_row(row: dict[int, float], claimed: int | None = None) -> str | None:
    """Why a row of returned logprobs (token id -> logprob: the top k plus the claimed token's)
    cannot be a model's log-softmax; None when it can (module docstring)."""
    def token(i: int) -> str:
        return f"token {i}" + (" (the claimed token)" if i == claimed else "")

    bad = next((i for i, v in row.items() if not np.isfinite(v)), None)
    if bad is not None:
        return f"holds logprob {row[bad]} for {token(bad)}, which is not finite"
    top = max(row, key=row.get)
    if row[top] > LOGSUMEXP_TOL:
        return f"holds logprob {row[top]:.6g} for {token(top)}, above 0"
    v = np.fromiter(row.values(), float)
    lse = float(np.logaddexp.reduce(v))
    if lse > LOGSUMEXP_TOL:
        return (f"is not normalized: its {len(v)} probabilities sum to {np.exp(lse):.6g} > 1 "
                f"(logsumexp {lse:.3g} > {LOGSUMEXP_TOL})")
    if len(v) >= 2 and np.all(v == v[0]) and (len(v) >= DEGENERATE_MIN or lse >= -LOGSUMEXP_TOL):
        return f"is degenerate: all {len(v)} logprobs equal {v[0]:.6g}"
    return None


@dataclass
class RemoteReference:
    """A vLLM server's prompt logprobs as the reference of `audit.replay.score_claims` (in place of
    an Engine: `reference_spec`, `device` and `config` describe it, `map_parts` scores).

    url: the OpenAI-compatible base URL (ending in /v1); model: the name it serves; logprobs: k;
    config: the model's config.json (vocab size; hidden size and layers for fingerprint checks);
    device: where the rows are scored."""

    url: str
    model: str
    config: LlamaConfig
    logprobs: int = 20
    protocol: str = "prompt_logprobs"  # vLLM's prompt_logprobs | "echo" (OpenAI completions echo + logprobs)
    token_bytes: object = field(default=None, repr=False)  # retokenize.TokenBytes, needed by "echo"
    concurrency: int = 4
    retries: int = 4
    timeout: float = 600.0
    device: str = "cpu"
    api_key: str = "EMPTY"
    extra_fields: tuple = REMOTE_FIELDS
    _client: object = field(default=None, repr=False)

    def __post_init__(self):
        if self.logprobs < 1:
            raise VerinferError(f"--reference-logprobs must be >= 1, got {self.logprobs}", fix="e.g. 64")
        if self.concurrency < 1:
            raise VerinferError(f"--reference-concurrency must be >= 1, got {self.concurrency}", fix="e.g. 4")
        if self.protocol not in PROTOCOLS:
            raise VerinferError(f"unknown reference protocol {self.protocol!r}", fix=f"one of {', '.join(PROTOCOLS)}")
        if self.protocol == "echo" and self.token_bytes is None:
            raise VerinferError("the echo protocol maps token texts to ids with the model's tokenizer",
                                fix="build the reference with RemoteReference.for_model_dir (a model dir with a tokenizer)")
        self.reference_spec = ReferenceSpec(self.url, self.model, self.logprobs, self.protocol)

    @classmethod
    def for_model_dir(cls, url: str, model: str, model_dir: str | Path, **kw) -> "RemoteReference":
        if kw.get("protocol") == "echo" and kw.get("token_bytes") is None:
            kw["token_bytes"] = Retokenizer.for_model(model_dir).token_bytes
        return cls(url, model, LlamaConfig.from_dir(model_dir), **kw)

    @property
    def client(self):
        if self._client is None:
            self._client = new_client(self.url, self.api_key, timeout=self.timeout, max_retries=self.retries)
        return self._client

    # --- the server ---------------------------------------------------------------------------
    def fetch(self, claim: Claim) -> list[dict[int, float]]:
        """The prompt logprobs rows of the claim's output tokens ([T] dicts token id -> logprob),
        validated; a ReferenceServerError naming the server and the claim otherwise."""
        ids = list(claim.prompt_token_ids) + list(claim.output_token_ids)
        where = f"{self.url} (claim {claim.id!r}{', ' + claim.source if claim.source else ''})"
        ask = ({"prompt_logprobs": self.logprobs} if self.protocol == "prompt_logprobs"
               else {"echo": True, "logprobs": self.logprobs})
        with endpoint_errors(None, where, target=f"the reference server after {self.retries} retries",
                             reach_fix=f"check --reference-url or start the server ({START_SERVER}); rerun the same "
                                       "command to resume: finished parts are kept",
                             answered="the server answered ", special=self._special_status,
                             status_fix="check the server's log; a context longer than its --max-model-len needs a "
                                        "larger one", error=ReferenceServerError):
            raw = self.client.completions.with_raw_response.create(
                model=self.model, prompt=ids, max_tokens=1, temperature=0.0, extra_body=ask)
        if self.protocol == "echo":
            return self._echo_rows(raw.http_response.content, claim, where)
        return self._rows(raw.http_response.content, claim, where)

    def _echo_rows(self, body: bytes, claim: Claim, where: str) -> list[dict[int, float]]:
        """Rows of an echo reply: the top-k texts mapped to ids, the claimed token's own logprob."""
        try:
            reply = EchoReply.model_validate(json.loads(body))
        except (json.JSONDecodeError, UnicodeDecodeError, ValidationError) as e:
            raise ReferenceServerError(f"not an echo reply with logprobs ({type(e).__name__}: {str(e)[:200]})",
                                       where=where, fix="use a completions endpoint that supports echo with logprobs, "
                                                        "or a vLLM server with --reference-protocol prompt_logprobs") from None
        lp = reply.choices[0].logprobs
        P, T = len(claim.prompt_token_ids), len(claim.output_token_ids)
        if lp is None or len(lp.token_logprobs) < P + T or len(lp.top_logprobs) < P + T:
            raise ReferenceServerError(f"the echo reply holds logprobs for {0 if lp is None else len(lp.token_logprobs)} "
                                       f"positions, the prompt has {P + T}", where=where,
                                       fix="the endpoint must echo the prompt (echo: true) with logprobs")
        out = []
        for t, y in enumerate(claim.output_token_ids):
            top, own = lp.top_logprobs[P + t], lp.token_logprobs[P + t]
            if top is None or own is None:
                raise ReferenceServerError(f"no logprobs at output token {t}", where=where,
                                           fix="the endpoint must return top_logprobs for every echoed position")
            row = {}
            for text, v in top.items():
                i = self._token_id(text)
                if i is None:
                    raise ReferenceServerError(f"token text {text!r} at output token {t} is no token of the model",
                                               where=where, fix="--reference-model must serve the model of --model")
                row.setdefault(i, v)
            row[y] = own
            out.append(self._checked(row, y, t, P, where))
        return out

    def _checked(self, row: dict[int, float], y: int, t: int, P: int, where: str) -> dict[int, float]:
        """The row of output token t (claimed token y), or a ReferenceServerError when it is no
        model's (`impossible_row`)."""
        why = impossible_row(row, y)
        if why is not None:
            raise ReferenceServerError(f"the {self.protocol} row of output token {t} (prompt position {P + t}) {why}; "
                                       "no model's log-softmax gives that", where=where, fix=NOT_FAITHFUL)
        return row

    def _token_id(self, text: str) -> int | None:
        if text.startswith("token_id:"):
            i = int(text.removeprefix("token_id:"))
            return i if 0 <= i < self.config.vocab_size else None
        raw = (bytes.fromhex(text.removeprefix("bytes:").replace("\\x", "")) if text.startswith("bytes:")
               else text.encode("utf-8"))
        i = self.token_bytes.id_of(raw)
        return i if i is not None else self.token_bytes.special_id(text)

    def _special_status(self, status: int, msg: str) -> tuple[str, str] | None:
        """(what, fix) of the HTTP errors a reference server gives when misused: the model it does
        not serve, more prompt logprobs than its --max-logprobs; None for the others."""
        if status == 404 or "does not exist" in msg:
            served = self.served_models()
            return (f"the server does not serve model {self.model!r} (HTTP {status}: {msg})",
                    f"pass --reference-model one of: {', '.join(served) or '(none listed)'}")
        if "max allowed" in msg or "max_logprobs" in msg:
            return (f"the server refuses {self.logprobs} prompt logprobs (HTTP {status}: {msg})",
                    f"restart it with --max-logprobs {self.logprobs} (or more), or pass --reference-logprobs within "
                    "its limit")
        return None

    def served_models(self) -> list[str]:
        try:
            return [m.id for m in self.client.models.list()]
        except Exception:
            return []

    def _rows(self, body: bytes, claim: Claim, where: str) -> list[dict[int, float]]:
        try:
            reply = PromptLogprobsReply.model_validate(json.loads(body))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ReferenceServerError(f"the reply is not JSON ({e}; body starts {body[:80]!r})", where=where,
                                 fix="--reference-url must be an OpenAI-compatible API ending in /v1") from None
        except ValidationError as e:
            bad = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()[:3])
            raise ReferenceServerError(f"malformed prompt_logprobs reply ({bad})", where=where,
                                 fix="use a vLLM server as the reference (vllm serve)") from None
        rows = reply.choices[0].prompt_logprobs
        P, T = len(claim.prompt_token_ids), len(claim.output_token_ids)
        if rows is None:
            raise ReferenceServerError("the reply has no prompt_logprobs: the server ignored vLLM's prompt_logprobs "
                                 "parameter", where=where, fix=f"use a vLLM server as the reference; {START_SERVER}")
        if len(rows) != P + T:
            raise ReferenceServerError(f"prompt_logprobs has {len(rows)} rows for {P + T} prompt tokens", where=where,
                                 fix="use a vLLM server as the reference (one row per prompt token)")
        out = []
        for t, (y, row) in enumerate(zip(claim.output_token_ids, rows[P:])):
            if row is None or y not in row:
                raise ReferenceServerError(f"prompt_logprobs row of output token {t} lacks the claimed token {y}",
                                     where=where, fix="use a vLLM server (it always includes the actual token)")
            if len(row) < min(self.logprobs, self.config.vocab_size):
                raise ReferenceServerError(f"prompt_logprobs row of output token {t} has {len(row)} entries, fewer than "
                                     f"the {self.logprobs} asked", where=where,
                                     fix=f"restart the server with --max-logprobs {self.logprobs}")
            bad = [i for i in row if not 0 <= i < self.config.vocab_size]
            if bad:
                raise ReferenceServerError(f"token id {bad[0]} outside the model's vocabulary of {self.config.vocab_size}",
                                     where=where, fix="--reference-model must serve the model of --model")
            out.append(self._checked({i: e.logprob for i, e in row.items()}, y, t, P, where))
        return out

    # --- scoring ------------------------------------------------------------------------------
    def refuse_unseeded(self, claims: list[Claim], rows: list[list[dict[int, float]]] | None = None) -> None:
        """A VerinferError naming the first unseeded claim whose rows are not, or (rows None: before
        they are fetched) can never be, the whole filtered distribution its PIT needs (module docstring)."""
        for i, c in enumerate(claims):
            if not c.sampling.unseeded:
                continue
            why = unseeded_refusal(c.sampling, self.logprobs, self.config.vocab_size)
            for t, row in enumerate(rows[i] if rows is not None and why is None else ()):
                reason = exactness(np.fromiter(row.values(), float), c.sampling, self.logprobs)
                if reason is not None:
                    why = f"its row of output token {t} may miss a kept token ({reason})"
                    break
            if why is not None:
                raise VerinferError(
                    f"the claim is unseeded (`\"seed\": null`): its PIT and entropy need every token its filters "
                    f"keep, and the {self.protocol} reference at {self.url} returns only the top {self.logprobs} "
                    f"logprobs per position: {why}",
                    where=f"claim {c.id!r}{', ' + c.source if c.source else ''}",
                    fix="score unseeded claims with a local reference (`verinfer score` without --reference-url), "
                        "or ask for more logprobs than the claims' top_k (--reference-logprobs; the server's "
                        "--max-logprobs), up to the vocabulary size for a claim without top-k")

    def replays(self, claims: list[Claim], rows: list[list[dict[int, float]]]) -> list[Replay]:
        """The rows as Replay logits: [T, V] fp32, the returned logprobs at their ids, -inf elsewhere."""
        out = []
        for c, r in zip(claims, rows):
            l_TV = torch.full((len(r), self.config.vocab_size), float("-inf"), dtype=torch.float32, device=self.device)
            for t, row in enumerate(r):
                l_TV[t, torch.tensor(list(row), device=self.device)] = torch.tensor(list(row.values()),
                                                                                    dtype=torch.float32,
                                                                                    device=self.device)
            out.append(Replay(l_TV))
        return out

    def score_chunk(self, claims: list[Claim], rows: list[list[dict[int, float]]], *, sigma: float = DEFAULT_SIGMA,
                    gaps: bool = False, logits_budget: int | None = None, **_) -> pa.Table:
        """`audit.replay.scores_table` over the rows, a group of claims of at most logits_budget
        [rows, V] elements at a time, plus the exactness columns. Unseeded claims whose rows are not
        exact are refused (`refuse_unseeded`)."""
        self.refuse_unseeded(claims, rows)
        budget = logits_budget or replay_batch_size(self.device)[2]
        tables, group, n = [], [], 0
        for i, c in enumerate(claims):
            group.append(i)
            n += len(c.output_token_ids)
            if i + 1 == len(claims) or (n + len(claims[i + 1].output_token_ids)) * self.config.vocab_size > budget:
                cs, rs = [claims[j] for j in group], [rows[j] for j in group]
                tables.append(scores_table(cs, self.replays(cs, rs), sigma, gaps=gaps))
                group, n = [], 0
        t = pa.concat_tables(tables)
        reasons, xent = [], t[CROSS_ENTROPY].to_numpy().copy()
        o = 0
        for c, r in zip(claims, rows):
            for row, y in zip(r, c.output_token_ids):
                reasons.append(exactness(np.fromiter(row.values(), float), c.sampling, self.logprobs))
                if c.sampling.greedy:
                    xent[o] = -row[y]
                o += 1
        t = t.set_column(t.column_names.index(CROSS_ENTROPY), CROSS_ENTROPY, pa.array(xent, pa.float64()))
        t = t.append_column(REMOTE_FIELDS[0], pa.array([r is not None for r in reasons], pa.bool_()))
        return t.append_column(REMOTE_FIELDS[1], pa.array(reasons, pa.string()))

    def map_parts(self, jobs: Iterable[tuple], retokenizer=None, **kwargs) -> Iterator[tuple[int, pa.Table]]:
        """Score (k, claims, fps, layer) jobs in order: every claim of a part fetched, `concurrency`
        requests at a time, then scored. fps / layer are ignored (fp_l2 stays null). retokenizer:
        claims derived from text are re-cut where the server's greedy token spells the same text
        (`audit.replay.recut_claims`; each re-cut claim is fetched again)."""
        with ThreadPoolExecutor(self.concurrency) as pool:
            for k, claims, _fps, _layer in jobs:
                self.refuse_unseeded(claims)  # settings no top-k row can serve: before any request
                rows = list(pool.map(self.fetch, claims))
                if retokenizer is None or not any(c.derived for c in claims):
                    yield k, self.score_chunk(claims, rows, **kwargs)
                    continue

                def rescore(cs: list[Claim]) -> list[pa.Table]:
                    return [self.score_chunk([c], [r], **kwargs) for c, r in zip(cs, pool.map(self.fetch, cs))]

                claims = list(claims)
                per_claim = [self.score_chunk([c], [r], **kwargs) for c, r in zip(claims, rows)]
                recut_claims(claims, per_claim, retokenizer, rescore)
                yield k, pa.concat_tables(per_claim)
