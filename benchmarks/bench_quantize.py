"""Load-time quantization speed: one layer of routed experts (default Qwen3-30B-A3B: E=128, H=2048,
I=768) packed from bf16 by the native quantizers (hybridmoe/cpu/pack.py) on every physical core,
as GB/s of bf16 input, per method; the torch reference (quant.pack_layer) once for comparison with
--reference; and random layers drawn directly in packed form (`--load-format dummy`).

    python benchmarks/bench_quantize.py                 # median of --repeats, per method
    python benchmarks/bench_quantize.py --experts 8     # quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--methods", default="AMXINT8,AMXINT4,BF16")
    p.add_argument("--threads", type=int, default=None, help="default: every physical core")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reference", action="store_true", help="also time the torch reference (slow)")
    a = p.parse_args()

    from hybridmoe.cpu import pack, quant
    from hybridmoe.cpu.engine import CPUThreadPool
    from hybridmoe.cpu.topology import physical_cores

    threads = a.threads or len(physical_cores())
    pool = CPUThreadPool(threads=threads)
    e, h, i = a.experts, a.hidden, a.inter
    gu = torch.empty(e, 2 * i, h, dtype=torch.bfloat16).normal_(0, 0.02)
    dn = torch.empty(e, h, i, dtype=torch.bfloat16).normal_(0, 0.02)
    nbytes = gu.nbytes + dn.nbytes
    print(f"{threads} threads, one layer E={e} H={h} I={i}: {nbytes / 1e9:.2f} GB of bf16")
    for m in a.methods.split(","):
        times, rnd = [], []
        for _ in range(a.repeats):
            t = time.perf_counter()
            pack.pack_layer(gu, dn, m, pool=pool)
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            pack.random_packed_layer(e, h, i, m, pool=pool)
            rnd.append(time.perf_counter() - t)
        dt = statistics.median(times)
        line = f"{m:8s} native {dt:6.2f} s = {nbytes / dt / 1e9:6.2f} GB/s bf16 in; random packed {statistics.median(rnd):.2f} s"
        if a.reference:
            t = time.perf_counter()
            quant.pack_layer(gu, dn, m)
            line += f"; torch reference {time.perf_counter() - t:.1f} s"
        print(line, flush=True)
    pool.close()


if __name__ == "__main__":
    main()
