"""Where an audit's claims come from: the sources of `core.collect.collect`, one class each.

    CompletionsSource   token-id prompts to a completions endpoint (audit-api): the endpoint's own
                        prompt and output ids, checked against the trusted model before they are a
                        claim (`openai_http.request_completion`)
    ChatSource          conversations to a vendor's /v1/chat/completions (audit-api --chat,
                        audit-vendors): a claim per reply, its ids derived from the text or the
                        endpoint's own (`reply_claim`)
    log_sources         a chat log's exchanges (audit-log), one `collect.InHand` per vendor the
                        replies name and sampling (greedy; seeded with a declared sampler; unseeded,
                        claimed without seed or noise): nothing is sent, the collector only saves them
    collect.InHand      claims already in hand (a claims file)

A new source is one more class with the `collect.Source` protocol: `manifest`, `concurrency`,
`len`, `claim_id(i)`, `send(i)`, `claim(i, reply)`, `interrupted(...)`, `check_collected(claims)`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

from verinfer.core.collect import InHand
from verinfer.claims import Claim
from verinfer.errors import VerinferError
from verinfer.providers.chat_contract import cut_by_stop, reasoning_reply, stop_strings
from verinfer.providers.chat_http import ChatEndpoint, ChatReply, request_chat
from verinfer.providers.chat_contract import ContractError
from verinfer.providers.chat_log import ChatLogError, iter_chat_log, unusable_for_replay
from verinfer.providers.openai_http import Endpoint, EndpointError, check_token_reply, request_completion
from verinfer.retokenize import DERIVED, PLAIN_CHAT_TEMPLATE, RETURNED, Retokenizer, whole_token_text
from verinfer.sampling.params import SamplingParams


class CompletionsSource:
    """Token-id prompts to a completions endpoint, one at a time; request i asks `params[i]` (its
    seed) and its reply is checked against the trusted model (`vocab_size`) before it becomes a
    claim under `local_name`; a reply with no output tokens is none."""

    concurrency = 1

    def __init__(self, client, endpoint: Endpoint, prompts: list[list[int]], params: list[SamplingParams],
                 local_name: str, vocab_size: int, manifest: dict):
        self.client, self.endpoint, self.prompts, self.params = client, endpoint, prompts, params
        self.local_name, self.vocab_size, self.manifest = local_name, vocab_size, manifest

    def __len__(self) -> int:
        return len(self.prompts)

    def claim_id(self, i: int) -> str:
        return f"api-{i:05d}"

    def send(self, i: int) -> tuple[list[int], list[int], str]:
        return request_completion(self.client, self.endpoint, self.prompts[i], self.params[i],
                                  f"request {i} (claim {self.claim_id(i)})", vocab_size=self.vocab_size)

    def claim(self, i: int, reply: tuple[list[int], list[int], str]) -> Claim | None:
        p_ids, o_ids, finish = reply
        if not o_ids:
            return None
        return Claim(self.claim_id(i), self.local_name, p_ids, o_ids, self.params[i],
                     provider=f"api:{self.endpoint.model}", extra={"finish_reason": finish})

    def interrupted(self, what: str, saved: int, path: Path) -> str:
        return f"{what} ({saved} of {len(self)} claims collected, saved in {path})"

    def check_collected(self, claims: list[Claim]) -> None:
        if not claims:
            raise EndpointError(f"the endpoint returned no output tokens for any of {len(self)} prompts",
                                where=self.endpoint.base_url, fix="check max_tokens and the model the endpoint serves")


def claim_tokens(tokens: str, have_ids: bool) -> str:
    """Where a chat claim's ids come from: `tokens` ("derived" | "returned"), or for "auto" the
    endpoint's ids where it sent them, else the text's."""
    return tokens if tokens != "auto" else (RETURNED if have_ids else DERIVED)


def scored_text(retok: Retokenizer, messages: list[dict], text: str, finish_reason: str, reasoning: str | None,
                where: str) -> str:
    """The text of a reply its claim's ids come from, by the chat contract (`chat_contract`): up to
    its last whole character (a reply cut by max_tokens inside one), and after its reasoning block
    as the model's template renders it (a template without a reasoning segment refuses it)."""
    text, _ = whole_token_text(text, finish_reason)
    if reasoning:
        template = retok.chat_template or (None if getattr(retok.tokenizer, "chat_template", None)
                                           else PLAIN_CHAT_TEMPLATE)
        text = reasoning_reply(retok.tokenizer, messages, reasoning, text, where, template)
    return text


