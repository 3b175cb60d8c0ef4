"""Smoke test of benchmarks/bench_cpu_moe.py with --dynamic, --reduce-inline, --gap-us and --items-per-thread (every row measured with each
setting in turn on the same pool): it runs end to end in a subprocess, writes a row for every (T, setting), and
refuses a bad setting with one line and exit code 2."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "bench_cpu_moe.py")


def test_bench_cpu_moe_settings_interleaved(tmp_path):
    out = tmp_path / "moe.json"
    res = subprocess.run([sys.executable, SCRIPT, "--E", "4", "--k", "2", "--H", "256", "--I", "128", "--layers", "2",
                          "--threads", "2", "--isa", "avx2", "--T", "1,5", "--seconds", "0.01", "--min-iters", "2",
                          "--max-iters", "3", "--stream-bytes", str(1 << 22), "--dynamic", "on,off",
                          "--reduce-inline", "16,0", "--gap-us", "0,30", "--items-per-thread", "8,2",
                          "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    got = sorted((r["T"], r["dynamic_phases"], r["reduce_inline_rows"], r["gap_us"], r["items_per_thread"]) for r in rows)
    want = sorted((t, d, ri, g, n) for t in (1, 5) for d in (True, False) for ri in (16, 0) for g in (0, 30)
                  for n in (8, 2))
    assert got == want


def test_bench_cpu_moe_bad_setting_is_one_line():
    for bad in (["--reduce-inline", "-1"], ["--reduce-inline", "x"], ["--dynamic", "maybe"], ["--gap-us", "-5"],
                ["--items-per-thread", "0"]):
        res = subprocess.run([sys.executable, SCRIPT, *bad], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert res.returncode == 2, bad
        assert "Traceback" not in res.stderr and res.stderr.strip().splitlines()[-1].startswith("bench_cpu_moe.py: error")
