"""Tile sweep of the fused Triton MoE kernels at decode sizes, on the GPU; writes the tuned table
that `triton_moe_kernels.choose_config` reads (hybridmoe/moe/configs/E{E}_H{H}_I{I}_K{K}.json).

Each kernel (gate/up, down) is timed alone for every candidate tile, over `--layers` distinct
weight sets (so the weights come from HBM, not L2), with its launches captured in a CUDA graph
(no launch gaps in the numbers). The best gate/up and down tiles per T are combined. Also prints,
per T, the time of the whole fused forward with the old heuristic and with the tuned config, and
the weight bytes it reads over the device-to-device copy bandwidth measured in the same run.

    python benchmarks/sweep_moe_decode.py --write
"""

# ruff: noqa: B023, E741  (closures run inside their loop iteration; I is the intermediate size)
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch

from hybridmoe.moe import triton_moe_kernels as K


def graph_time(fn, reps: int = 5) -> float:
    """Seconds per call of fn (which launches work for all layers once), via CUDA graph replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up / compile
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / graph_time(lambda: dst.copy_(src))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--write", action="store_true", help="write the tuned table into the package's configs/")
    p.add_argument("--out", default=None, help="also write the table (and timings) here")
    a = p.parse_args()
    E, H, I, topk = a.experts, a.hidden, a.inter, a.topk
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    gate_up = [torch.randn(E, 2 * I, H, device=dev, dtype=dt) * 0.02 for _ in range(a.layers)]
    down = [torch.randn(E, H, I, device=dev, dtype=dt) * 0.02 for _ in range(a.layers)]

    gu_space = [dict(gu_block_n=bn, gu_block_k=bk, gu_warps=w, gu_stages=st)
                for bn, bk, w, st in itertools.product([16, 32, 64], [128, 256], [4, 8], [3, 5])]
    dn_space = [dict(dn_block_n=bn, dn_block_k=bk, dn_warps=w, dn_stages=st)
                for bn, bk, w, st in itertools.product([16, 32, 64, 128], [64, 128, 256], [4, 8], [3])]
    table, report = {}, {}
    for T in a.tokens:
        t0 = time.perf_counter()
        g = torch.Generator(device="cpu").manual_seed(T)
        xs = [torch.randn(T, H, device=dev, dtype=dt) for _ in range(a.layers)]
        ids = [torch.rand(T, E, generator=g).argsort(dim=1)[:, :topk].to(dev, torch.int32) for _ in range(a.layers)]
        ws = [torch.rand(T, topk, device=dev, dtype=torch.float32) for _ in range(a.layers)]
        base = K.default_config(T, E, topk, H, I)
        bm = base.block_m
        aligned = [K.align_pairs(i, E, bm) for i in ids]
        P = T * topk
        inter = torch.randn(P, I, device=dev, dtype=dt)
        out_pairs = torch.empty(P, H, device=dev, dtype=dt)

        def run_gu(c: dict) -> None:
            cfg = dataclasses.replace(base, **c)
            for L in range(a.layers):
                sp, be = aligned[L]
                K.launch_gate_up(xs[L], gate_up[L], inter, sp, be, ws[L].reshape(-1), topk, cfg)

        def run_dn(c: dict) -> None:
            cfg = dataclasses.replace(base, **c)
            for L in range(a.layers):
                sp, be = aligned[L]
                K.launch_down(inter, down[L], out_pairs, ws[L].reshape(-1), sp, be, cfg)

        def best(space, run):
            res = []
            for c in space:
                try:
                    res.append((graph_time(lambda c=c: run(c)) / a.layers, c))
                except Exception as e:  # a tile the compiler rejects (shared memory): skip it
                    print(f"  skip {c}: {type(e).__name__}", flush=True)
            return min(res, key=lambda r: r[0])

        gu_t, gu_c = best(gu_space, run_gu)
        dn_t, dn_c = best(dn_space, run_dn)
        tuned = dataclasses.replace(base, **gu_c, **dn_c)

        def whole(cfg):
            return graph_time(lambda: [K.fused_moe(xs[L], gate_up[L], down[L], ids[L], ws[L], cfg)
                                       for L in range(a.layers)]) / a.layers

        t_base, t_tuned = whole(base), whole(tuned)
        touched = sum(int(torch.unique(i).numel()) for i in ids) / a.layers
        nbytes = touched * 3 * H * I * 2
        floor = nbytes / (bw / 2)  # reading the touched experts once at the copy's read rate
        table[T] = dataclasses.asdict(tuned)
        report[T] = {"gate_up_us": gu_t * 1e6, "down_us": dn_t * 1e6, "fused_heuristic_us": t_base * 1e6,
                     "fused_tuned_us": t_tuned * 1e6, "floor_us": floor * 1e6, "config": table[T]}
        print(f"T={T:4d}: gate/up {gu_t * 1e6:6.1f} us {gu_c}  down {dn_t * 1e6:6.1f} us {dn_c}  | fused: "
              f"heuristic {t_base * 1e6:6.1f} us, tuned {t_tuned * 1e6:6.1f} us, floor {floor * 1e6:5.1f} us "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    doc = {"shape": {"E": E, "H": H, "I": I, "K": topk}, "device": torch.cuda.get_device_name(),
           "configs": {str(t): c for t, c in table.items()}}
    if a.write:
        path = K.config_file(E, H, I, topk)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        K._tuned_table.cache_clear()
        print(f"wrote {path}")
    if a.out:
        Path(a.out).write_text(json.dumps({**doc, "copy_bw": bw, "timings": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
