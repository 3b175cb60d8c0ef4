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


def test_load_error_sets_the_exit_code_even_if_shutdown_wins_the_race(monkeypatch):
    """CI (stop 47) saw exit code 0: the lifespan ended before the load watcher's continuation ran."""
    import hybridmoe.server.app as app_module

    async def watcher_that_never_sees_it(state):
        return None

    monkeypatch.setattr(app_module, "_watch_load", watcher_that_never_sees_it)

    def failing_factory(args: EngineArgs):
        raise RuntimeError("no weights here")

    app = create_app(EngineArgs(device="cpu"), engine_factory=failing_factory)
    with TestClient(app):
        assert not app.state.hybridmoe.engine.wait_loaded(30)
    assert app.state.hybridmoe.exit_code == 1


def test_a_failed_shutdown_step_is_one_warning_and_the_later_steps_still_run(caplog):
    app = create_app(EngineArgs(device="cpu", log_level="warning"))
    state = app.state.hybridmoe
    real_stop, real_close, calls = state.engine.stop, state.pool.close, []

    def failing_stop(*a, **k):
        calls.append("stop")
        raise RuntimeError("boom")

    def close():
        calls.append("close")
        real_close()

    with TestClient(app) as client:
        assert state.engine.wait_loaded(120)
        assert client.get("/health").status_code == 200
        state.engine.stop, state.pool.close = failing_stop, close
    real_stop()  # the engine thread the failing step left running
    assert calls == ["stop", "close"]
    lines = [r.getMessage() for r in caplog.records if "shutdown:" in r.getMessage()]
    assert lines == ["shutdown: could not stop the engine: RuntimeError: boom"], lines
