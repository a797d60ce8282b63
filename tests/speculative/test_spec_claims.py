"""Audit link (DiFR appendix F): spec claims round-trip, honest standard claims verify with 0
violations, tampered claims are caught, the CLI generate --speculative / score path."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from verinfer.claims import read_claims, write_claims
from verinfer.cli.main import app
from verinfer.errors import ClaimError
from verinfer.models.llama import LlamaLM
from verinfer.models.load import load_tokenizer
from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR, TOKENIZER_DIR
from verinfer.speculative.spec_claims import check_events, spec_claims, verify_spec_claims
from verinfer.speculative.rules import Rule


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return LlamaLM.from_pretrained(TARGET_DIR), LlamaLM.from_pretrained(DRAFT_DIR), load_tokenizer(TOKENIZER_DIR)


def _prompts(tok, n):
    return [tok.encode(s, add_special_tokens=False) for s in
            ("import os\nimport ", "    def __init__(self", "Q: 37+45=\nA: ", "class A:\n    def ", "    return self._",
             "for i in range(")][:n]


def _claims(models, rule, temperature=1.0, n=6, max_tokens=24):
    t, d, tok = models
    prompts = _prompts(tok, n)
    return spec_claims(t, d, prompts, run_rule=rule, claimed="standard", gamma=3, temperature=temperature,
                       max_tokens=max_tokens, seed=1, model_name="m", draft_name="d", provider="p")


def test_event_structure_checks():
    check_events("aaab" "ar" "r" "aa", 3, 9, "x")
    for bad, msg in [("aaaa", "more than gamma"), ("aab", "bonus"), ("aaar", "after a fully accepted"),
                     ("ax", "a/r/b"), ("aa", "one per output token")]:
        with pytest.raises(ClaimError, match=msg):
            check_events(bad, 3, len(bad) + (bad == "aa"), "x")
    # a feature-head claim: exactly one leading 't' (the target's own first token), then rounds
    check_events("t" "aaab" "ar" "aa", 3, 9, "x", head=True)
    check_events("t", 3, 1, "x", head=True)
    for bad, head, msg in [("taat", True, "target token 't' at 3"), ("tt", True, "target token 't' at 1"),
                           ("aab", True, "start with 'a', not 't'"), ("taaaa", True, "more than gamma"),
                           ("tar", False, "target token 't' at 0"), ("aat", False, "only a feature-head claim")]:
        with pytest.raises(ClaimError, match=msg) as e:
            check_events(bad, 3, len(bad), "x", head=head)
        assert e.value.where == "x"
        assert e.value.fix is not None or "gamma" in msg


def test_honest_standard_claims_verify_and_round_trip(models, tmp_path):
    t, d, _ = models
    claims = _claims(models, Rule("standard"))
    write_claims(tmp_path / "c.jsonl", claims)
    back = read_claims(tmp_path / "c.jsonl")
    assert [c.extra["spec"] for c in back] == [c.extra["spec"] for c in claims]
    rows = verify_spec_claims(back, t, d)
    assert rows["score"].size == sum(len(c.output_token_ids) for c in claims)
    assert rows["violation"].sum() == 0
    assert set(rows["event"].tolist()) <= {"a", "r", "b"} and (rows["event"] == "a").any()
    # accept_nll recomputed by hand for the first accepted token
    k = int(np.flatnonzero(rows["event"] == "a")[0])
    c = back[rows["claim"][k]]
    pos = rows["position"][k]
    seq = c.prompt_token_ids + c.output_token_ids
    with torch.no_grad():
        lt, _ = t(torch.tensor([seq]), torch.arange(len(seq))[None])
        ld, _ = d(torch.tensor([seq]), torch.arange(len(seq))[None])
    i = len(c.prompt_token_ids) - 1 + pos
    y = c.output_token_ids[pos]
    ratio = torch.softmax(lt[0, i].double(), -1)[y] / torch.softmax(ld[0, i].double(), -1)[y]
    assert rows["accept_nll"][k] == pytest.approx(-np.log(min(1.0, float(ratio))), abs=1e-6)


def test_tampered_claims_are_violations(models):
    t, d, _ = models
    claims = _claims(models, Rule("standard"), temperature=0.0, n=3, max_tokens=12)
    assert verify_spec_claims(claims, t, d)["violation"].sum() == 0  # greedy: every token is the argmax
    c = claims[0]
    c.output_token_ids[2] = (c.output_token_ids[2] + 1) % t.config.vocab_size
    rows = verify_spec_claims(claims, t, d)
    assert rows["violation"][(rows["claim"] == 0) & (rows["position"] == 2)].all()


def test_kl_provider_accepts_less_likely_tokens(models):
    """The lossy KL provider's accepted tokens have larger -log min(1, p/q) than the honest one's."""
    t, d, _ = models
    honest = verify_spec_claims(_claims(models, Rule("standard"), max_tokens=32), t, d)
    kl = verify_spec_claims(_claims(models, Rule("kl", 1.0), max_tokens=32), t, d)
    mean = lambda r: r["accept_nll"][r["event"] == "a"].mean()  # noqa: E731
    assert mean(kl) > mean(honest)


def test_cli_generate_speculative_and_score(tmp_path):
    runner = CliRunner()
    out = tmp_path / "s.jsonl"
    r = runner.invoke(app, ["generate", "--speculative", "standard", "--out", str(out), "--n", "3", "--max-tokens", "16"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "speculative (standard" in r.output
    assert "generate speculative-standard 3/3" in r.output  # its progress (was silent)
    line = json.loads(out.read_text().splitlines()[0])
    assert line["spec"]["method"] == "standard" and len(line["spec"]["events"]) == len(line["output_token_ids"])
    r = runner.invoke(app, ["score", str(out), "--out", str(tmp_path / "s.parquet")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "0 violations" in r.output
    total = sum(len(json.loads(x)["output_token_ids"]) for x in out.read_text().splitlines())
    assert f"score s.jsonl (speculative) {total}/{total}" in r.output  # its progress (was silent)
    # a lossy rule labelled honestly cannot be verified: the error says so
    r = runner.invoke(app, ["generate", "--speculative", "kl", "--threshold", "0.5", "--out", str(tmp_path / "k.jsonl"),
                            "--n", "2", "--max-tokens", "8"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["score", str(tmp_path / "k.jsonl"), "--out", str(tmp_path / "k.parquet")])
    assert r.exit_code == 2 and "only claims of standard" in r.output
    # the dynamic draft length: named in the claims, verified by score; refused without --speculative
    cut = tmp_path / "c.jsonl"
    r = runner.invoke(app, ["generate", "--speculative", "standard", "--draft-confidence", "0.4", "--out", str(cut),
                            "--n", "3", "--max-tokens", "16"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads(cut.read_text().splitlines()[0])["spec"]["draft_confidence"] == 0.4
    r = runner.invoke(app, ["score", str(cut), "--out", str(tmp_path / "c.parquet")], catch_exceptions=False)
    assert r.exit_code == 0 and "0 violations" in r.output, r.output
    r = runner.invoke(app, ["generate", "honest", "--draft-confidence", "0.4", "--out", str(tmp_path / "h.jsonl")])
    assert r.exit_code == 2 and "--draft-confidence" in r.output and not (tmp_path / "h.jsonl").exists()
    r = runner.invoke(app, ["generate", "--speculative", "standard", "--draft-confidence", "1.5", "--out",
                            str(tmp_path / "x.jsonl")])
    assert r.exit_code == 2 and "[0, 1)" in r.output and not (tmp_path / "x.jsonl").exists()


def test_sampled_claims_name_and_replay_their_noise(models):
    """Sampled claims name the speculative-keyed stream; the verifier regenerates every draw from it:
    an honest standard provider's tokens and accept/reject decisions are reproduced (margin 0), the
    KL provider's accepted drafts include ones the ratio test rejects (accept_gap >= 0), a tampered
    token is not reproduced."""
    t, d, _ = models
    claims = _claims(models, Rule("standard"), max_tokens=32)
    assert all(c.sampling.noise == "speculative-keyed" and "rng" not in c.extra["spec"] for c in claims)
    honest = verify_spec_claims(claims, t, d)
    kl = verify_spec_claims(_claims(models, Rule("kl", 1.0), max_tokens=32), t, d)
    print({"honest_match": honest["replay_match"].mean(), "kl_match": kl["replay_match"].mean()})
    assert honest["replay_match"].mean() > 0.98 and (honest["margin"][honest["replay_match"]] == 0).all()
    ha, ka = honest["event"] == "a", kl["event"] == "a"
    assert (honest["accept_gap"][ha] < 0).mean() > 0.98 and (honest["accept_gap"][honest["event"] == "r"] >= 0).all()
    assert (kl["accept_gap"][ka] >= 0).sum() >= 3 and kl["replay_match"].mean() < honest["replay_match"].mean()
    c = claims[1]
    k = next(i for i, e in enumerate(c.extra["spec"]["events"]) if e == "a")
    c.output_token_ids[k] = (c.output_token_ids[k] + 1) % t.config.vocab_size
    rows = verify_spec_claims([c], t, d)
    assert not rows["replay_match"][k] and rows["margin"][k] > 0


def test_claims_with_a_dynamic_draft_length_verify_and_a_wrong_cut_is_a_violation(models):
    """Claims of the decoder with draft_confidence name it; their short fully accepted blocks ('b'
    after fewer than gamma 'a's) pass the event check and verify with 0 violations, every draw
    replayed; the same events claimed without it fail the event check; a cut moved to where the
    draft was confident, or a block that went on past a token below the bound, is a violation."""
    t, d, tok = models
    claims = spec_claims(t, d, _prompts(tok, 6), run_rule=Rule("standard"), claimed="standard", gamma=3,
                         temperature=1.0, max_tokens=32, seed=1, model_name="m", draft_name="d", provider="p",
                         draft_confidence=0.5)
    assert all(c.extra["spec"]["draft_confidence"] == 0.5 for c in claims)
    events = "".join(c.extra["spec"]["events"] for c in claims)
    assert any(e.startswith(("ab", "aab")) or "rab" in e or "bab" in e or "raab" in e or "baab" in e
               for e in (c.extra["spec"]["events"] for c in claims))  # a cut block fully accepted
    rows = verify_spec_claims(claims, t, d)
    assert rows["violation"].sum() == 0 and rows["replay_match"].all(), events
    check_events("abaab", 3, 5, "x", cut=True)
    with pytest.raises(ClaimError, match="bonus token at 1 after 1"):
        check_events("abaab", 3, 5, "x")
    with pytest.raises(ClaimError, match="after 0 accepted"):
        check_events("b", 3, 1, "x", cut=True)
    # the same claims verified as if cut at 0.01 (nothing is below it): every cut block is a violation
    k = next(i for i, c in enumerate(claims) if any(w in c.extra["spec"]["events"] for w in ("ab", "aab")))
    c = claims[k]
    c.extra["spec"]["draft_confidence"] = 0.01
    bad = verify_spec_claims([c], t, d)
    ev = c.extra["spec"]["events"]
    assert bad["violation"].any() and all(ev[i] == "b" for i in np.flatnonzero(bad["violation"]))
    # at 0.99 nearly every draft is below it: a block that went on past one is a violation
    c.extra["spec"]["draft_confidence"] = 0.99
    assert verify_spec_claims([c], t, d)["violation"].any()
    for v in (1.0, -0.1, "0.5", True):
        c.extra["spec"]["draft_confidence"] = v
        with pytest.raises(ClaimError, match="draft_confidence"):
            verify_spec_claims([c], t, d)


def test_residual_violation_tolerates_bf16_rounding_only():
    """A correction y needs p(y) > q(y); a bf16 verifier allows RESIDUAL_REL_TOL (0.1) of rounding: the
    honest minimum measured on SmolLM2 and its draft was -0.080, so -0.08 passes there and not in fp32."""
    from verinfer.speculative.spec_claims import RESIDUAL_REL_TOL, residual_violation

    bf16, fp32 = RESIDUAL_REL_TOL[torch.bfloat16], RESIDUAL_REL_TOL[torch.float32]
    assert (bf16, fp32) == (0.1, 0.0)
    assert not residual_violation(0.30, 0.10, fp32) and not residual_violation(0.30, 0.10, bf16)
    assert residual_violation(0.10, 0.10, fp32)                     # p(y) == q(y): the residual is 0 at y
    assert residual_violation(0.092, 0.10, fp32) and not residual_violation(0.092, 0.10, bf16)
    assert residual_violation(0.085, 0.10, bf16)                     # 15% below: beyond rounding
    assert residual_violation(0.0, 0.10, bf16) and residual_violation(0.0, 0.0, bf16)  # p(y) = 0: never drawn


# --- a feature-level head as the draft (speculative/feature_head.py) -------------------------------

@pytest.fixture(scope="module")
def head_models(models):
    from tests.speculative.test_feature_head import _head

    t, _, tok = models
    return t, _head(t), tok


def _head_claims(head_models, rule, temperature=1.0, n=4, max_tokens=24, seed=1):
    t, h, tok = head_models
    return spec_claims(t, h, _prompts(tok, n), run_rule=rule, claimed="standard", gamma=3, temperature=temperature,
                       max_tokens=max_tokens, seed=seed, model_name="m", draft_name="h", provider="p")


@torch.no_grad()
def _scratch_head_q(target, head, c, T):
    """The head's q of every a / r token of claim c with no cache: the target's features from one
    whole-sequence forward, then for slot k of a round starting at committed length n the head's
    forward over entries (seq[t+1], f_t), t <= n-2, followed by k entries that feed back the head's
    own last hidden state, recomputed over the whole sequence at every step. {output index: q_V}."""
    seq = c.prompt_token_ids + c.output_token_ids
    P = len(c.prompt_token_ids)

    def fwd(model, toks, feats=None):
        kw = {} if feats is None else {"features_BTD": feats}
        return model(torch.tensor([toks]), torch.arange(len(toks))[None], hidden_layer=-1, **kw)

    _, f = fwd(target, seq[:-1])
    out, k = {}, 0
    for t, e in enumerate(c.extra["spec"]["events"]):
        if e in "ar":
            n = P + t - k                      # the round's committed length
            toks, feats = seq[1:n], f[:, : n - 1]
            for j in range(1, k + 1):          # the chain: token seq[n+j-1], the head's own feature
                _, hh = fwd(head, toks, feats)
                toks, feats = toks + [seq[n + j - 1]], torch.cat([feats, hh[:, -1:]], 1)
            lg, _ = fwd(head, toks, feats)
            out[t] = torch.softmax(lg[0, -1].double() / T, -1)
        k = k + 1 if e == "a" else 0
    return out


def test_head_q_equals_the_decoders_and_a_cache_free_chain(head_models, monkeypatch):
    """The verifier's q of every a / r token of head claims (head_draft_logits: one head pass plus a
    batched chain over copies of its cache) is (1) the q the decoder drew that token's draft from,
    captured from the decoder's draws (drafters.Drafting.draw), and (2) a cache-free recomputation
    of the chain."""
    from verinfer.engine.engine import Engine
    from verinfer.speculative.drafters import Drafting
    from verinfer.speculative.spec_claims import head_draft_logits

    t, h, _ = head_models
    drawn = {}  # (row, round, slot) -> q_V of the decoder's draw
    orig = Drafting.draw

    def spy(self, lg, gens, rows, active, i):
        x, q = orig(self, lg, gens, rows, active, i)
        for b, r in enumerate(active):
            drawn[(r, rows.outs[r].target_forwards, i)] = q[b].double().cpu()
        return x, q

    monkeypatch.setattr(Drafting, "draw", spy)
    claims = _head_claims(head_models, Rule("kl", 1e9), n=3, max_tokens=20)  # many accepted: long chains
    monkeypatch.undo()
    eng = Engine(h, lean_prefill=True)
    n_checked, n_chain, worst = 0, 0, 0.0
    for r, c in enumerate(claims):
        seq = c.prompt_token_ids + c.output_token_ids
        _, f_TD = Engine(t).forward_sequence(seq[:-1], hidden_layer=-1)
        ev = c.extra["spec"]["events"]
        ld = head_draft_logits(eng, seq, len(c.prompt_token_ids), f_TD, ev)
        q_ver = torch.softmax(ld.double(), -1)
        ref = _scratch_head_q(t, h, c, 1.0)
        assert sorted(ref) == [i for i, e in enumerate(ev) if e in "ar"]
        assert torch.isnan(q_ver[[i for i, e in enumerate(ev) if e in "tb"]]).all()
        rnd = k = 0
        for i, e in enumerate(ev):
            if e in "ar":
                torch.testing.assert_close(q_ver[i], ref[i], rtol=0, atol=1e-5)
                torch.testing.assert_close(q_ver[i], drawn[(r, rnd, k)], rtol=0, atol=1e-5)
                worst = max(worst, float((q_ver[i] - drawn[(r, rnd, k)]).abs().max()))
                n_checked += 1
                n_chain += k > 0
            k, rnd = (k + 1, rnd) if e == "a" else (0, rnd + 1)
    print({"tokens_checked": n_checked, "chain_slots": n_chain, "max_abs_q_diff_vs_decoder": worst})
    assert n_checked >= 30 and n_chain >= 10


def test_head_claims_verify_and_kl_head_is_caught(head_models):
    """Honest standard claims with the head at temperature 1: 0 violations, every draw replayed
    (the 't' first token from round 0's token noise); a provider running the KL judge on the head
    while claiming standard has larger mean -log min(1, p/q) on its accepted tokens."""
    t, h, _ = head_models
    claims = _head_claims(head_models, Rule("standard"), n=6, max_tokens=32)
    assert all(c.extra["spec"]["draft_kind"] == "head" and c.extra["spec"]["events"][0] == "t" for c in claims)
    honest = verify_spec_claims(claims, t, h)
    assert honest["violation"].sum() == 0 and honest["replay_match"].all()
    assert (honest["margin"] == 0).all()
    assert (honest["event"] == "t").sum() == len(claims) and (honest["event"] == "a").sum() >= 10
    kl = verify_spec_claims(_head_claims(head_models, Rule("kl", 1.0), n=6, max_tokens=32, seed=8), t, h)
    mean = lambda r: r["accept_nll"][r["event"] == "a"].mean()  # noqa: E731
    print({"honest_mean_accept_nll": mean(honest), "kl_mean_accept_nll": mean(kl),
           "kl_replay_match": kl["replay_match"].mean()})
    assert mean(kl) > mean(honest) and not kl["replay_match"].all()
    # the 't' token is a draw from p: tampering with it is not replayed
    c = claims[0]
    c.output_token_ids[0] = (c.output_token_ids[0] + 1) % t.config.vocab_size
    rows = verify_spec_claims([c], t, h)
    assert not rows["replay_match"][0] and rows["margin"][0] > 0


def test_greedy_head_claims_verify_and_drafts_must_match(head_models, models):
    t, h, _ = head_models
    claims = _head_claims(head_models, Rule("standard"), temperature=0.0, n=3, max_tokens=16)
    rows = verify_spec_claims(claims, t, h)
    assert rows["violation"].sum() == 0 and rows["replay_match"].all() and rows["event"][0] == "t"
    c = claims[0]
    c.output_token_ids[3] = (c.output_token_ids[3] + 1) % t.config.vocab_size
    rows = verify_spec_claims(claims, t, h)
    assert rows["violation"][(rows["claim"] == 0) & (rows["position"] == 3)].all()
    # the claims name their draft's kind: a head's claims with a separate draft (and back) are refused
    with pytest.raises(ClaimError, match="verified with a separate draft model") as e:
        verify_spec_claims(claims, t, models[1])
    assert "FeatureHead.from_target" in e.value.fix
    with pytest.raises(ClaimError, match="drafted by a separate draft model"):
        verify_spec_claims(_claims(models, Rule("standard"), temperature=0.0, n=1, max_tokens=4), t, h)
    claims[1].extra["spec"]["draft_kind"] = "eagle"
    with pytest.raises(ClaimError, match="draft_kind"):
        verify_spec_claims(claims[1:], t, h)
