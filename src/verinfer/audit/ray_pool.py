"""Replay on a Ray pool: `verinfer score --workers N` (a local Ray runtime) or `--ray-address ADDR`
(an existing cluster). Replay is embarrassingly parallel over claims; verinfer schedules nothing of
its own: Ray places the actors, restarts a dead one and retries its task.

    driver (score_claims)                         actors (ReplayWorker, one model each)
    claims file -> parts of chunk_claims claims -> score_chunk(part) on a free actor -> Arrow table
                <- the driver writes each returned table as `<out>.parts/<k>.parquet` (resumable)

The parts are exactly those a single process writes (same chunking, same `score_chunk`, the same
numerics with `threads` torch threads per actor), so the Parquet output is bitwise the
single-process output at that thread count. Parts are written by the driver, so a rerun after the
driver dies resumes from the finished parts; actors return tables through Ray's object store, so
workers on other nodes need only the model directory at the same path (`verinfer models get` there).

Actors: `num_cpus=threads` each (and `num_gpus=1` on a CUDA device), restarted up to
`max_restarts` times when their process dies, each task retried up to `max_task_retries` times
(Ray's actor fault tolerance); at most `2 * workers` parts are in flight, so driver memory stays
bounded by the parts, not the file.

`--ray-address` is parsed when the pool is made and its host:port probed (a TCP connect, at most
PROBE_TIMEOUT_S) before `ray.init`, which waits minutes for a cluster that does not answer.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa

from verinfer.errors import VerinferError
from verinfer.models.llama import LlamaConfig
from verinfer.numerics import Numerics

RAY_FIX = "install the extra: pip install -e '.[ray]' (Ray >= 2.9)"
PROBE_TIMEOUT_S = 5.0
ADDRESS_FIX = ("pass the address `ray start --head` printed on the head node (host:port of its GCS, port 6379 by "
               "default, or ray://host:10001 for Ray Client), or drop --ray-address to start a local Ray")
RESOLVED_BY_RAY = ("auto", "local")  # addresses Ray resolves itself (the running cluster's file / a new one)


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise VerinferError(f"`--workers` / `--ray-address` need Ray, which is not installed ({e})",
                            fix=RAY_FIX) from None
    return ray


def ray_gcs_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) a `--ray-address` names: "host:port", "ray://host:port" (Ray Client) or
    "[v6 address]:port"; None for "auto" and "local". A VerinferError for anything else."""
    if address in RESOLVED_BY_RAY:
        return None
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 address needs its brackets: [::1]:6379
    if "://" in hostport or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise VerinferError(f"not a Ray address: {address!r} (expected host:port, e.g. 10.0.0.5:6379)",
                            where="--ray-address", fix=ADDRESS_FIX)
    return host, int(port)


def connect_failure(e: OSError, timeout_s: float) -> str:
    """Why a TCP connect failed, in words."""
    if isinstance(e, socket.timeout):
        return f"no answer within {timeout_s:g} s"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the host: {e.strerror or e}"
    return e.strerror or str(e)


