"""Session 37: the worst GET /health latency while one 6.5 MiB chat body of 200,000 messages is served, with the
body validated on the event loop ("inline") and in a thread ("thread"), interleaved (in-process server, demo
model). Run from the repository root: python benchmarks/results/session37/offloop_validation_stall.py"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def worst_health_during(url: str, raw: bytes) -> tuple[float, float, int]:
    """(request seconds, worst /health seconds, status) of one POST of `raw` with /health probed meanwhile."""
    worst, stop = [0.0], threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            httpx.get(url + "/health", timeout=30)
            worst[0] = max(worst[0], time.perf_counter() - t)
            time.sleep(0.005)

    th = threading.Thread(target=probe)
    th.start()
    time.sleep(0.2)
    t = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=120)
    took = time.perf_counter() - t
    time.sleep(0.1)
    stop.set()
    th.join()
    return took, worst[0], r.status_code


def main() -> None:
    from hybridmoe.config import EngineArgs
    from hybridmoe.engine.engine import Engine
    from hybridmoe.server import app as app_module
    from hybridmoe.server.limits import ServerLimits
    from tests.server.inproc import serve_in_thread

    engine = Engine(EngineArgs(model_path="hybridmoe/demo_model", device="cpu"), progress=False)
    raw = json.dumps({"messages": [{"role": "user", "content": "a"}] * 200000}).encode()
    with serve_in_thread(lambda _args: engine, limits=ServerLimits(tokenizer_workers=1)) as url:
        for mode in ("inline", "thread", "inline", "thread"):
            app_module.OFF_LOOP_VALIDATE_BYTES = 1 << 40 if mode == "inline" else 256 << 10
            took, worst, status = worst_health_during(url, raw)
            print(f"{mode}: request {took:.2f} s ({status}), worst /health {worst * 1e3:.0f} ms")


if __name__ == "__main__":  # the tokenizer workers are spawned processes: they import this file
    main()
