"""Audit link for speculative providers (DiFR appendix F): claims carry, per output token, the
mode that produced it, and the verifier checks each token under that mode with ONE teacher-forced
forward of the target and one of the draft over prompt + output (no sequential decoding).

Claim field (JSONL, beside the usual ones; token ids only):
  "spec": {"method": "standard" | "kl" | ...,   # the acceptance rule the provider says it ran
           "threshold": float, "gamma": int, "draft": str,
           "draft_kind": "model" | "head",     # optional, default "model": a separate draft model,
                                                # or a feature-level head (feature_head.py)
           "draft_confidence": float,           # optional, default 0: the decoder's dynamic draft
                                                # length (a block ends after a token q(x) < it)
           "events": "aaraab..."}              # per output token: a = accepted draft token,
                                                # r = correction after a rejection, b = bonus,
                                                # t = the target's own token (heads: the first)
Structure checked per claim: runs of 'a' are at most gamma long; 'b' follows exactly gamma
'a's (with draft_confidence: 1 to gamma, the block cut after its last one); 'r' ends a shorter
run (the last round may be cut by a stop token or max_tokens). A head
claim starts with exactly one 't' (the target's prefill draws the first output token itself,
round 0), which no other claim has.

Per-token check under the claimed rule "standard" (the lossless one), with p / q the target /
draft distributions at the sampling temperature (temperature 0: argmax checks):
  a: accepted with probability min(1, p(y)/q(y)); score accept_nll = -log min(1, p(y)/q(y))
  r: drawn from norm(max(0, p - q)): impossible when p(y) <= q(y)  (violation; with a bf16/fp16
     target, when p(y) < q(y) by more than RESIDUAL_REL_TOL of max(p(y), q(y)): see below)
  b, t: drawn from p: impossible when p(y) == 0                     (violation)
  greedy: every token must be argmax p                                (violation otherwise)
  draft_confidence tau (sampled claims): a 'b' after fewer than gamma 'a's needs q(y) < tau at the
     last 'a' (the block was cut there), and an 'a' with q(y) < tau must be followed by 'b' (or end
     the claim): violation otherwise, on the 'b' or on the token after the 'a' (q within the bf16
     tolerance of tau on either side is not judged)
The per-output-token score is accept_nll on 'a' tokens, 0 on others, +inf on violations;
batch means of it separate an honest standard provider from one that runs the lossy KL judge
(which accepts tokens the ratio test would usually reject) -> tokens-to-detect with the DiFR
protocol (audit.metrics.auc_vs_tokens at AUC@1%FPR >= 0.99).

Low precision: the verifier's p and q come from one teacher-forced forward, the provider's from
cached decode steps; in bf16 these differ by rounding (SmolLM2-135M with its draft, 2,322 honest
corrections: (p(y) - q(y)) / max(p(y), q(y)) at the verifier had minimum -0.080 and 0.1% quantile
+0.035), so an exact p(y) <= q(y) test flagged 1 honest token in 4,096. The tolerance does not
weaken the KL-judge audit: a lossy rule is caught by accept_nll on 'a' tokens, not by violations.

Draft distribution q of a feature-level head (speculative/feature_head.py; drafting in
drafters.HeadDrafter), seq = prompt + output (length L, prompt length P), f_t the target's
final-norm hidden state at position t (one teacher-forced target forward, the same that gives p):
  head entries  e_t = (token seq[t+1], feature f_t), t = 0..L-2: ONE head pass (KV cache) over them
  round starting at committed length n (its first output token is seq[n]):
    slot 0:   q = softmax(head logits at entry n-2 / T)          (the head's catch-up output)
    slot k>0: q from the chain: cache cut to entries 0..n-2, then k one-token extends with token
              seq[n+j-1] (the accepted draft of slot j-1) and feature = the head's previous output
              f^ (its own prediction, not the target's) at positions n-1..n-2+k
  t, b: q unused (drawn from p).
The chain steps of all rounds of a claim run as rows of one batch (the head's cache copied per
round): at most gamma-1 extends per claim.

Re-execution (sampled claims): every random number of verinfer's speculative decoder comes from
the claim's speculative-keyed noise (sampling/noise.py), addressed by (seed, round, slot); the
round and slot of each token follow from the events (a round ends at r, b or t; a head claim's
't' is round 0, drawn from p with the token noise of round 0). `replay_draw`
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
from verinfer.engine.engine import Engine, Request, select_rows
from verinfer.errors import ClaimError
from verinfer.models.llama import LlamaLM
from verinfer.sampling.gap import probs_margin
from verinfer.sampling.noise import SpeculativeNoise, speculative_noise
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.sampler import sample_probs
from verinfer.speculative.decoder import SpeculativeDecoder
from verinfer.speculative.feature_head import FeatureHead
from verinfer.speculative.rules import Rule, residual

SPEC_NOISE = "speculative-keyed"  # the noise stream SpeculativeDecoder draws from (sampling/noise.py)
# a correction token with p(y) below q(y) by more than this share of max(p(y), q(y)) is a violation
# (exact p(y) <= q(y) in fp32; module docstring, "Low precision")
RESIDUAL_REL_TOL = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 0.1, torch.float16: 0.1}
DRAFT_KINDS = ("model", "head")  # spec.draft_kind: a separate draft model (the default) or a FeatureHead


def residual_violation(py: float, qy: float, rel_tol: float = 0.0) -> bool:
    """A correction token y could not come from norm(max(0, p - q)): p(y) <= q(y), or, with rel_tol > 0,
    p(y) < q(y) - rel_tol * max(p(y), q(y))."""
    if rel_tol == 0.0 or py <= 0.0:
        return py <= qy or py <= 0.0
    return py - qy < -rel_tol * max(py, qy)


def _cut_violation(events: str, t: int, slot: int, gamma: int, qy, tau: float, rel_tol: float) -> bool:
    """Token t of a sampled claim against its dynamic draft length (module docstring): a block cut
    (a 'b' after slot < gamma accepted tokens) where the last accepted token's q was not below tau,
    or a block that went on after a token with q below it. q within the tolerance of tau (the
    verifier's q is the provider's up to rounding) is not judged."""
    if tau <= 0 or t == 0 or events[t - 1] != "a":
        return False
    tol = max(rel_tol, 1e-4) * tau
    q_prev = float(qy[t - 1])
    if events[t] == "b" and slot < gamma:
        return q_prev >= tau + tol
    return events[t] != "b" and q_prev < tau - tol


def spec_claims(target: LlamaLM, draft: "LlamaLM | FeatureHead", prompts: list[list[int]], *, run_rule: Rule,
                claimed: str, gamma: int, temperature: float, max_tokens: int, seed: int, model_name: str,
                draft_name: str, provider: str, batch_size: int = 16, stop_token_ids=(), progress=None,
                draft_confidence: float = 0.0) -> list[Claim]:
    """Generate with `run_rule` and label the claims as produced by `claimed` (a provider that
    claims 'standard' while running 'kl' is the misconfiguration the audit must catch). A FeatureHead
    draft is named in the spec (draft_kind "head"; its events start with 't'), and a dynamic draft
    length (draft_confidence > 0) as spec.draft_confidence. progress(k) after each batch of k prompts."""
    seeds = [seed * 1_000_003 + i for i in range(len(prompts))] if temperature > 0 else None
    dec = SpeculativeDecoder(target, draft, run_rule, gamma=gamma, temperature=temperature, stop_token_ids=stop_token_ids,
                             draft_confidence=draft_confidence)
    outs = dec.generate(prompts, max_tokens, seeds=seeds, batch_size=batch_size, progress=progress)
    claims = []
    for i, o in enumerate(outs):
        params = SamplingParams(temperature=temperature, seed=None if seeds is None else seeds[i],
                                max_tokens=max_tokens, noise=SPEC_NOISE)
        spec = {"method": claimed, "threshold": run_rule.threshold if claimed == run_rule.name else 0.0,
                "gamma": gamma, "draft": draft_name, "events": o.events}
        if isinstance(draft, FeatureHead):
            spec["draft_kind"] = "head"
        if draft_confidence > 0:
            spec["draft_confidence"] = draft_confidence
        claims.append(Claim(f"{provider}-{i}", model_name, list(o.prompt_token_ids), o.output_token_ids, params,
                            provider, {"spec": spec}))
    return claims


def check_events(events: str, gamma: int, n_tokens: int, where: str, head: bool = False, cut: bool = False) -> None:
    """The structure of `spec.events` (module docstring); head: the claim's draft is a feature-level
    head, so its first event is the target's own token 't' (and no other is); cut: the decoder's
    blocks end early (draft_confidence), so a bonus may follow 1 to gamma accepted tokens."""
    if not isinstance(events, str) or len(events) != n_tokens or set(events) - set("arbt"):
        raise ClaimError(f"`spec.events` must be a string of a/r/b{'/t' if head else ''}, one per output token "
                         f"({n_tokens})", where=where)
    if "t" in events[1:] or ("t" in events and not head):
        k = events.index("t", 1 if head else 0)
        raise ClaimError(f"`spec.events`: target token 't' at {k}: only a feature-head claim has one, as its first "
                         "event (the target's prefill draws the first output token)", where=where,
                         fix='a head claim names spec.draft_kind "head"; a separate draft\'s rounds end in r or b')
    if head and n_tokens and events[0] != "t":
        raise ClaimError(f"`spec.events` of a feature-head claim start with {events[0]!r}, not 't' (the target's "
                         "own first token)", where=where,
                         fix='spec.draft_kind "head" is for claims of the head decoder; a separate draft model\'s '
                             'claims leave it out')
    run = 0
    for k, e in enumerate(events):
        if e == "a":
            run += 1
            if run > gamma:
                raise ClaimError(f"`spec.events`: more than gamma={gamma} accepted tokens in a row at token {k}",
                                 where=where)
        else:
            if e == "b" and (run != gamma and not (cut and run >= 1)):
                raise ClaimError(f"`spec.events`: bonus token at {k} after {run} accepted tokens (needs "
                                 f"{'1 to ' if cut else ''}gamma={gamma})", where=where)
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
    kind = s.get("draft_kind", "model")
    if kind not in DRAFT_KINDS:
        raise ClaimError(f"`spec.draft_kind` {kind!r} is not one of {', '.join(DRAFT_KINDS)}", where=where,
                         fix='leave it out for a separate draft model; "head" for a feature-level head')
    tau = s.get("draft_confidence", 0.0)
    if not isinstance(tau, (int, float)) or isinstance(tau, bool) or not 0.0 <= tau < 1.0:
        raise ClaimError(f"`spec.draft_confidence` must be a number in [0, 1), got {tau!r}", where=where,
                         fix="leave it out when every round drafted gamma tokens")
    check_events(s.get("events"), g, len(c.output_token_ids), where, head=kind == "head", cut=tau > 0)
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
         token noise rnd) be the claimed token; b, t: sample_probs(p, token noise rnd) (q unused).
    accept_gap = log u - log min(1, p(x)/q(x)) (u the slot's acceptance uniform): < 0 iff the
    standard rule accepts x (NaN for b, t). margin: `gap.probs_margin` of the claimed token under the
    distribution it was drawn from (0 when reproduced, +inf when impossible)."""
    agap, accepted = math.nan, None
    if event in ("b", "t"):
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
def head_draft_logits(head_engine: Engine, seq: list[int], P: int, f_TD: torch.Tensor, events: str) -> torch.Tensor:
    """The logits a feature-level head drafted each output token of one claim from (module docstring,
    "Draft distribution q of a feature-level head"): ld_NV, N = len(events) output tokens, fp32 on the
    CPU; rows of 't' and 'b' tokens (drawn from p, no draft) are NaN. seq = prompt + output (length
    L), P = the prompt's length, f_TD the target's final-norm hidden states at positions 0..L-2.
      pass:  prefill_extend over the entries (seq[t+1], f_t), t = 0..L-2, as prompt entries 0..P-1
             plus appended P..L-2: logits_A and f^_A at entries P-1..L-2, so a round starting at
             output token s (committed length n = P+s) reads its slot 0 at row s-1
      chain: one row per round with a slot k >= 1 (the pass's cache copied), cut to entries
             0..P+s-2; step k extends token seq[P+s+k-1] with the previous step's f^ (step 1: row
             s-1 of the pass) and gives slot k's logits."""
    N, L = len(events), len(seq)
    ld_NV = torch.full((N, head_engine.vocab_size), math.nan)
    slots = []  # (output index, its round's first output index, slot in the round) of every a / r token
    k = 0
    for t, e in enumerate(events):
        if e in ("a", "r"):
            slots.append((t, t - k, k))
        k = k + 1 if e == "a" else 0
    if not slots:
        return ld_NV
    if slots[0][1] < 1:
        raise ValueError("a head claim's first output token is the target's own ('t'): no draft slot before it")
    K = max(k for _, _, k in slots) + 1
    req = Request("0", seq[1 : P + 1], SamplingParams(temperature=0.0, max_tokens=K))
    append_1A = torch.tensor([seq[P + 1 : L]]) if L - 1 > P else None
    batch, logits_1AV, h_1AD = head_engine.prefill_extend([req], append_1A, extra_slots=K, hidden_layer=-1,
                                                          features_BTD=f_TD[None, : L - 1])
    logits_AV = logits_1AV[0].float().cpu()
    for t, s, k in slots:
        if k == 0:
            ld_NV[t] = logits_AV[s - 1]
    steps = {}  # round start s -> its chain steps (its largest slot)
    for _, s, k in slots:
        steps[s] = max(steps.get(s, 0), k)
    starts_R = [s for s, m in steps.items() if m >= 1]
    if not starts_R:
        return ld_NV
    batch = select_rows(batch, [0] * len(starts_R))
    head_engine.truncate(batch, torch.tensor([P + s - 1 for s in starts_R]))
    f_R1D = h_1AD[0, [s - 1 for s in starts_R]][:, None]
    for k in range(1, max(steps[s] for s in starts_R) + 1):
        # rows whose chain has ended feed token 0: their later slots are never read
        tok_R1 = torch.tensor([[seq[P + s + k - 1] if k <= steps[s] else 0] for s in starts_R])
        logits_R1V, f_R1D = head_engine.extend(batch, tok_R1, hidden_layer=-1, features_BTD=f_R1D)
        logits_RV = logits_R1V[:, 0].float().cpu()
        for r, s in enumerate(starts_R):
            if k <= steps[s]:
                ld_NV[s + k] = logits_RV[r]
    return ld_NV


