"""bench_hybrid_decode.py runs end to end (a tiny model on the CPU, `--device cpu`): the script the
H200 runs is not first exercised on the device. It checks the script, not the numbers."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_hybrid_decode_smoke(tmp_path):
    out = tmp_path / "hb.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_hybrid_decode.py"), "--device", "cpu",
           "--layers", "2", "--experts", "8", "--topk", "2", "--hidden", "64", "--inter", "64", "--heads", "4",
           "--kv-heads", "2", "--head-dim", "16", "--vocab", "128", "--gpu-experts", "2", "--deferred", "0", "1",
           "--batch", "1", "--graphs", "off", "--off-steps", "3", "--prompt-len", "8", "--blocking-sync", "on",
           "--hostfn-spin-us=-1", "--repeat", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = res["runs"]
    # the grid twice, interleaved: (repeat, deferral)
    assert [(r["rep"], r["deferred"]) for r in rows] == [(rep, d) for rep in (0, 1) for d in (0, 1)]
    assert all(r["hostfn_spin_us"] == -1 for r in rows)
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["cpu_tasks_per_step"] > 0
        # every layer's task traced: 2 MoE layers (+1 deferred) per step, 3 steps and more
        assert r["cpu_trace"]["tasks"] >= 3 * (2 + r["deferred"]) and r["cpu_trace"]["run_us"] > 0
        assert 0 < r["ratio_to_best_probe_bound"] <= r["ratio_to_bound"] * 1.0001
        lo, hi = sorted(r["adjacent_probes_gbps"])
        assert r["ratio_to_bound"] * r["stream_read_gbps"] / hi * 0.9999 <= r["ratio_to_adjacent_bound"]
        assert r["ratio_to_adjacent_bound"] <= r["ratio_to_bound"] * r["stream_read_gbps"] / lo * 1.0001
    assert "CPU trace:" in proc.stdout
    summary = {e["deferred"]: e for e in res["summary"]}
    assert sorted(summary) == [0, 1]
    for d, e in summary.items():
        vals = sorted(r["tokens_per_s"] for r in rows if r["deferred"] == d)
        assert e["runs"] == 2 and e["median_tokens_per_s"] == (vals[0] + vals[1]) / 2
    assert "median" in proc.stdout
