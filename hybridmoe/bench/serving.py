"""`hybridmoe bench serving`: concurrent streaming clients over HTTP, like SGLang's bench_serving.

Targets a running server (`--url`) or starts one (`hybridmoe serve` with `--server-args`; `--shape
qwen3-30b-a3b` serves that shape with random weights). Prompts are random token ids of up to
`--input-len` tokens (lengths drawn from [range-ratio * len, len]); each request generates up to
`--output-len` tokens with ignore_eos. Requests are sent at `--request-rate` per second (Poisson
arrivals; inf: all at once) with at most `concurrency` in flight, for each concurrency level.
Reports requests/s, tokens/s, TTFT, ITL and E2E latency percentiles; `--out` writes JSON and,
when matplotlib is installed, a PNG of throughput and latency against concurrency.

    hybridmoe bench serving --server-args "--device cpu" --concurrency 1 8 32 --out r.json
    hybridmoe bench serving --url http://127.0.0.1:30000 --input-len 512 --request-rate 4

`--overlap-ab` starts the server with `--disable-overlap-schedule` and with `--enable-overlap-schedule`
in turn (`--ab-rounds` times) and reports each level both ways and the ITL p50 ratio; with
`--offline-ceiling` the engine's own decode step (`hybridmoe bench one-batch`, batch 1, the same
flags, no overlap) is measured in the same run and the ITL p50s are given as ratios to it.

    hybridmoe bench serving --shape qwen3-30b-a3b --server-args "" --concurrency 1 --overlap-ab --offline-ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PERCENTILES = (50, 90, 99)


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
    """One streamed /generate; TTFT, per-token gaps and E2E as the client sees them."""
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


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    out = {f"{prefix}_ms_mean": (sum(values) / len(values) * 1e3) if values else float("nan")}
    out.update({f"{prefix}_ms_p{q}": percentile(values, q) * 1e3 for q in PERCENTILES})
    return out


async def run_level(base_url: str, headers: dict, prompts: list[list[int]], output_len: int, concurrency: int,
                    request_rate: float = math.inf, seed: int = 0) -> dict:
    """Send every prompt (Poisson arrivals at request_rate/s), at most `concurrency` in flight."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=3600, limits=limits) as client:
        async def bounded(ids: list[int]) -> RequestResult:
            async with sem:
                return await one_request(client, ids, output_len)

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.ensure_future(bounded(p)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    level = {
        "concurrency": concurrency, "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "num_requests": len(prompts), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "duration_s": duration,
        "request_throughput": len(ok) / duration, "input_throughput": sum(r.input_tokens for r in ok) / duration,
        "output_throughput": out_tokens / duration, "total_input_tokens": sum(r.input_tokens for r in ok),
        "total_output_tokens": out_tokens,
    }
    level.update(_stats("ttft", [r.ttft for r in ok]))
    level.update(_stats("itl", [x for r in ok for x in r.itl]))
    level.update(_stats("e2e", [r.e2e for r in ok]))
    return level


def make_prompts(n: int, input_len: int, range_ratio: float, vocab: int, rng: random.Random) -> list[list[int]]:
    """Random token ids (avoiding the first 10 ids, where special tokens usually live)."""
    lo = max(1, int(input_len * range_ratio))
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, input_len))] for _ in range(n)]


