"""The native dense BF16 linears (hybridmoe.cpu.dense) against torch's F.linear on the CPU, at the
Qwen3-30B-A3B shapes (LM head, fused qkv, o_proj, router), for a few token counts, interleaved
rounds, medians, with the pool's stream-read bandwidth measured in the same rounds.

    python benchmarks/bench_cpu_dense.py                      # every shape, T = 1 2 4 8 16
    python benchmarks/bench_cpu_dense.py --tokens 1 --repeats 5 --isa avx512 avx2

Sets OMP_WAIT_POLICY=PASSIVE (unless set) and torch's threads to the pool's, as CPU-only mode does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {"lm_head": (151936, 2048), "qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048)}


def _time(fn, min_bytes: int, nbytes: int) -> float:
    """Seconds per call (after 2 untimed calls), over enough calls to read ~min_bytes."""
    fn()
    fn()
    reps = max(3, min_bytes // max(nbytes, 1))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _prefetch_list(text: str) -> list[int]:
    """--prefetch: comma-separated distances in [0, 1 MiB] (an argparse error otherwise)."""
    try:
        out = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(not 0 <= v <= 1 << 20 for v in out):
        raise argparse.ArgumentTypeError(f"each distance must be in [0, {1 << 20}], got {text!r}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--isa", nargs="+", default=["avx512", "avx2"])
    p.add_argument("--threads", type=int, default=None, help="pool and torch threads (default: physical cores)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefetch", default=None, type=_prefetch_list,
                   help="comma list of software prefetch distances (bytes; CPUEngineSettings.prefetch_bytes), one "
                        "pool each, interleaved in every round, for the native kernels (default: the pool's default)")
    p.add_argument("--no-torch", action="store_true", help="skip torch's F.linear")
    a = p.parse_args()
    from hybridmoe.cpu.dense import dense_linear
    from hybridmoe.cpu.engine import CPUThreadPool
    from hybridmoe.cpu.topology import physical_cores

    torch.set_grad_enabled(False)
    threads = a.threads or len(physical_cores())
    torch.set_num_threads(threads)
    from hybridmoe.cpu import hugepages
    from hybridmoe.cpu.settings import CPUEngineSettings

    pfs = a.prefetch or [None]
    pools = {pf: CPUThreadPool(threads, settings=None if pf is None else CPUEngineSettings(prefetch_bytes=pf))
             for pf in pfs}
    pool = pools[pfs[0]]
    g = torch.Generator().manual_seed(0)
    # on 2 MB pages, as the CPU-only path keeps them (hybridmoe/cpu/hugepages.py)
    ws = {s: hugepages.to_huge(torch.randn(*SHAPES[s], generator=g).bfloat16()) for s in a.shapes}
    # native implementations: "isa" or "isa@prefetch"
    natives = [i if pf is None else f"{i}@{pf}" for i in a.isa for pf in pfs]
    impls = ([] if a.no_torch else ["torch"]) + natives
    res: dict = {}
    bw = []
    for _ in range(a.repeats):
        bw.append(pool.stream_read_gbps(1 << 30, 3))
        for s in a.shapes:
            w = ws[s]
            for t in a.tokens:
                x = torch.randn(t, w.shape[1], generator=g).bfloat16()
                for impl in impls:
                    isa, _, pf = impl.partition("@")
                    pl = pools[int(pf) if pf else None]
                    fn = (lambda x=x, w=w: F.linear(x, w)) if impl == "torch" else \
                        (lambda x=x, w=w, isa=isa, pl=pl: dense_linear(x, w, pool=pl, isa=isa))
                    res.setdefault((s, t, impl), []).append(_time(fn, 1 << 30, w.nbytes))
    bw_m = statistics.median(bw)
    print(f"stream read {bw_m:.1f} GB/s (median of {[round(b, 1) for b in bw]}), {threads} threads")
    print(f"{'shape':8s} {'T':>3s} " + " ".join(f"{i + ' ms':>11s} {'GB/s':>6s}" for i in impls) + "  best/torch")
    for s in a.shapes:
        nb = ws[s].nbytes
        for t in a.tokens:
            ms = {i: statistics.median(res[(s, t, i)]) for i in impls}
            cols = " ".join(f"{ms[i] * 1e3:11.3f} {nb / ms[i] / 1e9:6.1f}" for i in impls)
            best = min(ms[i] for i in natives)
            vs = f"{ms['torch'] / best:5.2f}x  " if "torch" in ms else ""
            ratios = " ".join(f"{i} {nb / ms[i] / 1e9 / bw_m:.2f}" for i in natives)
            print(f"{s:8s} {t:3d} {cols}  {vs}(bound ratio {nb / best / 1e9 / bw_m:.2f}; {ratios})")
    for pl in pools.values():
        pl.close()


if __name__ == "__main__":
    main()
