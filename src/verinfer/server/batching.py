"""Continuous batching of a served model's greedy requests (`verinfer serve --batching continuous`).

One `Batcher` per served model owns one background thread and one running `Batch` of up to
`max_batch` rows. The thread runs, until the server stops:

    1. wait until a request is queued or the batch has rows
    2. admit: drop cancelled rows; take up to max_batch - rows queued requests (first come, first
       served), prefill them together on the batch engine (right-padded, in `prefill_chunk`-token
       chunks; none on the deterministic path) with a cache of the batch's slot count (grown, if a
       newcomer needs more, to the kernels' slot multiple over prompt + max_tokens + 1), and join
       them to the running batch (engine.join)
    3. one batched decode step for every row: each row's logits before the step give its Step's
       logprob and top-k (log-softmax of that row's fp32 logits, as generation.py); engine.emit
       picks the greedy tokens, each row's own stop rule (EOS unless ignore_eos, then max_tokens:
       sampling.params.stop_reason) finishes it, the Steps go to the requests' queues, and
       engine.advance runs the new tokens through the model
    4. finished and cancelled rows leave the batch (engine.select_rows)

This is the loop of `determinism.scheduler.Scheduler.steps` with the `bf16` policy (`fast`: the
server's numerics with chunked prefill, so rows of mixed lengths give the batch effects of a real
server) or the `best` policy (a server started with `--deterministic best` holds the fixed-shape
model: prefill and every decode step run on it, so each request's tokens and logprobs are its
batch-of-one answer whatever it shares the batch with). Only greedy requests join: a sampled one
runs alone (server/generation.py) with its own noise stream.

An exception in the loop fails the requests it touched (the newcomers of a failed admission, every
row of a failed step) with a `BatchError` naming what went wrong; the loop goes on with the
others. `stop()` ends the thread and fails whatever is still queued or running.

Shape key: B = batch rows, V = vocab.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from verinfer.engine.engine import Batch, Engine, Request, join, select_rows
from verinfer.sampling.params import SamplingParams, stop_reason
from verinfer.server.generation import Step, step_of
from verinfer.server.registry import ServedModel

BATCHING = ("alone", "continuous")
PREFILL_CHUNK = 16          # tokens per prefill chunk on the bf16 path (determinism.scheduler.make_engines')
STOP_TIMEOUT_S = 30.0       # how long stop() waits for the step in flight


class BatchError(Exception):
    """A request of the batch could not be completed (the loop's error, or the server stopping)."""


@dataclass
class Ticket:
    """One greedy request in a Batcher: its Steps (then None on success, or a BatchError) go to
    `deliver`, called on the loop thread; `cancel()` makes the loop drop it before its next step."""

    request: Request
    stop_ids: frozenset[int]
    logprobs: int | None
    deliver: Callable[[Step | BatchError], None]
    cancelled: bool = field(default=False)

    def cancel(self) -> None:
        self.cancelled = True


def batch_engine(model: ServedModel, deterministic: bool) -> Engine:
    """The engine the batch runs on: the served model's weights and numerics, no EOS of its own
    (each row's stop set is its request's), prefill in PREFILL_CHUNK chunks unless deterministic
    (the fixed-shape model prefills whole prompts, as the `best` policy's det engine)."""
    num = model.engine.numerics.with_(prefill_chunk=None if deterministic else PREFILL_CHUNK)
    return Engine(model.engine.model, num, eos_token_id=None)


def grow_slots(batch: Batch, slots: int) -> None:
    """Give every row of the batch's cache `slots` slots (zeros appended; a kernel's bits depend on
    the slots it reads, never on how many the cache holds)."""
    c = batch.cache
    if c.max_slots >= slots:
        return
    pad = lambda x: torch.cat([x, x.new_zeros(x.shape[0], slots - x.shape[1], *x.shape[2:])], dim=1)  # noqa: E731
    c.k, c.v, c.max_slots = [pad(k) for k in c.k], [pad(v) for v in c.v], slots


class Batcher:
    """The continuous-batching loop of one served model (module docstring): `submit` queues a
    greedy request, the background thread (started by `start`) decodes every admitted request in
    one batch, `stop` ends it."""

    def __init__(self, model: ServedModel, max_batch: int = 16, deterministic: bool = False):
        self.model, self.max_batch = model, max_batch
        self.engine = batch_engine(model, deterministic)
        self.eos_ids = model.engine.stop_token_ids
        self._queue: deque[Ticket] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._batch: Batch | None = None
        self._rows: list[Ticket] = []      # the ticket of each batch row
        self.peak_rows = 0                 # the most rows a decode step has run (a check that requests met)

    # --- the request side -------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Requests queued, not yet admitted to the batch."""
        return len(self._queue)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the loop thread (once; later calls do nothing)."""
        with self._cv:
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._loop, name=f"batch-{self.model.name}", daemon=True)
                self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, deliver, *,
               logprobs: int | None = None, ignore_eos: bool = False) -> Ticket:
        """Queue one greedy request; its Steps go to `deliver` (see Ticket)."""
        if not params.greedy:
            raise ValueError(f"request {request_id}: only greedy requests (temperature 0) join a batch")
        t = Ticket(Request(request_id, list(prompt_ids), params), frozenset() if ignore_eos else self.eos_ids,
                   logprobs, deliver)
        with self._cv:
            if self._stopping:
                raise BatchError("the server is shutting down; retry the request on a running server")
            self._queue.append(t)
            self._cv.notify()
        return t

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """End the loop thread (after the step in flight) and fail every queued or running request."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._cv:
            left, self._queue = list(self._queue), deque()
        self._fail(left, "the server is shutting down; retry the request on a running server")

    # --- the loop -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._queue and self._batch is None:
                    self._cv.wait()
                if self._stopping:
                    break
                new = self._take()
            if new:
                self._guard(new, "prefilling the new requests", self._admit, new)
            if self._batch is not None:
                self._guard(self._rows, "a batched decode step", self._step)
        rows, self._batch, self._rows = self._rows, None, []
        self._fail(rows, "the server is shutting down; retry the request on a running server")

    def _take(self) -> list[Ticket]:
        """Up to the free rows' worth of queued requests, cancelled ones dropped (under the lock)."""
        new: list[Ticket] = []
        while self._queue and len(self._rows) + len(new) < self.max_batch:
            t = self._queue.popleft()
            if not t.cancelled:
                new.append(t)
        return new

    def _guard(self, tickets: list[Ticket], what: str, fn, *args) -> None:
        """fn(*args); on an exception, fail `tickets` naming `what` failed and drop them from the batch."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - any error of the engine fails its requests, never the loop
            failed = {id(t) for t in tickets}
            keep = [b for b, t in enumerate(self._rows) if id(t) not in failed]
            self._keep(keep)
            self._fail(tickets, f"generation failed in {what} of model {self.model.name!r}: "
                                f"{type(e).__name__}: {e}; retry the request, or serve with --batching alone "
                                f"if it persists")

    def _admit(self, new: list[Ticket]) -> None:
        """Prefill the newcomers together and join them to the running batch."""
        reqs = [t.request for t in new]
        need = max(len(r.prompt_token_ids) + r.params.max_tokens for r in reqs) + 1
        have = self._batch.cache.max_slots if self._batch is not None else 0
        slots = max(have, self.engine.model.kernels.cache_slots(need))
        T = max(len(r.prompt_token_ids) for r in reqs)
        nb = self.engine.prefill(reqs, extra_slots=slots - T - 1)
        if self._batch is None:
            self._batch = nb
        else:
            grow_slots(self._batch, slots)
            self._batch = join(self._batch, nb)
        self._rows = self._rows + new

    def _step(self) -> None:
        """Drop cancelled rows, one batched decode step, deliver each row's Step, drop finished rows."""
        self._keep([b for b, t in enumerate(self._rows) if not t.cancelled])
        batch = self._batch
        if batch is None:
            return
        self.peak_rows = max(self.peak_rows, len(self._rows))
        logits_BV = batch.logits_BV.float()
        tokens_B = self.engine.emit(batch)
        for b, t in enumerate(self._rows):  # each row's own stop rule (EOS unless ignore_eos, then length)
            reason = stop_reason(int(tokens_B[b]), len(batch.outputs[b]), t.request.params.max_tokens, t.stop_ids)
            batch.done_B[b], batch.finish[b] = reason is not None, reason
        for b, t in enumerate(self._rows):
            t.deliver(step_of(logits_BV[b], int(tokens_B[b]), t.logprobs, batch.finish[b]))
        self.engine.advance(batch, tokens_B)
        self._keep([b for b, d in enumerate(batch.done_B) if not d])

    def _keep(self, keep: list[int]) -> None:
        """Only rows `keep` stay in the batch (None when none do)."""
        if self._batch is None or len(keep) == len(self._rows):
            return
        self._batch = select_rows(self._batch, keep) if keep else None
        self._rows = [self._rows[b] for b in keep]

    @staticmethod
    def _fail(tickets: list[Ticket], message: str) -> None:
        for t in tickets:
            try:
                t.deliver(BatchError(message))
            except Exception:  # noqa: BLE001 - a receiver that is gone cannot be told
                pass


async def batched_steps(batcher: Batcher, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                        logprobs: int | None = None, ignore_eos: bool = False) -> AsyncIterator[Step]:
    """The Steps of one greedy request decoded in `batcher`'s batch, as generation.generate_steps
    yields them (the last carries finish_reason); raises BatchError if the loop failed it. Leaving
    early (a client that went away) cancels its row."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def deliver(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody waits for this request any more
            pass

    batcher.start()
    ticket = batcher.submit(request_id, prompt_ids, params, deliver, logprobs=logprobs, ignore_eos=ignore_eos)
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BatchError):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        ticket.cancel()