def reply_claim(i: int, msgs: list[dict], reply: ChatReply, endpoint: ChatEndpoint, params: SamplingParams,
                tokens: str, retok: Retokenizer, model_name: str, *, vocab_size: int,
                mode: str | None = None) -> Claim | None:
    """The claim of reply i. Where its ids are the endpoint's (tokens "returned", or "auto" with ids
    sent), they are checked against the trusted model's vocab_size and max_tokens first
    (`openai_http.check_token_reply`): a bad reply is an EndpointError, never a claim. A request
    with stop strings (`extra["stop"]`): a reply that stopped is claimed as possibly cut by one
    (`chat_contract.cut_by_stop`, `Claim.from_chat` stop), and one cut before any text is no claim
    (None); its text is `scored_text`'s. mode: the audit mode the claim is judged in (recorded as
    its `mode`: greedy, seeded, unseeded; an unseeded claim states no seed and no noise, whatever
    the request carried: `SamplingParams.unseeded`)."""
    tokens = claim_tokens(tokens, reply.output_token_ids is not None)
    if tokens == RETURNED and reply.output_token_ids is None:
        raise EndpointError(f"request {i}: the endpoint returned no token ids (tokens='returned')",
                            where=endpoint.name, fix="audit with tokens derived from the text (the default)")
    if tokens == RETURNED:
        check_token_reply(reply.output_token_ids, reply.finish_reason, vocab_size=vocab_size,
                          max_tokens=params.max_tokens, request=f"request {i} of vendor {endpoint.name!r}",
                          where=endpoint.name, prompt_ids=reply.prompt_token_ids)
    stops = stop_strings(endpoint.extra)
    cut = cut_by_stop(reply.finish_reason, stops, reply.model_end)
    text = scored_text(retok, msgs, reply.text, reply.finish_reason, reply.reasoning,
                       f"request {i} of vendor {endpoint.name!r}")
    if tokens == DERIVED and (cut or reply.finish_reason == "length") and not text:
        return None
    if mode == "unseeded" and not params.unseeded:
        params = params.without_seed()
    return Claim.from_chat(f"{endpoint.name}-{i:05d}", model_name, msgs, text, reply.finish_reason, params,
                           retok, tokens=tokens, returned=(reply.prompt_token_ids, reply.output_token_ids),
                           usage=reply.usage, provider=endpoint.name,
                           extra={**({"served_model": reply.served_model} if reply.served_model else {}),
                                  **({"mode": mode} if mode else {})} or None,
                           stop=stops if cut else None)


class ChatSource:
    """A vendor's requests: each conversation to its `/v1/chat/completions`, `endpoint.concurrency`
    in flight, conversation i with `params[i]` (greedy, or sampled with its own seed; one
    SamplingParams: every request alike); a reply becomes a claim by `reply_claim`, tagged `mode`
    (a reply cut before any text is none)."""

    def __init__(self, endpoint: ChatEndpoint, conversations: list[list[dict]],
                 params: SamplingParams | list[SamplingParams], tokens: str, retok: Retokenizer, model_name: str,
                 vocab_size: int, manifest: dict, mode: str | None = None):
        if isinstance(params, SamplingParams):
            params = [params] * len(conversations)
        self.endpoint, self.conversations, self.params, self.tokens = endpoint, conversations, list(params), tokens
        self.mode = mode
        self.retok, self.model_name, self.vocab_size, self.manifest = retok, model_name, vocab_size, manifest
        self.concurrency = endpoint.concurrency
        self.client = endpoint.client()

    def __len__(self) -> int:
        return len(self.conversations)

    def claim_id(self, i: int) -> str:
        return f"{self.endpoint.name}-{i:05d}"

    def send(self, i: int) -> ChatReply:
        return request_chat(self.client, self.endpoint, self.conversations[i], self.params[i],
                            f"request {i} of vendor {self.endpoint.name!r}")

    def claim(self, i: int, reply: ChatReply) -> Claim | None:
        return reply_claim(i, self.conversations[i], reply, self.endpoint, self.params[i], self.tokens, self.retok,
                           self.model_name, vocab_size=self.vocab_size, mode=self.mode)

    def interrupted(self, what: str, saved: int, path: Path) -> str:
        return f"{what} ({saved} of {len(self)} replies saved in {path}; rerun to resume)"

    def check_collected(self, claims: list[Claim]) -> None:
        return None


def vendor_dir_name(name: str) -> str:
    """The directory of the vendor `name` (its exact name, as the replies give it): the name itself
    where it is a safe directory name of at most 64 characters, else its safe characters ('_' for the
    others, at most 48) and the first 8 hex digits of the exact name's sha256. Two different names
    never share a directory: `acme/llama`, `acme_llama` and `acme llama` are three vendors."""
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name).strip("._") or "model"
    if safe == name and len(name) <= 64:
        return name
    return f"{safe[:48]}-{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def _over_context(ex, n_out, max_positions: int | None) -> ChatLogError | None:
    """A reply whose own token count (its ids, else usage.completion_tokens) is beyond the model's context."""
    if max_positions is None or not isinstance(n_out, int) or n_out <= max_positions:
        return None
    return ChatLogError(f"the reply claims {n_out} output tokens, more than the model's context of {max_positions}",
                        kind="over-length", where=ex.source, fix="audit exchanges of this model (or pass --skip-unusable)")


