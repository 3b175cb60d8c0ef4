"""Smoke test of benchmarks/bench_cpu_attn.py: the pool mode and the --libs A/B mode (the installed
library twice) run end to end on a small shape, and report the cache bytes read per second."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, *args) -> dict:
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_attn.py"), "--lens", "5,300",
                          "--heads", "8", "--kv-heads", "2", "--head-dim", "64", "--repeats", "1", "--calls", "2",
                          "--out", str(out), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "GB/s" in res.stdout
    return json.loads(out.read_text())


def test_pool_mode(tmp_path):
    r = _run(tmp_path, "--threads", "2")
    assert r["threads"] == 2 and [x["len"] for x in r["runs"]] == [5, 300]
    assert all(x["gbps"] > 0 and x["us"] > 0 for x in r["runs"])


def test_libs_mode(tmp_path):
    from hybridmoe.cpu import native

    lib = str(native._locate())
    r = _run(tmp_path, "--cold", "--libs", f"a={lib},b={lib}")
    assert r["cold"] and r["threads"] == 1
    assert sorted((x["lib"], x["len"]) for x in r["runs"]) == [("a", 5), ("a", 300), ("b", 5), ("b", 300)]
