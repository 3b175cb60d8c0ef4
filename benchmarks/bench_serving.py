"""Serving benchmark (like SGLang's bench_serving): concurrent streaming clients over HTTP.

Targets a running server (--base-url) or starts one (`python -m hybridmoe.launch_server` with
--server-args). Prompts are random token ids of --input-len tokens (optionally varied by
--range-ratio); each request generates --output-len tokens with ignore_eos. For each concurrency
level it reports requests/s, output tokens/s, time to first token and inter-token latency
(p50/p99), and with --out writes everything as JSON.

    python benchmarks/bench_serving.py --server-args "--device cpu" --concurrency 1 8 32
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --input-len 512 --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class RequestResult:
    ok: bool
    input_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, ids: list[int], output_len: int) -> RequestResult:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}}
    res = RequestResult(ok=False, input_tokens=len(ids))
    start = last = time.perf_counter()
    seen = 0
    try:
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                res.error = f"{r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev and "meta_info" not in ev:
                    res.error = str(ev["error"])
                    return res
                n = len(ev["output_ids"])
                now = time.perf_counter()
                if n > seen:
                    if seen == 0:
                        res.ttft = now - start
                    else:
                        res.itl.extend([(now - last) / (n - seen)] * (n - seen))
                    seen, last = n, now
                if ev["meta_info"]["finish_reason"] is not None:
                    res.output_tokens = ev["meta_info"]["completion_tokens"]
        res.e2e = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_level(base_url: str, headers: dict, prompts: list[list[int]], output_len: int,
                    concurrency: int) -> dict:
    """Run all prompts with at most `concurrency` in flight; summary statistics."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=3600, limits=limits) as client:
        async def bounded(ids: list[int]) -> RequestResult:
            async with sem:
                return await one_request(client, ids, output_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency, "num_requests": len(prompts), "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "input_throughput": sum(r.input_tokens for r in ok) / duration, "output_throughput": out_tokens / duration,
        "total_output_tokens": out_tokens,
        "ttft_ms_p50": percentile([r.ttft for r in ok], 50) * 1e3, "ttft_ms_p99": percentile([r.ttft for r in ok], 99) * 1e3,
        "itl_ms_p50": percentile(itl, 50) * 1e3, "itl_ms_p99": percentile(itl, 99) * 1e3,
        "e2e_ms_p50": percentile([r.e2e for r in ok], 50) * 1e3,
    }


def make_prompts(n: int, input_len: int, range_ratio: float, vocab: int, rng: random.Random) -> list[list[int]]:
    """Random token ids (avoiding the first 10 ids, where special tokens usually live)."""
    lo = max(1, int(input_len * range_ratio))
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, input_len))] for _ in range(n)]


def start_server(server_args: str, timeout: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "hybridmoe.launch_server", "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(server_args)]
    print("starting:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"the server did not become healthy in {timeout} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server; default: start one")
    p.add_argument("--server-args", default="--device cpu", help="flags for the server this script starts")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=None, help="requests per level (default: 4 x concurrency, >= 8)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=1.0, help="lengths drawn from [ratio*len, len]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--dummy-qwen3-30b", action="store_true",
                   help="serve a Qwen3-30B-A3B-shaped model with random weights (adds --model-path to a "
                        "generated config, --load-format dummy, --skip-tokenizer-init to --server-args)")
    a = p.parse_args(argv)
    proc = None
    tmp = None
    if a.dummy_qwen3_30b:
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_decode import write_config

        tmp = tempfile.TemporaryDirectory()
        shape = argparse.Namespace(vocab=151936, hidden=2048, inter=768, layers=48, heads=32, kv_heads=4,
                                   head_dim=128, experts=128, topk=8)
        write_config(Path(tmp.name), shape)
        a.server_args += f" --model-path {tmp.name} --load-format dummy --skip-tokenizer-init"
    if a.base_url is None:
        proc, base_url = start_server(a.server_args, a.startup_timeout)
    else:
        base_url = a.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        info = httpx.get(base_url + "/get_model_info", headers=headers, timeout=30).json()
        vocab = int(info.get("vocab_size") or 1000)
        rng = random.Random(a.seed)
        asyncio.run(run_level(base_url, headers, make_prompts(2, a.input_len, a.range_ratio, vocab, rng),
                              min(a.output_len, 4), 2))  # warm-up
        levels = []
        print(f"{'conc':>5} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
              f"{'ITL p99':>8} {'failed':>6}   (latencies in ms)")
        for c in a.concurrency:
            n = a.num_prompts or max(8, 4 * c)
            r = asyncio.run(run_level(base_url, headers, make_prompts(n, a.input_len, a.range_ratio, vocab, rng),
                                      a.output_len, c))
            levels.append(r)
            print(f"{c:>5} {r['request_throughput']:>8.2f} {r['output_throughput']:>10.1f} {r['ttft_ms_p50']:>9.1f} "
                  f"{r['ttft_ms_p99']:>9.1f} {r['itl_ms_p50']:>8.1f} {r['itl_ms_p99']:>8.1f} {r['failed']:>6}")
            for e in r["errors"]:
                print(f"      error: {e}", file=sys.stderr)
        if a.out:
            config = {k: v for k, v in vars(a).items() if k != "api_key"}
            Path(a.out).write_text(json.dumps({"config": config, "base_url": base_url, "model": info,
                                               "results": levels}, indent=2) + "\n")
            print(f"wrote {a.out}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
