"""A request whose final output only is awaited (RequestStream.result: the routes that do not stream) has its
output built at its first token (it has started: --max-queued-requests counts it no longer) and at its end,
not after every step: that was 0.6 ms of the engine thread a step for 64 requests of 4000 tokens (2-core Zen 4),
and a wake-up of each request's task on the event loop."""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest

from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from hybridmoe.engine.request import Req, SamplingParams
from hybridmoe.server.async_engine import AsyncEngine
from tests.server.conftest import DEMO
from tests.server.inproc import demo_engine, serve_in_thread


@pytest.fixture(scope="module")
def engine():
    return demo_engine()


@pytest.fixture
def built(monkeypatch) -> collections.Counter:
    """Outputs built, per request id."""
    counts: collections.Counter = collections.Counter()
    real = Engine.output_dict

    def counting(req, tokenizer=None):
        counts[req.rid] += 1
        return real(req, tokenizer)

    monkeypatch.setattr(Engine, "output_dict", staticmethod(counting))
    return counts


def test_a_request_not_streamed_has_two_outputs_built_and_the_same_answer(engine, built):
    body = {"input_ids": [5, 9, 14, 3], "rid": "quiet",
            "sampling_params": {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}}
    with serve_in_thread(lambda args: engine) as url:
        quiet = httpx.post(url + "/generate", json=body, timeout=60).json()
        events = []
        with httpx.stream("POST", url + "/generate", json=dict(body, rid="loud", stream=True), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0, "n": 2,
            "ignore_eos": True}).json()
    assert quiet["output_ids"] == events[-1]["output_ids"] and len(quiet["output_ids"]) == 48
    assert quiet["meta_info"]["finish_reason"] == {"type": "length", "length": 48}
    # a streamed request: one a step (its events may be fewer: a stream sends only the newest it has)
    assert built["loud"] >= 48 and len(events) >= 2
    # the first token's, the last; one more where a step ended before the event loop had taken the first
    assert 2 <= built["quiet"] <= 4, built
    chat_rids = [rid for rid in built if rid not in ("quiet", "loud")]
    assert len(chat_rids) == 2 and all(2 <= built[rid] <= 4 for rid in chat_rids), built  # n = 2: each sequence
    assert [c["finish_reason"] for c in chat["choices"]] == ["length", "length"]
    assert chat["usage"]["completion_tokens"] == 80


def test_a_quiet_request_leaves_the_queue_at_its_first_token(engine, built):
    """--max-queued-requests 1: a request waited on, past its first token, lets another in."""

    async def main():
        aeng = AsyncEngine(EngineArgs(model_path=str(DEMO), device="cpu"), engine_factory=lambda a: engine,
                           max_queued_requests=1)
        aeng.start(asyncio.get_running_loop())
        assert await asyncio.to_thread(aeng.wait_loaded)
        try:
            def req(rid: str, n: int) -> Req:
                return Req(rid=rid, prompt_ids=[4, 8, 15], params=SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                                  ignore_eos=True))
            long = aeng.submit(req("long", 400))
            waiter = asyncio.ensure_future(long.result())
            for _ in range(2000):
                if long.started:
                    break
                await asyncio.sleep(0.005)
            assert long.started and aeng.num_queued == 0
            short = await aeng.submit(req("short", 3)).result()  # not "too many queued requests"
            assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
            assert not waiter.done()  # the long request was still running
            out = await waiter
            assert len(out["output_ids"]) == 400 and built["long"] <= 4, built
        finally:
            aeng.stop()

    asyncio.run(main())
