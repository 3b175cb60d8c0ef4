"""Request isolation: a request whose sampling, detokenization, stop matching or output building raises
ends alone (finish_reason abort with the message) and the others complete; a failed model forward fails
its batch and the engine keeps serving. In-process Engine tests, then the same through a real HTTP server
(uvicorn on 127.0.0.1 in a thread, so the faults can be injected with monkeypatch)."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx
import pytest

from hybridmoe.config import EngineArgs
from hybridmoe.engine.detokenizer import IncrementalDetokenizer
from hybridmoe.engine.engine import Engine
from hybridmoe.engine.request import Req, SamplingParams, new_rid
from hybridmoe.engine.sampler import Sampler
from tests.server.conftest import DEMO
from tests.server.inproc import serve_in_thread

MARK_TOP_K = 77  # a request with this top_k trips the injected sampler fault


@pytest.fixture(scope="module")
def engine():
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")
    return Engine(EngineArgs(model_path=str(DEMO), device="cpu", chunked_prefill_size=64), progress=False)


def _prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(rng.randint(3, 20))]


def _req(ids: list[int], rid: str | None = None, **params) -> Req:
    p = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True, **params}
    return Req(rid=rid or new_rid(), prompt_ids=ids, params=SamplingParams(**p))


def _run(engine: Engine, reqs: list[Req]) -> None:
    for r in reqs:
        engine.submit(r)
    engine.run_until_done(reqs)


def _alone(engine: Engine, ids: list[int]) -> list[int]:
    r = _req(ids)
    _run(engine, [r])
    return r.output_ids


def _check_isolated(engine: Engine, bad: Req, good: list[Req], expected: list[list[int]], word: str) -> None:
    _run(engine, [good[0], bad, *good[1:]])
    assert bad.finish_reason["type"] == "abort" and word in bad.finish_reason["message"], bad.finish_reason
    for r, ids in zip(good, expected):
        assert r.finish_reason == {"type": "length", "length": 6}, r.finish_reason
        assert r.output_ids == ids, "a request next to a failing one must give what it gives alone"
    stats = engine.stats()
    assert stats["kv_used_pages"] == 0 and stats["num_running_reqs"] == 0 and not engine.has_work()


def _good(engine: Engine, seed: int) -> tuple[list[Req], list[list[int]]]:
    rng = random.Random(seed)
    prompts = [_prompt(rng, 4000) for _ in range(3)]
    return [_req(p) for p in prompts], [_alone(engine, p) for p in prompts]


def test_overflowing_top_k_fails_alone(engine):
    good, expected = _good(engine, random.randrange(1 << 30))
    # What a client sent before strict validation: the sampler's tensor of top_k overflows int64.
    bad = _req([5, 6, 7], temperature=0.7, top_k=99999999999999999999)
    _check_isolated(engine, bad, good, expected, "Overflow")


def test_penalty_failure_fails_alone(engine, monkeypatch):
    real = Sampler._apply_penalties

    def faulty(self, logits, reqs):
        if any(r.params.top_k == MARK_TOP_K for r in reqs):
            raise RuntimeError("injected penalty fault")
        return real(self, logits, reqs)

    monkeypatch.setattr(Sampler, "_apply_penalties", faulty)
    good, expected = _good(engine, random.randrange(1 << 30))
    _check_isolated(engine, _req([9, 10], top_k=MARK_TOP_K, temperature=0.5), good, expected, "injected penalty")


def test_detokenization_failure_fails_alone(engine, monkeypatch):
    real = IncrementalDetokenizer.add

    def faulty(self, ids):
        if len(self.ids) >= 2 and getattr(self, "boom", False):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real(self, ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add", faulty)
    good, expected = _good(engine, random.randrange(1 << 30))
    bad = _req([11, 12, 13], rid="detok-bad")
    real_drain = engine._drain_inbox

    def drain():
        ended = real_drain()
        if "detok-bad" in engine._detok:
            engine._detok["detok-bad"].boom = True
        return ended

    monkeypatch.setattr(engine, "_drain_inbox", drain)
    _check_isolated(engine, bad, good, expected, "injected detokenizer")
    assert len(bad.output_ids) == 3  # it ran until the fault, then stopped


def test_stop_matching_failure_fails_alone(engine, monkeypatch):
    import hybridmoe.engine.engine as engine_module

    real = engine_module.match_stop_str

    def faulty(req, new_len):
        if "never-there" in req.params.stop_strs:
            raise IndexError("injected stop fault")
        return real(req, new_len)

    monkeypatch.setattr(engine_module, "match_stop_str", faulty)
    good, expected = _good(engine, random.randrange(1 << 30))
    _check_isolated(engine, _req([14, 15], stop=["never-there"]), good, expected, "injected stop")


def test_output_building_failure_fails_alone(engine, monkeypatch):
    real = Engine.output_dict

    def faulty(req):
        if req.rid == "out-bad":
            raise ValueError("injected output fault")
        return real(req)

    monkeypatch.setattr(Engine, "output_dict", staticmethod(faulty))
    a, b = _req([16, 17]), _req([18, 19], rid="out-bad")
    for r in (a, b):
        engine.submit(r)
    outs: dict = {}
    while "out-bad" not in outs:  # one step; with overlap scheduling its tokens come with the step after
        outs.update(engine.outputs(engine.step()))
    assert outs["out-bad"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "injected output" in outs["out-bad"]["meta_info"]["finish_reason"]["message"]
    assert outs[a.rid]["meta_info"]["finish_reason"] is None and len(outs[a.rid]["output_ids"]) == 1
    engine.run_until_done([a])
    assert a.finish_reason["type"] == "length" and engine.stats()["kv_used_pages"] == 0


def test_forward_failure_fails_its_batch_and_engine_recovers(engine, monkeypatch, caplog):
    real = engine.runner.forward
    calls = {"n": 0}

    def faulty(batch):
        calls["n"] += 1
        if calls["n"] == 2:  # the second step: both requests are decoding
            raise RuntimeError("injected forward fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "forward", faulty)
    reqs = [_req([20, 21, 22]), _req([23, 24])]
    with caplog.at_level(logging.INFO, logger="hybridmoe"):
        _run(engine, reqs)
    failed = [r for r in caplog.records if "the model forward failed" in r.getMessage()]
    # one line, the error in it; no traceback below info level (it was "NoneType: None": exc_info outside `except`)
    assert len(failed) == 1 and "RuntimeError: injected forward fault" in failed[0].getMessage()
    assert failed[0].exc_info is None
    for r in reqs:
        assert r.finish_reason["type"] == "abort" and "engine failure" in r.finish_reason["message"]
        assert len(r.output_ids) == 1  # the failed step kept nothing
    assert engine.stats()["failed_batches"] >= 1 and engine.stats()["kv_used_pages"] == 0
    again = _req([20, 21, 22])
    _run(engine, [again])
    assert again.finish_reason == {"type": "length", "length": 6}
    assert again.output_ids == _alone(engine, [20, 21, 22])


def test_generate_command_exits_1_when_its_request_fails(monkeypatch, capsys):
    """`hybridmoe generate` whose request ends in an abort (here a failed forward) exits 1, not 0."""
    from hybridmoe.cli import main as cli_main
    from hybridmoe.engine.model_runner import ModelRunner

    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")

    def faulty(self, batch):
        raise RuntimeError("injected forward fault")

    monkeypatch.setattr(ModelRunner, "forward", faulty)
    rc = cli_main(["generate", "--device", "cpu", "--model-path", str(DEMO), "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert rc == 1 and "'type': 'abort'" in out and "injected forward fault" in out, (rc, out)


# ---------------------------------------------------------------- through a real server


@pytest.fixture(scope="module")
def live(engine):
    with serve_in_thread(lambda args: engine) as url:
        yield url


async def _stream(c: httpx.AsyncClient, body: dict) -> list[dict]:
    events = []
    async with c.stream("POST", "/generate", json=dict(body, stream=True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


def test_server_sampling_failure_fails_alone(live, monkeypatch):
    real = Sampler._filter

    def faulty(logits, params):
        if any(p.top_k == MARK_TOP_K for p in params):
            raise OverflowError("injected sampler fault")
        return real(logits, params)

    monkeypatch.setattr(Sampler, "_filter", staticmethod(faulty))
    good = {"text": "Return the value", "sampling_params": {"max_new_tokens": 24, "ignore_eos": True,
                                                             "temperature": 0.8, "top_k": 5}}
    bad = {"text": "a b c", "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "top_k": MARK_TOP_K}}

    async def main():
        async with httpx.AsyncClient(base_url=live, timeout=60) as c:
            return await asyncio.gather(_stream(c, good), c.post("/generate", json=bad), _stream(c, good))

    first, bad_r, second = asyncio.run(main())
    assert bad_r.status_code == 200
    reason = bad_r.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "injected sampler fault" in reason["message"]
    for events in (first, second):
        assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert httpx.get(live + "/health").status_code == 200


def test_server_forward_failure_then_serves(live, engine, monkeypatch):
    real = engine.runner.forward

    def faulty(batch):
        if any(r.prompt_ids[:1] == [MARK_TOP_K] for r in batch.reqs):
            raise RuntimeError("injected forward fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "forward", faulty)
    r = httpx.post(live + "/generate", json={"input_ids": [MARK_TOP_K, 5], "sampling_params": {"max_new_tokens": 4}})
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "engine failure" in reason["message"]
    ok = httpx.post(live + "/generate", json={"input_ids": [8, 5], "sampling_params": {"max_new_tokens": 4,
                                                                                      "ignore_eos": True}})
    assert ok.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    info = httpx.get(live + "/get_server_info").json()
    assert info["failed_batches"] >= 1 and info["kv_used_pages"] == 0
