"""The fused MoE's expert grouping (triton_moe_kernels.align_pairs) by method, at decode and prefill sizes.

Per (P = T * K pairs, method): the eager wall time of one call as a prefill layer sees it (host launches
included: the median over calls, each synchronized), and the GPU time of the same call replayed in a CUDA
graph (launch cost excluded). Methods: triton (one program), grid (three kernels), torch (sort-based,
~20 ops). Every method's result is checked against torch's before timing.

    python benchmarks/bench_align.py                           # E 128, K 8, T 1..8192
    python benchmarks/bench_align.py --experts 256 --out a.json
    TRITON_INTERPRET=1 python benchmarks/bench_align.py --device cpu --tokens 3 40   # smoke run, times meaningless
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

METHODS = ("triton", "grid", "torch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--block-m", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 512, 2048, 8192])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--calls", type=int, default=50, help="timed calls per row (eager and graph replays)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    a = p.parse_args(argv)
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in a.methods if m not in METHODS]
    if bad or not a.methods:
        p.error(f"--methods: choose from {','.join(METHODS)}, got {a.methods}")
    if a.experts < 1 or a.top_k < 1 or a.block_m < 16 or a.calls < 1 or min(a.tokens) < 1:
        p.error("--experts, --top-k, --calls and --tokens must be positive, --block-m at least 16")
    return a


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def eager_us(fn, calls: int, dev: str) -> float:
    times = []
    for _ in range(calls):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def graph_us(fn, calls: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm (allocations) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from hybridmoe.moe.triton_moe_kernels import align_pairs

    rows = []
    print(f"{'T':>6} {'P':>7} {'method':>7} {'eager us':>9} {'graph us':>9}", flush=True)
    for t in a.tokens:
        ids = torch.randint(0, a.experts, (t, a.top_k), device=a.device)
        ref = align_pairs(ids, a.experts, a.block_m, "torch")
        for m in a.methods:
            got = align_pairs(ids, a.experts, a.block_m, m)  # compiles, then checked
            if not all(torch.equal(x, y) for x, y in zip(ref, got)):
                print(f"{m} differs from torch at T={t}", file=sys.stderr)
                return 1
            fn = lambda m=m, ids=ids: align_pairs(ids, a.experts, a.block_m, m)  # noqa: E731
            row = dict(tokens=t, pairs=ids.numel(), method=m, eager_us=eager_us(fn, a.calls, a.device))
            row["graph_us"] = graph_us(fn, a.calls) if a.device == "cuda" else None
            rows.append(row)
            gtxt = f"{row['graph_us']:>9.1f}" if row["graph_us"] is not None else f"{'-':>9}"
            print(f"{t:>6} {ids.numel():>7} {m:>7} {row['eager_us']:>9.1f} {gtxt}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(args=vars(a), rows=rows), f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
