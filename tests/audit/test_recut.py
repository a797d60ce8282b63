"""The replay re-cuts claims derived from text where the reference segments the same text
differently (audit.replay.recut_claims): an honest greedy reply whose text re-encodes to other ids
is scored on the model's own ids; without the re-cut it diverges from the split on."""

import pyarrow.compute as pc
import pytest

from verinfer.apps.pipeline import verifier_engine
from verinfer.audit.replay import score_chunk
from verinfer.claims import Claim
from verinfer.engine.engine import Request
from verinfer.models.testbed import TARGET_DIR
from verinfer.retokenize import Retokenizer
from verinfer.sampling.params import SamplingParams
from tests.test_retokenize import TEMPLATE, split_segmentation

GREEDY = SamplingParams(0.0, -1, 1.0, 0.0, None, 24, "vllm-cpu")
QUESTIONS = ["import os\nimport sys", "class Stack:\n    def __init__(self):",
             "def read_file(path):\n    with open(path) as f:", "return self._items"]


@pytest.fixture(scope="module")
def setup():
    retok = Retokenizer.for_model(TARGET_DIR, chat_template=TEMPLATE)
    engine = verifier_engine(TARGET_DIR)
    msgs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    done = engine.generate([Request(str(i), retok.prompt_ids(m), GREEDY) for i, m in enumerate(msgs)], batch_size=4)
    return retok, engine, msgs, done


@pytest.mark.slow  # generates and replays on the testbed (~10 s on 2 busy cores)
def test_recut_restores_the_models_ids(setup):
    retok, engine, msgs, done = setup
    claims, truth = [], []
    for i, (m, d) in enumerate(zip(msgs, done)):
        ids = list(d.output_token_ids)
        text_ids = ids[:-1] if d.finish_reason == "stop" else ids
        c = Claim.from_chat(f"c{i}", "m", m, retok.tokenizer.decode(text_ids), d.finish_reason, GREEDY, retok)
        try:
            other, _ = split_segmentation(retok, c.output_token_ids)  # a provider-side cut the model did not take
        except AssertionError:
            continue  # a reply of single-byte tokens ("0x0000..."; which reply depends on the machine's kernels)
        claims.append(Claim(c.id, c.model, c.prompt_token_ids, other, c.sampling, extra=c.extra))
        truth.append(ids)
    assert len(claims) >= 2
    naive = score_chunk(claims, engine)
    recut = score_chunk(claims, engine, retokenizer=retok)
    true_ids = score_chunk([Claim(c.id, c.model, c.prompt_token_ids, ids, c.sampling)
                            for c, ids in zip(claims, truth)], engine)
    for i, c in enumerate(claims):
        rows = recut.filter(pc.equal(recut["claim_id"], c.id))
        assert rows["token_id"].to_pylist() == truth[i]
    for col in ("token_id", "exact_match", "margin", "cross_entropy"):  # scored exactly as the true ids
        assert recut[col].to_pylist() == true_ids[col].to_pylist()
    assert pc.sum(naive["exact_match"]).as_py() < pc.sum(true_ids["exact_match"]).as_py()  # naive: diverges at the split
    # claims whose ids were returned by the endpoint are never re-cut
    returned = [Claim(c.id, c.model, c.prompt_token_ids, c.output_token_ids, c.sampling,
                      extra={"chat": {**c.chat, "tokens": "returned"}}) for c in claims]
    same = score_chunk(returned, engine, retokenizer=retok)
    assert same["token_id"].to_pylist() == naive["token_id"].to_pylist()


# --- which segmentation is kept: the reference's cost over the span, from oracle replays ----------
from verinfer.audit.replay import recut_claims, rejoin  # noqa: E402
import pyarrow as pa  # noqa: E402


def oracle(truth: dict):
    """rescore(claims) -> tables from `truth`: ids -> [(replayed token, margin)] per output position
    (an exact match where a position is not listed)."""
    def table(c):
        rows = truth[tuple(c.output_token_ids)]
        rep = [rows.get(t, (y, 0.0))[0] for t, y in enumerate(c.output_token_ids)]
        m = [rows.get(t, (y, 0.0))[1] for t, y in enumerate(c.output_token_ids)]
        return pa.table({"replay_token_id": rep, "margin": m, "cross_entropy": [0.5 + x for x in m]})
    return table, (lambda cs: [table(c) for c in cs])


