"""Instructions per weight byte of the GGUF MoE layer (--kt-method LLAMAFILE) under callgrind: a
load-independent measure of the decode kernels' cost (timings on a shared machine are noisy).

    python benchmarks/instr_gguf_moe.py --types Q4_K,Q8_0 --T 1,4,16 [--isa avx2]

Runs, per (type, T), `--tasks` decode tasks of a Qwen3-30B-A3B-shaped layer (E experts, top-k, H, I)
on a one-thread pool under `valgrind --tool=callgrind`, collecting inside hm::run_moe_task only,
and prints the instructions per weight byte touched (the distinct experts' three matrices) in
total, of the gate/up GEMM phase (ph_gemm<true>, with the activation) per gate/up byte, of the down
phase (ph_gemm<false>) per down byte, and of the rest (routing, quantization, gather, reduction)
per byte of all three. Needs valgrind and callgrind_annotate on PATH. Valgrind (3.19) has no
AVX-512: under it the library's CPU check sees AVX2 only, so these are the AVX2 kernels' counts
whatever --isa says; HYBRIDMOE_CPU_LIB=path/to/lib.so compares two builds.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, torch
sys.path.insert(0, {bench_dir!r})
from bench_gguf_moe import make_layer, routing
from hybridmoe.cpu.engine import CPUThreadPool
from hybridmoe.cpu.gguf_engine import GGUFMoELayer
typ, t, tasks, E, k, H, I, isa = {args!r}
torch.manual_seed(0)
pool = CPUThreadPool(threads=1)
layer = GGUFMoELayer(make_layer(typ, E, H, I, 0), isa=isa, pool=pool)
x = torch.randn(t, H, dtype=torch.bfloat16)
out = torch.empty_like(x)
touched = 0
for j in range(tasks):
    ids, w = routing(t, k, E)
    touched += int(ids.unique().numel())
    layer.forward(x, ids, w, out=out)
ts = layer.packed.tensors()
print("BYTES", touched * (ts["gate"].numel() + ts["up"].numel()) / E, touched * ts["down"].numel() / E)
"""

PHASES = {"gemm1": "ph_gemm<true>", "gemm2": "ph_gemm<false>"}


def run_one(typ: str, t: int, a) -> dict:
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        code = CHILD.format(bench_dir=bench_dir, args=(typ, t, a.tasks, a.E, a.k, a.H, a.I, a.isa))
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--collect-atstart=no",
               "--toggle-collect=hm::run_moe_task*", sys.executable, "-c", code]
        p = subprocess.run(cmd, capture_output=True, text=True, check=True)
        m = re.search(r"BYTES (\S+) (\S+)", p.stdout)
        b13, b2 = float(m.group(1)), float(m.group(2))
        nbytes = b13 + b2
        if a.keep:
            subprocess.run(["cp", out, f"{a.keep}.{typ}.T{t}"], check=True)
        ann = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out],
                             capture_output=True, text=True, check=True).stdout
    total = float(re.search(r"([\d,]+)\s+\(100.0%\)\s+PROGRAM TOTALS", ann).group(1).replace(",", ""))
    row = {"type": typ, "T": t, "bytes": nbytes, "instr": total, "instr_per_byte": total / nbytes}
    phase = {}
    for name, fn in PHASES.items():
        n = 0.0
        for line in ann.splitlines():
            if fn in line and "run_moe_task" not in line:
                n = max(n, float(line.split()[0].replace(",", "")))
        phase[name] = n
    row["gemm1"] = phase["gemm1"] / b13  # per gate/up byte
    row["gemm2"] = phase["gemm2"] / b2  # per down byte
    row["other"] = (total - phase["gemm1"] - phase["gemm2"]) / nbytes
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q8_0")
    ap.add_argument("--T", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--E", type=int, default=32)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--I", type=int, default=768)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--keep", default=None, help="copy each callgrind output to KEEP.<type>.T<t>")
    a = ap.parse_args(argv)
    rows = []
    for typ in a.types.split(","):
        for t in a.T:
            r = run_one(typ, t, a)
            rows.append(r)
            print(f"{typ:6s} T={t:4d}  instr/byte {r['instr_per_byte']:.4f}  (gate/up phase per gate/up byte "
                  f"{r['gemm1']:.4f}, down phase per down byte {r['gemm2']:.4f}, the rest per byte {r['other']:.4f})", flush=True)
    return rows


if __name__ == "__main__":
    main()
