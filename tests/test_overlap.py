"""Overlap scheduling on a real model (CPU): outputs with it on equal those with it off, over mixed
batches, and streamed through the server's AsyncEngine. The exact bookkeeping (preemption, prefix
cache, aborts, failed steps) is tested on a fake device in test_overlap_pipeline.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from hybridmoe import LLM
from hybridmoe.config import EngineArgs
from hybridmoe.engine.engine import Engine
from tests.server.conftest import DEMO
from tests.server.inproc import serve_in_thread


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """(overlap off, overlap on) offline engines of the same tiny model."""
    path = str(tiny_model_dir("qwen3_moe"))
    opts = dict(device="cpu", progress=False, chunked_prefill_size=40, max_running_requests=12)
    off = LLM(path, disable_overlap_schedule=True, **opts)
    on = LLM(path, enable_overlap_schedule=True, **opts)
    assert not off.engine.overlap and on.engine.overlap
    return off, on


def _ids(n: int, seed: int, vocab: int = 211) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _mixed(ref_tokens: list[int]) -> tuple[list[list[int]], list[dict]]:
    shared = _ids(50, 99)
    prompts = [_ids(n, s) for n, s in ((1, 1), (7, 2), (33, 3), (64, 4), (90, 5), (12, 6))]
    prompts += [shared + _ids(5, 7), shared + _ids(9, 8)]  # a prefix-cache hit (pages of 16 tokens)
    greedy = {"temperature": 0, "ignore_eos": True}
    params = [
        dict(greedy, max_new_tokens=1),
        dict(greedy, max_new_tokens=0),
        dict(greedy, max_new_tokens=20, stop_token_ids=ref_tokens[3:5]),
        {"temperature": 0.8, "top_p": 0.9, "top_k": 30, "max_new_tokens": 17, "sampling_seed": 5, "ignore_eos": True},
        dict(greedy, max_new_tokens=15, repetition_penalty=1.2, min_new_tokens=4),  # a synchronous step
        dict(greedy, max_new_tokens=25, logit_bias={"7": 2.0}),
        dict(greedy, max_new_tokens=9),
        {"temperature": 1.0, "max_new_tokens": 11, "sampling_seed": 77, "ignore_eos": True},
    ]
    return prompts, params


def test_mixed_batch_equal(pair):
    off, on = pair
    probe = off.generate(input_ids=_ids(33, 3), sampling_params={"temperature": 0, "max_new_tokens": 20,
                                                                 "ignore_eos": True})["output_ids"]
    prompts, params = _mixed(probe)
    before = on.engine.pipeline.overlapped_steps
    for round_ in range(2):  # the second round hits the prefix cache of the first
        a = off.generate(input_ids=prompts, sampling_params=params)
        b = on.generate(input_ids=prompts, sampling_params=params)
        for x, y in zip(a, b):
            assert y["output_ids"] == x["output_ids"]
            assert y["meta_info"]["finish_reason"] == x["meta_info"]["finish_reason"]
            if round_:  # (in the first, what is cached at admission depends on when the others ended)
                assert y["meta_info"]["cached_tokens"] == x["meta_info"]["cached_tokens"]
    assert a[2]["meta_info"]["finish_reason"]["type"] == "stop" and b[7]["meta_info"]["cached_tokens"] > 0
    assert on.engine.pipeline.overlapped_steps > before
    assert on.engine.kv.num_used() == 0 and not on.engine.has_work()


def test_eos_logprobs_and_n(pair):
    """EOS (made likely by adding ids to the model's EOS set), logprobs and n=2 next to plain requests."""
    off, on = pair
    outs = []
    for llm in (off, on):
        eos = llm.engine.eos_ids
        saved = list(eos)
        eos.extend(t for t in range(0, 211, 13) if t not in eos)  # the sampler shares the list
        try:
            outs.append(llm.generate(
                input_ids=[_ids(20, 11), _ids(5, 12), _ids(40, 13)],
                sampling_params=[{"temperature": 0, "max_new_tokens": 40},
                                 {"temperature": 0.9, "max_new_tokens": 12, "n": 2, "sampling_seed": 3,
                                  "ignore_eos": True},
                                 {"temperature": 0, "max_new_tokens": 30}],
                return_logprob=True, top_logprobs_num=2))
        finally:
            eos[:] = saved
    for x, y in zip(*outs):
        assert y["output_ids"] == x["output_ids"]
        assert y["meta_info"]["finish_reason"] == x["meta_info"]["finish_reason"]
        assert [t for _, t, _ in y["meta_info"]["output_token_logprobs"]] == y["output_ids"]
        lp_x = [v for v, _, _ in x["meta_info"]["output_token_logprobs"]]
        lp_y = [v for v, _, _ in y["meta_info"]["output_token_logprobs"]]
        assert lp_y == pytest.approx(lp_x, abs=1e-5)
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs[0])


