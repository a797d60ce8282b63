"""Real `verinfer serve` processes on free loopback ports (127.0.0.1 only), stopped after use.
Both servers start together at the first use of either (their start-ups overlap)."""

from __future__ import annotations

import pytest

from .serverproc import Launched


@pytest.fixture(scope="session")
def _servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("servers")
    launched = {}
    try:
        launched["honest"] = Launched(d, "--max-concurrent", "4")
        launched["int4"] = Launched(d, "--misconfig", "int4")
        yield launched
    finally:
        for s in launched.values():
            s.stop()


@pytest.fixture(scope="session")
def honest_server(_servers):
    return _servers["honest"].ready()


@pytest.fixture(scope="session")
def int4_server(_servers):
    return _servers["int4"].ready()
