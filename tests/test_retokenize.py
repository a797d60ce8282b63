"""Tokens from text (verinfer.retokenize): the chat prompt and reply ids, each token's bytes, and
the re-cut that follows the reference's segmentation of the same text; Claim.from_chat."""

import pytest

from verinfer.claims import Claim, parse_claim
from verinfer.errors import ClaimError
from verinfer.models.testbed import TARGET_DIR
from verinfer.retokenize import Retokenizer, TemplateError, whole_token_text
from verinfer.sampling.params import SamplingParams

# the testbed is a code model: a "chat" is code, each message a comment line naming its role
TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}    {% endif %}")
GREEDY = SamplingParams(0.0, -1, 1.0, 0.0, None, 16, "vllm-cpu")


@pytest.fixture(scope="module")
def retok():
    return Retokenizer.for_model(TARGET_DIR, chat_template=TEMPLATE)


def split_segmentation(r: Retokenizer, ids: list[int]) -> tuple[list[int], int]:
    """Another segmentation of the same text and the first position where it differs: the first
    multi-byte text token cut in two, or else the first two adjacent tokens that are one token."""
    tb = r.token_bytes
    for t, tok in enumerate(ids):
        b = tb.of_id(tok)
        if b and len(b) >= 2:
            head, tail = r.encode(b[:1].decode()), r.encode(b[1:].decode())
            if len(head) == 1 and len(tail) == 1:
                return [*ids[:t], head[0], tail[0], *ids[t + 1:]], t
    for t in range(len(ids) - 1):
        a, b = tb.of_id(ids[t]), tb.of_id(ids[t + 1])
        if a and b:
            one = r.encode((a + b).decode("utf-8", "replace"))
            if len(one) == 1 and tb.of_id(one[0]) == a + b:
                return [*ids[:t], one[0], *ids[t + 2:]], t
    raise AssertionError("no token to cut or merge")


def test_token_bytes_spell_the_text(retok):
    text = "def f(x):\n    return x * 2  # é, 漢字"
    ids = retok.encode(text)
    assert b"".join(retok.token_bytes.of_id(i) for i in ids).decode() == text
    assert retok.token_bytes.of_id(retok.end_token_id) is None  # special: no bytes, never re-cut


def test_prompt_is_the_rendered_template_encoded(retok):
    msgs = [{"role": "user", "content": "x = 1"}]
    assert retok.prompt_ids(msgs) == retok.encode("# user\nx = 1\n    ")
    assert retok.output_ids("y = 2", "stop") == [*retok.encode("y = 2"), retok.end_token_id]
    assert retok.output_ids("y = 2", "length") == retok.encode("y = 2")
    with pytest.raises(ValueError, match="finish_reason"):
        retok.output_ids("y", "tool_calls")
    with pytest.raises(TemplateError, match="cannot render"):
        Retokenizer(retok.tokenizer, 1, "{{ messages[0]['nope'] + 1 }}").prompt_ids(msgs)


def test_resegment_at_follows_the_replay_where_it_spells_the_same_text(retok):
    text = "return value_of(items)"
    canonical = retok.output_ids(text, "stop")
    other, t = split_segmentation(retok, canonical)
    # the claim holds the canonical cut, the reference (replay) took the other one at t
    replay = [*other[:t + 1], *[0] * (len(canonical) - t - 1)]
    hit = retok.resegment_at(canonical, replay, 0)
    assert hit is not None and hit[0] == t
    assert hit[1][: t + 1] == other[: t + 1] and hit[1][-1] == retok.end_token_id
    assert b"".join(retok.token_bytes.of_id(i) for i in hit[1][:-1]).decode() == text
    # a replay token that spells other text is a divergence, not a re-cut
    wrong = list(canonical)
    wrong[t] = retok.encode("Z")[0]
    assert retok.resegment_at(canonical, wrong, 0) is None
    assert retok.resegment_at(canonical, replay, t + 1) is None  # nothing past start


