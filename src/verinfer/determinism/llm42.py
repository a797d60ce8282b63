"""LLM-42's decode-verify-rollback (microsoft/llm-42), always on (`llm42`) or gated by the
MarginGate margin (`gated_llm42`).

- `llm42`: every protected row's unverified tokens are replayed on the deterministic path once
  any row has `window` unverified tokens or has finished (all rows with unverified tokens are
  verified in the same pass, as its fixed-pool mode fills a verify batch with not-yet-ready
  requests); at the first mismatch the output is truncated, the verifier's token emitted, and
  decoding resumes from there; verified K/V columns replace the bf16 ones (`verify_rollback`).
- `gated_llm42`: a protected row is only armed by a near-tie step (margingate.gate: margin <
  tau); once an armed row has `window` tokens since its first near-tie (or finished), all armed
  rows replay their unverified tokens (since their last verified one) in one deterministic pass,
  with rollback from the first mismatch as in llm42. A row with no near-tie since its last
  verification is never replayed.
Protected prompts are prefilled on the deterministic path.

Shape key: B=batch rows, N=replayed rows, T=replayed tokens per row, V=vocab.
"""

from __future__ import annotations


from verinfer.determinism.margingate import gate, padded_chunks
from verinfer.determinism.policies import Policy, Row, Stats
from verinfer.engine.engine import Batch, Engine


def verify_rollback(det: Engine, batch: Batch, rows: list[Row], start: dict[int, int], st: Stats) -> None:
    """One deterministic verification pass: row b's outputs[start[b]:] are replayed with `det` in
    one forward (all rows together, on a private copy of their KV). The logits of outputs[j] come
    from the forward of token j-1 (the prompt's last token for j=0) at slot P+j-1, so tokens
    s-1 .. n-1 are replayed (a finished row's last token is not). All verified: the replayed K/V
    columns are committed and the row's next logits are the verifier's. First mismatch at j:
    columns up to it are committed, outputs[s+j:] rolled back and the verifier's logits there
    give the next token (Engine.rollback_row)."""
    todo = sorted(start)
    st.verify_passes += 1
    seqs, pos0 = [], []
    for b in todo:
        s, outs = start[b], batch.outputs[b]
        P = len(batch.requests[b].prompt_token_ids)
        prev = outs[s - 1] if s > 0 else batch.requests[b].prompt_token_ids[-1]
        seqs.append([prev] + outs[s:-1] if batch.done_B[b] else [prev] + outs[s:])
        pos0.append(P + s - 1)
    tokens_NT, pos_NT = padded_chunks(seqs, pos0)
    logits_NTV, scratch = det.recompute(batch, todo, tokens_NT, pos_NT)
    pred_NT = logits_NTV.argmax(-1)
    for i, b in enumerate(todo):
        s, outs, n = start[b], batch.outputs[b], len(seqs[i])
        st.triggered += n
        claimed = outs[s : s + n]
        pred = pred_NT[i, : len(claimed)].tolist()
        j = next((t for t in range(len(claimed)) if pred[t] != claimed[t]), None)
        if j is None:  # all verified; the last replayed logits are deterministic
            scratch.commit(i, pos0[i], pos0[i] + n)
            rows[b].verified = s + n
            if not batch.done_B[b]:
                batch.logits_BV[b] = logits_NTV[i, n - 1]
                rows[b].det_logits = True  # so verified = len(outs) + 1: the next token too
        else:  # keep outs[:s+j], emit the verifier's token next
            st.repaired += 1
            scratch.commit(i, pos0[i], pos0[i] + j + 1)
            st.rolled_back += len(outs) - (s + j)
            det.rollback_row(batch, b, s + j, logits_NTV[i, j])
            rows[b].verified = s + j + 1
            rows[b].det_logits = True
        rows[b].armed_at = None


class LLM42(Policy):
    """Always-on windowed verification of every protected row."""

    def __init__(self, window: int):
        super().__init__(prefill="protected")
        self.window = window

    def pending(self, batch: Batch, rows: list[Row], prot_B: list[bool]) -> dict[int, int]:
        """{row: index of its first unverified output} for the rows a pass would replay."""
        return {b: rows[b].verified for b, p in enumerate(prot_B) if p and len(batch.outputs[b]) > rows[b].verified}

    def window_start(self, row: Row, start: int) -> int:
        """Output index the row's window counts from."""
        return start

    def after_step(self, sched, batch: Batch, rows: list[Row], prot_B: list[bool], st: Stats) -> None:
        start = self.pending(batch, rows, prot_B)
        if any(batch.done_B[b] or len(batch.outputs[b]) - self.window_start(rows[b], s) >= self.window
               for b, s in start.items()):
            verify_rollback(sched.det, batch, rows, start, st)


class GatedLLM42(LLM42):
    """LLM-42's windows, armed only by a near-tie step."""

    def __init__(self, tau: float, window: int):
        super().__init__(window)
        self.tau = tau

    def before_step(self, sched, batch: Batch, rows: list[Row], prot_B: list[bool], st: Stats) -> None:
        near_B = gate(batch.logits_BV, self.tau)
        for b, p in enumerate(prot_B):
            r = rows[b]
            if p and not batch.done_B[b] and not r.det_logits and r.armed_at is None and near_B[b]:
                r.armed_at = len(batch.outputs[b])  # index of the token about to be emitted

    def pending(self, batch: Batch, rows: list[Row], prot_B: list[bool]) -> dict[int, int]:
        # armed rows replay everything since their last verified token (so every column a later
        # step reads was written by the deterministic path or by a high-margin step)
        return {b: rows[b].verified for b, p in enumerate(prot_B) if p and rows[b].armed_at is not None}

    def window_start(self, row: Row, start: int) -> int:
        return row.armed_at


def llm42(*, window: int = 64, **_) -> LLM42:
    return LLM42(window)


def gated_llm42(*, tau: float, window: int = 64, **_) -> GatedLLM42:
    return GatedLLM42(tau, window)
