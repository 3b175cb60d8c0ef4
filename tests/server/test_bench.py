"""`hybridmoe bench one-batch` and `hybridmoe bench serving` on the CPU with small sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "hybridmoe" / "demo_model"

ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridmoe.cli", "bench", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_one_batch(tmp_path):
    out = tmp_path / "one.json"
    r = _run("one-batch", "--device", "cpu", "--batch-size", "1", "3", "--input-len", "12", "--output-len", "4",
             "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [x["batch_size"] for x in data["results"]] == [1, 3]
    for x in data["results"]:
        assert x["decode_steps"] == 3 and x["prefill_latency_ms"] > 0 and x["decode_throughput_tok_s"] > 0
    assert "decode tok/s" in r.stdout
    assert "hybridmoe.startup: experts:" in r.stderr  # the startup summary


def test_one_batch_random_weights_hybrid(tmp_path):
    r = _run("one-batch", "--device", "cpu", "--load-format", "dummy", "--kt-num-gpu-experts", "2", "--kt-cpuinfer",
             "1", "--batch-size", "2", "--input-len", "8", "--output-len", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 of 8 on the GPU" in r.stderr


def test_one_batch_refuses_bad_sizes():
    r = _run("one-batch", "--device", "cpu", "--batch-size", "0")
    assert r.returncode == 2 and "--batch-size" in r.stderr


def test_serving_starts_its_server(tmp_path):
    """Two servers (--overlap-ab: overlap off, then on), each level both ways and the ITL ratio, and the
    engine's decode step (--offline-ceiling: one-batch) in the same run."""
    pytest.importorskip("httpx")
    out = tmp_path / "serving.json"
    r = _run("serving", "--server-args", f"--device cpu --model-path {DEMO}", "--server-log",
             str(tmp_path / "server.log"), "--concurrency", "1", "4", "--num-prompts", "6", "--input-len", "16",
             "--output-len", "5", "--range-ratio", "0.5", "--request-rate", "50", "--overlap-ab", "--offline-ceiling",
             "--out", str(out), timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(out.read_text())
    levels = data["results"]
    assert [(x["overlap"], x["concurrency"]) for x in levels] == [("off", 1), ("off", 4), ("on", 1), ("on", 4)]
    for x in levels:
        assert x["completed"] == 6 and x["failed"] == 0 and x["total_output_tokens"] == 30
        assert 0 < x["ttft_ms_p50"] <= x["ttft_ms_p99"] and 0 < x["e2e_ms_p50"] <= x["e2e_ms_p99"]
        assert x["itl_ms_p50"] > 0
    assert [row["concurrency"] for row in data["overlap_summary"]] == [1, 4]
    assert data["offline_decode_step_ms"] > 0
    for row in data["overlap_summary"]:
        assert row["on_over_off"] > 0 and row["on_over_ceiling"] > 0 and row["off_over_ceiling"] > 0
    assert "on/off" in r.stdout and "against the offline decode step" in r.stdout
    assert "--disable-overlap-schedule" in r.stderr and "--enable-overlap-schedule" in r.stderr  # the commands
    png = out.with_suffix(".png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no PNG: matplotlib is not installed" in r.stdout
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_usage():
    r = _run("nope")
    assert r.returncode == 2 and "one-batch" in r.stderr


def test_serving_without_a_server_is_one_line(tmp_path):
    """No server at --url: one line naming the URL, exit code 2 (was an httpx traceback, exit 1)."""
    r = _run("serving", "--url", "http://127.0.0.1:9", "--num-prompts", "2", timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("hybridmoe bench serving: error: cannot reach the server at http://127.0.0.1:9")
    r = _run("serving", "--url", "http://127.0.0.1:9", "--overlap-ab", timeout=60)
    assert r.returncode == 2 and "leave --url out" in r.stderr and "Traceback" not in r.stderr


def test_serving_offline_ceiling_alone(tmp_path):
    """--offline-ceiling without --overlap-ab: the one server's ITL against the decode step (its summary printed
    'ITL p50 off nan ms, on nan ms' before: it looked only for the A/B's labels)."""
    pytest.importorskip("httpx")
    out = tmp_path / "serving.json"
    r = _run("serving", "--server-args", f"--device cpu --model-path {DEMO}", "--server-log",
             str(tmp_path / "server.log"), "--concurrency", "1", "--num-prompts", "2", "--input-len", "8",
             "--output-len", "4", "--offline-ceiling", "--out", str(out), timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (row,) = json.loads(out.read_text())["overlap_summary"]
    assert row["concurrency"] == 1 and row["itl_ms_p50_server"] > 0 and row["server_over_ceiling"] > 0
    assert "nan" not in r.stdout and "ITL p50 server" in r.stdout
