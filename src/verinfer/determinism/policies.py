"""What a determinism policy is to the scheduler (scheduler.py), and the policies that need no
verifier.

A policy says which engine prefills a row and which one runs the batched decode step, and may act
on the batch before the step (MarginGate's gate and repair, margingate.py; gated LLM-42's arming)
and after it (LLM-42's verify-rollback, llm42.py). Two engines serve every policy: `fast` (the
batched bf16 path, chunked prefill) and `det` (the deterministic path: the reference and the
verifier). `grow_slots` gives a KV cache more slots (the loop's running batch when a newcomer
needs more, a MarginGate shadow stacked with longer rows).

- `bf16`: the default batched bf16 path, nothing else.
- `batch_invariant`: every forward (prefill and decode, every row) on `det` (the tiled
  batch-invariant kernels are passed as `det`).
- `layercast`: the bf16 policy run with a LayerCast engine as `fast` (bf16 weights, fp32 compute).
- `best` (verinfer's cheapest exact policy): protected prompts are prefilled and every decode step
  runs on `det`, the fixed-shape kernels (numerics/kernels.FixedShape), after `certify()` checked on
  this machine that nothing else changes a row's bits. Unprotected rows share the same forward
  (their prefill stays on the fast chunked path). Exact by construction: nothing is verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verinfer.engine.engine import Batch
from verinfer.models.llama import KVCache


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
    """A policy's per-row state, aligned with the batch's rows."""

    verified: int = 0          # windowed policies: outputs[:verified] are verified
    armed_at: int | None = None  # gated_llm42: output index of the first unverified near-tie step
    det_logits: bool = True    # the row's current logits came from the deterministic path
    shadow: object = None      # margingate: the row's prefix-only verifier (margingate.ShadowVerifier)


@dataclass
class Policy:
    """prefill: which rows `det` prefills ("none", "protected" or "all"; the others: `fast`).
    det_decode: the batched decode step runs on `det` (else on `fast`).
    The hooks get the scheduler (its `det` engine), the batch, the per-row state, which rows are
    protected and the stats; the base policy does nothing in them."""

    prefill: str = "none"
    det_decode: bool = False

    def before_step(self, sched, batch: Batch, rows: list[Row], prot_B: list[bool], st: Stats) -> None:
        """Before the decode step samples from batch.logits_BV."""

    def after_step(self, sched, batch: Batch, rows: list[Row], prot_B: list[bool], st: Stats) -> None:
        """After the decode step recorded its tokens and ran them through the model."""


def bf16(**_) -> Policy:
    return Policy()


def batch_invariant(**_) -> Policy:
    return Policy(prefill="all", det_decode=True)


def layercast(**_) -> Policy:
    return Policy()


def best(**_) -> Policy:
    return Policy(prefill="protected", det_decode=True)


def grow_slots(cache: KVCache, slots: int) -> None:
    """Give every row of `cache` at least `slots` slots (zeros appended; a kernel's bits depend on
    the slots it reads, never on how many the cache holds: numerics/kernels.py cache_slots)."""
    if cache.max_slots >= slots:
        return
    pad = lambda x: torch.cat([x, x.new_zeros(x.shape[0], slots - x.shape[1], *x.shape[2:])], dim=1)  # noqa: E731
    cache.k, cache.v, cache.max_slots = [pad(k) for k in cache.k], [pad(v) for v in cache.v], slots
