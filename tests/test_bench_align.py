"""benchmarks/bench_align.py runs end to end (on the CPU under the Triton interpreter: timings meaningless)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_align.py"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


def test_bench_align_smoke(tmp_path):
    out = tmp_path / "a.json"
    r = _run("--device", "cpu", "--tokens", "3", "100", "--experts", "16", "--calls", "2", "--out", str(out),
             tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(x["tokens"], x["method"]) for x in rows] == [(t, m) for t in (3, 100) for m in ("triton", "grid", "torch")]
    assert all(x["eager_us"] > 0 and x["pairs"] == x["tokens"] * 8 for x in rows)


def test_bench_align_bad_method_is_one_line(tmp_path):
    r = _run("--device", "cpu", "--methods", "triton,bogus", tmp_path=tmp_path)
    assert r.returncode == 2
    assert "--methods" in r.stderr.strip().splitlines()[-1]
