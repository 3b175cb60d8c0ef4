"""The server's own process freezes the objects alive after the model load (app.freeze_loaded_objects): a full
garbage collection walked all of them (~180 ms with the demo model on 2 cores, the GIL held), stalling every
stream and the engine's step whenever the oldest generation filled up."""

from __future__ import annotations

import gc
import socket
import threading
import time

import httpx
import pytest

from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from hybridmoe.server.app import create_app, freeze_loaded_objects
from hybridmoe.server.limits import ServerLimits
from hybridmoe.server.run import build_server
from tests.server.conftest import DEMO


@pytest.fixture()
def unfrozen():
    """Leaves this test process's collector as it found it."""
    assert gc.get_freeze_count() == 0, "another test left objects frozen"
    try:
        yield
    finally:
        gc.unfreeze()


def test_freeze_makes_a_full_collection_walk_none_of_the_loaded_objects(unfrozen):
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")
    engine = Engine(EngineArgs(model_path=str(DEMO), device="cpu"), progress=False)
    assert engine is not None
    gc.collect()
    before = len(gc.get_objects())
    n = freeze_loaded_objects()
    assert n >= before // 2 and gc.get_freeze_count() == n
    assert len(gc.get_objects()) < before // 10  # what a full collection walks now


def test_the_app_freezes_once_the_model_has_loaded_only_when_asked(unfrozen):
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")
    args = EngineArgs(model_path=str(DEMO), device="cpu", log_level="warning")
    limits = ServerLimits(tokenizer_workers=1)
    for freeze in (False, True):
        app = create_app(args, limits=limits, freeze_gc=freeze)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = build_server(app, args, limits, graceful_shutdown_timeout=1.0, port=0)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            deadline = time.time() + 120
            while time.time() < deadline:
                try:
                    r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                                   timeout=30)
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            assert r.status_code == 200, r.text
            while freeze and gc.get_freeze_count() == 0 and time.time() < deadline:
                time.sleep(0.05)  # the freeze runs beside the first requests
            assert (gc.get_freeze_count() > 0) == freeze
        finally:
            server.should_exit = True
            thread.join(30)