def start_server(server_args: str, timeout: float, log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """`hybridmoe serve` on a free port; returns once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "hybridmoe.launch_server", "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(server_args)]
    print("starting:", " ".join(cmd), file=sys.stderr)
    out = open(log_path, "w") if log_path else None  # noqa: SIM115  (closed with the process)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None)
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


def build_parser() -> argparse.ArgumentParser:
    from hybridmoe.args import OneLineParser
    from hybridmoe.bench.shapes import SHAPES

    p = OneLineParser(prog="hybridmoe bench serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", "--base-url", dest="url", default=None, help="a running server (default: start one)")
    p.add_argument("--server-args", default="--device cpu", help="flags of the server this command starts")
    p.add_argument("--server-log", default=None, help="write the started server's output here (default: inherit)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="the started server serves this shape with random weights (adds --model-path, "
                        "--load-format dummy, --skip-tokenizer-init to --server-args)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="levels (default 1 8 32)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per level (default: 4 x concurrency, >= 8)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=1.0, help="lengths drawn from [ratio*len, len] (default 1)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="write the results as JSON here (and a PNG beside it)")
    p.add_argument("--png", default=None, help="the PNG's path (default: --out with .png)")
    p.add_argument("--overlap-ab", action="store_true",
                   help="run every level against a server started with --disable-overlap-schedule and one started "
                        "with --enable-overlap-schedule (in turn, --ab-rounds times); report both and the ratio")
    p.add_argument("--ab-rounds", type=int, default=1, help="--overlap-ab: off/on rounds (default 1)")
    p.add_argument("--offline-ceiling", action="store_true",
                   help="also measure the engine's decode step at batch 1 without a server (`hybridmoe bench "
                        "one-batch` with --server-args as engine flags, overlap off) and report ITL p50 against it")
    return p


HEADER = (f"{'overlap':>7} {'conc':>5} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'E2E p50':>9} {'E2E p99':>9} {'failed':>6}   (latencies in ms)")


def _row(r: dict) -> str:
    return (f"{r.get('overlap', '-'):>7} {r['concurrency']:>5} {r['request_throughput']:>8.2f} {r['output_throughput']:>10.1f} "
            f"{r['ttft_ms_p50']:>9.1f} {r['ttft_ms_p99']:>9.1f} {r['itl_ms_p50']:>8.1f} {r['itl_ms_p99']:>8.1f} "
            f"{r['e2e_ms_p50']:>9.1f} {r['e2e_ms_p99']:>9.1f} {r['failed']:>6}")


class BenchError(Exception):
    """The benchmark cannot run (no server, a refused request); `main` prints it as one line, exit code 2."""


def model_info(base_url: str, headers: dict) -> dict:
    """The server's /get_model_info; BenchError when it cannot be reached or does not answer 200."""
    try:
        r = httpx.get(base_url + "/get_model_info", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {base_url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"{base_url}/get_model_info answered {r.status_code}: {r.text[:200]}")
    return r.json()


def run_levels(a: argparse.Namespace, base_url: str, headers: dict, label: str) -> tuple[list[dict], dict]:
    """Every concurrency level against one server (after a warm-up); the levels and /get_model_info."""
    info = model_info(base_url, headers)
    vocab = int(info.get("vocab_size") or 1000)
    rng = random.Random(a.seed)
    asyncio.run(run_level(base_url, headers, make_prompts(2, a.input_len, a.range_ratio, vocab, rng),
                          min(a.output_len, 4), 2))  # warm-up
    levels = []
    for c in a.concurrency:
        n = a.num_prompts or max(8, 4 * c)
        r = asyncio.run(run_level(base_url, headers, make_prompts(n, a.input_len, a.range_ratio, vocab, rng),
                                  a.output_len, c, a.request_rate, a.seed))
        r["overlap"] = label
        levels.append(r)
        print(_row(r), flush=True)
        for e in r["errors"]:
            print(f"      error: {e}", file=sys.stderr)
    return levels, info


def offline_ceiling(a: argparse.Namespace) -> float:
    """The median decode step (ms) of `hybridmoe bench one-batch` at batch 1 with the server's engine
    flags and overlap off, in a subprocess (the servers are stopped by then: the device is free)."""
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "one_batch.json")
        cmd = [sys.executable, "-m", "hybridmoe.cli", "bench", "one-batch", *shlex.split(a.server_args),
               "--batch-size", "1", "--input-len", str(a.input_len), "--output-len", str(max(a.output_len, 8)),
               "--out", out]
        print("offline ceiling:", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if a.server_log else None)
        return float(json.loads(Path(out).read_text())["results"][0]["decode_latency_ms_median"])


def _ab_summary(levels: list[dict], ceiling: float | None) -> list[dict]:
    """Per concurrency: the median over rounds of ITL p50 off and on, their ratio (and to the ceiling)."""
    import statistics

    rows = []
    for c in sorted({r["concurrency"] for r in levels}):
        # "-": one server with its own settings (--offline-ceiling without --overlap-ab), called "server"
        med = {("server" if m == "-" else m): statistics.median(
            [r["itl_ms_p50"] for r in levels if r["concurrency"] == c and r["overlap"] == m])
            for m in ("off", "on", "-") if any(r["concurrency"] == c and r["overlap"] == m for r in levels)}
        row = {"concurrency": c, **{f"itl_ms_p50_{m}": v for m, v in med.items()}}
        line = f"conc {c}: ITL p50 " + ", ".join(f"{m} {v:.2f} ms" for m, v in med.items())
        if len(med) == 2:
            row["on_over_off"] = med["on"] / med["off"]
            line += f", on/off {row['on_over_off']:.3f}"
        if ceiling:
            for m, v in med.items():
                row[f"{m}_over_ceiling"] = v / ceiling
            line += f"; against the offline decode step {ceiling:.2f} ms: " + ", ".join(
                f"{m} {v / ceiling:.3f}" for m, v in med.items())
        print(line, flush=True)
        rows.append(row)
    return rows


PROMPT_TOKEN_BYTES = 36  # a random id in a Python list: its 8-byte slot and a 28-byte int (ids >= 257 are not cached)


def _writable(flag: str, path: str | None) -> str | None:
    """Why `path` cannot be written (its directory missing, or a directory itself); None when it can be tried.
    The results are written after the whole benchmark: a bad path was a traceback then."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        return f"{flag} {path}: is a directory, expected a file path"
    if not p.parent.is_dir():
        return f"{flag} {path}: the directory {p.parent} does not exist"
    return None


def check_flags(a: argparse.Namespace) -> str | None:
    """The flags' values, before any server is started or reached: the first error, or None.
    A zero concurrency hung on its semaphore, a NaN rate or a negative ratio failed inside the first level
    (after the server was up), --server-args with an unclosed quote was shlex's traceback."""
    try:
        shlex.split(a.server_args)
    except ValueError as e:
        return f"--server-args {a.server_args!r}: {e} (a shell-quoted flag string)"
    if any(c < 1 for c in a.concurrency):
        return f"--concurrency: got {' '.join(map(str, a.concurrency))}, expected positive integers"
    for flag, value in (("--num-prompts", a.num_prompts), ("--input-len", a.input_len),
                        ("--output-len", a.output_len), ("--ab-rounds", a.ab_rounds)):
        if value is not None and value < 1:
            return f"{flag}: got {value}, expected a positive integer"
    if not 0.0 <= a.range_ratio <= 1.0:  # (also NaN)
        return f"--range-ratio: got {a.range_ratio}, expected a number in [0, 1]"
    if not a.request_rate > 0:  # NaN, 0 or below; inf: all at once
        return f"--request-rate: got {a.request_rate}, expected requests per second > 0 (or inf)"
    if not (math.isfinite(a.startup_timeout) and a.startup_timeout > 0):
        return f"--startup-timeout: got {a.startup_timeout}, expected a positive number of seconds"
    from hybridmoe.moe.memory_plan import host_available_bytes

    # a level's prompts are made in full before it starts: 4 x a huge --concurrency was gigabytes of Python ints
    have = host_available_bytes()
    prompts = max((a.num_prompts or max(8, 4 * c)) for c in a.concurrency)
    need = prompts * a.input_len * PROMPT_TOKEN_BYTES
    if have is not None and need > have:
        flag = f"--num-prompts {a.num_prompts}" if a.num_prompts else f"--concurrency {max(a.concurrency)}"
        return (f"{flag}: {prompts} prompts of up to {a.input_len} tokens (--input-len) take "
                f"{need / 2**30:.1f} GiB of host memory, {have / 2**30:.1f} GiB are available")
    for flag, path in (("--out", a.out), ("--png", a.png), ("--server-log", a.server_log)):
        why = _writable(flag, path)
        if why:
            return why
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BenchError as e:
        print(f"hybridmoe bench serving: error: {e}", file=sys.stderr, flush=True)
        return 2


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    error = check_flags(a)
    if error:
        parser.error(error)
    if a.shape is not None:
        from hybridmoe.bench.shapes import write_shape_dir

        a.server_args += f" --model-path {write_shape_dir(a.shape)} --load-format dummy --skip-tokenizer-init"
    if (a.overlap_ab or a.offline_ceiling) and a.url is not None:
        parser.error("--overlap-ab and --offline-ceiling start their own servers: leave --url out")
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    modes = [("off", " --disable-overlap-schedule"), ("on", " --enable-overlap-schedule")] * max(1, a.ab_rounds) \
        if a.overlap_ab else [("-", "")]
    levels: list[dict] = []
    info: dict = {}
    base_url = a.url.rstrip("/") if a.url else ""
    if a.url is not None:
        model_info(base_url, headers)  # a server that is not there: one line before any table
    print(HEADER)
    for label, flag in modes:
        proc = None
        if a.url is None:
            proc, base_url = start_server(a.server_args + flag, a.startup_timeout, a.server_log)
        try:
            got, info = run_levels(a, base_url, headers, label)
            levels += got
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    ceiling = offline_ceiling(a) if a.offline_ceiling else None
    summary = _ab_summary(levels, ceiling) if a.overlap_ab or ceiling else []
    if a.out:
        config = {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf") for k, v in vars(a).items()
                  if k != "api_key"}
        Path(a.out).write_text(json.dumps({"benchmark": "serving", "config": config, "base_url": base_url,
                                           "model": info, "results": levels, "overlap_summary": summary,
                                           "offline_decode_step_ms": ceiling}, indent=2) + "\n")
        print(f"wrote {a.out}")
    if a.out or a.png:
        from hybridmoe.bench.plot import plot_levels

        shown = [r for r in levels if r["overlap"] != "off"][:len(a.concurrency)]  # one curve: the default's
        print(plot_levels(shown, a.png or str(Path(a.out).with_suffix(".png")), title=info.get("model_path", "")))
    return 0 if all(r["failed"] == 0 for r in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
