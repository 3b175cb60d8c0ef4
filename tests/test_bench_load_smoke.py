"""bench_load.py runs end to end on a tiny shape (the script, not the numbers): the checkpoint it writes
loads with load-time quantization and decodes, for two methods. (--cold is not run: it drops the
machine's whole page cache.)"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_load_smoke(tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_load.py"), "--layers", "2", "--experts", "4",
           "--hidden", "64", "--inter", "32", "--vocab", "96", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
           "--methods", "AMXINT8,BF16", "--threads", "1", "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["layers"] == 2 and res["cold"] is False
    assert res["experts_bytes"] == 2 * 4 * 3 * 64 * 32 * 2  # layers x experts x (gate, up, down) x bf16
    assert [r["method"] for r in res["runs"]] == ["AMXINT8", "BF16"]
    assert all(r["ready_s"] > 0 for r in res["runs"])
    assert "round 0 AMXINT8: model ready in" in proc.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bench_load_")]  # cleaned up
