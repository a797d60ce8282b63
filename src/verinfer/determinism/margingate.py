"""MarginGate (paper: selective verification for deterministic batched decoding): the gate, the
verifier that keeps the paper's contract, and the native repair.

At each step, a protected row whose current logits came from the batched bf16 path is verified
when its top-1 minus top-2 logit margin is below tau (`gate`). Two verifiers:

- `margingate` (the paper's method: `ShadowVerifier`, its section 3.2 contract): the verifier's token
  and K/V column are a function of the row's token prefix alone. Each protected row keeps a private
  shadow KV cache that only the deterministic engine writes (its prompt's prefill columns, then the
  columns of every token it has verified through). At a trigger the shadow is caught up in one
  chunked deterministic pass over the tokens since its last trigger (the fixed-shape kernels give
  the same bits chunked as token by token: tests/determinism/test_invariant.py), whose last logits
  are the verifier's: exactly the batch-size-1 reference's logits for that prefix. Where its token
  differs, its logits replace the row's and its column overwrites the row's current column in the
  live cache (native repair: one column, no rollback); a verified step keeps the bf16 column
  (`commit_verified=False`, the paper's choice) unless asked.
- `margingate_live_cache` (`repair_on_live_cache`, an ablation): the step is recomputed on a private copy
  of the row's live cache, which holds the bf16 columns of every unverified step, so at a near-tie
  the verifier's token depends on the batch the request shared, not only on its tokens; with
  `commit_verified` (its default) a verified step also writes the verifier's column.

Protected prompts are prefilled on the deterministic path. r_verify = triggered / protected steps,
r_repair = repaired / protected steps (Stats.rates).

Shape key: B=batch rows, N=triggered rows, T=tokens, V=vocab.
"""

from __future__ import annotations

import torch

from verinfer.determinism.policies import Policy, Row, Stats, grow_slots
from verinfer.engine.engine import Batch, Engine, RowsCache


def top2_margin(logits_BV: torch.Tensor) -> torch.Tensor:
    """margin_B = l_top1 - l_top2 of each row's logits."""
    top = logits_BV.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def gate(logits_BV: torch.Tensor, tau: float) -> list[bool]:
    """MarginGate's gate: verify row b's step when top2_margin(logits)[b] < tau (compared as
    Python floats, the fp32 margin exactly)."""
    return [m < tau for m in top2_margin(logits_BV).tolist()]


def triggered(batch: Batch, rows: list[Row], prot_B: list[bool], tau: float) -> list[int]:
    """The rows MarginGate verifies this step: protected, unfinished, logits from the bf16 path,
    top-2 margin below tau (`gate`)."""
    verify_B = gate(batch.logits_BV, tau)
    return [b for b, p in enumerate(prot_B) if p and not batch.done_B[b] and not rows[b].det_logits and verify_B[b]]


def repair_on_live_cache(det: Engine, batch: Batch, trig: list[int], commit_verified: bool = True) -> int:
    """Recompute the step that produced rows `trig`'s current logits (the last token, prompt's
    last for a first step, at slot len-1) with the deterministic engine `det` in one forward;
    where its argmax differs from the row's, replace the row's logits and K/V column with the
    verifier's (with commit_verified, write the column of a verified step too). Returns the
    number of repaired rows."""
    last_N1 = torch.tensor([(batch.outputs[b][-1] if batch.outputs[b] else batch.requests[b].prompt_token_ids[-1])
                            for b in trig])[:, None]
    pos_N1 = (batch.len_B[trig] - 1)[:, None]
    logits_N1V, scratch = det.recompute(batch, trig, last_N1, pos_N1)
    v_NV = logits_N1V[:, 0]
    fast_tok = batch.logits_BV[trig].argmax(-1)
    ver_tok = v_NV.argmax(-1)
    repaired = 0
    for i, b in enumerate(trig):
        slot = int(pos_N1[i, 0])
        if int(ver_tok[i]) != int(fast_tok[i]):
            repaired += 1
            scratch.commit(i, slot, slot + 1)
            batch.logits_BV[b] = v_NV[i]
        elif commit_verified:  # verified commit also keeps the verifier's column
            scratch.commit(i, slot, slot + 1)
    return repaired


class MarginGateLiveCache(Policy):
    """The live-cache ablation of MarginGate (module docstring): a triggered step is recomputed on a
    copy of the row's live cache (`repair_on_live_cache`)."""

    def __init__(self, tau: float, commit_verified: bool = True):
        super().__init__(prefill="protected")
        self.tau, self.commit_verified = tau, commit_verified

    def before_step(self, sched, batch: Batch, rows: list[Row], prot_B: list[bool], st: Stats) -> None:
        trig = triggered(batch, rows, prot_B, self.tau)
        if not trig:
            return
        st.triggered += len(trig)
        st.verify_passes += 1
        st.repaired += repair_on_live_cache(sched.det, batch, trig, self.commit_verified)


