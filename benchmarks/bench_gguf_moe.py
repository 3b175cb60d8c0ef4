"""CPU MoE layer on GGUF blocks (--kt-method LLAMAFILE), Qwen3-30B-A3B shape by default: decode T as a
ratio to the stream-read probe measured in the same run (interleaved), large T in TFLOP/s.

    python benchmarks/bench_gguf_moe.py --types Q4_K,Q8_0 --T 1,4,16,1024,4096 [--isa avx512] [--json out.json]

Each type is one layer set of `--layers` copies (so decode reads from DRAM, not cache), random valid
GGUF blocks (speed does not depend on the values). Bytes touched per task = the distinct experts
routed x their three matrices' GGUF bytes. Prints one line per (type, T) and the probe.
Timing: as benchmarks/bench_cpu_moe.py, tasks (fresh random routing each) are built before the clock
starts, as the engine's CUDA path does, and the time is submit -> done (the native library's own
latency); `--timing forward` times layer.forward instead (adds the Python argument checks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from hybridmoe.cpu import gguf_quant as gq
from hybridmoe.cpu import hugepages, native
from hybridmoe.cpu.engine import FUSE_MODES, CPUThreadPool
from hybridmoe.cpu.gguf_engine import GGUFExperts, GGUFMoELayer
from hybridmoe.cpu.settings import CPUEngineSettings


def make_layer(typ: str, e: int, h: int, i: int, seed: int) -> GGUFExperts:
    g = torch.Generator().manual_seed(seed)
    mats = [gq.random_blocks(typ, e * n, k, generator=g).view(e, n, -1) for n, k in ((i, h), (i, h), (h, i))]
    return GGUFExperts.of(*mats, (typ,) * 3)


def on_huge_pages(x: GGUFExperts) -> GGUFExperts:
    """A copy of x's matrices on 2 MB pages (hugepages.to_huge; the kernel may fall back to 4 KB ones)."""
    return dataclasses.replace(x, gate=hugepages.to_huge(x.gate), up=hugepages.to_huge(x.up),
                               down=hugepages.to_huge(x.down))


