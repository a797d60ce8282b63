"""`--ray-address` that does not answer is an error within seconds, not a hang (issue 34 item 3):
the address is parsed and its host:port probed before `ray.init`, which would wait for minutes.
Runs without Ray (a stand-in module stands for it where the pool needs one); test_ray_pool.py
checks the same with the real Ray."""

from __future__ import annotations

import json
import socket
import time
import types

import pytest
from typer.testing import CliRunner

from verinfer.audit import ray_pool
from verinfer.audit.ray_pool import RayReplayPool, probe_ray_address, ray_gcs_endpoint
from verinfer.cli.main import app
from verinfer.errors import VerinferError
from verinfer.models.testbed import TARGET_DIR
from verinfer.numerics import Numerics

BOUND_S = 30  # generous: a refused connection takes milliseconds
CLAIM = {"id": "c0", "model": "verinfer-testbed-target", "prompt_token_ids": [12, 223, 965, 414],
         "output_token_ids": [373, 1786], "provider": "honest-bf16-b8",
         "sampling": {"temperature": 1.0, "top_k": 50, "top_p": 0.95, "min_p": 0.0, "seed": 7, "noise": "vllm-cpu"}}


@pytest.fixture
def closed_port():
    """A loopback port bound but not listening: connecting to it is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture
def listening_port():
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


@pytest.fixture
def fake_ray(monkeypatch):
    """A stand-in for the ray module: not initialized, and failing the test if ray.init is reached."""
    def init(**kw):
        pytest.fail(f"ray.init was called ({kw})")

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    monkeypatch.setattr(ray_pool, "import_ray", lambda: fake)
    return fake


@pytest.mark.parametrize("address, endpoint", [
    ("127.0.0.1:6379", ("127.0.0.1", 6379)),
    ("head-node:6380", ("head-node", 6380)),
    ("ray://10.0.0.5:10001", ("10.0.0.5", 10001)),
    ("[::1]:6379", ("::1", 6379)),
    ("auto", None),
    ("local", None),
])
def test_ray_addresses_name_a_host_and_port(address, endpoint):
    assert ray_gcs_endpoint(address) == endpoint


@pytest.mark.parametrize("address", ["nohost", "1.2.3.4:notaport", "1.2.3.4:", ":6379", "1.2.3.4:0",
                                     "1.2.3.4:70000", "http://1.2.3.4:6379", "", "::1:6379"])
def test_a_malformed_ray_address_is_named(address):
    with pytest.raises(VerinferError) as e:
        ray_gcs_endpoint(address)
    assert e.value.where == "--ray-address" and repr(address) in e.value.what
    assert "ray start --head" in e.value.fix


def test_the_probe_refuses_a_closed_port_at_once(closed_port):
    address = f"127.0.0.1:{closed_port}"
    t0 = time.monotonic()
    with pytest.raises(VerinferError) as e:
        probe_ray_address(address)
    assert time.monotonic() - t0 < BOUND_S
    assert address in e.value.what and e.value.where == "--ray-address"
    assert "ray start --head" in e.value.fix and "port" in e.value.fix


def test_the_probe_passes_a_listening_port(listening_port):
    probe_ray_address(f"127.0.0.1:{listening_port}")
    probe_ray_address(f"ray://127.0.0.1:{listening_port}")
    probe_ray_address("auto")  # Ray finds the cluster itself


def test_the_probe_gives_up_on_a_silent_host(monkeypatch):
    """A host that drops the packets (no refusal): the connect timeout bounds the wait."""
    seen = {}

    def create_connection(addr, timeout=None):
        seen["timeout"] = timeout
        raise socket.timeout("timed out")

    monkeypatch.setattr(socket, "create_connection", create_connection)
    with pytest.raises(VerinferError, match="10.255.255.1:6379 .no answer within"):
        probe_ray_address("10.255.255.1:6379")
    assert 0 < seen["timeout"] <= BOUND_S


def pool(address: str) -> RayReplayPool:
    return RayReplayPool(str(TARGET_DIR), Numerics(dtype="bf16"), workers=1, address=address)


def test_a_malformed_address_fails_when_the_pool_is_made(fake_ray):
    with pytest.raises(VerinferError, match="'1.2.3.4:notaport'"):
        pool("1.2.3.4:notaport")


@pytest.mark.parametrize("address", ["127.0.0.1:1", "closed"])
def test_the_pool_refuses_an_address_that_does_not_answer_before_ray_init(fake_ray, closed_port, address):
    address = f"127.0.0.1:{closed_port}" if address == "closed" else address
    t0 = time.monotonic()
    with pytest.raises(VerinferError) as e:
        with pool(address):
            pass
    assert time.monotonic() - t0 < BOUND_S and address in e.value.what


@pytest.mark.parametrize("address, words", [("nohost", "'nohost'"), ("127.0.0.1:1", "127.0.0.1:1")])
def test_score_cli_stops_with_exit_2(fake_ray, tmp_path, address, words):
    """`verinfer score --ray-address ADDR` (it used to hang on 127.0.0.1:1 for more than 300 s)."""
    claims = tmp_path / "claims.jsonl"
    claims.write_text(json.dumps(CLAIM) + "\n")
    t0 = time.monotonic()
    r = CliRunner().invoke(app, ["score", str(claims), "--out", str(tmp_path / "s.parquet"), "--ray-address", address])
    assert time.monotonic() - t0 < BOUND_S
    assert r.exit_code == 2, r.output
    assert "--ray-address" in r.output and words in r.output and "ray start --head" in r.output

