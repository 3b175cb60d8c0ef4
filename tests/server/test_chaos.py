"""Many clients at once on a server whose KV cache is small enough to preempt: every route, streamed or not, n > 1,
and a third of the clients hanging up mid-answer. Afterwards nothing is left running or holding KV pages, the cache
flushes, nothing was logged as an error, and the server answers as before.

The abort paths are tested one at a time elsewhere (test_streaming_results.py, test_responses_api.py); this is them
together with preemption, where a request aborted while preempted, forked or queued could leave pages held."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses")


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--served-model-name", "demo", "--page-size", "4", "--max-total-tokens", "256",
                        "--max-running-requests", "6", "--chunked-prefill-size", "32")


def _body(rng: random.Random, route: str, stream: bool) -> dict:
    words = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran"]) for _ in range(
        rng.randrange(3, 60)))
    new = rng.randrange(4, 48)
    if route == "/generate":
        return {"text": words, "stream": stream, "sampling_params": {"max_new_tokens": new, "ignore_eos": True,
                                                                      "n": rng.choice([1, 1, 2])}}
    if route == "/v1/completions":
        return {"model": "demo", "prompt": words, "max_tokens": new, "stream": stream, "ignore_eos": True}
    if route == "/v1/chat/completions":
        return {"model": "demo", "messages": [{"role": "user", "content": words}], "max_tokens": new, "stream": stream,
                "ignore_eos": True, "n": rng.choice([1, 2])}
    return {"model": "demo", "input": words, "max_output_tokens": new, "stream": stream}


async def _client(http: httpx.AsyncClient, rng: random.Random, outcomes: list[str]) -> None:
    route, stream = rng.choice(ROUTES), rng.random() < 0.6
    body = _body(rng, route, stream)
    hang_up = rng.random() < 0.35
    await asyncio.sleep(rng.random() * 0.5)  # arrivals spread over the first half second
    if stream:
        async with http.stream("POST", route, json=body) as r:
            assert r.status_code == 200, (route, body, await r.aread())
            lines, quota = 0, rng.randrange(1, 6)
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines += 1
                    assert '"error"' not in line or route == "/v1/responses" and '"type": "error"' not in line, line
                    if hang_up and lines >= quota:
                        outcomes.append("hung up mid-stream")
                        return  # leaving the block closes the connection
            outcomes.append("streamed")
        return
    if hang_up:  # gives up before the answer: the request is aborted on the server
        try:
            await http.post(route, json=body, timeout=rng.uniform(0.05, 0.4))
            outcomes.append("answered before the timeout")
        except httpx.TimeoutException:
            outcomes.append("hung up waiting")
        return
    r = await http.post(route, json=body)
    assert r.status_code == 200, (route, body, r.text)
    data = r.json()
    for out in data if isinstance(data, list) else [data]:
        reason = json.dumps(out.get("meta_info", {}).get("finish_reason") or out.get("choices") or out.get("status"))
        assert "abort" not in reason and "cancelled" not in reason, (route, out)
    outcomes.append("answered")


def test_clients_hanging_up_under_preemption_leave_nothing_behind(srv):
    rng = random.Random(7)
    outcomes: list[str] = []
    errors_before = len(srv.error_lines())

    async def main() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            await asyncio.gather(*(_client(http, random.Random(rng.random()), outcomes) for _ in range(40)))

    asyncio.run(main())
    assert len(outcomes) == 40
    assert outcomes.count("hung up mid-stream") + outcomes.count("hung up waiting") >= 5, outcomes
    deadline, load = time.time() + 30, None
    while time.time() < deadline:  # aborts are taken in at the engine's next step
        load = httpx.get(srv.url + "/get_load", timeout=10).json()[0]
        if load["num_reqs"] == 0 and load["num_tokens"] == 0:
            break
        time.sleep(0.2)
    assert load is not None and load["num_reqs"] == 0 and load["num_tokens"] == 0, load
    info = httpx.get(srv.url + "/get_server_info", timeout=10).json()
    assert info["num_preemptions"] > 0 and info["kv_used_pages"] == 0, info  # the pool was small enough to preempt
    assert httpx.post(srv.url + "/flush_cache", timeout=10).status_code == 200
    after = httpx.post(srv.url + "/generate", json={"text": "The cat", "sampling_params": {"max_new_tokens": 5,
                                                                                          "ignore_eos": True}})
    assert after.status_code == 200 and after.json()["meta_info"]["completion_tokens"] == 5
    assert srv.error_lines()[errors_before:] == [], "\n".join(srv.error_lines()[errors_before:])