def sampling_key(params: SamplingParams) -> str:
    """A file-name-safe name of a claim's sampling settings (its seed and length aside): 'greedy',
    'seeded-t0.7-p0.95-k-1-m0-vllm-cpu' or 'unseeded-t0.7-p0.95-k-1-m0' (`core.chat.ChatSampling.key`)."""
    if params.greedy:
        return "greedy"
    if params.unseeded:
        return f"unseeded-t{params.temperature:g}-p{params.top_p:g}-k{params.top_k}-m{params.min_p:g}"
    return (f"seeded-t{params.temperature:g}-p{params.top_p:g}-k{params.top_k}-m{params.min_p:g}-{params.noise}")


def exchange_params(ex, max_tokens: int, noise: str | None) -> SamplingParams | None:
    """The sampling an exchange is replayed with: greedy at temperature 0; seeded where the request
    carried a seed and the auditor declared the vendor's sampler (`noise`); None: unseeded (sampled
    without a seed, or without a declared sampler, or a seed no sampler takes)."""
    s = ex.sampling
    if s.get("temperature", 1.0) == 0:
        return SamplingParams(0.0, -1, 1.0, 0.0, None, max_tokens, "vllm-cpu")
    if s.get("seed") is None or noise is None:
        return None
    top_k = s.get("top_k")
    try:
        return SamplingParams(float(s["temperature"]), top_k if top_k is not None and top_k > 0 else -1,
                              float(s.get("top_p", 1.0)), float(s.get("min_p") or 0.0), int(s["seed"]), max_tokens,
                              noise)
    except ValueError:
        return None


def unseeded_params(ex, max_tokens: int) -> SamplingParams:
    """The sampling a sampled exchange no seeded replay can judge is claimed with: the request's
    temperature and filters, no seed and no noise (`SamplingParams.unseeded`); a ChatLogError
    (kind "shape") where they are out of range."""
    s = ex.sampling
    top_k = s.get("top_k")
    try:
        return SamplingParams(float(s.get("temperature", 1.0)), top_k if top_k is not None and top_k > 0 else -1,
                              float(s.get("top_p", 1.0)), float(s.get("min_p") or 0.0), None, max_tokens, None,
                              unseeded=True)
    except ValueError as e:
        raise ChatLogError(f"the request's sampling cannot be audited: {e}", kind="shape", where=ex.source,
                           fix="fix the logged request (or pass --skip-unusable)") from None


def one_draw_each(claims: list[Claim]) -> tuple[list[Claim], int]:
    """(claims, repeats): unseeded claims with each reply that repeats an earlier one byte for byte (the
    same conversation, the same claimed text, finish reason and ids: a response cache or a sampler with
    one fixed seed answered it again) left out: one draw, counted once (the first kept, in order).
    Counted once rather than withheld: the unseeded test assumes independent draws, and on synthetic
    replies (8 conversations x 3 requests, 24 tokens, vocab 50, Neyman's smooth test on 6 components at
    alpha 0.01, 1,000 runs) a cache counted as 3 draws was flagged 36% of the time, counted once 1.4%;
    an honest sampler 1.1% with its chance repeats kept, 0.7% left out. A fixed-seed sampler: 46%,
    counted once 3.5%, its replies to different conversations still sharing the noise (24 distinct
    conversations, no repeat: 13%), which a log cannot show: the row's note says so."""
    seen: set[str] = set()
    kept = []
    for c in claims:
        draw = json.dumps([c.chat["messages"], c.chat["text"], c.chat["finish_reason"], c.output_token_ids],
                          sort_keys=True, default=str)
        if draw not in seen:
            seen.add(draw)
            kept.append(c)
    return kept, len(claims) - len(kept)


