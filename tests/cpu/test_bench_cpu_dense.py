"""Smoke test of benchmarks/bench_cpu_dense.py with --prefetch (one pool per distance, interleaved): it runs
end to end in a subprocess and prints a bound ratio for every native variant."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cpu_dense_prefetch_variants():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_dense.py"), "--shapes", "router",
                          "--tokens", "1", "--isa", "avx2", "--prefetch", "0,2048", "--repeats", "1", "--no-torch"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("router"))
    assert "avx2@0 " in line and "avx2@2048 " in line and "bound ratio" in line
