"""bench_lora_decode.py runs end to end (a tiny model on the CPU, `--device cpu`, every expert on the
torch side): the script the H200 runs is not first exercised on the device. It checks the script and
that the adapters were served, not the numbers."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_lora_decode_smoke(tmp_path):
    out = tmp_path / "lora.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_lora_decode.py"), "--device", "cpu", "--layers", "2",
           "--experts", "8", "--hidden", "64", "--inter", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
           "--vocab", "256", "--gpu-experts", "8", "--method", "BF16", "--steps", "3", "--repeat", "2", "--batch", "3",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(r["rep"], r["kind"], r["batch"]) for r in res["runs"]] == \
        [(rep, k, b) for rep in (0, 1) for k, b in (("base", 1), ("lora", 1), ("base", 3), ("lora", 3))]
    assert [s["batch"] for s in res["summary"]] == [1, 3] and all(s["ratio"] > 0 for s in res["summary"])
    assert res["adapters"] == ["a0", "a1", "a2"]
