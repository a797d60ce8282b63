"""Draft sources of the speculative round (decoder.py): strategies with the same two calls, one
state per batch of rows, made as Kind(source, drafting, reqs, slots) (source: the draft's Engine,
or the NgramDraft; reqs: the batch's engine requests; slots: cache slots past the prompt).

  propose(rows, active, gens) -> Block     the round's draft tokens x_BG of the active rows, the
                                           distributions q_BGV they were drawn from and n_valid_B
  advance(rows, active, keep, n_B, n_acc_B, th_BTD)
                                           after the commit (n_B: the lengths before it, th_BTD: the
                                           verification's target features): drop the finished rows,
                                           keep[j] = the batch index of the j-th row still running,
                                           and catch up on the committed tokens

  ModelDrafter   a separate draft model on the target's tokenizer: its prefill of the prompt gives
                 q_1; after a commit its cache is rolled back to n-2 tokens and extended with
                 s[n-2:n] (re-writing slot n-2 with the same token is harmless, and every row feeds
                 2 tokens whatever was accepted), which gives the next round's q_1; then gamma-1
                 one-token extends give q_2..q_G.
  HeadDrafter    a feature-level head (feature_head.py; EAGLE's chain drafting): its first block
                 is empty (the target's prefill gives the first token, as target-only decoding);
                 the head then prefills on the prompt with the target's features at every prompt
                 position; after each later commit it catches up on the committed tokens
                 x_1..x_a, y with the verification's features f_{n-1}..f_{n-1+a} (its draft-time
                 entries are overwritten: rollback by length); each draft step feeds back the
                 head's own features.
  LookupDrafter  n-gram prompt lookup (ngram.py): no model, q one-hot at the proposals, no catch-up.

Drafting.block draws a model's or a head's block (module docstring of decoder.py for the counters).

Shape key: B = active rows, G = drafted positions, V = vocab, D = hidden dim, T = positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verinfer.engine.engine import Engine, Request, select_rows
from verinfer.sampling.params import SamplingParams, stop_reason
from verinfer.sampling.sampler import sample_probs
from verinfer.speculative.ngram import NgramDraft


def requests(prompts: list[list[int]], max_tokens: int) -> list[Request]:
    """Engine requests for the decoders' rows. Greedy params: the decoders draw their own
    randomness (rules.verify and the draft's draws), so the engine's rows carry no noise stream."""
    return [Request(str(i), list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens))
            for i, p in enumerate(prompts)]


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)


@dataclass
class Block:
    """One round's drafts: x_BG (G may be 0), q_BGV, n_valid_B (None: all G verified), the draft's
    hidden state before each drafted token (hds[i]: [B, D] or None) and the draft forwards spent."""

    x_BG: torch.Tensor
    q_BGV: torch.Tensor
    n_valid_B: torch.Tensor | None
    hds: list
    draft_forwards: int


@dataclass(frozen=True, eq=False)
class Drafting:
    """How a draft model or head draws its block. skip_q: no rule reads q (greedy verification by
    p and the drafted tokens alone): no draft softmax. vocab_N: the draft's lm_head rows (FR-Spec),
    or None. hidden_layer: the draft hidden state a rule reads (autojudge), or None. device: where
    the draft tokens go (the target's)."""

    gamma: int
    temperature: float
    draft_confidence: float
    stop: frozenset
    skip_q: bool
    vocab_size: int
    vocab_N: torch.Tensor | None
    hidden_layer: int | None
    device: torch.device

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def block(self, lg, hd, gens, rows, active: list[int], step) -> Block:
        """Up to gamma draft tokens per active row from the draft's logits lg (and hidden state hd);
        step(x_B, hd) -> (logits, hidden) of the next position. Greedy: stop once every row has
        drafted a stop token or filled its max_tokens budget (later draft tokens could never be
        emitted); not when sampling: a row's number of draws must not depend on its batch neighbours.
        With draft_confidence, row b's block ends after its first token drafted below it: the loop
        stops once every row's has, and n_valid_B[b] says how many of row b's tokens are verified."""
        xs, qs, hds = [], [], []
        ended = [False] * len(active)
        budget = [rows.max_tokens - len(rows.outs[r].output_token_ids) for r in active]
        tau = self.draft_confidence
        n_valid = None if tau == 0 else torch.full((len(active),), self.gamma, dtype=torch.long)
        for i in range(self.gamma):
            x, q = self.draw(lg, gens, rows, active, i)
            xs.append(x)
            qs.append(q)
            hds.append(hd)
            if tau > 0:
                conf = self.confidence(lg, q, x).cpu()
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
        B, Gr = len(active), len(xs)  # Gr < gamma only after the greedy or the confidence cut
        q_BGV = torch.zeros(1, device=lg.device).expand(B, Gr, self.vocab_size) if self.skip_q else torch.stack(qs, 1)
        return Block(torch.stack(xs, 1), q_BGV, n_valid, hds, Gr)

    def confidence(self, lg, q, x):
        """The draft's probability of each row's drafted token x_B: from q when drawn, else (greedy
        with a rule that reads no q) the softmax maximum of lg, the argmax's probability."""
        if q is not None:
            return q.gather(1, x[:, None].to(q.device))[:, 0].float()
        return torch.softmax(lg.float(), -1).amax(-1)

    def draw(self, lg, gens, rows, active: list[int], i: int):
        """Draft token i of the round from the draft's logits lg (B rows): (x_B token ids, q_BV or
        None when no rule reads it). Greedy: argmax; sampling: row r's draft noise (round, i)."""
        q = None if self.skip_q else probs(lg, self.temperature)
        if self.greedy:
            x = lg.argmax(-1)
        else:
            qc = q.double().cpu()
            x = torch.tensor([sample_probs(qc[b], gens[r].draft(rows.outs[r].target_forwards, i))
                              for b, r in enumerate(active)], device=lg.device)
        if self.vocab_N is not None:  # head positions -> token ids; q onto the whole vocabulary
            x = self.vocab_N[x]
            if q is not None:
                q_BV = torch.zeros(len(x), self.vocab_size, device=lg.device, dtype=q.dtype)
                q = q_BV.index_copy_(1, self.vocab_N, q)
        return x, q


def _lengths(rows, active: list[int], dev) -> torch.Tensor:
    return torch.tensor([len(rows.seqs[r]) for r in active], device=dev)


class ModelDrafter:
    """A separate draft model (module docstring). The target forward reads hidden states only for
    a rule that reads them (autojudge: the target's and the draft's)."""

    def __init__(self, engine: Engine, drafting: Drafting, reqs: list[Request], slots: int):
        self.engine, self.drafting = engine, drafting
        self.target_hidden_layer, self.prefill_features = drafting.hidden_layer, False
        self.db = engine.prefill(reqs, extra_slots=slots, hidden_layer=drafting.hidden_layer)
        self.lg, self.hd = self.db.logits_BV, self.db.hidden_BD

    def _extend(self, tokens_BT: torch.Tensor):
        logits, h = self.engine.extend(self.db, tokens_BT, hidden_layer=self.drafting.hidden_layer)
        return logits[:, -1], (h[:, -1] if h is not None else None)

    def propose(self, rows, active: list[int], gens) -> Block:
        return self.drafting.block(self.lg, self.hd, gens, rows, active, lambda x, _hd: self._extend(x[:, None]))

    def advance(self, rows, active: list[int], keep: list[int], n_B, n_acc, th) -> None:
        if len(keep) < len(active):
            self.db = select_rows(self.db, keep)
        if not keep:
            return
        running = [active[b] for b in keep]
        dev = self.drafting.device
        self.engine.truncate(self.db, _lengths(rows, running, dev) - 2)
        self.lg, self.hd = self._extend(torch.tensor([rows.seqs[r][-2:] for r in running], device=dev))


class HeadDrafter:
    """A feature-level head (module docstring): the target forwards read the final-norm features
    (hidden_layer -1), the first (the prefill) at every prompt position."""

    target_hidden_layer, prefill_features = -1, True

    def __init__(self, engine: Engine, drafting: Drafting, reqs: list[Request], slots: int):
        self.engine, self.drafting, self.slots = engine, drafting, slots
        self.hb = self.lg = self.hd = None  # the head's batch: after the first token

    def _step(self, x, hd):
        logits, h = self.engine.extend(self.hb, x[:, None], hidden_layer=-1, features_BTD=hd[:, None])
        return logits[:, 0], h[:, 0]

    def propose(self, rows, active: list[int], gens) -> Block:
        if self.hb is None:  # the first token comes from the target's prefill alone
            dev, V = self.drafting.device, self.drafting.vocab_size
            return Block(torch.zeros(len(active), 0, dtype=torch.long, device=dev),
                         torch.zeros(len(active), 0, V, device=dev), None, [], 0)
        return self.drafting.block(self.lg, self.hd, gens, rows, active, self._step)

    def advance(self, rows, active: list[int], keep: list[int], n_B, n_acc, th) -> None:
        if self.hb is None:
            head_reqs = requests([rows.seqs[r][1:] for r in active], rows.max_tokens)
            self.hb, hlogits, hh = self.engine.prefill_extend(head_reqs, None, extra_slots=self.slots, hidden_layer=-1,
                                                              features_BTD=th)
            self.lg, self.hd = hlogits[:, -1], hh[:, -1]
            if len(keep) < len(active):
                self.hb = select_rows(self.hb, keep)
                self.lg, self.hd = self.lg[keep], self.hd[keep]
            return
        if not keep:
            return
        dev = self.drafting.device
        k_idx = torch.tensor(keep, device=dev)
        a_K = n_acc[keep].to(dev)  # verify returns n_accepted_B as a tensor
        A = int(a_K.max()) + 1
        toks = torch.zeros(len(keep), A, dtype=torch.long)
        for j, b in enumerate(keep):
            new = rows.seqs[active[b]][int(n_B[b]):]
            toks[j, :len(new)] = torch.tensor(new)
        self.hb = select_rows(self.hb, keep)
        self.engine.truncate(self.hb, n_B[k_idx] - 1)
        logits, h = self.engine.extend(self.hb, toks, hidden_layer=-1, features_BTD=th[k_idx, :A])
        ar = torch.arange(len(keep), device=dev)
        self.lg, self.hd = logits[ar, a_K], h[ar, a_K]
        self.engine.truncate(self.hb, n_B[k_idx] + a_K)


class LookupDrafter:
    """N-gram prompt lookup (module docstring): proposals padded to the round's longest (at least
    1), q one-hot at the proposals (greedy verification never reads q: a zero view there) and
    n_valid_B each row's own count (0 without a match)."""

    target_hidden_layer, prefill_features = None, False

    def __init__(self, ngram: NgramDraft, drafting: Drafting, reqs: list[Request], slots: int):
        self.ngram, self.drafting = ngram, drafting

    def propose(self, rows, active: list[int], gens) -> Block:
        props = [self.ngram.propose(rows.seqs[r], self.drafting.gamma) for r in active]
        Gr = max(1, max(len(x) for x in props))
        dev, V = self.drafting.device, self.drafting.vocab_size
        x_BG = torch.tensor([x + [0] * (Gr - len(x)) for x in props], device=dev)
        q_BGV = (torch.zeros(1, device=dev).expand(*x_BG.shape, V) if self.drafting.greedy
                 else torch.nn.functional.one_hot(x_BG, V).float())
        return Block(x_BG, q_BGV, torch.tensor([len(x) for x in props]), [], 0)

    def advance(self, rows, active: list[int], keep: list[int], n_B, n_acc, th) -> None:
        pass
