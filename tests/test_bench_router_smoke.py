"""benchmarks/bench_router.py runs end to end (the Triton interpreter on the CPU, tiny sizes): every fused config
it times gives the two-launch path's experts, and its JSON has a row per shape."""

from __future__ import annotations

import json
from pathlib import Path

from interpreter import REPO, run_interpreted


def test_bench_router_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "router.json"
    proc = run_interpreted(REPO / "benchmarks" / "bench_router.py", "--device", "cpu", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["shape"] for r in rows] == ["tiny"]
    assert len(rows[0]["fused"]) == 2 and all(v["ids_differ"] == 0 for v in rows[0]["fused"].values())
