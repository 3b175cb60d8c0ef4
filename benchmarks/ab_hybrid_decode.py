"""Two revisions of hybridmoe side by side: each revision's own bench_hybrid_decode.py, run in
alternating processes (A, B, A, B, ...), so both see the same drift of the host's memory bandwidth.
Prints per revision and deferral the median batch-1 tok/s and its ratio to the bound from the
stream probes adjacent to each row, and B's median as a fraction of A's.

    python benchmarks/ab_hybrid_decode.py --a OLD_TREE --b . --rounds 3 --out ab.json -- --layers 24 --steps 192

Everything after `--` goes to both bench_hybrid_decode.py runs (besides --deferred, --batch 1 and
--graphs, which this script sets).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_one(tree: Path, deferred: list[int], graphs: str, extra: list[str], log) -> list[dict]:
    """One bench_hybrid_decode.py process of `tree`: its batch-1 rows."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(tree / "benchmarks" / "bench_hybrid_decode.py"), "--deferred", *map(str, deferred),
           "--batch", "1", "--graphs", graphs, "--out", out, *extra]
    env = dict(os.environ, PYTHONPATH=str(tree))  # the tree's own package, whatever is installed
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    log(f"{tree}: exit {proc.returncode} in {time.perf_counter() - t:.0f} s")
    if proc.returncode != 0:
        log(proc.stdout[-3000:] + proc.stderr[-3000:])
        return []
    rows = json.loads(Path(out).read_text())["runs"]
    return [r for r in rows if r["batch"] == 1 and r["graphs"] == graphs]


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="the reference tree (the old revision)")
    p.add_argument("--b", required=True, help="the tree compared with it")
    p.add_argument("--rounds", type=int, default=3, help="A, B pairs of processes")
    p.add_argument("--deferred", type=int, nargs="+", default=[0, 2])
    p.add_argument("--graphs", default="on", choices=["on", "off"], help="off: a CPU smoke run of this script")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    trees = {"a": Path(a.a).resolve(), "b": Path(a.b).resolve()}
    rows: list[dict] = []
    for rnd in range(a.rounds):
        for name, tree in trees.items():
            for r in run_one(tree, a.deferred, a.graphs, extra, log):
                r = {k: v for k, v in r.items() if k != "cpu_trace"}
                rows.append({"round": rnd, "rev": name, **r})
                log(f"round {rnd} {name} deferred {r['deferred']}: {r['tokens_per_s']:.1f} tok/s "
                    f"(adjacent-probe ratio {r.get('ratio_to_adjacent_bound', float('nan')):.2f})")
            if a.out:
                Path(a.out).write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "rows": rows},
                                                  indent=2))
    summary = {}
    for d in a.deferred:
        med = {}
        for name in trees:
            sel = [r for r in rows if r["rev"] == name and r["deferred"] == d]
            if sel:
                med[name] = (statistics.median(r["tokens_per_s"] for r in sel),
                             statistics.median(r["ratio_to_adjacent_bound"] for r in sel), len(sel))
        for name, (tps, ratio, n) in med.items():
            log(f"deferred {d} {name}: median {tps:.1f} tok/s of {n}, median adjacent-probe ratio {ratio:.3f}")
        if len(med) == 2:
            summary[d] = {"b_over_a_tok_s": med["b"][0] / med["a"][0], "b_over_a_ratio": med["b"][1] / med["a"][1]}
            log(f"deferred {d}: b/a tok/s {summary[d]['b_over_a_tok_s']:.3f}, "
                f"b/a bound ratio {summary[d]['b_over_a_ratio']:.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "rows": rows,
                                           "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
