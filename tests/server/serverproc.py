"""Start and stop real `verinfer serve` processes on free loopback ports (127.0.0.1 only)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HOST = "127.0.0.1"
START_TIMEOUT_S = 90


def verinfer_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("verinfer")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "verinfer.cli"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def child_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class Launched:
    """A `verinfer serve` process started on a free loopback port; `ready()` waits for /health."""

    def __init__(self, tmp_path: Path, *args: str):
        self.port = free_port()
        self.log = tmp_path / f"serve-{self.port}.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([*verinfer_cmd(), "serve", "--host", HOST, "--port", str(self.port),
                                          "--threads", "1", "--log-level", "warning", *args], stdout=f,
                                         stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://{HOST}:{self.port}"

    def ready(self) -> "Launched":
        import httpx2 as httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"verinfer serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.root + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"verinfer serve did not answer /health within {START_TIMEOUT_S} s:\n"
                           f"{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


@contextmanager
def serve(tmp_path: Path, *args: str):
    """Start `verinfer serve ARGS` on a free loopback port, wait until it answers, stop it after."""
    s = Launched(tmp_path, *args)
    try:
        yield s.ready()
    finally:
        s.stop()