def routing(t: int, k: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(t, e).topk(k, dim=-1).indices.contiguous(), torch.rand(t, k)


def measure(layers, t, k, e, h, seconds, min_iters, max_iters, timing="task"):
    x = torch.randn(t, h, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    for j in range(min(2, len(layers))):  # warm-up (page faults, workspace growth)
        layers[j].forward(x, *routing(t, k, e), out=out)
    n_pre = min(max_iters, 64) if timing == "task" else 0  # reused round-robin
    pending = []  # prebuilt tasks: routing drawn and arguments checked before the clock starts
    for j in range(n_pre):
        ids, w = routing(t, k, e)
        task, keep = layers[j % len(layers)].make_task(x, ids, w, out)
        pending.append((task, keep, int(ids.unique().numel())))
    pool = layers[0].pool
    native.profile(reset=True)  # the phase profile covers the timed tasks only
    times, touched = [], []
    deadline = time.perf_counter() + seconds
    it = 0
    while it < min_iters or (time.perf_counter() < deadline and it < max_iters):
        if timing == "task":
            task, keep, n = pending[it % len(pending)]
            t0 = time.perf_counter()
            pool.sync(pool.submit(task, keep))
            times.append(time.perf_counter() - t0)
        else:
            ids, w = routing(t, k, e)
            n = int(ids.unique().numel())
            t0 = time.perf_counter()
            layers[it % len(layers)].forward(x, ids, w, out=out)
            times.append(time.perf_counter() - t0)
        touched.append(n)
        it += 1
    return statistics.median(times), statistics.median(touched)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q8_0")
    ap.add_argument("--E", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--I", type=int, default=768)
    ap.add_argument("--T", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 1024, 4096])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--isa", default=None)
    ap.add_argument("--layers", type=int, default=8, help="copies per type (decode must read DRAM)")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--min-iters", type=int, default=3)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--stream-bytes", type=int, default=1 << 30)
    ap.add_argument("--timing", choices=("task", "forward"), default="task",
                    help="task: submit -> done of prebuilt tasks (bench_cpu_moe.py's way); forward: layer.forward")
    ap.add_argument("--profile", action="store_true", help="print the native phase times (us per task)")
    ap.add_argument("--prefetch", default=None,
                    help="software prefetch distances (bytes) to compare, e.g. default,0,2048,4096: one pool, its "
                         "distance switched between runs, the distances interleaved in every round; `default` is "
                         "this host's CPUEngineSettings.prefetch_bytes (4096 on Intel with AVX-512, else 2048 or 0), "
                         "the distance the engine runs; list it first, the summary's `vs` ratios are to the first")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeats of the whole (distance x T x type) set, the distances' order rotated each round; "
                         "with several, the summary gives medians and each distance's per-round ratio to the first")
    ap.add_argument("--pages", default="4k", help="where the blocks live: 4k (plain memory, as a file's page-cache "
                    "mapping on 4 KB pages), 2m (2 MB transparent huge pages), or 4k,2m: both sets, interleaved "
                    "(rows of the 2m set are named TYPE@2m)")
    ap.add_argument("--fuse", default="on", help="CPUThreadPool.fuse_mode values, each in turn for every row "
                    "(e.g. on,nochain: the down items chained into the gate/up phase, or not)")
    ap.add_argument("--block-prefetch", default="1", help="CPUThreadPool.block_prefetch modes, each in turn for every "
                    "row (0 none, 1 the next block's rows towards L2: the default, 2 towards L1; e.g. 1,0)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    fuses = a.fuse.split(",")
    if not fuses or any(f not in FUSE_MODES for f in fuses):
        ap.error(f"--fuse {a.fuse}: a comma list of {', '.join(FUSE_MODES)}")
    try:
        bps = [int(v) for v in a.block_prefetch.split(",")]
    except ValueError:
        bps = []
    if not bps or any(v not in (0, 1, 2) for v in bps):
        ap.error(f"--block-prefetch {a.block_prefetch}: a comma list of 0, 1, 2")
    pages = a.pages.split(",")
    if not pages or any(p not in ("4k", "2m") for p in pages):
        ap.error(f"--pages takes 4k, 2m or 4k,2m, got {a.pages!r}")
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    base = CPUEngineSettings()
    try:
        prefetch = list(dict.fromkeys(base.prefetch_bytes if v.strip() == "default" else int(v)
                                      for v in (a.prefetch or "default").split(",")))
    except ValueError:
        ap.error(f"--prefetch {a.prefetch}: a comma list of byte counts or `default`")
    for pf in prefetch:
        dataclasses.replace(base, prefetch_bytes=pf)  # validated here (a bad distance: its own error)
    packs = {}
    for typ in a.types.split(","):
        plain = [make_layer(typ, a.E, a.H, a.I, s) for s in range(a.layers)]
        for pg in pages:
            packs[typ if pg == "4k" else f"{typ}@2m"] = plain if pg == "4k" else [on_huge_pages(x) for x in plain]
        if "4k" not in pages:
            del plain
    pool = CPUThreadPool(threads=a.threads, settings=dataclasses.replace(base, prefetch_bytes=prefetch[0]))
    sets = {typ: [GGUFMoELayer(p, isa=a.isa, pool=pool) for p in ps] for typ, ps in packs.items()}
    kernel, threads = next(iter(sets.values()))[0].kernel_name, pool.threads
    rows, probes = [], [pool.stream_read_gbps(a.stream_bytes, 5)]
    for rnd in range(a.rounds):
        k0 = rnd % len(prefetch)
        for pf in prefetch[k0:] + prefetch[:k0]:
            pool.prefetch_bytes = pf
            for t in a.T:
                for typ, layers, fuse, bp in [(ty, ls, f, b) for ty, ls in sets.items() for f in fuses for b in bps]:
                    pool.fuse_mode = fuse  # a probe per T
                    pool.block_prefetch = bp
                    sec, touched = measure(layers, t, a.k, a.E, a.H, a.seconds, a.min_iters, a.max_iters, a.timing)
                    prof = native.profile(reset=True)
                    per_expert = sum(m.numel() for m in layers[0].packed.tensors().values()) / a.E
                    gbs = touched * per_expert / sec / 1e9
                    tflops = 2 * 3 * a.H * a.I * t * a.k / sec / 1e12
                    phases = {p: v / max(1.0, prof["tasks"]) * 1e6 for p, v in prof.items() if p != "tasks"}
                    rows.append({"type": typ, "T": t, "prefetch": pf, "fuse": fuse, "bp": bp, "round": rnd, "ms": sec * 1e3, "GB/s": gbs,
                                 "TFLOP/s": tflops, "phases_us": phases, "probe_before": probes[-1]})
                probes.append(pool.stream_read_gbps(a.stream_bytes, 5))
                for r in rows:
                    r.setdefault("probe_after", probes[-1])
    del sets
    pool.close()
    best = max(probes)
    print(f"kernel {kernel}, threads {threads}, stream-read probe best {best:.1f} GB/s (all {probes})")
    for r in rows:
        r["ratio_to_stream"] = r["GB/s"] / best
        r["ratio_to_adjacent"] = r["GB/s"] / max(r["probe_before"], r["probe_after"])
        print(f"{r['type']:7s} T={r['T']:5d} pf={r['prefetch']:5d} fuse {r['fuse']:7s} bp {r['bp']} round {r['round']}  "
              f"{r['ms']:9.3f} ms  "
              f"{r['GB/s']:7.1f} GB/s  ratio {r['ratio_to_stream']:.2f} (adjacent {r['ratio_to_adjacent']:.2f})  "
              f"{r['TFLOP/s']:.3f} TFLOP/s")
        if a.profile:
            print("         phases (us/task): " + ", ".join(f"{p} {v:.1f}" for p, v in r["phases_us"].items()))
    summary = summarize(rows, prefetch, best)
    if a.rounds > 1 or len(prefetch) > 1 or len(fuses) > 1 or len(bps) > 1:
        for s in summary:
            print(f"median {s['type']:7s} T={s['T']:5d} pf={s['prefetch']:5d} fuse {s['fuse']:7s} bp {s['bp']} {s['GB/s']:7.1f} GB/s  ratio "
                  f"{s['ratio_to_stream']:.2f} (adjacent {s['ratio_to_adjacent']:.2f})  vs pf={prefetch[0]}: "
                  f"{s['vs_first']:.3f}" + (f", vs bp 0: {s['vs_bp0']:.3f}" if s["vs_bp0"] is not None else "")
                  + f" (rounds {s['rounds']})")
    res = {"kernel": kernel, "threads": threads, "timing": a.timing, "prefetch_bytes_default": base.prefetch_bytes,
           "stream_read_gbps": best, "probes": probes, "rows": rows,
           "summary": summary, "shape": {"E": a.E, "k": a.k, "H": a.H, "I": a.I}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


def summarize(rows: list[dict], prefetch: list[int], best: float) -> list[dict]:
    """Per (type, T, distance, fuse mode, block prefetch): the medians over rounds of GB/s and of the ratio to the
    adjacent probes, and the median over rounds of GB/s / the first distance's GB/s (same fuse mode and block
    prefetch) in the same round (the bandwidth drifts between rounds, less within one)."""
    by = {(r["type"], r["T"], r["prefetch"], r["fuse"], r.get("bp", 0), r["round"]): r for r in rows}
    out = []
    for typ, t, pf, fu, bp in dict.fromkeys((r["type"], r["T"], r["prefetch"], r["fuse"], r.get("bp", 0)) for r in rows):
        mine = [r for r in rows if (r["type"], r["T"], r["prefetch"], r["fuse"], r.get("bp", 0)) == (typ, t, pf, fu, bp)]
        vs = [r["GB/s"] / by[(typ, t, prefetch[0], fu, bp, r["round"])]["GB/s"] for r in mine]
        bp0 = [r["GB/s"] / by[(typ, t, pf, fu, 0, r["round"])]["GB/s"] for r in mine
               if (typ, t, pf, fu, 0, r["round"]) in by]
        gbs = statistics.median(r["GB/s"] for r in mine)
        out.append({"type": typ, "T": t, "prefetch": pf, "fuse": fu, "bp": bp, "rounds": len(mine), "GB/s": gbs,
                    "ratio_to_stream": gbs / best,
                    "ratio_to_adjacent": statistics.median(r["ratio_to_adjacent"] for r in mine),
                    "vs_first": statistics.median(vs), "vs_bp0": statistics.median(bp0) if bp0 else None})
    return out


if __name__ == "__main__":
    main()