def splittable(retok):
    """A text token W whose bytes are the tokens P + R (W is the tokenizer's cut of them)."""
    for w in retok.encode("def read_file(path):\n    return self._items  # comment"):
        b = retok.token_bytes.of_id(w)
        for k in range(1, len(b) if b else 0):
            p, r = retok.encode(b[:k].decode()), retok.encode(b[k:].decode())
            if len(p) == 1 and len(r) == 1:
                return w, p[0], r[0]
    raise AssertionError("no splittable token")


def derived(retok, text: str, stop=None, finish="length"):
    return Claim.from_chat("c", "m", [{"role": "user", "content": "q"}], text, finish, GREEDY, retok, stop=stop)


def test_a_near_tie_is_not_recut_into_a_large_margin():
    """The model wrote W; the reference's argmax there is the shorter P by a near-tie (0.1), and
    after P the reference would never write R (13.8): the claim keeps W, scored at 0.1."""
    retok = Retokenizer.for_model(TARGET_DIR, chat_template=TEMPLATE)
    w, p, r = splittable(retok)
    text = retok.tokenizer.decode([w])
    c = derived(retok, text)
    assert c.output_token_ids == [w]
    table, rescore = oracle({(w,): {0: (p, 0.1)}, (p, r): {1: (p, 13.8)}})
    claims, per = [c], [table(c)]
    recut_claims(claims, per, retok, rescore)
    assert claims[0].output_token_ids == [w] and per[0]["margin"].to_pylist() == [0.1]


def test_a_split_the_model_took_is_recut():
    """The model wrote P then R where the tokenizer writes W: the canonical W costs the reference's
    margin (5.0), P + R cost nothing, so the claim is re-cut to the model's ids."""
    retok = Retokenizer.for_model(TARGET_DIR, chat_template=TEMPLATE)
    w, p, r = splittable(retok)
    c = derived(retok, retok.tokenizer.decode([w]))
    table, rescore = oracle({(w,): {0: (p, 5.0)}, (p, r): {}})
    claims, per = [c], [table(c)]
    recut_claims(claims, per, retok, rescore)
    assert claims[0].output_token_ids == [p, r] and per[0]["margin"].to_pylist() == [0.0, 0.0]
    assert rejoin([1, w, 9], [1, p, r, 9], 1) == (2, 3)


def test_a_reply_cut_by_a_stop_string_ends_with_the_models_last_token():
    """The model wrote U + "\\n" as one token T and the request's stop string "\\n" cut the text after
    U: the claim has no end token, and its last token is re-cut to T where the reference writes T.
    Without the stop string the same replay is a mismatch (the text does not go on)."""
    retok = Retokenizer.for_model(TARGET_DIR, chat_template=TEMPLATE)
    tb = retok.token_bytes
    t, u = next((t, retok.encode(tb.of_id(t)[:-1].decode())) for t in range(len(tb.table))
                if tb.of_id(t) and len(tb.of_id(t)) > 1 and tb.of_id(t).endswith(b"\n")
                and len(retok.encode(tb.of_id(t)[:-1].decode())) == 1)
    text = tb.of_id(u[0]).decode()
    cut = derived(retok, text, stop=["\n"], finish="stop")
    assert cut.output_token_ids == u and cut.stop_strings == ("\n",) and cut.chat["stop"] == ["\n"]
    table, rescore = oracle({tuple(u): {0: (t, 2.0)}, (t,): {}})
    claims, per = [cut], [table(cut)]
    recut_claims(claims, per, retok, rescore)
    assert claims[0].output_token_ids == [t]
    plain = derived(retok, text, finish="length")
    claims, per = [plain], [table(plain)]
    recut_claims(claims, per, retok, rescore)
    assert claims[0].output_token_ids == u                       # nothing to re-cut without a stop string
    with pytest.raises(ValueError, match="no token to score"):
        derived(retok, "", stop=["\n"], finish="stop")


# --- the real model: honest replies in other scripts, cut inside characters ------------------------
from verinfer.models.catalog import SMOLLM2_135M_INSTRUCT, model_path  # noqa: E402

