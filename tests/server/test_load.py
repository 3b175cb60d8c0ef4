"""Concurrency: 64 streaming clients x 4 requests, 16 of them hanging up mid-stream; seeded determinism."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx

CLIENTS, PER_CLIENT, DISCONNECTING = 64, 4, 16
WORDS = "the value of a list is returned by this function when the default object name is given".split()
SEEDED = {"text": "This module provides", "sampling_params": {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 12,
                                                               "sampling_seed": 1234, "ignore_eos": True}}


async def _stream(c: httpx.AsyncClient, body: dict, hang_up_after: int | None = None) -> list[dict]:
    events: list[dict] = []
    async with c.stream("POST", "/generate", json=dict(body, stream=True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[6:]))
            if hang_up_after is not None and len(events) >= hang_up_after:
                return events  # leaving the context closes the connection mid-stream
    return events


async def _client(c: httpx.AsyncClient, i: int, rng: random.Random, done: list, eos: set[int]) -> None:
    for j in range(PER_CLIENT):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        if i < DISCONNECTING and j == 1:
            body = {"text": prompt, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
            await _stream(c, body, hang_up_after=2)
            continue
        n = rng.randint(3, 8)
        body = {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0.8}}
        events = await _stream(c, body)
        last = events[-1]
        meta, reason = last["meta_info"], last["meta_info"]["finish_reason"]
        assert [len(e["output_ids"]) for e in events] == sorted({len(e["output_ids"]) for e in events})
        assert meta["completion_tokens"] == len(last["output_ids"])
        if reason["type"] == "length":
            assert meta["completion_tokens"] == n
        else:
            assert reason["type"] == "stop" and reason["matched"] in eos and last["output_ids"][-1] in eos
            assert meta["completion_tokens"] <= n
        done.append(meta["id"])


async def _seeded(c: httpx.AsyncClient) -> list[str]:
    texts = []
    for delay in (0.3, 0.5, 0.8):
        await asyncio.sleep(delay)
        texts.append((await c.post("/generate", json=SEEDED)).json()["text"])
    return texts


def test_concurrent_streams_with_disconnects(server, http):
    alone = http.post("/generate", json=SEEDED).json()["text"]
    eos = set(http.get("/get_model_info").json()["eos_token_ids"])
    done: list[str] = []

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            rngs = [random.Random(i) for i in range(CLIENTS)]
            results = await asyncio.gather(_seeded(c), *(_client(c, i, rngs[i], done, eos) for i in range(CLIENTS)))
        return results[0]

    t0 = time.time()
    under_load = asyncio.run(main())
    elapsed = time.time() - t0
    assert len(done) == CLIENTS * PER_CLIENT - DISCONNECTING
    assert under_load == [alone] * 3, "a seeded request must give the same text alone and under load"
    deadline = time.time() + 10
    while True:
        info = http.get("/get_server_info").json()
        if info["kv_used_pages"] == 0 and info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0:
            break
        assert time.time() < deadline, f"KV pages still held after the load: {info}"
        time.sleep(0.1)
    metrics = http.get("/metrics").text
    aborted = float(re.search(r"^sglang:num_aborted_requests_total\{[^}]*\} (\S+)", metrics, re.M).group(1))
    assert aborted >= DISCONNECTING
    assert float(re.search(r"^sglang:token_usage\{[^}]*\} (\S+)", metrics, re.M).group(1)) == 0.0
    assert http.post("/generate", json=SEEDED).json()["text"] == alone
    assert server.error_lines() == []
    print(f"load: {CLIENTS * PER_CLIENT} requests in {elapsed:.1f} s")


def test_non_streaming_disconnect_aborts(server, http):
    body = {"text": "a", "rid": "hang-up", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    try:
        httpx.post(server.url + "/generate", json=body, timeout=0.5)
        raise AssertionError("the request should have outlived the client's timeout")
    except httpx.TimeoutException:
        pass
    deadline = time.time() + 5
    while (info := http.get("/get_server_info").json())["kv_used_pages"] or info["num_running_reqs"]:
        assert time.time() < deadline, f"the abandoned request still runs: {info}"
        time.sleep(0.05)
