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


def _claims(models, rule, temperature=1.0, n=6, max_tokens=24):
    t, d, tok = models
    prompts = [tok.encode(s, add_special_tokens=False) for s in
               ("import os\nimport ", "    def __init__(self", "Q: 37+45=\nA: ", "class A:\n    def ", "    return self._",
                "for i in range(")][:n]
    return spec_claims(t, d, prompts, run_rule=rule, claimed="standard", gamma=3, temperature=temperature,
                       max_tokens=max_tokens, seed=1, model_name="m", draft_name="d", provider="p")


def test_event_structure_checks():
    check_events("aaab" "ar" "r" "aa", 3, 9, "x")
    for bad, msg in [("aaaa", "more than gamma"), ("aab", "bonus"), ("aaar", "after a fully accepted"),
                     ("ax", "a/r/b"), ("aa", "one per output token")]:
        with pytest.raises(ClaimError, match=msg):
            check_events(bad, 3, len(bad) + (bad == "aa"), "x")


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
