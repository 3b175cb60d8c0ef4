"""While the model loads every route answers 503 (JSON), and a load failure is reported (no model needed)."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from hybridmoe.config import EngineArgs
from hybridmoe.server.app import create_app


def test_503_while_starting_then_load_error():
    release = threading.Event()

    def slow_failing_factory(args: EngineArgs):
        release.wait(30)
        raise RuntimeError("no weights here")

    app = create_app(EngineArgs(device="cpu"), engine_factory=slow_failing_factory)
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and "starting" in r.json()["error"]["message"]
        r = client.post("/generate", json={"text": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503
        release.set()
        assert not app.state.hybridmoe.engine.wait_loaded(30)
        r = client.get("/health")
        assert r.status_code == 503 and "no weights here" in r.json()["error"]["message"]
    assert app.state.hybridmoe.exit_code == 1
