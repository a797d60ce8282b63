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
  r: drawn from norm(max(0, p - q)): impossible when p(y) <= q(y)  (violation; with a bf16/fp16
     target, when p(y) < q(y) by more than RESIDUAL_REL_TOL of max(p(y), q(y)): see below)
  b: drawn from p: impossible when p(y) == 0                        (violation)
  greedy: every token must be argmax p                                (violation otherwise)
The per-output-token score is accept_nll on 'a' tokens, 0 on others, +inf on violations;
batch means of it separate an honest standard provider from one that runs the lossy KL judge
(which accepts tokens the ratio test would usually reject) -> tokens-to-detect with the DiFR
protocol (audit.metrics.auc_vs_tokens at AUC@1%FPR >= 0.99).

Low precision: the verifier's p and q come from one teacher-forced forward, the provider's from
cached decode steps; in bf16 these differ by rounding (SmolLM2-135M with its draft, 2,322 honest
corrections: (p(y) - q(y)) / max(p(y), q(y)) at the verifier had minimum -0.080 and 0.1% quantile
+0.035), so an exact p(y) <= q(y) test flagged 1 honest token in 4,096. The tolerance does not
weaken the KL-judge audit: a lossy rule is caught by accept_nll on 'a' tokens, not by violations.

Re-execution (sampled claims): every random number of verinfer's speculative decoder comes from
the claim's speculative-keyed noise (sampling/noise.py), addressed by (seed, round, slot); the
round and slot of each token follow from the events (a round ends at r or b). `replay_draw`
regenerates the draft token, the acceptance uniform and the correction/bonus draw from the
verifier's p and q: replay_match (the claimed token and accept/reject decision reproduced),
margin (post-Gumbel margin of the claimed token, sampling/gap.py) and accept_gap
(log u - log min(1, p(x)/q(x)): < 0 iff the standard rule accepts the draft x).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from verinfer.claims import Claim
from verinfer.engine.engine import Engine
from verinfer.errors import ClaimError
from verinfer.models.llama import LlamaLM
from verinfer.sampling.gap import probs_margin
from verinfer.sampling.noise import SpeculativeNoise, speculative_noise
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.sampler import sample_probs
from verinfer.speculative.decoder import SpeculativeDecoder
from verinfer.speculative.rules import Rule, residual

SPEC_NOISE = "speculative-keyed"  # the noise stream SpeculativeDecoder draws from (sampling/noise.py)
# a correction token with p(y) below q(y) by more than this share of max(p(y), q(y)) is a violation
# (exact p(y) <= q(y) in fp32; module docstring, "Low precision")
RESIDUAL_REL_TOL = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 0.1, torch.float16: 0.1}


def residual_violation(py: float, qy: float, rel_tol: float = 0.0) -> bool:
    """A correction token y could not come from norm(max(0, p - q)): p(y) <= q(y), or, with rel_tol > 0,
    p(y) < q(y) - rel_tol * max(p(y), q(y))."""
    if rel_tol == 0.0 or py <= 0.0:
        return py <= qy or py <= 0.0
    return py - qy < -rel_tol * max(py, qy)


def spec_claims(target: LlamaLM, draft: LlamaLM, prompts: list[list[int]], *, run_rule: Rule, claimed: str,
                gamma: int, temperature: float, max_tokens: int, seed: int, model_name: str, draft_name: str,
                provider: str, batch_size: int = 16, stop_token_ids=(), progress=None) -> list[Claim]:
    """Generate with `run_rule` and label the claims as produced by `claimed` (a provider that
    claims 'standard' while running 'kl' is the misconfiguration the audit must catch).
    progress(k) after each batch of k prompts."""
    seeds = [seed * 1_000_003 + i for i in range(len(prompts))] if temperature > 0 else None
    dec = SpeculativeDecoder(target, draft, run_rule, gamma=gamma, temperature=temperature, stop_token_ids=stop_token_ids)
    outs = dec.generate(prompts, max_tokens, seeds=seeds, batch_size=batch_size, progress=progress)
    claims = []
    for i, o in enumerate(outs):
        params = SamplingParams(temperature=temperature, seed=None if seeds is None else seeds[i],
                                max_tokens=max_tokens, noise=SPEC_NOISE)
        spec = {"method": claimed, "threshold": run_rule.threshold if claimed == run_rule.name else 0.0,
                "gamma": gamma, "draft": draft_name, "events": o.events}
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