SMOL_GREEDY = SamplingParams(0.0, -1, 1.0, 0.0, None, 32, "vllm-cpu")
SCRIPTS = ["Translate to Chinese: I love my family.", "Write one sentence in Japanese about the sea.",
           "Repeat exactly: cafe\u0301 nai\u0308ve re\u0301sume\u0301", "Write a short poem in Chinese.",
           "List three fruits with emoji.", "日本の首都はどこですか？", "Write the word 'hello' in Korean.",
           "Write a sentence in Russian.", "Copy this: ñ = n\u0303, ü = u\u0308"]


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct's greedy replies (32 tokens at most) to SCRIPTS: (retokenizer, engine,
    messages, [(model's ids, finish_reason, text as vLLM's detokenizer writes it)])."""
    d = model_path(SMOLLM2_135M_INSTRUCT)
    if not (d / "config.json").is_file():
        pytest.skip(f"SmolLM2-135M-Instruct is not in {d} (verinfer models get smollm2-135m-instruct)")
    retok, engine = Retokenizer.for_model(d), verifier_engine(d)
    msgs = [[{"role": "user", "content": q}] for q in SCRIPTS]
    done = engine.generate([Request(str(i), retok.prompt_ids(m), SMOL_GREEDY) for i, m in enumerate(msgs)],
                           batch_size=len(msgs))
    replies = []
    for d in done:
        ids = list(d.output_token_ids)
        text = retok.tokenizer.decode(ids[:-1] if d.finish_reason == "stop" else ids)  # U+FFFD for a partial tail
        replies.append((ids, d.finish_reason, text))
    return retok, engine, msgs, replies


def cut_inside_a_character(r: Retokenizer, ids: list[int]) -> list[int] | None:
    """The same bytes cut another way inside a character, a segmentation the model did not take:
    the first multi-byte non-ASCII token cut into one token per byte, or else the first two
    adjacent tokens holding non-ASCII bytes that are one token joined (None if neither is)."""
    tb = r.token_bytes
    for t, tok in enumerate(ids):
        b = tb.of_id(tok)
        if b and len(b) >= 2 and max(b) >= 0x80:
            return [*ids[:t], *[tb.id_of(bytes([x])) for x in b], *ids[t + 1:]]
    for t in range(len(ids) - 1):
        a, b = tb.of_id(ids[t]), tb.of_id(ids[t + 1])
        if a and b and max(a + b) >= 0x80 and (one := tb.id_of(a + b)) is not None:
            return [*ids[:t], one, *ids[t + 2:]]
    return None


def scored_ids(table, claims) -> list[list[int]]:
    return [table.filter(pc.equal(table["claim_id"], c.id))["token_id"].to_pylist() for c in claims]


@pytest.mark.slow  # SmolLM2 loads, generates 9 replies and replays them (20-40 s on 2 busy cores)
def test_honest_replies_in_other_scripts_come_back_to_the_models_ids(smol):
    """Chinese, Japanese, Korean, Cyrillic, emoji and combining marks: SmolLM2's byte-level tokens
    split characters. Each whole reply is claimed twice, from its text (the tokenizer's cut) and
    cut another way inside a character where its tokens allow (a cut the model did not take): the
    re-cut brings every claim back to the model's ids."""
    retok, engine, msgs, replies = smol
    claims, truth = [], []
    for i, (m, (ids, finish, text)) in enumerate(zip(msgs, replies)):
        if "\ufffd" in text:
            continue  # cut by max_tokens inside a character: test_a_reply_cut_inside_a_character...
        c = Claim.from_chat(f"c{i}", "m", m, text, finish, SMOL_GREEDY, retok)
        claims.append(c)
        truth.append(ids)
        other = cut_inside_a_character(retok, c.output_token_ids)  # None: combining marks as single bytes
        if other is not None:
            assert None not in other
            claims.append(Claim(f"s{i}", c.model, c.prompt_token_ids, other, c.sampling, extra=c.extra))
            truth.append(ids)
    assert len(claims) >= 10
    got = scored_ids(score_chunk(claims, engine, retokenizer=retok), claims)
    assert sum(g == t for g, t in zip(got, truth)) == len(claims)


def whole_tokens(r: Retokenizer, ids: list[int]) -> list[int]:
    """`ids` less its trailing tokens whose bytes all lie in an incomplete last character."""
    tb = r.token_bytes
    b = b"".join(tb.of_id(t) for t in ids)
    try:
        b.decode()
        return ids
    except UnicodeDecodeError as e:
        partial = len(b) - e.start
    n = len(ids)
    while n and len(tb.of_id(ids[n - 1])) <= partial:
        partial -= len(tb.of_id(ids[n - 1]))
        n -= 1
    return ids[:n]


@pytest.mark.slow  # shares test_honest_replies_in_other_scripts...'s replies
def test_a_reply_cut_inside_a_character_is_scored_up_to_its_last_whole_token(smol):
    """max_tokens cut an emoji and a kana in two: the text ends in U+FFFD (tokenizer.decode, as
    vLLM's detokenizer writes it), which the derived claim drops; the replay re-cuts it to the
    model's ids, less the tokens that hold only bytes of the cut character."""
    retok, engine, msgs, replies = smol
    claims, truth = [], []
    for i, (m, (ids, finish, text)) in enumerate(zip(msgs, replies)):
        if text.endswith("\ufffd"):
            assert finish == "length" and whole_tokens(retok, ids) != ids
            claims.append(Claim.from_chat(f"c{i}", "m", m, text, finish, SMOL_GREEDY, retok))
            truth.append(whole_tokens(retok, ids))
    assert len(claims) >= 2
    assert scored_ids(score_chunk(claims, engine, retokenizer=retok), claims) == truth


# --- whitespace a vendor strips from the reply's two ends ------------------------------------------

def test_whitespace_the_vendor_stripped_is_inserted_where_the_reference_writes_it():
    """The model wrote "\\n" before the text and before its end token; the vendor stripped both.
    Each insertion is kept where the reference finds it more consistent (the claimed token after
    it is in the span), and refused where the token after it would cost more than the near-tie."""
    retok = Retokenizer.for_model(TARGET_DIR, chat_template=TEMPLATE)
    nl, z = retok.encode("\n")[0], retok.encode("Z")[0]
    c = derived(retok, "return x", finish="stop")
    y = c.output_token_ids
    model = [nl, *y[:-1], nl, y[-1]]
    table, rescore = oracle({tuple(y): {0: (nl, 3.0), len(y) - 1: (nl, 2.0)}, (nl, *y): {len(y): (nl, 2.0)},
                             tuple(model): {}})
    claims, per = [c], [table(c)]
    recut_claims(claims, per, retok, rescore)
    assert claims[0].output_token_ids == model and per[0]["margin"].to_pylist() == [0.0] * len(model)
    table, rescore = oracle({tuple(y): {0: (nl, 0.1)}, (nl, *y): {1: (z, 5.0)}})
    claims, per = [c], [table(c)]
    recut_claims(claims, per, retok, rescore)
    assert claims[0].output_token_ids == y                                  # a near-tie: not inserted


@pytest.mark.slow  # SmolLM2 generates 8 replies and replays them (10-30 s on 2 busy cores)
def test_replies_a_vendor_stripped_come_back_to_the_models_ids(smol):
    """A vendor's template without the newline after "assistant": SmolLM2 opens each reply with
    "\\n", which the vendor strips (and trailing whitespace). The claims derived from the stripped
    texts come back to the model's ids (a reply cut by max_tokens: less the whitespace-only
    tokens it ended in, which no claimed position covers)."""
    _, engine, _, _ = smol
    d = model_path(SMOLLM2_135M_INSTRUCT)
    template = (d / "chat_template.jinja").read_text().replace("<|im_start|>assistant\n", "<|im_start|>assistant")
    retok = Retokenizer.for_model(d, chat_template=template)
    msgs = [[{"role": "user", "content": q}] for q in
            ["What is 2+2? Answer with a number only.", "Say hi.", "Write a haiku about rain.", "Name a color.",
             "Write a Python one-liner that prints hello.", "Give me a bulleted list of 3 fruits.",
             "Translate 'cat' to French.", "Write one sentence in Japanese about the sea."]]
    done = engine.generate([Request(str(i), retok.prompt_ids(m), SMOL_GREEDY) for i, m in enumerate(msgs)],
                           batch_size=len(msgs))
    claims, truth, stripped = [], [], 0
    for i, (m, dn) in enumerate(zip(msgs, done)):
        ids, tb = list(dn.output_token_ids), retok.token_bytes
        text = retok.tokenizer.decode(ids[:-1] if dn.finish_reason == "stop" else ids)
        stripped += text != text.strip()
        claims.append(Claim.from_chat(f"c{i}", "m", m, text.strip(), dn.finish_reason, SMOL_GREEDY, retok))
        while dn.finish_reason == "length" and not tb.of_id(ids[-1]).strip():
            ids = ids[:-1]
        truth.append(ids)
    assert stripped >= 6
    assert scored_ids(score_chunk(claims, engine, retokenizer=retok), claims) == truth


UNSEEDED = SamplingParams(0.7, -1, 0.95, 0.0, None, 24, None, unseeded=True)


def test_an_unseeded_token_outside_the_kept_set_is_recut_to_pieces_inside_it():
    """Sampled without a seed, the model wrote P + R where the tokenizer writes W, and W lies outside
    the reference's top-p set (margin +inf, u = 1) while the reference's argmax spells no prefix of
    the text (the argmax-guided re-cut proposes nothing): the claim is re-cut to P + R, inside the set.
    A seeded claim and one whose every other segmentation is outside the set too keep W."""
    import dataclasses
    import math

    retok = Retokenizer.for_model(TARGET_DIR, chat_template=TEMPLATE)
    w, p, r = splittable(retok)
    other = next(x for x in range(len(retok.token_bytes.table)) if x not in (w, p, r) and retok.token_bytes.of_id(x)
                 and not retok.token_bytes.of_id(w).startswith(retok.token_bytes.of_id(x)))
    c = dataclasses.replace(derived(retok, retok.tokenizer.decode([w])), sampling=UNSEEDED)
    assert [p, r] in retok.prefix_recuts(c.output_token_ids, 0)

    class Truth(dict):  # the other segmentations (shorter pieces): outside the set at their first token
        def __missing__(self, key):
            return {0: (other, math.inf)}

    truth = Truth({(w,): {0: (other, math.inf)}, (p, r): {0: (other, 1.5)}})
    table, rescore = oracle(truth)
    claims, per = [c], [table(c)]
    recut_claims(claims, per, retok, rescore)
    assert claims[0].output_token_ids == [p, r] and per[0]["margin"].to_pylist() == [1.5, 0.0]
    seeded = dataclasses.replace(c, sampling=GREEDY)
    claims, per = [seeded], [table(seeded)]
    recut_claims(claims, per, retok, rescore)
    assert claims[0].output_token_ids == [w]
    truth[(p, r)] = {1: (other, math.inf)}
    claims, per = [c], [table(c)]
    recut_claims(claims, per, retok, rescore)
    assert claims[0].output_token_ids == [w] and math.isinf(per[0]["margin"].to_pylist()[0])


def test_out_of_set_recuts_stop_after_a_few_positions_per_claim():
    """A substitute's reply can hold dozens of out-of-set tokens, each re-cut costing a replay per
    candidate: `recut_unsupported` tries at most MAX_UNSUPPORTED_RECUTS positions per claim (honest
    replies need 0-1), and the positions left stay out of the set (evidence)."""
    import dataclasses
    import math

    from verinfer.audit.replay import MAX_UNSUPPORTED_RECUTS, recut_unsupported

    retok = Retokenizer.for_model(TARGET_DIR, chat_template=TEMPLATE)
    c = dataclasses.replace(derived(retok, "def read_file(path):\n    return self._items  # comment " * 2),
                            sampling=UNSEEDED)
    ids = c.output_token_ids
    recuttable = [t for t in range(len(ids)) if retok.prefix_recuts(ids, t)]
    assert len(recuttable) > 2 * MAX_UNSUPPORTED_RECUTS  # uncapped, each of these would be a replay step

    def table(claim):  # every token of every segmentation outside the kept set: no re-cut ever helps
        k = len(claim.output_token_ids)
        return pa.table({"replay_token_id": claim.output_token_ids, "margin": [math.inf] * k,
                         "cross_entropy": [math.inf] * k})

    steps = []

    def rescore(cands):
        steps.append(len(cands))
        return [table(x) for x in cands]

    claims, per = [c], [table(c)]
    recut_unsupported(claims, per, retok, rescore)
    assert len(steps) == MAX_UNSUPPORTED_RECUTS and min(steps) >= 1
    assert claims[0].output_token_ids == ids and all(math.isinf(x) for x in per[0]["margin"].to_pylist())
