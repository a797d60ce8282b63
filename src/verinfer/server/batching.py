"""Continuous batching of a served model's greedy requests (`verinfer serve --batching continuous`).

One `Batcher` per served model owns one background thread that runs the determinism scheduler's
loop (`determinism.scheduler.Scheduler.loop`, the one serving loop of verinfer) with the Batcher as
its Feed: `submit` queues a greedy request; the loop admits queued requests (first come, first
served) into its running batch of up to `max_batch` rows, and after each batched decode step the
Batcher hands every row's Step to its request (logprob and top-k: log-softmax of the row's fp32
logits the token was picked from, as generation.py). Each row has its own stop rule (its request's
EOS set unless ignore_eos, then max_tokens: sampling.params.stop_reason); a cancelled request (a
client that went away) leaves the batch before the next step. The thread sleeps while nothing is
queued or running.

The scheduler's policy is the server's `--deterministic` mode (`batch_scheduler`):
- none: `bf16` on the server's numerics with chunked prefill (`fast`, PREFILL_CHUNK tokens), so
  rows of mixed lengths give the batch effects of a real server.
- `best`: the served model is the fixed-shape model (server/registry.py): prefill and every decode
  step run on it, so each request's tokens and logprobs are its batch-of-one answer whatever it
  shares the batch with.
- `margingate` (the paper's method, determinism/margingate.py): the batch decodes on the server's
  bf16 path; a step whose top-2 margin is below the calibrated tau is verified by the fixed-shape
  path on the request's own token prefix and repaired, so each request's tokens are the fixed-shape
  path's batch-of-one tokens (`best`'s), its logprobs those of the batch.
Only greedy requests join: a sampled one runs alone (server/generation.py) with its own noise
stream.

An exception in the loop fails the requests it touched (the newcomers of a failed admission, every
row of a failed step) with a `BatchError` naming what went wrong; the loop goes on with the
others. `stop()` ends the thread and fails whatever is still queued or running.

Shape key: V = vocab.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from verinfer.determinism.invariant import fixed_shape_model
from verinfer.determinism.policies import Stats
from verinfer.determinism.scheduler import Feed, Scheduler
from verinfer.engine.engine import Engine, Request
from verinfer.sampling.params import SamplingParams
from verinfer.server.generation import Step, step_of
from verinfer.server.registry import ServedModel

BATCHING = ("alone", "continuous")
PREFILL_CHUNK = 16          # tokens per prefill chunk on the bf16 path (determinism.scheduler.make_engines')
STOP_TIMEOUT_S = 30.0       # how long stop() waits for the step in flight
SHUTTING_DOWN = "the server is shutting down; retry the request on a running server"


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


def batch_scheduler(model: ServedModel, deterministic: str | None, max_batch: int, tau: float = 0.0) -> Scheduler:
    """The scheduler of a served model's batch (module docstring): engines over the served model's
    weights and numerics, no EOS of their own (each row's stop set is its request's); the fast path
    prefills in PREFILL_CHUNK chunks, the fixed-shape path whole prompts (as make_engines')."""
    num, m = model.engine.numerics, model.engine.model
    fast = Engine(m, num.with_(prefill_chunk=PREFILL_CHUNK), eos_token_id=None)
    if deterministic is None:
        return Scheduler(fast, fast, "bf16", max_batch=max_batch)
    det = Engine(fixed_shape_model(m), num.with_(prefill_chunk=None), eos_token_id=None)
    if deterministic == "best":  # the served model is already the fixed-shape one: no bf16 path
        return Scheduler(det, det, "best", max_batch=max_batch)
    return Scheduler(fast, det, deterministic, tau=tau, max_batch=max_batch)


class Batcher(Feed):
    """The continuous-batching loop of one served model (module docstring): `submit` queues a
    greedy request, the background thread (started by `start`) runs `Scheduler.loop` with this
    Batcher as its feed, `stop` ends it. `stats`: the policy's counts (steps verified, repaired)."""

    def __init__(self, model: ServedModel, max_batch: int = 16, deterministic: str | None = None, tau: float = 0.0):
        self.model, self.max_batch = model, max_batch
        self.scheduler = batch_scheduler(model, deterministic, max_batch, tau)
        self.engine = self.scheduler.step_engine  # the engine of the batched decode step
        self.eos_ids = model.engine.stop_token_ids
        self.stats = Stats()
        self._queue: deque[Ticket] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._rows: dict[int, Ticket] = {}  # id(request) -> ticket, for every row of the batch (loop thread)
        self.peak_rows = 0                  # the most rows a decode step has run (a check that requests met)

    # --- the request side -------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Requests queued, not yet admitted to the batch."""
        return len(self._queue)

    @property
    def rows(self) -> int:
        """Requests in the running batch."""
        return len(self._rows)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the loop thread (once; later calls do nothing)."""
        with self._cv:
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name=f"batch-{self.model.name}", daemon=True)
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
                raise BatchError(SHUTTING_DOWN)
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
        self._fail(left, SHUTTING_DOWN)

    # --- the loop thread ----------------------------------------------------------------
    def _run(self) -> None:
        loop = self.scheduler.loop(self, None, self.stats)  # every request is protected
        while True:
            with self._cv:
                while not self._stopping and not self._queue and not self._rows:
                    self._cv.wait()
                if self._stopping:
                    break
            self.peak_rows = max(self.peak_rows, next(loop, 0))  # 0: it ended (the server is stopping)
        loop.close()
        rows, self._rows = list(self._rows.values()), {}
        self._fail(rows, SHUTTING_DOWN)

    # --- the feed (called by Scheduler.loop on the loop thread) -------------------------
    @property
    def open(self) -> bool:
        return not self._stopping

    def take(self, n: int) -> list[Request]:
        """Up to n queued requests, cancelled ones dropped."""
        new: list[Ticket] = []
        with self._cv:
            while self._queue and len(new) < n:
                t = self._queue.popleft()
                if not t.cancelled:
                    new.append(t)
        self._rows.update((id(t.request), t) for t in new)
        return [t.request for t in new]

    def cancelled(self, request: Request) -> bool:
        return self._rows[id(request)].cancelled

    def stop_ids(self, request: Request) -> Collection[int]:
        return self._rows[id(request)].stop_ids

    def emitted(self, request: Request, logits_V: torch.Tensor, token: int, finish: str | None) -> None:
        t = self._rows[id(request)]
        t.deliver(step_of(logits_V.float(), token, t.logprobs, finish))

    def left(self, request: Request, outputs: list[int]) -> None:
        self._rows.pop(id(request), None)

    def failed(self, requests: list[Request], what: str, error: Exception) -> None:
        tickets = [t for t in (self._rows.pop(id(r), None) for r in requests) if t is not None]
        self._fail(tickets, f"generation failed in {what} of model {self.model.name!r}: "
                            f"{type(error).__name__}: {error}; retry the request, or serve with --batching alone "
                            f"if it persists")

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
