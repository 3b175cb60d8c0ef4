"""bench_lora_decode.py runs end to end (a tiny model on the CPU, `--device cpu`): once with half the
experts on the native CPU engine (the split carries CPU tasks and the LoRA phase) and once with every
expert on the torch side (no CPU task): the script the H200 runs is not first exercised on the device.
It checks the script, the split's fields and that the adapters were served, not the numbers."""

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_lora_decode_smoke(tmp_path):
    out = tmp_path / "lora.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_lora_decode.py"), "--device", "cpu", "--layers", "2",
           "--experts", "8", "--hidden", "64", "--inter", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
           "--vocab", "256", "--gpu-experts", "4", "8", "--all-gpu-layers", "1", "--method", "BF16", "--steps", "3",
           "--repeat", "2", "--batch", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(r["gpu_experts"], r["layers"], r["rep"], r["kind"], r["batch"]) for r in res["runs"]] == \
        [(g, layers, rep, k, b) for g, layers in ((4, 2), (8, 1)) for rep in (0, 1)
         for k, b in (("base", 1), ("lora", 1), ("base", 3), ("lora", 3))]
    assert [(s["gpu_experts"], s["batch"]) for s in res["summary"]] == [(4, 1), (4, 3), (8, 1), (8, 3)]
    assert all(s["ratio"] > 0 for s in res["summary"])
    for s in res["summary"]:
        hybrid = s["gpu_experts"] == 4
        for kind in ("base", "lora"):
            m = s[kind]
            assert m["ms_per_step"] > 0 and (m["cpu_busy_ms_per_step"] > 0) == hybrid
            assert math.isclose(m["cpu_busy_ms_per_step"] + m["other_ms_per_step"], m["ms_per_step"], rel_tol=0.2)
            assert (m["cpu_tasks_per_step"] == 2) == hybrid  # one task per MoE layer, nothing deferred
            assert (m["trace_run_us"] > 0) if hybrid else math.isnan(m["trace_run_us"])
        # only runs on an adapter spend time in the CPU LoRA phases
        assert (s["lora"]["cpu_phase_us_per_task"]["lora"] > 0) == hybrid
        assert math.isclose(s["added"]["us_per_layer"], 1e3 * s["added"]["ms_per_step"] / s["layers"])
    assert res["adapters"] == ["a0", "a1", "a2"]


def test_bench_lora_decode_unfused_variant(tmp_path):
    """--unfused: a third model (the LoRA linears' unfused form) timed at batch 1 between the others, and the
    per-repeat ratios in the summary."""
    out = tmp_path / "lora.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_lora_decode.py"), "--device", "cpu", "--layers", "2",
           "--experts", "8", "--hidden", "64", "--inter", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
           "--vocab", "256", "--gpu-experts", "4", "--method", "BF16", "--steps", "3", "--repeat", "2", "--batch", "2",
           "--unfused", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(r["rep"], r["kind"], r["batch"]) for r in res["runs"]] == \
        [(rep, k, b) for rep in (0, 1) for k, b in (("base", 1), ("lora", 1), ("lora-unfused", 1), ("base", 2),
                                                      ("lora", 2))]
    one, two = res["summary"]
    assert len(one["ratio_per_rep"]) == 2 and len(one["unfused_ratio_per_rep"]) == 2
    assert len(one["fused_over_unfused_per_rep"]) == 2 and all(v > 0 for v in one["fused_over_unfused_per_rep"])
    assert "unfused_ratio_per_rep" not in two and len(two["ratio_per_rep"]) == 2
    assert "fused / unfused" in proc.stdout