def replay_draw(p_V: torch.Tensor, q_V: torch.Tensor, claimed: int, event: str, noise: SpeculativeNoise,
                rnd: int, slot: int) -> tuple[bool, float, float]:
    """Re-execute the draw that produced one claimed token of round `rnd`, slot `slot` (its index in
    the round) from the claim's speculative-keyed noise and the verifier's p (target) / q (draft):
    (replay_match, margin, accept_gap).
      a: the draft token x = sample_probs(q, draft noise (rnd, slot)) must be the claimed token and
         pass the ratio test; r: x must fail it and the correction sample_probs(residual(p, q),
         token noise rnd) be the claimed token; b: sample_probs(p, token noise rnd).
    accept_gap = log u - log min(1, p(x)/q(x)) (u the slot's acceptance uniform): < 0 iff the
    standard rule accepts x (NaN for b). margin: `gap.probs_margin` of the claimed token under the
    distribution it was drawn from (0 when reproduced, +inf when impossible)."""
    agap, accepted = math.nan, None
    if event == "b":
        dist, tok_noise = p_V, noise.token(rnd)
    else:
        x = sample_probs(q_V, noise.draft(rnd, slot))
        u = float(noise.accept_uniforms(rnd, slot + 1)[slot])
        ratio = min(1.0, float(p_V[x] / q_V[x]))
        agap = math.log(u) - math.log(ratio) if ratio > 0 else math.inf
        accepted = agap < 0
        dist, tok_noise = (q_V, noise.draft(rnd, slot)) if event == "a" else (residual(p_V, q_V), noise.token(rnd))
    margin, replay = probs_margin(dist, claimed, tok_noise)
    match = replay == claimed and (accepted is None or accepted == (event == "a"))
    return match, margin, agap


@torch.no_grad()
def verify_spec_claims(claims: list[Claim], target: LlamaLM, draft: LlamaLM, progress=None) -> dict[str, np.ndarray]:
    """One row per output token: claim index, position, event, accept_nll, violation, score and
    the re-execution of the claim's draws (`replay_draw`; sampled claims, noise speculative-keyed):
    replay_match, margin, accept_gap (greedy claims: replay_match = argmax check, margin 0, NaN).
    progress(k) after each claim of k output tokens."""
    keys = ("claim", "position", "event", "accept_nll", "violation", "score", "replay_match", "margin", "accept_gap")
    rows: dict[str, list] = {k: [] for k in keys}
    target_engine, draft_engine = Engine(target), Engine(draft)
    rel_tol = max(RESIDUAL_REL_TOL.get(target.dtype, 0.1), RESIDUAL_REL_TOL.get(draft.dtype, 0.1))
    for ci, c in enumerate(claims):
        s = _spec_of(c)
        seq = c.prompt_token_ids + c.output_token_ids
        P, n = len(c.prompt_token_ids), len(c.output_token_ids)
        lt, _ = target_engine.forward_sequence(seq[:-1])
        ld, _ = draft_engine.forward_sequence(seq[:-1])
        T = c.sampling.temperature
        lt, ld = lt[P - 1 :].float().cpu(), ld[P - 1 :].float().cpu()
        y = torch.tensor(c.output_token_ids)
        if T > 0:
            if c.sampling.noise != SPEC_NOISE:
                raise ClaimError(f"`sampling.noise` {c.sampling.noise!r}: sampled speculative claims are verified "
                                 f"against the {SPEC_NOISE!r} stream", where=c.source or f"claim {c.id}",
                                 fix=f"generate them with verinfer's speculative decoder (noise {SPEC_NOISE!r})")
            p = torch.softmax(lt.double() / T, -1)
            q = torch.softmax(ld.double() / T, -1)
            py, qy = p[torch.arange(n), y], q[torch.arange(n), y]
            noise = speculative_noise(c.sampling.seed, p.shape[-1])
        rnd = slot = 0
        for t, e in enumerate(s["events"]):
            viol, nll = False, 0.0
            match, margin, agap = True, 0.0, math.nan
            if T == 0:
                viol = int(lt[t].argmax()) != int(y[t])
                match = not viol
            else:
                match, margin, agap = replay_draw(p[t], q[t], int(y[t]), e, noise, rnd, slot)
                if e == "a":
                    nll = -math.log(min(1.0, float(py[t] / qy[t]))) if py[t] > 0 else math.inf
                    viol = bool(py[t] == 0)
                elif e == "r":
                    viol = residual_violation(float(py[t]), float(qy[t]), rel_tol)
                else:
                    viol = bool(py[t] == 0)
            slot, rnd = (slot + 1, rnd) if e == "a" else (0, rnd + 1)
            for k, v in zip(keys, (ci, t, e, nll, viol, math.inf if viol else nll, match, margin, agap)):
                rows[k].append(v)
        if progress is not None:
            progress(n)
    return {k: np.asarray(v) for k, v in rows.items()}
