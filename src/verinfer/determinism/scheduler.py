"""A continuous-batching greedy scheduler that applies a determinism policy.

Serving as an engine serves: up to `max_batch` rows; a row that finishes leaves the batch and
a waiting request is prefilled (in chunks, `fast` numerics) and joins the running batch, so
rows always have mixed lengths (right-padded cache, slot = position). Protected requests (the
ones that asked for determinism) and unprotected ones share the batch.

One batch step: newcomers prefilled (on the engine the policy picks per row) and joined;
policy.before_step; one batched decode step (Engine.decode_step, on `det` or `fast`);
policy.after_step; finished rows leave. Every forward goes through Engine (prefill, decode_step,
recompute, rollback_row, join, select_rows).

Policies (POLICIES, name -> factory; the reference for protected requests is the deterministic
path run alone): bf16, batch_invariant, layercast, best (policies.py), margingate_contract and
margingate (margingate.py: gate + a prefix-only verifier / the live-cache ablation, native repair),
llm42 and gated_llm42 (llm42.py: verify-rollback).

Shape key: B=batch rows, T=tokens, V=vocab.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from verinfer.determinism import llm42, margingate, policies
from verinfer.determinism.invariant import fixed_shape_model, layercast_model, tiled_model
from verinfer.determinism.policies import Policy, Row, Stats
from verinfer.engine.engine import Batch, Engine, Request, join, select_rows
from verinfer.models.load import load_model
from verinfer.numerics import Numerics
from verinfer.registry import Registry

POLICIES: Registry[Callable[..., Policy]] = Registry("determinism policy", {
    "bf16": policies.bf16, "batch_invariant": policies.batch_invariant, "layercast": policies.layercast,
    "margingate": margingate.margingate, "margingate_contract": margingate.margingate_contract,
    "llm42": llm42.llm42, "gated_llm42": llm42.gated_llm42,
    "best": policies.best,
})


@dataclass
class Engines:
    fast: Engine   # bf16 default, chunked prefill
    det: Engine    # fixed-shape deterministic path: the reference and every verifier
    tiled: Engine  # op-level batch-invariant kernels (the batch_invariant baseline; its own reference)
    layercast: Engine


def make_engines(model_dir, device="cpu", prefill_chunk: int = 16, threads: int | None = None,
                 tiled_key_slots: int | None = None) -> Engines:
    """The engines the policies run on, over one bf16 copy of the weights. tiled_key_slots: the
    fixed key length the tiled batch_invariant path pads every row to (default: the model's context,
    e.g. 8,192 positions for SmolLM2; a server that caps max_model_len lower can pad less)."""
    num = Numerics(dtype="bf16", threads=threads)
    m = load_model(model_dir, num, device)
    with num.threads_ctx():  # certify the kernels at the thread count they will run with
        det = fixed_shape_model(m)
    return Engines(Engine(m, num.with_(prefill_chunk=prefill_chunk), eos_token_id=None),
                   Engine(det, num, eos_token_id=None),
                   Engine(tiled_model(m, key_slots=tiled_key_slots), num, eos_token_id=None),
                   Engine(layercast_model(m), num.with_(dtype="fp32", prefill_chunk=prefill_chunk), eos_token_id=None))


class Scheduler:
    def __init__(self, fast: Engine, det: Engine, policy: str = "bf16", tau: float = 0.0, window: int = 64,
                 max_batch: int = 16, record_margins: bool = False, commit_verified: bool | None = None):
        self.fast, self.det, self.policy_name = fast, det, policy
        kw = {} if commit_verified is None else dict(commit_verified=commit_verified)  # None: the policy's default
        self.policy = POLICIES.get(policy)(tau=tau, window=window, **kw)
        self.max_batch = max_batch
        self.record_margins = record_margins
        self.slots = fast.max_positions + 1

    # --- batch management -------------------------------------------------------------
    def _engine_for(self, r: Request, protected: set[str]) -> Engine:
        p = self.policy.prefill
        return self.det if p == "all" or (p == "protected" and r.id in protected) else self.fast

    def _prefill(self, reqs: list[Request], protected: set[str]) -> Batch:
        groups: dict[int, list[Request]] = {}
        engines = {}
        for r in reqs:
            e = self._engine_for(r, protected)
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
        step (newcomers prefilled, one decode step, the policy's verification). Several schedulers
        can so be advanced in turn and timed step by step under the same machine load."""
        protected = set(r.id for r in requests) if protected is None else protected
        # cache slots for the longest request, not the model's whole context (memory of every row)
        # (in the deterministic kernels' slot multiples, so rows of both engines join)
        need = min(self.fast.max_positions, max((len(r.prompt_token_ids) + r.params.max_tokens
                                                 for r in requests), default=0)) + 1
        self.slots = max(self.det.model.kernels.cache_slots(need), self.fast.model.kernels.cache_slots(need))
        queue = deque(requests)
        batch: Batch | None = None
        rows: list[Row] = []
        step_engine = self.det if self.policy.det_decode else self.fast
        while queue or batch is not None:
            free = self.max_batch - (len(batch.requests) if batch else 0)
            if free > 0 and queue:
                new = [queue.popleft() for _ in range(min(free, len(queue)))]
                nb = self._prefill(new, protected)
                batch = nb if batch is None else join(batch, nb)
                rows += [Row() for _ in new]
            prot_B = [r.id in protected for r in batch.requests]
            if self.record_margins:
                self._record(batch, prot_B, st)
            self.policy.before_step(self, batch, rows, prot_B, st)
            st.protected_steps += sum(p and not d for p, d in zip(prot_B, batch.done_B))
            step_engine.decode_step(batch, sampler)
            for row in rows:
                row.det_logits = self.policy.det_decode
            self.policy.after_step(self, batch, rows, prot_B, st)
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

    def _record(self, batch: Batch, prot_B: list[bool], st: Stats) -> None:
        m = margingate.top2_margin(batch.logits_BV).tolist()
        for b, p in enumerate(prot_B):
            if p and not batch.done_B[b]:
                st.margins.append((batch.requests[b].id, len(batch.outputs[b]), m[b]))