def log_sources(log: Path, model_name: str, params: SamplingParams, tokens: str, retok: Retokenizer, *,
                skip_unusable: bool = False, skipped: list | None = None,
                max_positions: int | None = None, neutral: tuple[str, ...] = (), noise: str | None = None,
                noise_for: dict[str, str] | None = None) -> dict[str, InHand]:
    """The log's exchanges as claims of `model_name`, one `InHand` source per model the replies name
    (its `model`, else the request's; keyed by that exact name, `vendor_dir_name` gives its directory)
    and sampling: greedy exchanges under the vendor's name, seeded and unseeded ones under
    "<vendor> [<sampling_key>]" (manifest `mode`, `sampling`). ids derived from the text (or the ids
    the log holds, per `tokens`), each with the reply's length as max_tokens. A sampled exchange is
    seeded where its request carried a seed and the auditor declared the vendor's sampler
    (noise_for[vendor], else `noise`: a log cannot be probed), else unseeded: claimed without seed
    or noise (`unseeded_params`; a request's seed kept as the claim's `request_seed`), judged by the
    unseeded detectors, never scored as seeded (`exchange_params`); an unseeded group's repeated
    replies counted once (`one_draw_each`, the manifest's `repeated`). A reply longer than the model's context (`max_positions`) is no reply of it; request fields and
    reply features follow the chat contract as a live audit's do (`chat_contract`: stop strings
    replayed as cut, fields declared `neutral` by the auditor, `scored_text`): an unusable one is
    raised, or with skip_unusable counted in `skipped` as (source, kind, what)."""
    groups: dict[str, list[Claim]] = {}
    meta: dict[str, dict] = {}
    skipped = skipped if skipped is not None else []
    for ex in iter_chat_log(log, skip_unusable=skip_unusable, skipped=skipped):
        n_out = len(ex.output_token_ids) if ex.output_token_ids is not None else (ex.usage or {}).get("completion_tokens")
        err = unusable_for_replay(ex, neutral) or _over_context(ex, n_out, max_positions)
        if err is None:
            try:
                text = scored_text(retok, list(ex.messages), ex.text, ex.finish_reason, ex.reasoning, ex.source)
            except ContractError as e:
                err = e
        if err is not None:
            if not skip_unusable:
                raise err
            skipped.append((ex.source, err.kind, err.what))
            continue
        stops = stop_strings(ex.sampling.get("extra", {}))
        cut = cut_by_stop(ex.finish_reason, stops, ex.model_end)
        vendor = ex.served_model or ex.model
        how = claim_tokens(tokens, ex.output_token_ids is not None)
        if how == RETURNED and ex.output_token_ids is None:
            raise VerinferError("the log holds no token ids for this exchange (--tokens returned)", where=ex.source,
                                fix="derive them from the text (--tokens derived, the default)")
        length = max(1, int(ex.sampling.get("max_tokens") or n_out or params.max_tokens))
        own = exchange_params(ex, length, (noise_for or {}).get(vendor, noise))
        if own is None:
            try:
                own = unseeded_params(ex, length)
            except ChatLogError as e:
                if not skip_unusable:
                    raise
                skipped.append((ex.source, e.kind, e.what))
                continue
        if how == DERIVED and (cut or ex.finish_reason == "length") and not text:
            skipped.append((ex.source, "no-text", "nothing left to score: cut by a stop string or inside its first "
                                                  "character before any whole text"))
            continue
        mode = own.audit_mode
        seed = ex.sampling.get("seed") if own.unseeded else None
        claim = Claim.from_chat(
            ex.id, model_name, list(ex.messages), text, ex.finish_reason, own, retok, tokens=how,
            returned=(None if ex.prompt_token_ids is None else list(ex.prompt_token_ids),
                      None if ex.output_token_ids is None else list(ex.output_token_ids)),
            usage=ex.usage, provider=vendor,
            extra={"source": ex.source, "mode": mode, **({"request_seed": seed} if seed is not None else {})},
            stop=stops if cut else None)
        key = sampling_key(own)
        group = vendor if own.greedy else f"{vendor} [{key}]"
        groups.setdefault(group, []).append(claim)
        meta[group] = {"vendor": vendor} if own.greedy else {"vendor": vendor, "mode": mode, "sampling": key}
    for group, claims in groups.items():
        if claims[0].sampling.unseeded:
            groups[group], repeated = one_draw_each(claims)
            meta[group].update({"repeated": repeated} if repeated else {})
    if not groups:
        kinds = Counter(kind for _, kind, _ in skipped)
        raise VerinferError("the log holds no exchange that can be audited (skipped "
                            + ", ".join(f"{n} {k}" for k, n in kinds.most_common()) + ")", where=str(log),
                            fix="chat exchanges with text replies are audited; chat_log.UNUSABLE_KINDS says "
                                "why each skipped kind is not")
    return {group: InHand(claims, {"log": Path(log).name, **meta[group]}) for group, claims in groups.items()}


__all__ = ["ChatSource", "CompletionsSource", "claim_tokens", "exchange_params", "log_sources", "one_draw_each",
           "reply_claim", "sampling_key", "scored_text", "unseeded_params", "vendor_dir_name"]
