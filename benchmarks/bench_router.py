"""The one-token MoE router on the GPU: the two launches (cuBLAS GEMV, then the top-k kernel) against the fused
kernel of hybridmoe/moe/router_triton.py in each (experts a program, H tile, warps) config, per model shape.
Each timing is a CUDA graph of calls over distinct router weights (> 2x the L2 in all: in a decode step the
router's weight comes from HBM, the layer's other weights having passed through L2 since), median of --reps
replays, us a call. Each config's expert ids are compared with the two-launch path's (a near-tie may part them:
counted, not an error).

    python benchmarks/bench_router.py --out router.json
    TRITON_INTERPRET=1 python benchmarks/bench_router.py --device cpu   # the test suite's smoke run (tiny sizes)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_moe_decode import graph_time  # noqa: E402

SHAPES = {  # name -> (E, H, K, renormalize)
    "qwen3-30b-a3b": (128, 2048, 8, True), "qwen3-235b-a22b": (128, 4096, 8, True),
    "qwen2-57b-a14b": (64, 3584, 8, False), "mixtral-8x7b": (8, 4096, 2, True),
}
CONFIGS = [(ep, bh, w) for ep, bh, w in itertools.product([1, 2, 4], [512, 1024, 2048], [1, 2, 4])]


def timed(fn, copies: int, reps: int, device: str) -> float:
    """Median us a call of fn(i), i over the copies, captured in one CUDA graph (cpu: wall clock, one pass)."""
    if device != "cuda":
        t = time.perf_counter()
        for i in range(copies):
            fn(i)
        return (time.perf_counter() - t) * 1e6 / copies
    return graph_time(lambda: [fn(i) for i in range(copies)], reps) * 1e6 / copies


def bench_shape(name: str, e: int, h: int, k: int, renorm: bool, configs: list, a: argparse.Namespace) -> dict:
    """One shape: the two launches (top-k with 4 and 1 warps) and every fused config."""
    from hybridmoe.layers.fused_ops import topk_softmax
    from hybridmoe.moe.router_triton import CONFIG, new_ticket, router_topk

    dev = torch.device(a.device)
    dt = torch.bfloat16 if a.device == "cuda" else torch.float32
    copies = max(2, int(a.l2_mb * 2**20 // (e * h * 2))) if a.device == "cuda" else 2
    g = torch.Generator().manual_seed(e + h)
    ws = [(torch.randn(e, h, generator=g) / h**0.5).to(dev, dt) for _ in range(copies)]
    x = torch.randn(1, h, generator=g).to(dev, dt)
    ticket = new_ticket(dev)
    ref_ids = [torch.sort(topk_softmax(F.linear(x, w), k, renorm)[1]).values for w in ws]
    row = {"shape": name, "E": e, "H": h, "K": k, "copies": copies, "default": list(CONFIG)}
    for warps in (4, 1):
        row[f"two_launch_w{warps}_us"] = timed(lambda i, wp=warps: topk_softmax(F.linear(x, ws[i]), k, renorm, wp),
                                               copies, a.reps, a.device)
    fused = {}
    for cfg in configs:
        try:
            t = timed(lambda i, c=cfg: router_topk(x, ws[i], k, renorm, ticket, c), copies, a.reps, a.device)
        except Exception as exc:  # a config the compiler rejects: skip it
            print(f"  {name} {cfg}: {type(exc).__name__}", flush=True)
            continue
        differ = sum(not torch.equal(torch.sort(router_topk(x, w, k, renorm, ticket, cfg)[1]).values, r)
                     for w, r in zip(ws, ref_ids))
        fused[str(cfg)] = {"us": t, "ids_differ": differ}
    row["fused"] = fused
    best = min(fused.items(), key=lambda kv: kv[1]["us"])
    dflt = fused.get(str(CONFIG))
    print(f"{name:16s} E {e} H {h} K {k}: two launches {row['two_launch_w4_us']:6.2f} us (top-k with 1 warp "
          f"{row['two_launch_w1_us']:6.2f}); fused default {CONFIG} {dflt['us'] if dflt else float('nan'):6.2f} us; "
          f"best {best[0]} {best[1]['us']:6.2f} us (ids differ in {best[1]['ids_differ']} of {copies})", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--l2-mb", type=float, default=100.0, help="distinct router weight bytes a graph cycles through")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    unknown = [k for k in a.shapes.split(",") if k not in SHAPES]
    if unknown:
        p.error(f"--shapes {','.join(unknown)}: unknown (known: {', '.join(SHAPES)})")
    shapes = {k: SHAPES[k] for k in a.shapes.split(",")} if a.device == "cuda" else {"tiny": (12, 96, 3, True)}
    configs = CONFIGS if a.device == "cuda" else [(2, 64, 1), (4, 32, 2)]
    results = [bench_shape(name, *shape, configs, a) for name, shape in shapes.items()]
    if a.out:
        a.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