@torch.no_grad()
def verify_spec_claims(claims: list[Claim], target: LlamaLM, draft: "LlamaLM | FeatureHead",
                       progress=None) -> dict[str, np.ndarray]:
    """One row per output token: claim index, position, event, accept_nll, violation, score and
    the re-execution of the claim's draws (`replay_draw`; sampled claims, noise speculative-keyed):
    replay_match, margin, accept_gap (greedy claims: replay_match = argmax check, margin 0, NaN).
    draft: a separate draft model (its q from one teacher-forced forward) or a FeatureHead (q from
    `head_draft_logits` over the target's features of its forward; greedy claims need no q); the
    claims' spec.draft_kind must say which. progress(k) after each claim of k output tokens."""
    keys = ("claim", "position", "event", "accept_nll", "violation", "score", "replay_match", "margin", "accept_gap")
    rows: dict[str, list] = {k: [] for k in keys}
    is_head = isinstance(draft, FeatureHead)
    target_engine = Engine(target)
    draft_engine = Engine(draft, lean_prefill=True) if is_head else Engine(draft)
    rel_tol = max(RESIDUAL_REL_TOL.get(target.dtype, 0.1), RESIDUAL_REL_TOL.get(draft.dtype, 0.1))
    for ci, c in enumerate(claims):
        s = _spec_of(c)
        if (s.get("draft_kind", "model") == "head") != is_head:
            kinds = ("separate draft model", "feature head")
            raise ClaimError(f"claim drafted by a {kinds[not is_head]} (spec.draft_kind "
                             f"{s.get('draft_kind', 'model')!r}) verified with a {kinds[is_head]}",
                             where=c.source or f"claim {c.id}",
                             fix="verify with the draft the claims name: FeatureHead.from_target(head_dir, target) "
                                 "for draft_kind 'head', the draft LlamaLM otherwise")
        seq = c.prompt_token_ids + c.output_token_ids
        P, n = len(c.prompt_token_ids), len(c.output_token_ids)
        T = c.sampling.temperature
        if is_head:
            lt, f_TD = target_engine.forward_sequence(seq[:-1], hidden_layer=-1)
            ld = head_draft_logits(draft_engine, seq, P, f_TD, s["events"]) if T > 0 else None
            lt = lt[P - 1 :].float().cpu()
        else:
            lt, _ = target_engine.forward_sequence(seq[:-1])
            ld, _ = draft_engine.forward_sequence(seq[:-1])
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
        tau = s.get("draft_confidence", 0.0)
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
                viol = viol or _cut_violation(s["events"], t, slot, s["gamma"], qy, tau, rel_tol)
            slot, rnd = (slot + 1, rnd) if e == "a" else (0, rnd + 1)
            for k, v in zip(keys, (ci, t, e, nll, viol, math.inf if viol else nll, match, margin, agap)):
                rows[k].append(v)
        if progress is not None:
            progress(n)
    return {k: np.asarray(v) for k, v in rows.items()}
