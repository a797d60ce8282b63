"""Audit link for speculative providers (DiFR appendix F): claims carry, per output token, the
mode that produced it, and the verifier checks each token under that mode with ONE teacher-forced
forward of the target and one of the draft over prompt + output (no sequential decoding).

Claim field (JSONL, beside the usual ones; token ids only):
  "spec": {"method": "standard" | "kl" | ...,   # the acceptance rule the provider says it ran
           "threshold": float, "gamma": int, "draft": str,
           "events": "aaraab..."}              # per output token: a = accepted draft token,
                                                # r = correction after a rejection, b = bonus
Structure checked per claim: runs of 'a' are at most gamma long; 'b' follows exactly gamma
'a's; 'r' ends a shorter run (the last round may be cut by a stop token or max_tokens).

Per-token check under the claimed rule "standard" (the lossless one), with p / q the target /
draft distributions at the sampling temperature (temperature 0: argmax checks):
  a: accepted with probability min(1, p(y)/q(y)); score accept_nll = -log min(1, p(y)/q(y))
  r: drawn from norm(max(0, p - q)): impossible when p(y) <= q(y)  (violation)
  b: drawn from p: impossible when p(y) == 0                        (violation)
  greedy: every token must be argmax p                                (violation otherwise)
The per-output-token score is accept_nll on 'a' tokens, 0 on others, +inf on violations;
batch means of it separate an honest standard provider from one that runs the lossy KL judge
(which accepts tokens the ratio test would usually reject) -> tokens-to-detect with the DiFR
protocol (audit.metrics.auc_vs_tokens at AUC@1%FPR >= 0.99).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from verinfer.audit.claims import Claim
from verinfer.errors import ClaimError
from verinfer.models.llama import LlamaLM
from verinfer.sampling.params import SamplingParams
from verinfer.speculative.loop import SpeculativeDecoder
from verinfer.speculative.rules import Rule

SPEC_NOISE = "inverse-cdf"  # claims must name a backend; the spec field says the real RNG protocol
RNG_PROTOCOL = ("torch.Generator(seed) on CPU; per round: gamma draft draws (multinomial), gamma uniforms "
                "(float64), one draw for the correction/bonus token")


def spec_claims(target: LlamaLM, draft: LlamaLM, prompts: list[list[int]], *, run_rule: Rule, claimed: str,
                gamma: int, temperature: float, max_tokens: int, seed: int, model_name: str, draft_name: str,
                provider: str, batch_size: int = 16, stop_token_ids=()) -> list[Claim]:
    """Generate with `run_rule` and label the claims as produced by `claimed` (a provider that
    claims 'standard' while running 'kl' is the misconfiguration the audit must catch)."""
    seeds = [seed * 1_000_003 + i for i in range(len(prompts))] if temperature > 0 else None
    dec = SpeculativeDecoder(target, draft, run_rule, gamma=gamma, temperature=temperature, stop_token_ids=stop_token_ids)
    outs = dec.generate(prompts, max_tokens, seeds=seeds, batch_size=batch_size)
    claims = []
    for i, o in enumerate(outs):
        params = SamplingParams(temperature=temperature, seed=None if seeds is None else seeds[i],
                                max_tokens=max_tokens, noise=SPEC_NOISE)
        spec = {"method": claimed, "threshold": run_rule.threshold if claimed == run_rule.name else 0.0,
                "gamma": gamma, "draft": draft_name, "events": o.events, "rng": RNG_PROTOCOL}
        claims.append(Claim(f"{provider}-{i}", model_name, list(o.prompt_token_ids), o.output_token_ids, params,
                            provider, {"spec": spec}))
    return claims


def check_events(events: str, gamma: int, n_tokens: int, where: str) -> None:
    if not isinstance(events, str) or len(events) != n_tokens or set(events) - set("arb"):
        raise ClaimError(f"`spec.events` must be a string of a/r/b, one per output token ({n_tokens})", where=where)
    run = 0
    for k, e in enumerate(events):
        if e == "a":
            run += 1
            if run > gamma:
                raise ClaimError(f"`spec.events`: more than gamma={gamma} accepted tokens in a row at token {k}",
                                 where=where)
        else:
            if e == "b" and run != gamma:
                raise ClaimError(f"`spec.events`: bonus token at {k} after {run} accepted tokens (needs gamma={gamma})",
                                 where=where)
            if e == "r" and run >= gamma:
                raise ClaimError(f"`spec.events`: correction at {k} after a fully accepted block", where=where)
            run = 0


def _spec_of(c: Claim) -> dict:
    where = c.source or f"claim {c.id}"
    s = c.extra.get("spec")
    if not isinstance(s, dict):
        raise ClaimError("missing or malformed `spec` object", where=where,
                         fix="speculative claims carry spec {method, gamma, events}")
    g = s.get("gamma")
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ClaimError(f"`spec.gamma` must be an integer >= 1, got {g!r}", where=where)
    check_events(s.get("events"), g, len(c.output_token_ids), where)
    if s.get("method") != "standard":
        raise ClaimError(f"`spec.method` {s.get('method')!r}: only claims of standard (lossless) speculative sampling "
                         "can be verified", where=where, fix="the lossy rules have no target-distribution guarantee")
    return s


@torch.no_grad()
def verify_spec_claims(claims: list[Claim], target: LlamaLM, draft: LlamaLM) -> dict[str, np.ndarray]:
    """One row per output token: claim index, position, event, accept_nll, violation, score."""
    rows: dict[str, list] = {k: [] for k in ("claim", "position", "event", "accept_nll", "violation", "score")}
    for ci, c in enumerate(claims):
        s = _spec_of(c)
        seq = c.prompt_token_ids + c.output_token_ids
        P, n = len(c.prompt_token_ids), len(c.output_token_ids)
        x = torch.tensor([seq[:-1]], device=target.device)
        pos = torch.arange(len(seq) - 1, device=target.device)[None]
        lt, _ = target(x, pos)
        ld, _ = draft(x.to(draft.device), pos.to(draft.device))
        T = c.sampling.temperature
        lt, ld = lt[0, P - 1 :].float().cpu(), ld[0, P - 1 :].float().cpu()
        y = torch.tensor(c.output_token_ids)
        if T > 0:
            p = torch.softmax(lt.double() / T, -1)
            q = torch.softmax(ld.double() / T, -1)
            py, qy = p[torch.arange(n), y], q[torch.arange(n), y]
        for t, e in enumerate(s["events"]):
            viol, nll = False, 0.0
            if T == 0:
                viol = int(lt[t].argmax()) != int(y[t])
            elif e == "a":
                nll = -math.log(min(1.0, float(py[t] / qy[t]))) if py[t] > 0 else math.inf
                viol = bool(py[t] == 0)
            elif e == "r":
                viol = bool(py[t] <= qy[t])
            else:
                viol = bool(py[t] == 0)
            rows["claim"].append(ci)
            rows["position"].append(t)
            rows["event"].append(e)
            rows["accept_nll"].append(nll)
            rows["violation"].append(viol)
            rows["score"].append(math.inf if viol else nll)
    return {k: np.asarray(v) for k, v in rows.items()}


def write_scores(rows: dict[str, np.ndarray], claims: list[Claim], out: str | Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [claims[i].id for i in rows["claim"]]
    tokens = [claims[i].output_token_ids[t] for i, t in zip(rows["claim"], rows["position"])]
    t = pa.table({"claim_id": ids, "position": rows["position"], "token_id": tokens, "event": rows["event"],
                  "spec_accept_nll": rows["accept_nll"], "spec_violation": rows["violation"],
                  "spec_score": rows["score"]})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, out)


def tokens_to_detect_kl_provider(target: LlamaLM, draft: LlamaLM, prompts: list[list[int]], *, threshold: float,
                                 gamma: int = 4, temperature: float = 1.0, max_tokens: int = 64, seed: int = 0,
                                 batch_size: int = 16, model_name: str = "testbed-target") -> dict:
    """Honest standard provider vs a provider running the KL judge at `threshold` while claiming
    standard: per-token scores, AUC@1%FPR by batch size (DiFR protocol), tokens-to-detect."""
    from verinfer.audit.metrics import auc_vs_tokens, tokens_to_detect

    res = {}
    scores = {}
    for name, rule, s in [("honest_standard", Rule("standard"), seed), ("kl_claims_standard", Rule("kl", threshold), seed + 7)]:
        cl = spec_claims(target, draft, prompts, run_rule=rule, claimed="standard", gamma=gamma, temperature=temperature,
                         max_tokens=max_tokens, seed=s, model_name=model_name, draft_name="testbed-draft",
                         provider=name, batch_size=batch_size)
        rows = verify_spec_claims(cl, target, draft)
        scores[name] = rows["score"]
        a = rows["event"] == "a"
        res[name] = {"tokens": int(rows["score"].size), "accepted_fraction": float(a.mean()),
                     "violations": int(rows["violation"].sum()),
                     "mean_accept_nll": float(rows["accept_nll"][a].mean()) if a.any() else 0.0}
    curve = auc_vs_tokens(scores["honest_standard"], scores["kl_claims_standard"],
                          batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000), rng=np.random.default_rng(seed))
    res["auc_at_1pct_fpr_by_tokens"] = {str(k): v for k, v in curve.items()}
    res["tokens_to_detect"] = tokens_to_detect(curve)
    res["setup"] = {"threshold": threshold, "gamma": gamma, "temperature": temperature, "max_tokens": max_tokens,
                    "prompts": len(prompts)}
    return res


# --- file-level entry points (the CLI calls these) ---------------------------------------------
def generate_claims_file(model_dir, draft_dir, out, *, rule: str = "kl", threshold: float = 0.5, gamma: int = 4,
                         n: int = 32, max_tokens: int = 64, seed: int = 0, temperature: float = 1.0,
                         judge_path=None, device: str = "cpu", claimed: str | None = None) -> list[Claim]:
    """Speculative generation on the audit prompts (models/corpus.eval_prompts) -> claims JSONL
    with a `spec` field. `claimed` defaults to the rule actually run (an honest label)."""
    from verinfer.audit.claims import write_claims
    from verinfer.audit.pipeline import prompts_for
    from verinfer.models.load import model_info
    from verinfer.speculative.judge import Judge

    judge = None
    if rule == "autojudge":
        if judge_path is None:
            raise ValueError("--speculative autojudge needs --judge PATH (a judge JSON, e.g. "
                             "benchmarks/results/kl_judge_autojudge.json)")
        judge = Judge.from_json(judge_path)
    r = Rule(rule, 0.0 if rule == "standard" else threshold, judge)
    info, dinfo = model_info(model_dir), model_info(draft_dir)
    target = LlamaLM.from_pretrained(model_dir, device=device)
    draft = LlamaLM.from_pretrained(draft_dir, device=device)
    prompts = prompts_for(model_dir, n, seed)
    stop = (info.eos_token_id,) if info.eos_token_id is not None else ()
    claims = spec_claims(target, draft, prompts, run_rule=r, claimed=claimed or rule, gamma=gamma,
                         temperature=temperature, max_tokens=max_tokens, seed=seed, model_name=info.name,
                         draft_name=dinfo.name, provider=f"speculative-{rule}", stop_token_ids=stop)
    write_claims(out, claims)
    return claims


def has_spec(claims: list[Claim]) -> bool:
    return any("spec" in c.extra for c in claims)


def score_file(claims_path, model_dir, draft_dir, out, device: str = "cpu") -> dict:
    """Verify speculative claims (all must carry `spec`): per-token Parquet at `out`; returns a
    summary (tokens, violations, mean accept_nll, per-claim violations)."""
    from verinfer.audit.claims import check_claims_fit, read_claims
    from verinfer.models.load import model_info

    claims = read_claims(claims_path)
    missing = [c.source for c in claims if "spec" not in c.extra]
    if missing:
        raise ClaimError("mixed file: some claims carry `spec` and some do not", where=missing[0],
                         fix="score speculative and plain claims in separate files")
    info = model_info(model_dir)
    check_claims_fit(claims, claims_path, model_name=info.name, vocab_size=info.vocab_size,
                     max_positions=info.max_positions)
    target = LlamaLM.from_pretrained(model_dir, device=device)
    draft = LlamaLM.from_pretrained(draft_dir, device=device)
    rows = verify_spec_claims(claims, target, draft)
    write_scores(rows, claims, out)
    a = rows["event"] == "a"
    return {"tokens": int(rows["score"].size), "violations": int(rows["violation"].sum()),
            "claims_with_violations": sorted({claims[i].id for i in rows["claim"][rows["violation"]]}),
            "accepted_fraction": float(a.mean()),
            "mean_accept_nll": float(rows["accept_nll"][a].mean()) if a.any() else 0.0}
