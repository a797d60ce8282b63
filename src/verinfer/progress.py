"""The progress display of long jobs: `ProgressBar` (a rich bar on a terminal, a log line every
`log_every` seconds elsewhere) and `progress_bar`, the same for a with-block."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class ProgressBar:
    """The progress display of every long job: a rich bar on a terminal, a log line every
    `log_every` seconds otherwise (under nohup, CI, a pipe; the first count and the last, at
    close, are always logged), nothing when disabled. `fields` are extra numbers shown beside the
    count (e.g. loss=...). A count past the total raises the total to it (a job that found more
    work than it planned, e.g. a widened tau sweep)."""

    def __init__(self, description: str, total: int, *, start: int = 0, enabled: bool = True,
                 fields: dict[str, float] | None = None, log_every: float = 20.0):
        self.description, self.total, self.enabled = description, total, enabled
        self.completed, self.fields, self.log_every = start, dict(fields or {}), log_every
        self.t0, self.start, self.last_log, self.logged = time.perf_counter(), start, None, None
        self.bar = None
        if enabled and sys.stderr.isatty():
            extra = [TextColumn(f"{k} {{task.fields[{k}]:.3f}}") for k in self.fields]
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), *extra, transient=True)
            self.bar.start()
            self.task = self.bar.add_task(description, total=total, completed=start, **self.fields)

    def update(self, completed: int, **fields: float) -> None:
        self.completed = completed
        self.total = max(self.total, completed)
        self.fields.update(fields)
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=completed, total=self.total, **fields)
            return
        now = time.perf_counter()
        if self.last_log is None or now - self.last_log >= self.log_every:
            self._log(now)

    def _log(self, now: float) -> None:
        self.last_log, self.logged = now, self.completed
        rate = (self.completed - self.start) / max(1e-9, now - self.t0)
        eta = (self.total - self.completed) / max(1e-9, rate)
        shown = "".join(f" {k} {v:.4f}" for k, v in self.fields.items())
        print(f"{self.description} {self.completed}/{self.total}{shown} {rate:.2f}/s eta {eta:.0f}s",
              file=sys.stderr, flush=True)

    def advance(self, n: int = 1) -> None:
        self.update(self.completed + n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.enabled and self.logged != self.completed:
            self._log(time.perf_counter())


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True):
    """A ProgressBar for a with-block; yields advance(n)."""
    bar = ProgressBar(description, total, enabled=enabled)
    try:
        yield bar.advance
    finally:
        bar.close()
