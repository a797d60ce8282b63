"""MarginGate (paper: selective verification for deterministic batched decoding): the gate and
the native repair.

At each step, a protected row whose current logits came from the batched bf16 path is verified
when its top-1 minus top-2 logit margin is below tau (`gate`). All triggered rows are recomputed
in one forward of the deterministic verifier (`repair`): the step that produced the row's
logits, i.e. its last token at slot len-1, on a private copy of its KV cache. If the verifier's
token differs, its logits replace the row's and its K/V column overwrites the row's current
column (native repair: one column, no rollback). With `commit_verified` (default) a verified
commit also writes the verifier's column (the paper keeps the bf16 one; on this testbed bf16
logits tie often and bf16 columns left in the cache break exactness). Protected prompts are
prefilled on the deterministic path. r_verify = triggered / protected steps, r_repair = repaired
/ protected steps (Stats.rates).

Shape key: B=batch rows, N=triggered rows, V=vocab.
"""

from __future__ import annotations

import torch

from verinfer.determinism.policies import Policy, Row, Stats
from verinfer.engine.engine import Batch, Engine


def top2_margin(logits_BV: torch.Tensor) -> torch.Tensor:
    """margin_B = l_top1 - l_top2 of each row's logits."""
    top = logits_BV.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def gate(logits_BV: torch.Tensor, tau: float) -> list[bool]:
    """MarginGate's gate: verify row b's step when top2_margin(logits)[b] < tau (compared as
    Python floats, the fp32 margin exactly)."""
    return [m < tau for m in top2_margin(logits_BV).tolist()]


def repair(det: Engine, batch: Batch, trig: list[int], commit_verified: bool = True) -> int:
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


class MarginGate(Policy):
    def __init__(self, tau: float, commit_verified: bool = True):
        super().__init__(prefill="protected")
        self.tau, self.commit_verified = tau, commit_verified

    def before_step(self, sched, batch: Batch, rows: list[Row], prot_B: list[bool], st: Stats) -> None:
        verify_B = gate(batch.logits_BV, self.tau)
        trig = [b for b, p in enumerate(prot_B) if p and not batch.done_B[b] and not rows[b].det_logits
                and verify_B[b]]
        if not trig:
            return
        st.triggered += len(trig)
        st.verify_passes += 1
        st.repaired += repair(sched.det, batch, trig, self.commit_verified)


def margingate(*, tau: float, commit_verified: bool = True, **_) -> MarginGate:
    return MarginGate(tau, commit_verified)
