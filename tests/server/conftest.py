"""A real server in a subprocess (`python -m hybridmoe.launch_server --device cpu ...`) on 127.0.0.1.

`server` (session scope) is shared by every test module that needs the default options; modules
needing other options start their own with `start_server`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "hybridmoe" / "demo_model"
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess whose output goes to a log file."""

    def __init__(self, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "hybridmoe.launch_server", "--device", "cpu", "--host", "127.0.0.1",
               "--port", str(self.port), *extra]
        # one torch thread: the tiny model gains nothing from more, and OpenMP spin-waiting threads
        # on a shared 2-core machine slow everything down by 10-100x
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def error_lines(self) -> list[str]:
        return [line for line in self.log().splitlines() if "ERROR" in line or "Traceback" in line]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(*flags) -> a healthy ServerProcess, stopped at the end of the session."""
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model hybridmoe/demo_model is not built")
    started: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        srv = ServerProcess(tmp_path_factory.mktemp("server") / "server.log", *flags)
        started.append(srv)
        srv.wait_healthy()
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def server(start_server) -> ServerProcess:
    """The shared server: demo model, metrics on, a small chunk so prefill interleaves with decode."""
    return start_server("--enable-metrics", "--chunked-prefill-size", "256", "--served-model-name", "demo")


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
