"""Speculative claims as files: generate claims JSONL with a `spec` field from speculative
decoding on the audit prompts, and verify such a file into per-token Parquet (the CLI calls these)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from verinfer.claims import Claim, check_claims_fit, read_claims, write_claims
from verinfer.errors import ClaimError
from verinfer.io import output
from verinfer.progress import progress_bar
from verinfer.models.llama import LlamaLM
from verinfer.models.load import model_info
from verinfer.models.prompts import prompts_for
from verinfer.numerics import Numerics
from verinfer.speculative.autojudge import Judge
from verinfer.speculative.rules import Rule
from verinfer.scores import SPEC_SCHEMA, make_provenance, spec_table, write_scores
from verinfer.speculative.spec_claims import spec_claims, verify_spec_claims


SPEC_VERIFIER_NUMERICS = Numerics(dtype="fp32")  # speculative claims are verified in fp32 (LlamaLM's default)


def load_draft(draft_dir, target: LlamaLM):
    """(draft, its name): a separate draft model directory, or a feature-level draft head's
    (speculative/feature_head.py: `verinfer models build-head`), loaded on `target`."""
    from verinfer.speculative.feature_head import HEAD_FILE, FeatureHead

    d = Path(draft_dir)
    if (d / HEAD_FILE).is_file():
        return FeatureHead.from_target(d, target), d.name
    return LlamaLM.from_pretrained(d, device=target.device, dtype=target.dtype), model_info(d).name


def generate_claims_file(model_dir, draft_dir, out, *, rule: str = "kl", threshold: float = 0.5, gamma: int = 4,
                         n: int = 32, max_tokens: int = 64, seed: int = 0, temperature: float = 1.0,
                         judge_path=None, device: str = "cpu", claimed: str | None = None,
                         show_progress: bool = True, draft_confidence: float = 0.0) -> list[Claim]:
    """Speculative generation on the audit prompts (models/corpus.eval_prompts) -> claims JSONL
    with a `spec` field. `claimed` defaults to the rule actually run (an honest label)."""
    with output(out, "claims file"):
        return _generate_claims_file(model_dir, draft_dir, out, rule=rule, threshold=threshold, gamma=gamma, n=n,
                                     max_tokens=max_tokens, seed=seed, temperature=temperature, judge_path=judge_path,
                                     device=device, claimed=claimed, show_progress=show_progress,
                                     draft_confidence=draft_confidence)


def _generate_claims_file(model_dir, draft_dir, out, *, rule, threshold, gamma, n, max_tokens, seed, temperature,
                          judge_path, device, claimed, show_progress, draft_confidence=0.0) -> list[Claim]:
    judge = None
    if rule == "autojudge":
        if judge_path is None:
            raise ValueError("--speculative autojudge needs --judge PATH: a trained AutoJudge head (JSON, as "
                             "`python -m benchmarks.kl_judge` writes it)")
        judge = Judge.from_json(judge_path)
    r = Rule(rule, 0.0 if rule == "standard" else threshold, judge)
    info = model_info(model_dir)
    target = LlamaLM.from_pretrained(model_dir, device=device)
    draft, draft_name = load_draft(draft_dir, target)
    prompts = prompts_for(model_dir, n, seed)
    stop = (info.eos_token_id,) if info.eos_token_id is not None else ()
    with progress_bar(f"generate speculative-{rule}", len(prompts), show_progress) as adv:
        claims = spec_claims(target, draft, prompts, run_rule=r, claimed=claimed or rule, gamma=gamma,
                             temperature=temperature, max_tokens=max_tokens, seed=seed, model_name=info.name,
                             draft_name=draft_name, provider=f"speculative-{rule}", stop_token_ids=stop,
                             progress=adv, draft_confidence=draft_confidence)
    write_claims(out, claims)
    return claims


def score_file(claims_path, model_dir, draft_dir, out, device: str = "cpu", model_names: tuple[str, ...] = (),
               show_progress: bool = True, claims: Iterable[Claim] | None = None) -> dict:
    """Verify speculative claims (all must carry `spec`): per-token Parquet at `out` (the scores
    contract's SPEC_SCHEMA, with provenance); returns a summary (tokens, violations, mean
    accept_nll, per-claim violations). model_names: names the user vouches the target is claimed
    under, besides its own aliases. claims: the file's claims when the caller has started reading
    it (else the file is read here)."""
    with output(out, "scores file", inputs=[claims_path]):
        return _score_file(claims_path, model_dir, draft_dir, out, device, model_names, show_progress, claims)


def _score_file(claims_path, model_dir, draft_dir, out, device, model_names, show_progress, claims) -> dict:
    claims = list(claims) if claims is not None else read_claims(claims_path)
    missing = [c.source for c in claims if "spec" not in c.extra]
    if missing:
        raise ClaimError("mixed file: some claims carry `spec` and some do not", where=missing[0],
                         fix="score speculative and plain claims in separate files")
    info = model_info(model_dir)
    check_claims_fit(claims, claims_path, model_name=info.name, vocab_size=info.vocab_size,
                     max_positions=info.max_positions, aliases=(*info.aliases, *model_names))
    target = LlamaLM.from_pretrained(model_dir, device=device)
    draft, _ = load_draft(draft_dir, target)
    with progress_bar(f"score {Path(claims_path).name} (speculative)", sum(len(c.output_token_ids) for c in claims),
                      show_progress) as adv:
        rows = verify_spec_claims(claims, target, draft, progress=adv)
    noise = {c.sampling.noise for c in claims}
    prov = make_provenance(info, SPEC_VERIFIER_NUMERICS, device, noise)
    write_scores(out, spec_table(rows, claims), SPEC_SCHEMA, prov)
    a = rows["event"] == "a"
    return {"tokens": int(rows["score"].size), "violations": int(rows["violation"].sum()),
            "claims_with_violations": sorted({claims[i].id for i in rows["claim"][rows["violation"]]}),
            "accepted_fraction": float(a.mean()),
            "mean_accept_nll": float(rows["accept_nll"][a].mean()) if a.any() else 0.0,
            "replay_match": float(rows["replay_match"].mean()) if a.size else 1.0}


def train_autojudge(model_dir, draft_dir, out, *, n: int = 64, seed: int = 1, max_tokens: int = 8, C: float = 1.0,
                    device: str = "cpu", show_progress: bool = True) -> dict:
    """Train the AutoJudge head that `generate --speculative autojudge --judge PATH` reads
    (`speculative.autojudge`: mine which target/draft mismatches change the final answer, then a
    logistic regression on both models' hidden states). Mined on `n` arithmetic training problems
    of `seed` (models/corpus.train_problems, never a held-out question), greedy, stopping at a
    newline token after at most `max_tokens`; the judge JSON goes to `out`. Returns the mining
    summary (problems, mismatches, important fraction)."""
    from verinfer.models.corpus import train_problems
    from verinfer.models.load import load_tokenizer
    from verinfer.models.nextline import newline_token_ids
    from verinfer.speculative.autojudge import mine, train_judge

    with output(out, "judge file"):
        tok = load_tokenizer(model_dir)
        prompts = [tok.encode(q, add_special_tokens=False) for q, _ in train_problems(n, seed)]
        target = LlamaLM.from_pretrained(model_dir, device=device)
        draft = LlamaLM.from_pretrained(draft_dir, device=device)
        stop = tuple(sorted(newline_token_ids(tok)))
        with progress_bar("mine AutoJudge labels", len(prompts), show_progress) as adv:
            mined = mine(target, draft, tok, prompts, max_tokens, stop, progress=lambda k: adv(1))
        train_judge(mined, C=C, seed=seed).to_json(out)
    return {"problems": mined.problems, "mismatches": int(mined.labels_N.numel()),
            "important_fraction": float(mined.labels_N.float().mean()), "out": str(out)}