def test_stream_and_abandon(pair):
    off, on = pair
    prompt = _ids(9, 21)
    params = {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True}
    full = off.generate(input_ids=prompt, sampling_params=params)
    chunks = list(on.generate(input_ids=prompt, sampling_params=params, stream=True))
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 8))
    assert chunks[-1]["output_ids"] == full["output_ids"]
    it = on.generate(input_ids=_ids(30, 22), sampling_params={"max_new_tokens": 50, "ignore_eos": True}, stream=True)
    next(it)
    assert on.engine.pipeline.busy  # the next step is in flight
    it.close()
    assert on.engine.kv.num_used() == 0 and not on.engine.has_work()


# ---------------------------------------------------------------- through the server's AsyncEngine


def _demo_engine(overlap: bool) -> Engine:
    flag = {"enable_overlap_schedule": True} if overlap else {"disable_overlap_schedule": True}
    return Engine(EngineArgs(model_path=str(DEMO), device="cpu", chunked_prefill_size=64, **flag), progress=False)


async def _stream(c: httpx.AsyncClient, body: dict) -> list[dict]:
    events = []
    async with c.stream("POST", "/generate", json=dict(body, stream=True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


def test_server_streams_equal(tiny_model_dir):
    if not (DEMO / "config.json").is_file():
        pytest.skip("the demo model is not built")
    plain = _demo_engine(False)
    texts = ["Return the value", "a b c d", "The quick brown fox", "1 2 3"]
    bodies = [{"text": t, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
              for t in texts]
    ref_text = None
    results = {}
    for overlap in (False, True):
        engine = _demo_engine(overlap)
        if ref_text is None:  # a stop string the output reaches: from the plain engine's own output
            r = plain.make_request(prompt=texts[0], sampling_params=bodies[0]["sampling_params"])
            plain.submit(r)
            plain.run_until_done([r])
            ref_text = r.text
            stop = ref_text[len(ref_text) // 2:len(ref_text) // 2 + 3]
            if stop.strip():
                bodies.append({"text": texts[0], "sampling_params": dict(bodies[0]["sampling_params"], stop=[stop])})
            bodies.append({"text": texts[2], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        with serve_in_thread(lambda args, e=engine: e) as url:
            async def main(url=url):
                async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                    streams = asyncio.gather(*(_stream(c, b) for b in bodies))
                    await asyncio.sleep(0.2)
                    aborted = _stream(c, {"text": "abort me", "rid": "gone",
                                          "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})
                    task = asyncio.ensure_future(aborted)
                    await asyncio.sleep(0.5)
                    await c.post("/abort_request", json={"rid": "gone"})
                    return await streams, await task

            results[overlap] = asyncio.run(main())
            assert engine.kv.num_used() == 0
            if overlap:
                assert engine.pipeline.overlapped_steps > 0
    (off, off_gone), (on, on_gone) = results[False], results[True]
    for a, b in zip(off, on):
        ids = [e["output_ids"] for e in b]
        assert all(len(x) <= len(y) for x, y in zip(ids, ids[1:])), "streams are cumulative"
        assert b[-1]["output_ids"] == a[-1]["output_ids"] and b[-1]["text"] == a[-1]["text"]
        assert b[-1]["meta_info"]["finish_reason"] == a[-1]["meta_info"]["finish_reason"]
    assert on_gone[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert off_gone[-1]["meta_info"]["finish_reason"]["type"] == "abort"
