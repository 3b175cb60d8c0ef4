"""Replicas behind SGLang's router (PyPI `sglang-router`): two hybridmoe servers (demo model, CPU)
and `python -m sglang_router.launch_router` in front. 64 concurrent requests through the router all
complete; after one replica is killed, the next 32 all complete through the other."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("sglang_router")

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_router(workers: list[str], log_path) -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115  (closed at the end of the test)
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *workers, "--policy", "round_robin", "--health-check-interval-secs", "1",
           "--health-failure-threshold", "1", "--health-check-timeout-secs", "2", "--retry-max-retries", "3",
           "--retry-initial-backoff-ms", "50", "--retry-max-backoff-ms", "200", "--worker-startup-timeout-secs", "60"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(f"the router exited with {proc.returncode}:\n{open(log_path).read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200 and _generate_ok(url):
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    log.close()
    raise RuntimeError(f"the router did not become ready:\n{open(log_path).read()}")


def _generate_ok(url: str) -> bool:
    r = httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}, timeout=30)
    return r.status_code == 200


async def _burst(url: str, n: int, tag: str) -> list[tuple[int, str]]:
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)) as c:
        async def one(i: int) -> tuple[int, str]:
            if i % 2:
                r = await c.post("/v1/completions", json={"model": "demo", "prompt": f"{tag} {i}", "max_tokens": 4})
                return r.status_code, r.text if r.status_code != 200 else r.json()["choices"][0]["finish_reason"]
            r = await c.post("/generate", json={"text": f"{tag} {i}", "sampling_params": {"max_new_tokens": 4}})
            return r.status_code, r.text if r.status_code != 200 else r.json()["meta_info"]["finish_reason"]["type"]
        return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_two_replicas_behind_sglang_router(start_server, tmp_path):
    flags = ("--served-model-name", "demo", "--max-running-requests", "64")
    a, b = start_server(*flags), start_server(*flags)
    router, url, log = _start_router([a.url, b.url], tmp_path / "router.log")
    try:
        results = asyncio.run(_burst(url, 64, "first"))
        bad = [r for r in results if r[0] != 200 or r[1] not in ("length", "stop")]
        assert not bad, bad[:3]
        # both replicas served some of them
        counts = [int(httpx.get(s.url + "/get_server_info").json()["finished_requests"]) for s in (a, b)]
        assert all(c > 0 for c in counts), counts
        # the router's own views of the workers, and its flush of every worker's /flush_cache
        assert httpx.get(url + "/get_model_info", timeout=10).status_code == 200
        r = httpx.post(url + "/flush_cache", timeout=10)
        assert r.status_code == 200 and r.json()["workers_flushed"] == 2, r.text
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        results = asyncio.run(_burst(url, 32, "second"))
        bad = [r for r in results if r[0] != 200 or r[1] not in ("length", "stop")]
        assert not bad, bad[:3]
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()
        log.close()