def margingate_live_cache(*, tau: float, commit_verified: bool = True, **_) -> MarginGateLiveCache:
    return MarginGateLiveCache(tau, commit_verified)


def padded_chunks(seqs: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_NT, pos_NT): row i's tokens seqs[i] at positions starts[i], starts[i]+1, ...; a
    shorter row's pads repeat its last token at its last position (a deterministic pass then
    rewrites that column with the same bits and gives the same logits there)."""
    T = max(len(x) for x in seqs)
    tokens_NT = torch.zeros(len(seqs), T, dtype=torch.long)
    pos_NT = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, (x, p0) in enumerate(zip(seqs, starts)):
        tokens_NT[i, :len(x)] = torch.tensor(x)
        tokens_NT[i, len(x):] = x[-1]
        pos_NT[i] = torch.clamp(torch.arange(p0, p0 + T), max=p0 + len(x) - 1)
    return tokens_NT, pos_NT


def sequence_of(batch: Batch, b: int) -> list[int]:
    """Row b's tokens in cache order: its prompt, then its outputs (len_B[b] of them are cached)."""
    return list(batch.requests[b].prompt_token_ids) + list(batch.outputs[b])


class ShadowVerifier:
    """A protected row's prefix-only verifier state: `cache`, a one-row KV cache written only by the
    deterministic engine, holding the deterministic columns of its first `length` tokens."""

    def __init__(self, batch: Batch, b: int):
        """Start from row b's cache as prefilled on the deterministic path (its prompt's columns)."""
        self.cache = RowsCache(batch.cache, [b])
        self.length = int(batch.len_B[b])

    def write_column(self, batch: Batch, b: int, slot: int) -> None:
        """Copy the shadow's (deterministic) K/V column at `slot` into row b of the live cache."""
        for pk, pv, k, v in zip(batch.cache.k, batch.cache.v, self.cache.k, self.cache.v):
            pk[b, slot] = k[0, slot]
            pv[b, slot] = v[0, slot]


def catch_up(det: Engine, batch: Batch, trig: list[int], shadows: list[ShadowVerifier]) -> torch.Tensor:
    """The verifier's logits_NV for rows `trig`'s current steps (each row's last cached token, slot
    len_B-1): every row's shadow caught up over its tokens [length, len_B) in one deterministic
    pass (rows stacked; a shorter row's pads repeat its last token at its last position, which
    rewrites that column with the same bits, as LLM-42's verify pass does). The logits and the
    shadows' columns depend on each row's tokens only (the kernels are batch-invariant)."""
    seqs = [sequence_of(batch, b)[s.length:int(batch.len_B[b])] for b, s in zip(trig, shadows)]
    tokens_NT, pos_NT = padded_chunks(seqs, [s.length for s in shadows])
    caches = [s.cache for s in shadows]
    slots = det.model.kernels.cache_slots(int(pos_NT.max()) + 1)
    for c in caches:  # a shadow made before the running batch's cache grew holds fewer slots
        grow_slots(c, slots)
    stacked = RowsCache.stack(caches, slots)
    logits_NTV = det.run_on(stacked, tokens_NT, pos_NT)
    stacked.unstack(caches)
    for x, s in zip(seqs, shadows):
        s.length += len(x)
    return logits_NTV[torch.arange(len(trig)), torch.tensor([len(x) - 1 for x in seqs])]


class MarginGate(Policy):
    """MarginGate as the paper has it, its verifier keeping the contract (module docstring): a shadow per
    protected row (`ShadowVerifier`), created when the row joins (its prompt prefilled on the
    deterministic path), caught up at each of its triggers."""

    def __init__(self, tau: float, commit_verified: bool = False):
        super().__init__(prefill="protected")
        self.tau, self.commit_verified = tau, commit_verified

    def before_step(self, sched, batch: Batch, rows: list[Row], prot_B: list[bool], st: Stats) -> None:
        for b, p in enumerate(prot_B):
            if p and rows[b].shadow is None:
                rows[b].shadow = ShadowVerifier(batch, b)
        trig = triggered(batch, rows, prot_B, self.tau)
        if not trig:
            return
        st.triggered += len(trig)
        st.verify_passes += 1
        v_NV = catch_up(sched.det, batch, trig, [rows[b].shadow for b in trig])
        ver_N, fast_N = v_NV.argmax(-1).tolist(), batch.logits_BV[trig].argmax(-1).tolist()
        for i, b in enumerate(trig):
            slot = int(batch.len_B[b]) - 1
            if ver_N[i] != fast_N[i]:
                st.repaired += 1
                batch.logits_BV[b] = v_NV[i]
                rows[b].shadow.write_column(batch, b, slot)
            elif self.commit_verified:
                rows[b].shadow.write_column(batch, b, slot)


def margingate(*, tau: float, commit_verified: bool = False, **_) -> MarginGate:
    return MarginGate(tau, commit_verified)