def test_claim_from_chat_round_trips_through_the_claims_reader(retok):
    msgs = [{"role": "user", "content": "2 + 2 ="}]
    c = Claim.from_chat("a", "m", msgs, " 4", "stop", GREEDY, retok, returned=(None, [5, 6]),
                        usage={"completion_tokens": 2})
    assert c.derived and c.output_token_ids == retok.output_ids(" 4", "stop")
    assert c.chat["returned_output_token_ids"] == [5, 6] and c.sampling.max_tokens == len(c.output_token_ids)
    back = parse_claim(c.to_json(), "x:1")
    assert back.derived and back.chat["text"] == " 4" and back.prompt_token_ids == retok.prompt_ids(msgs)
    r = Claim.from_chat("b", "m", msgs, " 4", "stop", GREEDY, retok, tokens="returned", returned=([1, 2], [7, 8]))
    assert not r.derived and (r.prompt_token_ids, r.output_token_ids) == ([1, 2], [7, 8])
    bad = {**c.to_json(), "chat": {**c.to_json()["chat"], "finish_reason": "tool_calls"}}
    with pytest.raises(ClaimError, match="chat.finish_reason"):
        parse_claim(bad, "x:2")


# --- segmentations that differ inside a multi-byte character ---------------------------------------

def byte_level_tokenizer(pieces: list[bytes]):
    """A hand-made GPT-2 ByteLevel BPE: a token per byte, then merges that build each piece from its
    bytes left to right (earlier pieces first), and <end>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    u = bytes_to_unicode()
    vocab = {u[b]: b for b in range(256)}
    merges = []
    for piece in pieces:
        s = "".join(u[b] for b in piece)
        for k in range(2, len(s) + 1):
            if s[:k] not in vocab:
                merges.append((s[:k - 1], s[k - 1]))
                vocab[s[:k]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<end>"})
    return Retokenizer(fast, fast.convert_tokens_to_ids("<end>"))


def follow(r: Retokenizer, claim: list[int], model: list[int], **kw) -> list[int]:
    """Re-cut `claim` where a replay writing `model` (the model's ids, agreed with wherever the
    claim left them) takes another token, until no position re-cuts."""
    ids, start = list(claim), 0
    while (hit := r.resegment_at(ids, [m if ids[:t] == model[:t] else y for t, (y, m) in
                                      enumerate(zip(ids, model + [None] * len(ids)))], start, **kw)) is not None:
        start, ids = hit[0] + 1, hit[1]
    return ids


def test_a_cut_inside_a_character_is_followed_like_any_other():
    """The tokenizer writes 日 (3 bytes) as one token; the model wrote its first two bytes, then the
    third joined to the first byte of 本, then the rest of 本: the re-cut follows it token by token,
    each tail begun mid-character spelled from byte tokens (it used to give up there)."""
    text = "日本語"
    b = text.encode()
    r = byte_level_tokenizer([b[:6], b[2:4], b[4:6]])
    tb = r.token_bytes
    canonical = r.output_ids(text, "stop")
    model = [tb.id_of(b[:2]), tb.id_of(b[2:4]), tb.id_of(b[4:6]), *r.encode("語"), r.end_token_id]
    assert None not in model and canonical != model and canonical[-1] == r.end_token_id
    assert follow(r, canonical, model) == model
    # the other way round: the tokenizer's cut is a model's too (the claim holds byte tokens)
    split = [tb.id_of(bytes([x])) for x in b] + [r.end_token_id]
    assert follow(r, split, canonical) == canonical


def test_encode_bytes_spells_tails_begun_and_ended_inside_a_character(retok):
    text = "x = '漢字 e\u0301 🙂'"
    b = text.encode()
    for i in range(len(b)):
        for j in (len(b), len(b) - 1, len(b) - 2):
            if i < j:
                ids = retok.encode_bytes(b[i:j])
                assert ids is not None and b"".join(retok.token_bytes.of_id(t) for t in ids) == b[i:j]
    assert retok.encode_bytes("漢字".encode()) == retok.encode("漢字")  # whole characters: the tokenizer's cut


def test_a_reply_cut_inside_a_character_is_scored_to_its_last_whole_token(retok):
    """max_tokens ended the reply inside a character: the detokenizer wrote U+FFFD for its bytes.
    A "length" reply drops it; a reply that stopped keeps it (the model wrote U+FFFD itself)."""
    assert whole_token_text("漢字\ufffd", "length") == ("漢字", True)
    assert whole_token_text("漢字\ufffd\ufffd", "length") == ("漢字", True)
    assert whole_token_text("漢字\ufffd", "stop") == ("漢字\ufffd", False)
    assert whole_token_text("\ufffd漢字", "length") == ("\ufffd漢字", False)
    assert retok.output_ids("漢字\ufffd", "length") == retok.encode("漢字")
    assert retok.output_ids("漢字\ufffd", "stop") == [*retok.encode("漢字\ufffd"), retok.end_token_id]


def test_the_last_token_of_a_reply_cut_inside_a_character_is_the_models():
    """The model's last token held 本 and the first byte of 語; max_tokens cut it there, the text
    ends in 本: the last token is re-cut to the model's where the replay writes it (the overflow
    is an incomplete character), not where the reply stopped or the overflow is a character."""
    text = "日本語"
    b = text.encode()
    r = byte_level_tokenizer([b[:3], b[3:6], b[3:7], b[3:9]])
    tb = r.token_bytes
    model = [tb.id_of(b[:3]), tb.id_of(b[3:7])]
    derived = r.output_ids(r.tokenizer.decode(model), "length")
    assert r.tokenizer.decode(model) == "日本\ufffd" and derived == [model[0], tb.id_of(b[3:6])]
    assert r.resegment_at(derived, model) == (1, model)
    assert r.resegment_at([*derived, r.end_token_id], [*model, r.end_token_id]) is None
    assert r.resegment_at(derived, [model[0], tb.id_of(b[3:9])]) is None  # 本語: the text goes on


# --- whitespace a vendor strips from the reply's two ends ------------------------------------------

def test_whitespace_a_vendor_stripped_is_followed_only_at_the_two_ends():
    """The model wrote "\\n" + " Hello world" + "\\n" + <end>; the vendor returned "Hello world".
    With stripped=True the replay's whitespace is followed at the text's start (a token that
    is whitespace then the text's start, or whitespace alone: inserted) and before the end token
    (whitespace alone: inserted; the text's end then whitespace: re-cut); never elsewhere, never
    other bytes, and not where no end token follows."""
    r = byte_level_tokenizer([b"Hello", b" Hello", b" world", b" world\n", b"\n\n"])
    tb, end = r.token_bytes, r.end_token_id
    H, sH, sW, sWn, nl, nn, h, sp = (tb.id_of(b) for b in (b"Hello", b" Hello", b" world", b" world\n", b"\n",
                                                            b"\n\n", b"H", b" "))
    claim = r.output_ids("Hello world", "stop")
    assert claim == [H, sW, end]
    at = lambda ids, t, tok, **kw: r.resegment_at(ids, [*ids[:t], tok, *ids[t + 1:]], t, **kw)  # noqa: E731
    assert at(claim, 0, sH) is None and at(claim, 2, nl) is None          # off by default
    assert at(claim, 0, sH, stripped=True) == (0, [sH, sW, end])          # " Hello": whitespace + the text's start
    assert at(claim, 0, nl, stripped=True) == (0, [nl, H, sW, end])       # "\n": inserted
    assert at([nl, H, sW, end], 1, nn, stripped=True) == (1, [nl, nn, H, sW, end])  # only whitespace before: the start
    assert at([nl, H, sW, end], 1, sH, stripped=True) == (1, [nl, sH, sW, end])
    assert at(claim, 2, nl, stripped=True) == (2, [H, sW, nl, end])       # before the end token: inserted
    assert at([H, sW, nl, end], 3, nn, stripped=True) == (3, [H, sW, nl, nn, end])
    assert at(claim, 1, sWn, stripped=True) == (1, [H, sWn, end])         # " world\n": the text's end + whitespace
    assert at(claim, 1, nl, stripped=True) is None                        # whitespace in the middle
    assert at(claim, 1, sH, stripped=True) is None                        # other text
    assert at(claim, 2, H, stripped=True) is None                         # text before the end token
    assert at(claim, 0, h, stripped=True) == (0, [h, *r.encode("ello world"), end])  # a plain re-cut
    cut = r.output_ids("Hello world", "length")                           # no end token: the end is not a boundary
    assert at(cut, 1, sWn, stripped=True) is None
    assert at(cut, 0, nl, stripped=True) == (0, [nl, H, sW])              # its start is
    assert at(r.output_ids("\n\n", "length"), 0, sp, stripped=True) is None  # begins with whitespace: not stripped
