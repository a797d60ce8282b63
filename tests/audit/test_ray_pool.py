"""Replay on a Ray pool (issue 18 item 1): bitwise the single-process result, a killed worker's part
is retried, an interrupted driver resumes. Skips without Ray unless VERINFER_REQUIRE_RAY=1 (CI)."""

from __future__ import annotations

import os
import signal
import time

import pyarrow.parquet as pq
import pytest

if os.environ.get("VERINFER_REQUIRE_RAY") != "1":
    pytest.importorskip("ray")
import ray  # noqa: E402

from verinfer.apps.pipeline import VERIFIER_NUMERICS, generate, score, verifier_engine  # noqa: E402
from verinfer.audit.ray_pool import RayReplayPool  # noqa: E402
from verinfer.audit.replay import score_claims  # noqa: E402
from verinfer.claims import iter_claims  # noqa: E402
from verinfer.errors import VerinferError  # noqa: E402
from verinfer.models.testbed import TARGET_DIR  # noqa: E402

CHUNK = 16  # claims per part: 6 parts of 90 claims


def test_an_address_that_does_not_answer_is_an_error_within_seconds():
    """`--ray-address 127.0.0.1:1` used to hang in ray.init (over 300 s): the address is probed first.
    First in this module: the `runtime` fixture below starts Ray, and a pool joins a running Ray."""
    if ray.is_initialized():
        pytest.skip("a Ray runtime is already running in this process: the pool would join it")
    t0 = time.monotonic()
    with pytest.raises(VerinferError, match="no Ray cluster answers at 127.0.0.1:1"):
        with RayReplayPool(str(TARGET_DIR), VERIFIER_NUMERICS, workers=1, address="127.0.0.1:1"):
            pass
    assert time.monotonic() - t0 < 30
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def claims(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray") / "claims.jsonl"
    generate("honest-bf16-b8", TARGET_DIR, path, n=90, max_tokens=24, show_progress=False)
    return path


@pytest.fixture(scope="module")
def runtime():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(claims, tmp_path_factory):
    """The single-process result at the workers' numerics (1 torch thread)."""
    out = tmp_path_factory.mktemp("ref") / "local.parquet"
    engine = verifier_engine(TARGET_DIR, VERIFIER_NUMERICS.with_(threads=1))
    score_claims(iter_claims(claims), engine, out, chunk_claims=CHUNK)
    return pq.read_table(out)


def pool_score(claims, out, workers, on_part=None):
    pool = RayReplayPool(str(TARGET_DIR), VERIFIER_NUMERICS, workers=workers, threads=1)
    with pool:
        score_claims(iter_claims(claims), pool, out, chunk_claims=CHUNK,
                     on_part=on_part(pool) if on_part else None)
    return pq.read_table(out)


@pytest.mark.parametrize("workers", [1, 2])
def test_pool_is_bitwise_the_single_process_result(runtime, claims, reference, tmp_path, workers):
    got = pool_score(claims, tmp_path / "s.parquet", workers)
    assert got.num_rows == reference.num_rows > 0
    assert got.equals(reference)


def test_a_killed_worker_has_its_part_retried(runtime, claims, reference, tmp_path):
    killed = []

    def kill_first_worker(pool):
        def on_part(k):
            if not killed:  # after the first part: the other parts are in flight or queued
                pid = pool.pids()[0]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return on_part

    got = pool_score(claims, tmp_path / "s.parquet", 2, kill_first_worker)
    assert killed and got.equals(reference)


def test_an_interrupted_driver_resumes(runtime, claims, reference, tmp_path):
    out = tmp_path / "s.parquet"

    def stop_after_two(pool):
        done = []

        def on_part(k):
            done.append(k)
            if len(done) == 2:
                raise KeyboardInterrupt
        return on_part

    with pytest.raises(KeyboardInterrupt):
        pool_score(claims, out, 2, stop_after_two)
    assert not out.exists() and len(list((tmp_path / "s.parquet.parts").glob("*.parquet"))) >= 2
    scored = []
    got = pool_score(claims, out, 2, lambda pool: scored.append)
    assert len(scored) <= 6 - 2  # finished parts are not scored again
    assert got.equals(reference)


def test_cli_workers(runtime, claims, reference, tmp_path):
    """`score --workers 2` (the pipeline entry; Ray is already running here, so it joins it)."""
    out = tmp_path / "cli.parquet"
    r = score(claims, TARGET_DIR, out, workers=2, show_progress=False)
    assert r.claims == 90 and pq.read_table(out).num_rows == reference.num_rows
