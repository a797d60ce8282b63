"""The draft/verify loop of speculative decoding over two engines (target and draft), batched,
plus plain autoregressive decoding with the same stop rule (the target-only baseline, on
Engine.generate).

One round, per active row with committed sequence s (prompt + output so far, length n):
  draft:  cache rolled back to n-2 tokens; extend with s[n-2:n] (re-writing slot n-2 with the
          same token is harmless, and it makes every row feed 2 tokens whatever was accepted
          before), sample x_1 from q_1; then gamma-1 one-token extends give q_2..q_G, x_2..x_G.
  target: cache rolled back to n-1 tokens; ONE extend with [s[n-1], x_1..x_G] gives p_1..p_{G+1}.
  verify: rules.verify -> a accepted drafts plus one target token (correction or bonus).
  commit: x_1..x_a, y (cut at a stop token or max_tokens). Both caches are "rolled back" by
          setting their lengths before the next round: slots past the valid prefix are
          overwritten later and never attended to (key slot <= query position).
Round 1 has no committed output yet: the draft's prefill of the prompt gives q_1, and the
target's prefill IS the first verification (one forward over prompt + x_1..x_G, logits read at
the last prompt position and after each draft token), so the target never runs a forward over
the prompt alone. Target-only decoding's first token comes from its prefill, so both decoders
spend one target forward on the prompt.

Counters: one target forward per round per row (round 1's fused prefill-verification counts as
one, like target-only decoding's prefill, which produces its first token). MAT = emitted tokens /
target forwards, and it COUNTS the token the target contributes itself in every round (the
correction after a rejection or the bonus after full acceptance), as in Leviathan et al.
Each output token carries an event: 'a' accepted draft token, 'r' target token after a
rejection (correction), 'b' bonus token after a fully accepted block; plain decoding emits 't'.

Shape key: B = active rows, G = gamma, V = vocab, D = hidden dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verinfer.engine.engine import Engine, Request, check_finite, select_rows
from verinfer.models.llama import LlamaLM
from verinfer.sampling.noise import SpeculativeNoise, speculative_noise
from verinfer.sampling.sampler import sample_probs
from verinfer.sampling.params import SamplingParams, stop_reason
from verinfer.speculative.draft_vocab import restrict_head
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


def _requests(prompts: list[list[int]], max_tokens: int) -> list[Request]:
    """Engine requests for the decoders' rows. Greedy params: the decoders draw their own
    randomness (rules.verify and the draft's draws), so the engine's rows carry no noise stream."""
    return [Request(str(i), list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens))
            for i, p in enumerate(prompts)]


def _check_context(model: LlamaLM, prompts: list[list[int]], slots: int) -> None:
    if max(len(p) for p in prompts) + slots > model.config.max_position_embeddings:
        raise ValueError(f"prompt ({max(len(p) for p in prompts)} tokens) + generation ({slots} slots) exceeds the "
                         f"model's context of {model.config.max_position_embeddings} positions")


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)


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
        self.ngram = draft if isinstance(draft, NgramDraft) else None
        self.is_head = isinstance(draft, FeatureHead)
        if self.is_head and (rule.needs_hidden or draft.config.hidden_size != target.config.hidden_size):
            raise ValueError("a feature-level head drafts from the target's own hidden states (same hidden size) and "
                             f"has no separate draft hidden state for the {rule.name!r} rule" if rule.needs_hidden else
                             f"the head's hidden size {draft.config.hidden_size} is not the target's "
                             f"{target.config.hidden_size}: use the head built for this target")
        if self.ngram is not None:
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
        if draft_confidence > 0 and self.ngram is not None:
            raise ValueError("draft_confidence cuts a draft model's block by its probabilities; n-gram drafting "
                             "has none (its proposals end where the match ends)")
        self.draft_confidence = draft_confidence
        self.vocab_N = None
        if draft_vocab is not None:
            if self.ngram is not None:
                raise ValueError("draft_vocab restricts a draft model's lm_head; n-gram drafting has none")
            if rule.reads_q(greedy=True):
                raise ValueError(f"with a restricted draft vocabulary q is zero outside it, and the {rule.name!r} "
                                 "rule reads q's whole distribution: use another rule or draft_vocab=None")
            draft = restrict_head(draft, draft_vocab)
            self.vocab_N = draft_vocab.long().flatten().to(target.device)
        self.target = Engine(target, lean_prefill=True)
        self.draft = None if self.ngram is not None or self.is_head else Engine(draft, lean_prefill=True)
        self.head = Engine(draft, lean_prefill=True) if self.is_head else None
        self.rule, self.gamma, self.temperature = rule, gamma, temperature
        self.stop = set(stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())

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
            gen = self._generate_batch_head if self.is_head else self._generate_batch
            out += gen(prompts[i : i + batch_size], max_tokens, None if gens is None else gens[i : i + batch_size])
            if progress is not None:
                progress(len(prompts[i : i + batch_size]))
        return out

    def _generate_batch(self, prompts, max_tokens, gens) -> list[SpecOutput]:
        G, T = self.gamma, self.temperature
        V = self.target.model.config.vocab_size
        hl = -1 if self.rule.needs_hidden else None
        # greedy verification by a rule that reads only p and the drafted tokens: no draft softmax
        skip_q = not self.rule.reads_q(self.greedy)
        slots = max_tokens + G + 2
        # round 1: the draft's prefill gives q_1; the target's prefill is fused with the first
        # verification (one forward over prompt + x_1..x_G), so no target forward is spent on
        # the prompt alone
        _check_context(self.target.model, prompts, slots + G)
        reqs = _requests(prompts, max_tokens)
        db = lg = hd = None
        if self.ngram is None:
            db = self.draft.prefill(reqs, extra_slots=slots, hidden_layer=hl)
            lg, hd = db.logits_BV, db.hidden_BD
        tb = None
        n_valid = None
        rows = _Rows(prompts, max_tokens)
        active = list(range(len(prompts)))
        dev = self.target.device
        while active:
            B = len(active)
            n_B = torch.tensor([len(rows.seqs[r]) for r in active], device=dev)
            # --- draft gamma tokens
            if self.ngram is not None:
                x_BG, q_BGV, n_valid = self._lookup(rows, active, G, dev)
                hds, Gr = [], x_BG.shape[1]
            else:
                if tb is not None:
                    self.draft.truncate(db, n_B - 2)
                    last2 = torch.tensor([rows.seqs[r][-2:] for r in active], device=dev)
                    logits, h = self.draft.extend(db, last2, hidden_layer=hl)
                    lg, hd = logits[:, -1], (h[:, -1] if h is not None else None)
                def step(x, _hd, db=db):
                    logits, h = self.draft.extend(db, x[:, None], hidden_layer=hl)
                    return logits[:, 0], (h[:, 0] if h is not None else None)

                xs, qs, hds, n_valid = self._draft_block(lg, hd, skip_q, gens, rows, active, step)
                Gr = len(xs)  # drafted this round (< G only after the greedy cut)
                x_BG = torch.stack(xs, 1)
                q_BGV = torch.zeros(1, device=dev).expand(B, Gr, V) if skip_q else torch.stack(qs, 1)
            # --- verify with one target forward over [last, x_1..x_G] (round 1: [prompt, x_1..x_G])
            if tb is None:
                tb, tlogits, th = self.target.prefill_extend(reqs, x_BG, extra_slots=slots, hidden_layer=hl)
            else:
                self.target.truncate(tb, n_B - 1)
                last = torch.tensor([rows.seqs[r][-1] for r in active], device=dev)
                tlogits, th = self.target.extend(tb, torch.cat([last[:, None], x_BG], 1), hidden_layer=hl)
                check_finite(tlogits, "target verification logits")
            p_BGpV = _probs(tlogits, T)
            feats = None
            if hl is not None:
                feats = torch.cat([th[:, :Gr].float(), torch.stack(hds, 1).float()], -1)
            u_BG = None if gens is None else torch.stack([gens[r].accept_uniforms(rows.outs[r].target_forwards, Gr)
                                                          for r in active])
            tok_noises = None if gens is None else [gens[r].token(rows.outs[r].target_forwards) for r in active]
            n_acc, nxt, _ = verify(self.rule, p_BGpV, q_BGV, x_BG, self.greedy, u_BG, tok_noises, feats, n_valid)
            keep = self._commit(rows, active, n_acc, nxt, x_BG, n_valid, 0 if self.ngram is not None else Gr)
            if len(keep) < B:
                tb = select_rows(tb, keep)
                db = select_rows(db, keep) if db is not None else None
                active = [active[b] for b in keep]
        return rows.outs

    def _draft_block(self, lg, hd, skip_q: bool, gens, rows: "_Rows", active: list[int], step):
        """Up to gamma draft tokens per active row from the draft's logits lg (and hidden state hd);
        step(x_B, hd) -> (logits, hidden) of the next position. Greedy: stop once every row has
        drafted a stop token or filled its max_tokens budget (later draft tokens could never be
        emitted); not when sampling: a row's number of draws must not depend on its batch neighbours.
        With draft_confidence, row b's block ends after its first token drafted below it: the loop
        stops once every row's has, and n_valid_B[b] says how many of row b's tokens are verified.
        Returns (xs, qs, hds, n_valid_B or None): per drafted position the tokens, q (or None) and
        the hidden state that drafted them."""
        xs, qs, hds = [], [], []
        ended = [False] * len(active)
        budget = [rows.max_tokens - len(rows.outs[r].output_token_ids) for r in active]
        tau = self.draft_confidence
        n_valid = None if tau == 0 else torch.full((len(active),), self.gamma, dtype=torch.long)
        for i in range(self.gamma):
            x, q = self._draw(lg, skip_q, gens, rows, active, i)
            xs.append(x)
            qs.append(q)
            hds.append(hd)
            if tau > 0:
                conf = self._confidence(lg, q, x).cpu()
                n_valid = torch.where((conf < tau) & (n_valid == self.gamma), i + 1, n_valid)
            if self.greedy:
                ended = [e or stop_reason(t, i + 1, n, self.stop) is not None
                         for e, t, n in zip(ended, x.tolist(), budget)]
            # done once no row can use another draft token: each is cut or (greedy) ended
            cut = [False] * len(active) if n_valid is None else (n_valid <= i + 1).tolist()
            if all(c or (e and self.greedy) for c, e in zip(cut, ended)):
                break
            if i < self.gamma - 1:
                lg, hd = step(x, hd)
        if n_valid is not None:
            n_valid = n_valid.clamp(max=len(xs))
        return xs, qs, hds, n_valid

    def _confidence(self, lg, q, x):
        """The draft's probability of each row's drafted token x_B: from q when drawn, else (greedy
        with a rule that reads no q) the softmax maximum of lg, the argmax's probability."""
        if q is not None:
            return q.gather(1, x[:, None].to(q.device))[:, 0].float()
        return torch.softmax(lg.float(), -1).amax(-1)

    def _draw(self, lg, skip_q: bool, gens, rows: "_Rows", active: list[int], i: int):
        """Draft token i of the round from the draft's logits lg (B rows): (x_B token ids, q_BV or
        None when no rule reads it). Greedy: argmax; sampling: row r's draft noise (round, i)."""
        q = None if skip_q else _probs(lg, self.temperature)
        if self.greedy:
            x = lg.argmax(-1)
        else:
            qc = q.double().cpu()
            x = torch.tensor([sample_probs(qc[b], gens[r].draft(rows.outs[r].target_forwards, i))
                              for b, r in enumerate(active)], device=lg.device)
        if self.vocab_N is not None:  # head positions -> token ids; q onto the whole vocabulary
            x = self.vocab_N[x]
            if q is not None:
                V = self.target.model.config.vocab_size
                q = torch.zeros(len(x), V, device=lg.device, dtype=q.dtype).index_copy_(1, self.vocab_N, q)
        return x, q

    def _generate_batch_head(self, prompts, max_tokens, gens) -> list[SpecOutput]:
        """The draft/verify loop with a feature-level head (feature_head.py; EAGLE's chain drafting).
        The target's prefill gives the first token (as target-only decoding) and its features at every
        prompt position, which the head prefills on; each round: gamma head steps (the first from the
        head's catch-up output, then feeding back its own features), one target verification forward
        over [last, x_1..x_G] (hidden_layer -1: the features of those positions), verify, commit, and
        the head's catch-up over the committed tokens x_1..x_a, y with the verification's features
        f_{n-1}..f_{n-1+a} (its draft-time entries are overwritten: rollback by length)."""
        G = self.gamma
        skip_q = not self.rule.reads_q(self.greedy)
        slots = max_tokens + G + 2
        _check_context(self.target.model, prompts, slots + G)
        reqs = _requests(prompts, max_tokens)
        rows = _Rows(prompts, max_tokens)
        active = list(range(len(prompts)))
        dev = self.target.device
        tb, tlogits, f_BTD = self.target.prefill_extend(reqs, None, extra_slots=slots, hidden_layer=-1, hidden_all=True)
        check_finite(tlogits, "target prefill logits")
        p_BV = _probs(tlogits[:, -1], self.temperature)
        if self.greedy:
            y_B = p_BV.argmax(-1).cpu()
        else:
            pc = p_BV.double().cpu()
            y_B = torch.tensor([sample_probs(pc[b], gens[r].token(0)) for b, r in enumerate(active)])
        head_reqs = _requests([p[1:] + [int(y)] for p, y in zip(prompts, y_B)], max_tokens)
        keep = self._commit(rows, active, torch.zeros(len(active), dtype=torch.long), y_B,
                            torch.zeros(len(active), 0, dtype=torch.long), None, 0, plain=True)
        hb, hlogits, hh = self.head.prefill_extend(head_reqs, None, extra_slots=slots, hidden_layer=-1,
                                                   features_BTD=f_BTD)
        lg, hd = hlogits[:, -1], hh[:, -1]
        while True:
            if len(keep) < len(active):
                tb, hb = select_rows(tb, keep), select_rows(hb, keep)
                lg, hd = lg[keep], hd[keep]
                active = [active[b] for b in keep]
            if not active:
                break
            B = len(active)
            n_B = torch.tensor([len(rows.seqs[r]) for r in active], device=dev)
            def step(x, hd, hb=hb):
                logits, h = self.head.extend(hb, x[:, None], hidden_layer=-1, features_BTD=hd[:, None])
                return logits[:, 0], h[:, 0]

            xs, qs, _, n_valid = self._draft_block(lg, hd, skip_q, gens, rows, active, step)
            Gr = len(xs)
            x_BG = torch.stack(xs, 1)
            V = self.target.model.config.vocab_size
            q_BGV = torch.zeros(1, device=dev).expand(B, Gr, V) if skip_q else torch.stack(qs, 1)
            self.target.truncate(tb, n_B - 1)
            last = torch.tensor([rows.seqs[r][-1] for r in active], device=dev)
            tlogits, th = self.target.extend(tb, torch.cat([last[:, None], x_BG], 1), hidden_layer=-1)
            check_finite(tlogits, "target verification logits")
            p_BGpV = _probs(tlogits, self.temperature)
            u_BG = None if gens is None else torch.stack([gens[r].accept_uniforms(rows.outs[r].target_forwards, Gr)
                                                          for r in active])
            tok_noises = None if gens is None else [gens[r].token(rows.outs[r].target_forwards) for r in active]
            n_acc, nxt, _ = verify(self.rule, p_BGpV, q_BGV, x_BG, self.greedy, u_BG, tok_noises, None, n_valid)
            keep = self._commit(rows, active, n_acc, nxt, x_BG, n_valid, Gr)
            if not keep:
                break
            # the head catches up on the committed tokens of the rows still running
            k_idx = torch.tensor(keep, device=dev)
            a_K = n_acc[keep].to(dev)  # verify returns n_accepted_B as a tensor
            A = int(a_K.max()) + 1
            toks = torch.zeros(len(keep), A, dtype=torch.long)
            for j, b in enumerate(keep):
                new = rows.seqs[active[b]][int(n_B[b]):]
                toks[j, :len(new)] = torch.tensor(new)
            hb_k = select_rows(hb, keep)
            self.head.truncate(hb_k, n_B[k_idx] - 1)
            logits, h = self.head.extend(hb_k, toks, hidden_layer=-1, features_BTD=th[k_idx, :A])
            ar = torch.arange(len(keep), device=dev)
            lg_k, hd_k = logits[ar, a_K], h[ar, a_K]
            self.head.truncate(hb_k, n_B[k_idx] + a_K)
            # keep the full-batch shapes until the select at the top of the loop
            hb = hb_k
            tb = select_rows(tb, keep)
            active = [active[b] for b in keep]
            lg, hd = lg_k, hd_k
            keep = list(range(len(active)))
        return rows.outs

    def _commit(self, rows: "_Rows", active: list[int], n_acc, nxt, x_BG, n_valid, draft_forwards: int,
                plain: bool = False) -> list[int]:
        """Append each active row's accepted drafts and its target token (cut at a stop token or
        max_tokens), update its counters; returns the batch indices of the rows still running.
        plain: a round without drafts (the head's first token, from the target's prefill): event 't'."""
        Gr = x_BG.shape[1]
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

    def _lookup(self, rows: "_Rows", active: list[int], G: int, dev):
        """N-gram proposals of every active row, padded to the round's longest (at least 1): x_BG,
        q_BGV (one-hot at the proposals; greedy verification never reads q, so a zero view there)
        and n_valid_B (each row's own count, 0 without a match)."""
        props = [self.ngram.propose(rows.seqs[r], G) for r in active]
        Gr = max(1, max(len(x) for x in props))
        x_BG = torch.tensor([x + [0] * (Gr - len(x)) for x in props], device=dev)
        V = self.target.model.config.vocab_size
        q_BGV = (torch.zeros(1, device=dev).expand(*x_BG.shape, V) if self.greedy
                 else torch.nn.functional.one_hot(x_BG, V).float())
        return x_BG, q_BGV, torch.tensor([len(x) for x in props])


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
            pc = _probs(logits_BV, temperature).double().cpu()
            return torch.tensor([sample_probs(pc[b], gens[int(r.id)].token(len(batch.outputs[b])))
                                 for b, r in enumerate(batch.requests)])

    _check_context(target, prompts, max_tokens + 1)
    done = eng.generate(_requests(prompts, max_tokens), batch_size, sampler, drop_finished=True,
                        extra_slots=max_tokens + 1)
    # the forward that would follow a finished row's last token is never run: one per token
    return [SpecOutput(c.prompt_token_ids, c.output_token_ids, "t" * len(c.output_token_ids), c.finish_reason,
                       target_forwards=len(c.output_token_ids)) for c in done]
