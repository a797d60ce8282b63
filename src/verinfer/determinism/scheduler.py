"""A continuous-batching greedy server loop with deterministic-decoding policies.

Serving as an engine serves: up to `max_batch` rows; a row that finishes leaves the batch and
a waiting request is prefilled (in chunks, `fast` numerics) and joins the running batch, so
rows always have mixed lengths (right-padded cache, slot = position). Protected requests (the
ones that asked for determinism) and unprotected ones share the batch.

Policies (the reference for protected requests is the batch-invariant path run alone):
- `bf16`: the default batched bf16 path, nothing else.
- `batch_invariant`: every forward (prefill and decode, every row) on the batch-invariant path.
- `layercast`: every forward with bf16 weights and fp32 compute (reference: LayerCast alone).
- `margingate` (paper): protected prompts are prefilled on the deterministic path; at each step
  a protected row whose top1-top2 logit margin is < tau has its step recomputed by the
  deterministic verifier (all triggered rows in one forward); if the verifier's token differs,
  its logits replace the row's and its K/V column overwrites the row's current column (native
  repair: one column, no rollback). With `commit_verified` (default) a verified commit also
  writes the verifier's column (the paper keeps the bf16 one; on this testbed bf16 logits tie
  often and bf16 columns left in the cache break exactness). r_verify = triggered / protected steps, r_repair = repaired
  / protected steps.
- `llm42` (always-on decode-verify-rollback, microsoft/llm-42): every protected row's unverified
  tokens are replayed on the deterministic path once any row has `window` unverified tokens or
  has finished (all rows with unverified tokens verified in the same pass, as its fixed-pool
  mode fills a verify batch with not-yet-ready requests); at the first mismatch the output is
  truncated, the verifier token emitted, and decoding resumes from there; verified K/V columns
  replace the bf16 ones.
- `gated_llm42`: LLM-42's windowed decode-verify-rollback gated by the margin: a protected row is
  only armed by a near-tie step (margin < tau); once an armed row has `window` tokens since its
  first near-tie (or finished), all armed rows replay their unverified tokens (since their last
  verified one) in one deterministic pass, with rollback from the first mismatch as in llm42. A
  row with no near-tie since its last verification is never replayed.
- `best` (verinfer's cheapest exact policy): protected prompts are prefilled and every decode
  step runs on the fixed-shape deterministic path (`det`, numerics/kernels.FixedShape):
  the library's own fast kernels with the key-slot count and the query shape held fixed, after
  `certify()` checked on this machine that nothing else changes a row's bits. Unprotected rows
  share the same forward (their prefill stays on the fast chunked path). Exact by construction,
  so nothing is verified, triggered or rolled back.

Shape key: B=batch rows, T=tokens, V=vocab.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from verinfer.engine.engine import Batch, Engine, Request, join, select_rows

POLICIES = ("bf16", "batch_invariant", "layercast", "margingate", "llm42", "gated_llm42", "best")


def top2_margin(logits_BV: torch.Tensor) -> torch.Tensor:
    top = logits_BV.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


@dataclass
class Stats:
    protected_steps: int = 0
    triggered: int = 0        # margingate: steps sent to the verifier; windowed: tokens replayed
    repaired: int = 0         # steps whose token the verifier changed
    verify_passes: int = 0
    rolled_back: int = 0      # tokens discarded by rollbacks
    seconds: float = 0.0      # wall clock
    cpu_seconds: float = 0.0  # this process's CPU time (robust to other load on a shared machine)
    margins: list = field(default_factory=list)  # (request id, step, margin) of protected rows

    def rates(self) -> dict:
        n = max(self.protected_steps, 1)
        return dict(trigger_rate=self.triggered / n, repair_rate=self.repaired / n,
                    verify_passes=self.verify_passes, rolled_back=self.rolled_back,
                    protected_steps=self.protected_steps, seconds=self.seconds, cpu_seconds=self.cpu_seconds)


@dataclass
class Row:
    verified: int = 0          # windowed policies: outputs[:verified] are verified
    armed_at: int | None = None  # gated_llm42: output index of the first unverified near-tie step
    det_logits: bool = True    # the row's current logits came from the deterministic path


class Server:
    def __init__(self, fast: Engine, det: Engine, policy: str = "bf16", tau: float = 0.0, window: int = 64,
                 max_batch: int = 16, record_margins: bool = False, commit_verified: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.fast, self.det, self.policy = fast, det, policy
        self.tau, self.window, self.max_batch = tau, window, max_batch
        self.record_margins = record_margins
        self.commit_verified = commit_verified
        self.slots = fast.max_positions + 1

    # --- batch management -------------------------------------------------------------
    def _prefill(self, reqs: list[Request], protected: set[str]) -> Batch:
        eng_for = lambda r: self.det if (self.policy in ("batch_invariant",) or  # noqa: E731
                                          (r.id in protected and self.policy in ("margingate", "llm42", "gated_llm42", "best"))) \
            else self.fast
        groups: dict[int, list[Request]] = {}
        engines = {}
        for r in reqs:
            e = eng_for(r)
            groups.setdefault(id(e), []).append(r)
            engines[id(e)] = e
        out = None
        for k, grp in groups.items():
            T = max(len(r.prompt_token_ids) for r in grp)
            b = engines[k].prefill(grp, extra_slots=self.slots - T - 1)
            out = b if out is None else join(out, b)
        return out

    def run(self, requests: list[Request], protected: set[str] | None = None, sampler=None,
            progress=None) -> tuple[dict[str, list[int]], Stats]:
        """Greedy-generate every request; returns ({id: output tokens}, stats)."""
        results: dict[str, list[int]] = {}
        st = Stats()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in self.steps(requests, protected, results, st, sampler, progress):
            pass
        st.seconds = time.perf_counter() - t0
        st.cpu_seconds = time.process_time() - c0
        return results, st

    def steps(self, requests: list[Request], protected: set[str] | None, results: dict, st: Stats, sampler=None,
              progress=None):
        """The serving loop as a generator: fills `results` and `st`, yielding after every batch
        step (newcomers prefilled, one decode step, the policy's verification). Several servers can
        so be advanced in turn and timed step by step under the same machine load."""
        protected = set(r.id for r in requests) if protected is None else protected
        queue = deque(requests)
        batch: Batch | None = None
        rows: list[Row] = []
        step_engine = {"batch_invariant": self.det, "best": self.det}.get(self.policy, self.fast)
        while queue or batch is not None:
            free = self.max_batch - (len(batch.requests) if batch else 0)
            if free > 0 and queue:
                new = [queue.popleft() for _ in range(min(free, len(queue)))]
                nb = self._prefill(new, protected)
                batch = nb if batch is None else join(batch, nb)
                rows += [Row() for _ in new]
            prot_B = [r.id in protected for r in batch.requests]
            if self.policy == "margingate":
                self._margingate(batch, rows, prot_B, st)
            elif self.policy == "gated_llm42":
                self._arm(batch, rows, prot_B, st)
            elif self.record_margins:
                self._record(batch, rows, prot_B, st)
            st.protected_steps += sum(p and not d for p, d in zip(prot_B, batch.done_B))
            step_engine.decode_step(batch, sampler)
            for row in rows:
                row.det_logits = self.policy in ("batch_invariant", "best")
            if self.policy in ("llm42", "gated_llm42"):
                self._windowed(batch, rows, prot_B, st)
            done = [b for b, d in enumerate(batch.done_B) if d]
            if done:
                for b in done:
                    results[batch.requests[b].id] = list(batch.outputs[b])
                    if progress is not None:
                        progress(1)
                keep = [b for b in range(len(batch.requests)) if not batch.done_B[b]]
                batch = select_rows(batch, keep) if keep else None
                rows = [rows[b] for b in keep]
            yield

    # --- policies ---------------------------------------------------------------------
    def _record(self, batch, rows, prot_B, st):
        m = top2_margin(batch.logits_BV).tolist()
        for b, p in enumerate(prot_B):
            if p and not batch.done_B[b]:
                st.margins.append((batch.requests[b].id, len(batch.outputs[b]), m[b]))

    def _margingate(self, batch: Batch, rows, prot_B, st: Stats) -> None:
        m_B = top2_margin(batch.logits_BV)
        if self.record_margins:
            self._record(batch, rows, prot_B, st)
        trig = [b for b, p in enumerate(prot_B) if p and not batch.done_B[b] and not rows[b].det_logits
                and float(m_B[b]) < self.tau]
        if not trig:
            return
        st.triggered += len(trig)
        st.verify_passes += 1
        # recompute the step that produced these logits: the last token, at slot len-1
        last = torch.tensor([(batch.outputs[b][-1] if batch.outputs[b] else batch.requests[b].prompt_token_ids[-1])
                             for b in trig])[:, None]
        pos = (batch.len_B[trig] - 1)[:, None]
        logits_NTV, sub = self.det.recompute(batch, trig, last, pos)
        v_N = logits_NTV[:, 0]
        fast_tok = batch.logits_BV[trig].argmax(-1)
        ver_tok = v_N.argmax(-1)
        for i, b in enumerate(trig):
            slot = int(pos[i, 0])
            if int(ver_tok[i]) != int(fast_tok[i]):
                st.repaired += 1
                sub.commit(i, slot, slot + 1)
                batch.logits_BV[b] = v_N[i]
            elif self.commit_verified:  # verified commit also keeps the verifier's column
                sub.commit(i, slot, slot + 1)

    def _arm(self, batch: Batch, rows, prot_B, st: Stats) -> None:
        m_B = top2_margin(batch.logits_BV)
        if self.record_margins:
            self._record(batch, rows, prot_B, st)
        for b, p in enumerate(prot_B):
            r = rows[b]
            if p and not batch.done_B[b] and not r.det_logits and r.armed_at is None and float(m_B[b]) < self.tau:
                r.armed_at = len(batch.outputs[b])  # index of the token about to be emitted

    def _windowed(self, batch: Batch, rows, prot_B, st: Stats) -> None:
        """Decode-verify-rollback for llm42 (every protected row) and gated_llm42 (armed rows)."""
        W = self.window
        if self.policy == "llm42":
            start = {b: rows[b].verified for b, p in enumerate(prot_B) if p and len(batch.outputs[b]) > rows[b].verified}
        else:
            # armed rows replay everything since their last verified token (so every column a
            # later step reads was written by the deterministic path or by a high-margin step)
            start = {b: rows[b].verified for b, p in enumerate(prot_B) if p and rows[b].armed_at is not None}
        ready = [b for b, s in start.items() if batch.done_B[b] or
                 len(batch.outputs[b]) - (rows[b].armed_at if self.policy == "gated_llm42" else s) >= W]
        if not ready:
            return
        todo = sorted(start)
        st.verify_passes += 1
        # row b: outputs[s:] are to check; the logits of outputs[j] come from the forward of
        # token j-1 (the prompt's last token for j=0) at slot P+j-1. Replay tokens s-1 .. n-1.
        seqs, pos0 = [], []
        for b in todo:
            s, outs = start[b], batch.outputs[b]
            P = len(batch.requests[b].prompt_token_ids)
            prev = outs[s - 1] if s > 0 else batch.requests[b].prompt_token_ids[-1]
            seqs.append([prev] + outs[s:-1] if batch.done_B[b] else [prev] + outs[s:])
            pos0.append(P + s - 1)
        T = max(len(x) for x in seqs)
        tokens_NT = torch.zeros(len(todo), T, dtype=torch.long)
        pos_NT = torch.zeros(len(todo), T, dtype=torch.long)
        for i, (x, p0) in enumerate(zip(seqs, pos0)):
            tokens_NT[i, : len(x)] = torch.tensor(x)
            tokens_NT[i, len(x):] = x[-1]
            pos_NT[i] = torch.clamp(torch.arange(p0, p0 + T), max=p0 + len(x) - 1)  # pads repeat the last token
        logits_NTV, sub = self.det.recompute(batch, todo, tokens_NT, pos_NT)
        pred_NT = logits_NTV.argmax(-1)
        for i, b in enumerate(todo):
            s, outs, n = start[b], batch.outputs[b], len(seqs[i])
            st.triggered += n
            claimed = outs[s : s + n]
            pred = pred_NT[i, : len(claimed)].tolist()
            j = next((t for t in range(len(claimed)) if pred[t] != claimed[t]), None)
            if j is None:  # all verified; the last replayed logits are deterministic
                sub.commit(i, pos0[i], pos0[i] + n)
                rows[b].verified = s + n
                if not batch.done_B[b]:
                    batch.logits_BV[b] = logits_NTV[i, n - 1]
                    rows[b].det_logits = True  # so verified = len(outs) + 1: the next token too
            else:  # keep outs[:s+j], emit the verifier's token next
                st.repaired += 1
                sub.commit(i, pos0[i], pos0[i] + j + 1)
                st.rolled_back += len(outs) - (s + j)
                self.det.rollback_row(batch, b, s + j, logits_NTV[i, j])
                rows[b].verified = s + j + 1
                rows[b].det_logits = True
            rows[b].armed_at = None
