"""Acceptance rules for speculative decoding: pure functions of the target and draft
distributions at the drafted positions, the draft tokens, explicit uniforms, and (for the
trained judge) hidden states.

Shape key: B = batch rows, G = drafted positions per row (gamma), V = vocab, D = feature dim.
p_BGV is the target distribution that verifies draft token x_BG (the target forward at the
position before it), q_BGV the draft distribution x_BG was drawn from.

Pipeline of one verification (Leviathan et al. 2023; Chen et al. 2023), per row:
  standard_b,i = u_b,i < min(1, p(x_i) / q(x_i))       sampling (temperature > 0), lossless
               = x_i == argmax p                          greedy (temperature == 0)
  accept_b,i   = standard_b,i OR relax_b,i              relax = the rule's lossy extra acceptance
  n_accepted_b = length of the leading run of accept_b (the first rejection ends the block)
  after a rejection at i: a token from the residual norm(max(0, p_i - q_i)) (greedy: argmax p_i);
  after full acceptance: a bonus token from the target's next distribution.

The relaxations (each a boolean mask, `threshold` is the knob swept in the benchmark):
  standard      none (lossless)
  kl            KL(p || q) < threshold  AND  max p <= 0.9   (KL-judge paper, section 4.1: where the
                target's top-1 probability exceeds 0.9 the standard rule alone decides)
  topk          x is among the target's top-`threshold` tokens (Bachmann et al. 2025)
  target_entropy H(p) > threshold: accept where the target itself is uncertain
  draft_entropy  H(q) < threshold: accept where the draft is confident
  autojudge     P(important | [h_target; h_draft]) < threshold, a logistic regression trained on
                mined labels (autojudge.py; Garipov et al. 2025)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from verinfer.registry import Registry
from verinfer.sampling.noise import StepNoise
from verinfer.sampling.sampler import sample_probs

CONFIDENT_TOP1 = 0.9  # KL judge: above this target top-1 probability only the standard rule applies

# acceptance rule name -> its relaxation (None: the standard rule alone), in the order of the docstring
RELAX: Registry[Callable[..., torch.Tensor] | None] = Registry("acceptance rule", {"standard": None})


def kl_divergence(p_BGV: torch.Tensor, q_BGV: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats over the last axis, in fp32 (terms with p = 0 contribute 0)."""
    p, q = p_BGV.float(), q_BGV.float()
    tiny = torch.finfo(torch.float32).tiny
    return (p * (p.clamp_min(tiny).log() - q.clamp_min(tiny).log())).sum(-1)


def entropy(p_BGV: torch.Tensor) -> torch.Tensor:
    p = p_BGV.float()
    return -(p * p.clamp_min(torch.finfo(torch.float32).tiny).log()).sum(-1)


def standard_accept(p_BGV: torch.Tensor, q_BGV: torch.Tensor, x_BG: torch.Tensor, u_BG: torch.Tensor | None,
                    greedy: bool) -> torch.Tensor:
    """The lossless rule: accept x with probability min(1, p(x)/q(x)) (u < ratio), or, greedy,
    when x is the target's argmax."""
    if greedy:
        return x_BG == p_BGV.argmax(-1)
    px = p_BGV.gather(-1, x_BG[..., None])[..., 0]
    qx = q_BGV.gather(-1, x_BG[..., None])[..., 0]
    # u < p/q  <=>  u * q < p (q(x) > 0 because x was drawn from q); no division by zero
    return u_BG * qx < px


@RELAX.register("kl")
def kl_judge(p_BGV, q_BGV, x_BG, threshold: float, **_) -> torch.Tensor:
    """The KL judge (KL-judge paper, section 4.1): accept the drafted token beyond the standard
    rule when KL(p || q) < threshold AND max p <= CONFIDENT_TOP1 (0.9); where the target's top-1
    probability exceeds 0.9 only the standard rule decides."""
    return (kl_divergence(p_BGV, q_BGV) < threshold) & (p_BGV.amax(-1) <= CONFIDENT_TOP1)


@RELAX.register("topk")
def relax_topk(p_BGV, q_BGV, x_BG, threshold: float, **_) -> torch.Tensor:
    k = int(threshold)
    if k <= 0:
        return torch.zeros_like(x_BG, dtype=torch.bool)
    top = p_BGV.topk(min(k, p_BGV.shape[-1]), dim=-1).indices
    return (top == x_BG[..., None]).any(-1)


@RELAX.register("target_entropy")
def relax_target_entropy(p_BGV, q_BGV, x_BG, threshold: float, **_) -> torch.Tensor:
    return entropy(p_BGV) > threshold


@RELAX.register("draft_entropy")
def relax_draft_entropy(p_BGV, q_BGV, x_BG, threshold: float, **_) -> torch.Tensor:
    return entropy(q_BGV) < threshold


@RELAX.register("autojudge")
def relax_autojudge(p_BGV, q_BGV, x_BG, threshold: float, *, judge=None, feats_BGD=None, **_) -> torch.Tensor:
    if judge is None or feats_BGD is None:
        raise ValueError("the autojudge rule needs a trained judge and hidden-state features "
                         "(train one with verinfer.speculative.autojudge.train_judge)")
    return judge.prob_important(feats_BGD) < threshold


