"""The server's own process freezes the objects alive after the model load (app.freeze_loaded_objects): a full
garbage collection walked all of them (~180 ms with the demo model on 2 cores, the GIL held), stalling every
stream and the engine's step whenever the oldest generation filled up."""

from __future__ import annotations

import gc
import time

import httpx
import pytest

from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from hybridmoe.server.app import freeze_loaded_objects
from hybridmoe.server.limits import ServerLimits
from tests.server.conftest import DEMO
from tests.server.inproc import serve_in_thread


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
    for freeze in (False, True):
        with serve_in_thread(model_path=str(DEMO), limits=ServerLimits(tokenizer_workers=1), freeze_gc=freeze) as url:
            r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
            assert r.status_code == 200, r.text
            deadline = time.time() + 60
            while freeze and gc.get_freeze_count() == 0 and time.time() < deadline:
                time.sleep(0.05)  # the freeze runs beside the first requests
            assert (gc.get_freeze_count() > 0) == freeze
