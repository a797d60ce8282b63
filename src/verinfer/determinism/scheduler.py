"""A continuous-batching greedy scheduler that applies a determinism policy: verinfer's one
serving loop (`Scheduler.loop`), run offline over a list of requests (`Scheduler.run` / `steps`:
`verinfer generate --deterministic`, tau calibration, the benchmarks) and by
`verinfer serve --batching continuous` (server/batching.Batcher feeds requests in while it runs
and streams each row's tokens out).

Serving as an engine serves: up to `max_batch` rows; a row that finishes leaves the batch and
a waiting request is prefilled (in chunks, `fast` numerics) and joins the running batch, so
rows always have mixed lengths (right-padded cache, slot = position). Protected requests (the
ones that asked for determinism) and unprotected ones share the batch.

One batch step: rows whose request was cancelled leave; newcomers taken from the `Feed`,
prefilled (on the engine the policy picks per row) and joined (the cache grown to the slots the
longest needs: `cache_slots`); policy.before_step; one batched decode step on `det` or `fast`
(Engine.emit, each row's own stop rule where the feed sets one, the feed told each row's token,
Engine.advance); policy.after_step; finished rows leave. Every forward goes through Engine
(prefill, emit/advance, recompute, rollback_row, join, select_rows).

The Feed says where requests come from and where their tokens go: `Requests` (a fixed list, its
outputs collected in a dict) or the server's Batcher (a queue open until the server stops). An
error in an admission or a step fails the requests it touched through `Feed.failed` (`Requests`
raises it; the server fails those requests and goes on with the others).

Policies (POLICIES, name -> factory; the reference for protected requests is the deterministic
path run alone): bf16, batch_invariant, layercast, best (policies.py), margingate (margingate.py:
the paper's gate + prefix-only verifier, native repair) and its margingate_live_cache ablation,
llm42 and gated_llm42 (llm42.py: verify-rollback). RENAMED: old names still accepted (with a
DeprecationWarning, `policy_name`) until the next release.

Shape key: B=batch rows, T=tokens, V=vocab.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Callable

import torch

from verinfer.determinism import llm42, margingate, policies
from verinfer.determinism.invariant import fixed_shape_model, layercast_model, tiled_model
from verinfer.determinism.policies import Policy, Row, Stats, grow_slots
from verinfer.engine.engine import Batch, Engine, Request, join, select_rows
from verinfer.models.load import load_model
from verinfer.numerics import Numerics
from verinfer.registry import Registry
from verinfer.sampling.params import stop_reason

POLICIES: Registry[Callable[..., Policy]] = Registry("determinism policy", {
    "bf16": policies.bf16, "batch_invariant": policies.batch_invariant, "layercast": policies.layercast,
    "margingate": margingate.margingate, "margingate_live_cache": margingate.margingate_live_cache,
    "llm42": llm42.llm42, "gated_llm42": llm42.gated_llm42,
    "best": policies.best,
})
RENAMED = {"margingate_contract": "margingate"}  # old name -> its name now (hidden; gone in the next release)


def renamed_note(old: str) -> str:
    """The one line that tells a user of an old policy name its new one."""
    return (f"determinism policy {old!r} is now called {RENAMED[old]!r}; the old name goes in the next release "
            f"(and 'margingate' is the paper's method now: its live-cache ablation is 'margingate_live_cache')")


def policy_name(name: str) -> str:
    """The registered name of policy `name`: itself, or a renamed policy's new name (RENAMED), with
    a DeprecationWarning."""
    if name in RENAMED:
        warnings.warn(renamed_note(name), DeprecationWarning, stacklevel=3)
        return RENAMED[name]
    return name


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


class Feed:
    """Where the loop's requests come from and where their tokens go. The base feed never has a
    request; `open`: more may still come (the loop then waits, yielding 0, instead of ending)."""

    open: bool = False

    def take(self, n: int) -> list[Request]:
        """Up to n requests to join the batch now (first come, first served)."""
        return []

    def cancelled(self, request: Request) -> bool:
        """Drop this request's row before the next step (nobody waits for its tokens any more)."""
        return False

    def stop_ids(self, request: Request) -> Collection[int] | None:
        """The tokens that end this request ("stop", the token included); None: only its
        max_tokens does (the scheduler's engines have no EOS of their own)."""
        return None

    def emitted(self, request: Request, logits_V: torch.Tensor, token: int, finish: str | None) -> None:
        """The row emitted `token`, picked from `logits_V` (the row's logits after the policy's
        verification); finish: why the row ends with it, else None."""

    def left(self, request: Request, outputs: list[int]) -> None:
        """The row left the batch: finished (outputs: its tokens) or cancelled."""

    def failed(self, requests: list[Request], what: str, error: Exception) -> None:
        """`what` ("prefilling the new requests" or "a batched decode step") raised `error`; the
        loop drops these requests' rows. The base feed raises it."""
        raise error


class Requests(Feed):
    """A fixed list of requests, first come first served; each finished request's output tokens go
    to `results` (and progress(1))."""

    def __init__(self, requests: list[Request], results: dict, progress=None):
        self.queue, self.results, self.progress = deque(requests), results, progress

    def take(self, n: int) -> list[Request]:
        return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]

    def left(self, request: Request, outputs: list[int]) -> None:
        self.results[request.id] = list(outputs)
        if self.progress is not None:
            self.progress(1)