RULES = RELAX.names()  # every acceptance rule, "standard" first


@dataclass(frozen=True)
class Rule:
    """An acceptance rule and its threshold. `judge` is the trained classifier (autojudge only)."""

    name: str = "standard"
    threshold: float = 0.0
    judge: object | None = None

    def __post_init__(self):
        RELAX.get(self.name)  # an unknown name raises, listing the rules

    @property
    def needs_hidden(self) -> bool:
        return self.name == "autojudge"

    @property
    def lossless(self) -> bool:
        return self.name == "standard"

    def reads_q(self, greedy: bool) -> bool:
        """Whether verification reads the draft distribution q beyond the drafted tokens: sampling's
        standard test reads q(x); the KL judge and the draft-entropy rule read all of q."""
        return not greedy or self.name in ("kl", "draft_entropy")


def accept_mask(rule: Rule, p_BGV: torch.Tensor, q_BGV: torch.Tensor, x_BG: torch.Tensor,
                u_BG: torch.Tensor | None, greedy: bool, feats_BGD: torch.Tensor | None = None) -> torch.Tensor:
    """Per drafted position: accepted by the rule (before the first-rejection cut)."""
    acc = standard_accept(p_BGV, q_BGV, x_BG, u_BG, greedy)
    relax = RELAX[rule.name]
    if relax is not None:
        acc = acc | relax(p_BGV, q_BGV, x_BG, rule.threshold, judge=rule.judge, feats_BGD=feats_BGD)
    return acc


def leading_accepted(acc_BG: torch.Tensor) -> torch.Tensor:
    """Number of accepted tokens before the first rejection, per row."""
    return acc_BG.long().cumprod(-1).sum(-1)


def residual(p_V: torch.Tensor, q_V: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what standard speculative sampling draws from after a rejection.
    When p == q numerically (a rejection then has probability 0 but rounding can cause one),
    falls back to p."""
    r = (p_V - q_V).clamp_min(0)
    s = r.sum()
    return r / s if s > 0 else p_V


def verify(rule: Rule, p_BGpV: torch.Tensor, q_BGV: torch.Tensor, x_BG: torch.Tensor, greedy: bool,
           u_BG: torch.Tensor | None = None, token_noises: list[StepNoise] | None = None,
           feats_BGD: torch.Tensor | None = None, n_valid_B: torch.Tensor | None = None):
    """One verification of a drafted block. p_BGpV has G+1 positions (the last one gives the
    bonus token). Returns (n_accepted_B, next_token_B, accept_BG) where accept_BG is the rule's
    per-position decision (the block ends at the first False) and next_token_B is the correction
    (after a rejection) or the bonus token (after full acceptance).

    Sampling (temperature > 0) takes its randomness as arguments, drawn by the caller from each
    row's speculative-keyed noise (sampling/noise.py, `SpeculativeNoise`): u_BG, the acceptance
    uniforms of the round, and token_noises, one StepNoise per row for the next token
    (`sampling.sampler.sample_probs` of the residual or the bonus distribution). Greedy draws nothing.

    n_valid_B: a row that proposed fewer than G tokens (n-gram drafting) has only its first
    n_valid_B[b] positions verified; where its block ends at n_valid_B[b] < G nothing was rejected,
    so its next token comes from the target's own distribution there (greedy: its argmax)."""
    B, G = x_BG.shape
    if not greedy:
        if u_BG is None or token_noises is None or len(token_noises) != B or tuple(u_BG.shape) != (B, G):
            raise ValueError(f"sampling (temperature > 0) needs the acceptance uniforms u_BG [{B}, {G}] and one "
                             f"token noise per row ({B} rows)")
        u_BG = u_BG.to(device=p_BGpV.device, dtype=p_BGpV.dtype)
    acc = accept_mask(rule, p_BGpV[:, :G], q_BGV, x_BG, u_BG, greedy, feats_BGD)
    if n_valid_B is not None:
        acc = acc & (torch.arange(G, device=acc.device)[None, :] < n_valid_B.to(acc.device)[:, None])
    n_B = leading_accepted(acc)
    if greedy:
        nxt = p_BGpV.gather(1, n_B.to(p_BGpV.device)[:, None, None].expand(B, 1, p_BGpV.shape[-1]))[:, 0].argmax(-1)
        return n_B.cpu(), nxt.cpu(), acc
    nxt = torch.empty(B, dtype=torch.long)
    p_cpu, q_cpu = p_BGpV.double().cpu(), q_BGV.double().cpu()
    for b in range(B):
        n = int(n_B[b])
        proposed = G if n_valid_B is None else int(n_valid_B[b])
        dist = p_cpu[b, n] if n >= proposed else residual(p_cpu[b, n], q_cpu[b, n])
        nxt[b] = sample_probs(dist, token_noises[b])
    return n_B.cpu(), nxt, acc