def probe_ray_address(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """A VerinferError, within about timeout_s, when nothing accepts a TCP connection at the
    address's host:port (ray.init would wait for it for minutes); the connection is closed at once."""
    endpoint = ray_gcs_endpoint(address)
    if endpoint is None:
        return
    try:
        socket.create_connection(endpoint, timeout=timeout_s).close()
    except OSError as e:
        raise VerinferError(f"no Ray cluster answers at {address} ({connect_failure(e, timeout_s)})",
                            where="--ray-address",
                            fix="start it (`ray start --head` prints the address to pass), or check the host and "
                                "port (the GCS port, 6379 by default) and that a firewall lets this machine reach "
                                "it; drop --ray-address to start a local Ray") from None


class ReplayWorker:
    """One replay engine (the model loaded once) in a Ray actor process, at `threads` torch threads."""

    def __init__(self, model_dir: str, numerics: dict, device: str, threads: int):
        import torch

        from verinfer.engine.engine import Engine
        from verinfer.models.load import load_model, model_info

        torch.set_num_threads(threads)
        num = Numerics(**numerics)
        self.engine = Engine(load_model(model_dir, num, device), num, eos_token_id=model_info(model_dir).eos_token_id)

    def pid(self) -> int:
        return os.getpid()

    def score(self, k: int, claims: list, fps: list | None, layer: int | None, kwargs: dict) -> tuple[int, pa.Table]:
        from verinfer.audit.replay import score_chunk

        return k, score_chunk(claims, self.engine, fps=fps, layer=layer, **kwargs)


@dataclass
class RayReplayPool:
    """A pool of `workers` ReplayWorker actors. Use as a context manager (starts Ray when it is not
    running: locally with `workers * threads` CPUs, or joining `address`; shuts down what it started).

    It stands in for the Engine in `audit.replay.score_claims`: `numerics`, `device` and `config`
    describe the replay (the manifest and fingerprint checks read them) and `map_parts` scores."""

    model_dir: str
    numerics: Numerics
    workers: int = 2
    threads: int = 1
    device: str = "cpu"
    address: str | None = None
    max_restarts: int = 3
    max_task_retries: int = 3

    def __post_init__(self):
        if self.workers < 1:
            raise VerinferError(f"--workers must be >= 1, got {self.workers}", fix="e.g. --workers 2")
        if self.threads < 1:
            raise VerinferError(f"threads per worker must be >= 1, got {self.threads}", fix="e.g. --worker-threads 1")
        if self.address is not None:
            ray_gcs_endpoint(self.address)  # a malformed address fails here, before Ray is imported
        self.numerics = self.numerics.with_(threads=self.threads)
        self.config = LlamaConfig.from_dir(self.model_dir)
        self._started = False
        self.actors: list = []

    def __enter__(self) -> "RayReplayPool":
        ray = import_ray()
        if not ray.is_initialized():
            if self.address:
                probe_ray_address(self.address)
            kw = dict(address=self.address) if self.address else dict(num_cpus=self.workers * self.threads)
            try:
                ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False, **kw)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise VerinferError(f"could not start or join a Ray runtime ({e})", where=self.address or "local",
                                    fix="check the address (ray start --head prints it) or drop --ray-address") from None
            self._started = True
        gpu = str(self.device).startswith("cuda")
        cls = ray.remote(num_cpus=self.threads, num_gpus=1 if gpu else 0, max_restarts=self.max_restarts,
                         max_task_retries=self.max_task_retries)(ReplayWorker)
        env = {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        self.actors = [cls.options(runtime_env={"env_vars": env}).remote(str(self.model_dir), self.numerics.to_dict(),
                                                                        str(self.device), self.threads)
                       for _ in range(self.workers)]
        return self

    def __exit__(self, *exc) -> None:
        ray = import_ray()
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self._started:
            ray.shutdown()
            self._started = False

    def pids(self) -> list[int]:
        """The actors' process ids (tests kill one to check that its part is retried)."""
        ray = import_ray()
        return ray.get([a.pid.remote() for a in self.actors])

    def map_parts(self, jobs: Iterable[tuple], on_done: Callable[[int], None] | None = None,
                  **kwargs) -> Iterator[tuple[int, pa.Table]]:
        """Score (k, claims, fps, layer) jobs on the actors, at most 2 per actor in flight; yield
        (k, table) as they finish (in any order). kwargs go to `score_chunk`."""
        ray = import_ray()
        if not self.actors:
            raise RuntimeError("RayReplayPool.map_parts outside its with-block")
        pending: dict = {}
        free = [a for a in self.actors for _ in range(2)]
        jobs = iter(jobs)
        exhausted = False
        while True:
            while free and not exhausted:
                job = next(jobs, None)
                if job is None:
                    exhausted = True
                    break
                actor = free.pop(0)
                pending[actor.score.remote(*job, kwargs)] = actor
            if not pending:
                return
            [ref], _ = ray.wait(list(pending), num_returns=1)
            actor = pending.pop(ref)
            try:
                k, table = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                raise VerinferError(f"a replay worker died and was not brought back after {self.max_restarts} "
                                    f"restarts ({type(e).__name__})", fix="rerun the same command: finished parts "
                                    "are kept and the run resumes") from None
            free.append(actor)
            if on_done is not None:
                on_done(k)
            yield k, table
