"""A real HTTP server (uvicorn, the production protocol and limits) on 127.0.0.1 in a thread of the
test process, so a test can monkeypatch the engine it serves."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx

from hybridmoe.config import EngineArgs, ServerConfig
from hybridmoe.engine.engine import Engine
from hybridmoe.server.app import create_app
from hybridmoe.server.limits import ServerLimits
from hybridmoe.server.run import build_server


@contextlib.contextmanager
def serve_in_thread(engine_factory: Callable[[EngineArgs], Engine] | None = None, limits: ServerLimits | None = None,
                    freeze_gc: bool = False, server: ServerConfig | None = None, **options: object) -> Iterator[str]:
    """Serve create_app(...) until the block ends; yields the base URL once /health answers 200."""
    args = EngineArgs(device="cpu", log_level="warning", **options)  # type: ignore[arg-type]
    limits = limits or ServerLimits()
    app = create_app(args, engine_factory=engine_factory, limits=limits, server=server, freeze_gc=freeze_gc)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = build_server(app, args, limits, graceful_shutdown_timeout=1.0, port=0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.time() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.time() < deadline and thread.is_alive(), "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def demo_engine() -> Engine:
    """An Engine on the demo model (CPU, 64-token prefill chunks), for a test module to serve; skips without it."""
    import pytest

    from tests.server.conftest import DEMO

    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")
    return Engine(EngineArgs(model_path=str(DEMO), device="cpu", chunked_prefill_size=64), progress=False)
