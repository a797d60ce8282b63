"""The speculative round over a target engine and a draft source, batched, plus plain
autoregressive decoding with the same stop rule (the target-only baseline, on Engine.generate).

One round, per active row with committed sequence s (prompt + output so far, length n):
  draft:  the draft source proposes x_1..x_G with the distributions q_1..q_G they were drawn from
          (drafters.py: a draft model, a feature-level head, or n-gram prompt lookup; G may differ
          per round, and per row through n_valid_B).
  target: cache rolled back to n-1 tokens; ONE extend with [s[n-1], x_1..x_G] gives p_1..p_{G+1}.
  verify: rules.verify -> a accepted drafts plus one target token (correction or bonus).
  commit: x_1..x_a, y (cut at a stop token or max_tokens). The target's cache is "rolled back"
          by setting its length before the next round: slots past the valid prefix are overwritten
          later and never attended to (key slot <= query position). The draft source then drops
          the finished rows and catches up on the committed tokens.
Round 1 has no committed output yet: the target's prefill IS the first verification (one forward
over prompt + x_1..x_G, logits read at the last prompt position and after each draft token), so
the target never runs a forward over the prompt alone. A draft model's x_1 comes from its own
prefill; a feature-level head's first block is empty (it drafts from the target's features), so
its round 1 is the target's prefill alone, whose token is emitted as 't'. Target-only decoding's
first token comes from its prefill, so every decoder spends one target forward on the prompt.

Counters: one target forward per round per row (round 1's fused prefill-verification counts as
one, like target-only decoding's prefill, which produces its first token). MAT = emitted tokens /
target forwards, and it COUNTS the token the target contributes itself in every round (the
correction after a rejection or the bonus after full acceptance), as in Leviathan et al.
Each output token carries an event: 'a' accepted draft token, 'r' target token after a
rejection (correction), 'b' bonus token after a fully accepted block, 't' the token of a round
without drafts (a head's first token; plain decoding emits only 't').

Shape key: B = active rows, G = gamma, V = vocab, D = hidden dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verinfer.engine.engine import Engine, check_finite, select_rows
from verinfer.models.llama import LlamaLM
from verinfer.sampling.noise import SpeculativeNoise, speculative_noise
from verinfer.sampling.params import stop_reason
from verinfer.sampling.sampler import sample_probs
from verinfer.speculative.draft_vocab import restrict_head
from verinfer.speculative.drafters import (Block, Drafting, HeadDrafter, LookupDrafter, ModelDrafter, probs,
                                           requests)
from verinfer.speculative.feature_head import FeatureHead
from verinfer.speculative.ngram import NgramDraft
from verinfer.speculative.rules import Rule, verify


@dataclass
class SpecOutput:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    events: str                 # one char per output token: a (accepted), r (correction), b (bonus), t (plain)
    finish_reason: str          # "stop" | "length"
    target_forwards: int = 0    # decode-time target forwards this row took part in
    draft_forwards: int = 0
    drafted: int = 0            # draft tokens proposed
    accepted: int = 0           # draft tokens accepted (before any stop/length cut)
    kl_BG: list[float] = field(default_factory=list)  # optional diagnostics
    proposed_at: list[int] = field(default_factory=list)  # [k]: rounds that drafted a (k+1)-th token
    accepted_at: list[int] = field(default_factory=list)  # [k]: ... and had it accepted

    @property
    def mat(self) -> float:
        return len(self.output_token_ids) / max(1, self.target_forwards)


def _check_context(model: LlamaLM, prompts: list[list[int]], slots: int) -> None:
    if max(len(p) for p in prompts) + slots > model.config.max_position_embeddings:
        raise ValueError(f"prompt ({max(len(p) for p in prompts)} tokens) + generation ({slots} slots) exceeds the "
                         f"model's context of {model.config.max_position_embeddings} positions")


class _Rows:
    """Per-row bookkeeping of a batch (the tensors live in the engines' Batch objects)."""

    def __init__(self, prompts, max_tokens):
        self.seqs = [list(p) for p in prompts]
        self.outs = [SpecOutput(list(p), [], "", "length") for p in prompts]
        self.max_tokens = max_tokens


class SpeculativeDecoder:
    """Speculative decoding with a pluggable acceptance rule. `device` is where both models live
    (any torch device). Sampling draws every random number from each row's speculative-keyed
    noise (sampling/noise.py), addressed by (seed, round): claims name noise "speculative-keyed"."""

    def __init__(self, target: LlamaLM, draft: "LlamaLM | NgramDraft | FeatureHead", rule: Rule = Rule(), gamma: int = 4,
                 temperature: float = 0.0, stop_token_ids: tuple[int, ...] = (), eos_token_id: int | None = None,
                 draft_vocab: torch.Tensor | None = None, draft_confidence: float = 0.0):
        """`draft`: a model on the target's tokenizer, or NgramDraft (prompt lookup: no draft model;
        up to gamma proposed tokens per row and round, q one-hot; the standard rule only).
        draft_vocab: token ids the draft proposes from (speculative/draft_vocab.py, FR-Spec): its
        lm_head runs on those rows only and q is zero elsewhere (standard verification stays
        lossless for any q); refused with the rules that read all of q (kl, draft_entropy).
        draft_confidence: dynamic draft length (transformers' assisted generation,
        `assistant_confidence_threshold`): a row stops drafting for the round after a token its draft
        gave probability below this (that token is still verified); 0 drafts gamma tokens. The cut
        reads only the draft's own distribution, so standard verification stays lossless (a lossy
        rule's output depends on it: a cut token is not offered to the rule), and each row's cut is
        its own (batched == batch-1)."""
        if gamma < 1:
            raise ValueError(f"gamma (draft tokens per round) must be >= 1, got {gamma}")
        ngram = draft if isinstance(draft, NgramDraft) else None
        is_head = isinstance(draft, FeatureHead)
        if is_head and (rule.needs_hidden or draft.config.hidden_size != target.config.hidden_size):
            raise ValueError("a feature-level head drafts from the target's own hidden states (same hidden size) and "
                             f"has no separate draft hidden state for the {rule.name!r} rule" if rule.needs_hidden else
                             f"the head's hidden size {draft.config.hidden_size} is not the target's "
                             f"{target.config.hidden_size}: use the head built for this target")
        if ngram is not None:
            if rule.name != "standard":
                raise ValueError(f"n-gram drafting has no draft distribution for the {rule.name!r} rule: use "
                                 "Rule('standard')")
        elif target.config.vocab_size != draft.config.vocab_size:
            raise ValueError(f"target and draft vocabularies differ ({target.config.vocab_size} vs "
                             f"{draft.config.vocab_size}): speculative decoding needs one tokenizer")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0.0 <= draft_confidence < 1.0:
            raise ValueError(f"draft_confidence (stop drafting below this draft probability) must be in [0, 1), "
                             f"got {draft_confidence}")
        if draft_confidence > 0 and ngram is not None:
            raise ValueError("draft_confidence cuts a draft model's block by its probabilities; n-gram drafting "
                             "has none (its proposals end where the match ends)")
        vocab_N = None
        if draft_vocab is not None:
            if ngram is not None:
                raise ValueError("draft_vocab restricts a draft model's lm_head; n-gram drafting has none")
            if rule.reads_q(greedy=True):
                raise ValueError(f"with a restricted draft vocabulary q is zero outside it, and the {rule.name!r} "
                                 "rule reads q's whole distribution: use another rule or draft_vocab=None")
            draft = restrict_head(draft, draft_vocab)
            vocab_N = draft_vocab.long().flatten().to(target.device)
        self.target = Engine(target, lean_prefill=True)
        self.rule, self.gamma, self.temperature = rule, gamma, temperature
        self.stop = set(stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
        self.drafting = Drafting(gamma, temperature, draft_confidence, frozenset(self.stop),
                                 not rule.reads_q(self.greedy), target.config.vocab_size, vocab_N,
                                 -1 if rule.needs_hidden else None, target.device)
        # the draft source (drafters.py): its class and what it drafts with, one state per batch
        self.source = ((LookupDrafter, ngram) if ngram is not None else
                       (HeadDrafter if is_head else ModelDrafter, Engine(draft, lean_prefill=True)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def _generators(self, n: int, seeds) -> list[SpeculativeNoise] | None:
        if self.greedy:
            return None
        if seeds is None or len(seeds) != n:
            raise ValueError(f"sampling (temperature {self.temperature}) needs one seed per prompt ({n})")
        return [speculative_noise(int(s), self.target.model.config.vocab_size) for s in seeds]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: int, seeds: list[int] | None = None,
                 batch_size: int = 8, progress=None) -> list[SpecOutput]:
        """Generate every prompt, `batch_size` rows at a time. Row r's randomness comes only from
        its speculative-keyed noise (seed r, round), so batched and batch-1 runs draw the same numbers.
        progress(k) after each batch of k prompts."""
        for i, p in enumerate(prompts):
            if len(p) < 2:
                raise ValueError(f"prompt #{i} has {len(p)} token(s); speculative decoding needs at least 2 "
                                 "(prepend a BOS token)")
        gens = self._generators(len(prompts), seeds)
        out: list[SpecOutput] = []
        for i in range(0, len(prompts), batch_size):
            out += self._generate_batch(prompts[i : i + batch_size], max_tokens,
                                        None if gens is None else gens[i : i + batch_size])
            if progress is not None:
                progress(len(prompts[i : i + batch_size]))
        return out

    def _generate_batch(self, prompts, max_tokens, gens) -> list[SpecOutput]:
        slots = max_tokens + self.gamma + 2
        _check_context(self.target.model, prompts, slots + self.gamma)
        reqs = requests(prompts, max_tokens)
        rows = _Rows(prompts, max_tokens)
        kind, source = self.source
        drafter = kind(source, self.drafting, reqs, slots)
        tb, active = None, list(range(len(prompts)))
        while active:
            tb, active = self._round(drafter, tb, reqs, rows, active, gens, slots)
        return rows.outs

    def _round(self, drafter, tb, reqs, rows: "_Rows", active: list[int], gens, slots: int):
        """One round of the active rows (module docstring): draft, verify with one target forward
        (round 1, tb None: the target's prefill), commit, and the drafter's catch-up. Returns the
        target's batch and the rows still running."""
        n_B = torch.tensor([len(rows.seqs[r]) for r in active], device=self.target.device)
        blk = drafter.propose(rows, active, gens)
        if tb is None:  # round 1: [prompt, x_1..x_G]
            append = blk.x_BG if blk.x_BG.shape[1] else None
            tb, tlogits, th = self.target.prefill_extend(reqs, append, extra_slots=slots,
                                                         hidden_layer=drafter.target_hidden_layer,
                                                         hidden_all=drafter.prefill_features)
            check_finite(tlogits, "target prefill logits")
        else:  # [last, x_1..x_G]
            self.target.truncate(tb, n_B - 1)
            last = torch.tensor([rows.seqs[r][-1] for r in active], device=self.target.device)
            tlogits, th = self.target.extend(tb, torch.cat([last[:, None], blk.x_BG], 1),
                                             hidden_layer=drafter.target_hidden_layer)
            check_finite(tlogits, "target verification logits")
        n_acc, nxt = self._verify(tlogits, th, blk, rows, active, gens)
        keep = self._commit(rows, active, n_acc, nxt, blk.x_BG, blk.n_valid_B, blk.draft_forwards)
        if len(keep) < len(active):
            tb = select_rows(tb, keep)
        drafter.advance(rows, active, keep, n_B, n_acc, th)
        return tb, [active[b] for b in keep]

    def _verify(self, tlogits, th, blk: Block, rows: "_Rows", active: list[int], gens):
        """rules.verify of the block against the target's logits, with each row's noise of the round
        (sampling) and, for a rule that reads them, the target's and the draft's hidden states."""
        Gr = blk.x_BG.shape[1]
        p_BGpV = probs(tlogits, self.temperature)
        feats = None
        if self.rule.needs_hidden:
            feats = torch.cat([th[:, :Gr].float(), torch.stack(blk.hds, 1).float()], -1)
        u_BG = None if gens is None else torch.stack([gens[r].accept_uniforms(rows.outs[r].target_forwards, Gr)
                                                      for r in active])
        tok_noises = None if gens is None else [gens[r].token(rows.outs[r].target_forwards) for r in active]
        n_acc, nxt, _ = verify(self.rule, p_BGpV, blk.q_BGV, blk.x_BG, self.greedy, u_BG, tok_noises, feats,
                               blk.n_valid_B)
        return n_acc, nxt

    def _commit(self, rows: "_Rows", active: list[int], n_acc, nxt, x_BG, n_valid, draft_forwards: int) -> list[int]:
        """Append each active row's accepted drafts and its target token (cut at a stop token or
        max_tokens), update its counters; returns the batch indices of the rows still running.
        A round without drafts (a head's first token, from the target's prefill) emits event 't'."""
        Gr = x_BG.shape[1]
        plain = Gr == 0
        x_cpu = x_BG.cpu()
        keep = []
        for b, r in enumerate(active):
            a = int(n_acc[b])
            o = rows.outs[r]
            proposed = Gr if n_valid is None else int(n_valid[b])
            o.target_forwards += 1
            o.draft_forwards += draft_forwards
            o.drafted += proposed
            o.accepted += a
            if len(o.proposed_at) < proposed:
                o.proposed_at += [0] * (proposed - len(o.proposed_at))
                o.accepted_at += [0] * (proposed - len(o.accepted_at))
            for k in range(proposed):
                o.proposed_at[k] += 1
                o.accepted_at[k] += k < a
            new = x_cpu[b, :a].tolist() + [int(nxt[b])]
            ev = "t" if plain else "a" * a + ("b" if a == proposed else "r")
            done = False
            for tok, e in zip(new, ev):
                o.output_token_ids.append(tok)
                o.events += e
                rows.seqs[r].append(tok)
                reason = stop_reason(tok, len(o.output_token_ids), rows.max_tokens, self.stop)
                if reason is not None:
                    o.finish_reason, done = reason, True
                    break
            if not done:
                keep.append(b)
        return keep

def autoregressive(target: LlamaLM, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
                   seeds: list[int] | None = None, stop_token_ids: tuple[int, ...] = (), batch_size: int = 8,
                   eos_token_id: int | None = None) -> list[SpecOutput]:
    """Target-only decoding (one target forward per token): Engine.generate, with the same stop
    rule and the same per-row noise as SpeculativeDecoder (step t draws round t's token noise:
    speculative decoding with gamma = 0); a finished row leaves the batch. The baseline
    speculative decoding is timed against."""
    stop = tuple(stop_token_ids) + ((eos_token_id,) if eos_token_id is not None else ())
    eng = Engine(target, lean_prefill=True, stop_token_ids=stop)
    sampler = None
    if temperature > 0:
        if seeds is None or len(seeds) != len(prompts):
            raise ValueError(f"sampling (temperature {temperature}) needs one seed per prompt ({len(prompts)})")
        gens = [speculative_noise(int(s), target.config.vocab_size) for s in seeds]

        def sampler(logits_BV, _params, _noises, batch):  # row r's step t: gens[r].token(t)
            pc = probs(logits_BV, temperature).double().cpu()
            return torch.tensor([sample_probs(pc[b], gens[int(r.id)].token(len(batch.outputs[b])))
                                 for b, r in enumerate(batch.requests)])

    _check_context(target, prompts, max_tokens + 1)
    done = eng.generate(requests(prompts, max_tokens), batch_size, sampler, drop_finished=True,
                        extra_slots=max_tokens + 1)
    # the forward that would follow a finished row's last token is never run: one per token
    return [SpecOutput(c.prompt_token_ids, c.output_token_ids, "t" * len(c.output_token_ids), c.finish_reason,
                       target_forwards=len(c.output_token_ids)) for c in done]