class Scheduler:
    def __init__(self, fast: Engine, det: Engine, policy: str = "bf16", tau: float = 0.0, window: int = 64,
                 max_batch: int = 16, record_margins: bool = False, commit_verified: bool | None = None):
        policy = policy_name(policy)
        self.fast, self.det, self.policy_name = fast, det, policy
        kw = {} if commit_verified is None else dict(commit_verified=commit_verified)  # None: the policy's default
        self.policy = POLICIES.get(policy)(tau=tau, window=window, **kw)
        self.max_batch = max_batch
        self.record_margins = record_margins

    @property
    def step_engine(self) -> Engine:
        """The engine of the batched decode step."""
        return self.det if self.policy.det_decode else self.fast

    def cache_slots(self, requests: list[Request]) -> int:
        """Cache slots for the longest of `requests` (prompt + max_tokens + 1, at most the model's
        context), not the model's whole context (memory of every row), in both engines' slot
        multiples so rows of both join."""
        need = min(self.fast.max_positions, max((len(r.prompt_token_ids) + r.params.max_tokens
                                                 for r in requests), default=0)) + 1
        return max(self.det.model.kernels.cache_slots(need), self.fast.model.kernels.cache_slots(need))

    # --- batch management -------------------------------------------------------------
    def _engine_for(self, r: Request, protected: bool) -> Engine:
        p = self.policy.prefill
        return self.det if p == "all" or (p == "protected" and protected) else self.fast

    def _prefill(self, reqs: list[Request], is_protected, slots: int) -> Batch:
        groups: dict[int, list[Request]] = {}
        engines = {}
        for r in reqs:
            e = self._engine_for(r, is_protected(r))
            groups.setdefault(id(e), []).append(r)
            engines[id(e)] = e
        out = None
        for k, grp in groups.items():
            T = max(len(r.prompt_token_ids) for r in grp)
            b = engines[k].prefill(grp, extra_slots=slots - T - 1)
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
              progress=None) -> Iterator[int]:
        """`loop` over the fixed list `requests` (None protected: all of them): fills `results`
        and `st`, yielding after every batch step. Several schedulers can so be advanced in turn
        and timed step by step under the same machine load. The cache is sized once for the
        longest request."""
        return self.loop(Requests(requests, results, progress), protected, st, sampler,
                         slots=self.cache_slots(requests))

    def loop(self, feed: Feed, protected: set[str] | None, st: Stats, sampler=None, slots: int = 0) -> Iterator[int]:
        """The serving loop (module docstring) as a generator: yields after every batch step the
        number of rows it decoded (0 while the batch is empty and the feed open); ends when the
        batch is empty and the feed closed. protected: the ids of the protected requests (None:
        every request). slots: the cache's slots to begin with (grown as newcomers need)."""
        is_protected = (lambda r: True) if protected is None else (lambda r: r.id in protected)
        batch: Batch | None = None
        rows: list[Row] = []
        while True:
            if batch is not None:
                gone = [b for b, r in enumerate(batch.requests) if feed.cancelled(r)]
                for b in gone:
                    feed.left(batch.requests[b], batch.outputs[b])
                batch, rows = _keep(batch, rows, [b for b in range(len(rows)) if b not in gone])
            free = self.max_batch - (len(batch.requests) if batch else 0)
            new = feed.take(free) if free > 0 else []
            if new:
                try:
                    slots = max(slots, self.cache_slots(new))
                    nb = self._prefill(new, is_protected, slots)
                    if batch is not None:
                        grow_slots(batch.cache, slots)
                    batch = nb if batch is None else join(batch, nb)
                    rows += [Row() for _ in new]
                except Exception as e:  # noqa: BLE001 - the feed decides (Requests raises it)
                    feed.failed(new, "prefilling the new requests", e)
            if batch is None:
                if not feed.open:
                    return
                yield 0
                continue
            n = len(batch.requests)
            try:
                self._step(batch, rows, [is_protected(r) for r in batch.requests], feed, st, sampler)
            except Exception as e:  # noqa: BLE001
                failed, batch, rows = batch.requests, None, []
                feed.failed(failed, "a batched decode step", e)
                yield n
                continue
            for b, d in enumerate(batch.done_B):
                if d:
                    feed.left(batch.requests[b], batch.outputs[b])
            batch, rows = _keep(batch, rows, [b for b, d in enumerate(batch.done_B) if not d])
            yield n

    def _step(self, batch: Batch, rows: list[Row], prot_B: list[bool], feed: Feed, st: Stats, sampler) -> None:
        """The policy's verification, one batched decode step, the policy's after-step."""
        if self.record_margins:
            self._record(batch, prot_B, st)
        self.policy.before_step(self, batch, rows, prot_B, st)
        st.protected_steps += sum(p and not d for p, d in zip(prot_B, batch.done_B))
        engine = self.step_engine
        tokens_B = engine.emit(batch, sampler)
        tokens = tokens_B.tolist()
        for b, r in enumerate(batch.requests):
            stop = feed.stop_ids(r)
            if stop is not None:  # the row's own stop rule (sampling.params.stop_reason)
                reason = stop_reason(tokens[b], len(batch.outputs[b]), r.params.max_tokens, stop)
                batch.done_B[b], batch.finish[b] = reason is not None, reason
            feed.emitted(r, batch.logits_BV[b], tokens[b], batch.finish[b])
        engine.advance(batch, tokens_B)
        for row in rows:
            row.det_logits = self.policy.det_decode
        self.policy.after_step(self, batch, rows, prot_B, st)

    def _record(self, batch: Batch, prot_B: list[bool], st: Stats) -> None:
        m = margingate.top2_margin(batch.logits_BV).tolist()
        for b, p in enumerate(prot_B):
            if p and not batch.done_B[b]:
                st.margins.append((batch.requests[b].id, len(batch.outputs[b]), m[b]))


def _keep(batch: Batch, rows: list[Row], keep: list[int]) -> tuple[Batch | None, list[Row]]:
    """Only rows `keep` stay in the batch (None when none do)."""
    if len(keep) == len(rows):
        return batch, rows
    return (select_rows(batch, keep) if keep else None), [rows[b] for b in keep]
