"""CPU expert engine benchmark: one MoE layer per call, rotating over several layers with fresh random
routing so the weights are not cache-resident.

For each T prints us/layer, effective weight bandwidth (bytes of the distinct experts touched / time),
TFLOP/s (2 * T * k * 3 * H * I / time), and the ratio to the stream-read bandwidth measured in the
same process with the library's own thread pool. Writes JSON with --out.

  python benchmarks/bench_cpu_moe.py --method AMXINT8 --out results.json
  (default layer: Qwen3-30B-A3B, E=128 k=8 H=2048 I=768; --dummy-deepseek-v3: E=256 k=8 H=7168 I=2048,
  --dummy-kimi-k2: E=384)

--method FP8 runs the FP8 method (random weights block-quantized to e4m3 in --group-size square
blocks, DeepSeek-V3's 128 x 128 by default). A comma list (--method FP8,BF16,AMXINT8) measures the
methods interleaved: for each T every method in turn, against the same stream probe.

--dynamic on,off measures every row with the pool's dynamic phases on and off in turn (the same
pool; off: every phase waits for every thread, as the light phases always did before session 23).

--reduce-inline 16,0 likewise for CPUThreadPool.reduce_inline_rows (the task's weighted sum on the
leader alone up to that many rows T * K, on all threads above; column `ri`).

--prefetch 0,512,2048 compares software prefetch distances (CPUEngineSettings.prefetch_bytes): a
pool is created for each (the setting is fixed for a pool's life).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridmoe.cpu import native  # noqa: E402
from hybridmoe.cpu.engine import FUSE_MODES, CPUMoELayer, CPUThreadPool  # noqa: E402
from hybridmoe.cpu.quant import PackedLayer, PackedMatrix, pack_layer  # noqa: E402
from hybridmoe.cpu.settings import CPUEngineSettings  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import add_dummy_flags, dummy_config, shape_flags  # noqa: E402

DEFAULT_T = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
METHODS = ("AMXINT8", "AMXINT4", "BF16", "FP8")


def clone_layer(p: PackedLayer) -> PackedLayer:
    """Same values in fresh memory (a distinct layer for the caches)."""

    def cm(m: PackedMatrix) -> PackedMatrix:
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        return PackedMatrix(c(m.data), m.n, m.k, c(m.scale), c(m.zero), c(m.wsum))

    return PackedLayer(
        p.method,
        p.num_experts,
        p.hidden,
        p.inter,
        p.hidden_pad,
        p.inter_pad,
        p.group_size,
        p.symmetric,
        p.activation,
        cm(p.w13),
        cm(p.w2),
    )


def expert_bytes(p: PackedLayer) -> float:
    return sum(t.numel() * t.element_size() for t in p.tensors().values()) / p.num_experts


def run_pool(args, pool: CPUThreadPool, sets: list[tuple[str, list[CPUMoELayer], float]], stream: float,
             probes: list[float]) -> list[dict]:
    """The rows of every T and method (sets: (method, layers, bytes per expert)) on one pool (its
    settings fixed); appends its stream probes to `probes`."""
    h = args.H
    pf = pool.settings.prefetch_bytes
    rows = []
    dyn0, ri0, fr0 = pool.dynamic_phases, pool.reduce_inline_rows, pool.fuse_mode  # restored after the rows
    ipt0 = pool.items_per_thread
    for t in args.T:
        # the probe read 94-147 GB/s minutes apart on one machine: each row gets its own, taken
        # right before it, and the ratio is to the median of the first and that one
        probe = pool.stream_read_gbps(args.stream_bytes, 5)
        probes.append(probe)
        ref_bw = statistics.median([stream, probe])
        x = torch.randn(t, h).to(torch.bfloat16)
        out = torch.empty(t, h, dtype=torch.bfloat16)
        for method, layers, ebytes in sets:
            for dyn in args.dynamic or [dyn0]:  # interleaved with the methods, against the same probe
                for ri in args.reduce_inline or [ri0]:
                    for fr, gap, ipt in [(f, g, n) for f in args.fuse or [fr0] for g in args.gap_us or [0]
                                         for n in args.items_per_thread or [ipt0]]:
                        pool.dynamic_phases, pool.reduce_inline_rows, pool.fuse_mode = dyn, ri, fr
                        pool.items_per_thread = ipt
                        rows.append(_measure(args, pool, layers, ebytes, method, t, x, out, ref_bw, pf, dyn, ri,
                                             fr, gap, ipt))
    pool.dynamic_phases, pool.reduce_inline_rows, pool.fuse_mode = dyn0, ri0, fr0
    pool.items_per_thread = ipt0
    return rows


def _measure(args, pool, layers, ebytes, method, t, x, out, ref_bw, pf, dyn, ri, fr, gap_us=0, ipt=8) -> dict:
    """One method at one T: the median time of tasks with fresh random routing; gap_us: the caller spins this long
    after each task before it submits the next (the pool idles, as it does between a hybrid decode's layers)."""
    e, k, h, i = args.E, args.k, args.H, args.I

    def route(t=t, k=k):  # fresh random routing for every call
        ids = torch.rand(t, e).topk(k, dim=-1).indices.to(torch.int32).contiguous()
        return ids, torch.rand(t, k).contiguous()

    for j in range(min(2, len(layers))):  # warm-up (page faults, workspace growth)
        layers[j].forward(x, *route(), out=out)
    # Tasks are built (and their routing drawn) before the clock starts, as the engine's CUDA
    # path does (one HostCall per layer and size): the time is submit -> done, the native
    # library's own latency, without Python argument checks or torch ops in between.
    pending = []
    for j in range(args.max_iters):
        ids, w = route()
        task, keep = layers[j % len(layers)].make_task(x, ids, w, out)
        pending.append((task, keep, torch.unique(ids).numel() * ebytes))
    native.profile(reset=True)
    times, byts = [], []
    deadline = time.time() + args.seconds
    n = 0
    while n < args.min_iters or (time.time() < deadline and n < args.max_iters):
        task, keep, nbytes = pending[n % len(pending)]
        s = time.perf_counter()
        pool.sync(pool.submit(task, keep))
        times.append(time.perf_counter() - s)
        byts.append(nbytes)
        n += 1
        if gap_us:
            until = time.perf_counter() + gap_us * 1e-6
            while time.perf_counter() < until:
                pass
    med = statistics.median(times)
    bw = statistics.median(b / s for b, s in zip(byts, times)) / 1e9
    tflops = 2.0 * t * k * 3 * h * i / med / 1e12
    experts = statistics.mean(b / ebytes for b in byts)
    prof = native.profile(reset=True)
    phases = {k: v / max(1.0, prof["tasks"]) * 1e6 for k, v in prof.items() if k != "tasks"}
    row = {
        "method": method,
        "T": t,
        "prefetch": pf,
        "dynamic_phases": dyn,
        "reduce_inline_rows": ri,
        "fuse": fr,
        "gap_us": gap_us,
        "items_per_thread": ipt,
        "phase_us": phases,
        "us_per_layer": med * 1e6,
        "eff_bw_gbps": bw,
        "ratio_to_stream": bw / ref_bw,
        "stream_read_gbps": ref_bw,
        "tflops": tflops,
        "distinct_experts": experts,
        "iters": n,
    }
    ph = " ".join(f"{k}={v:.0f}" for k, v in phases.items()) if args.profile else ""
    print(
        f"{method:>8} {t:>6} {med * 1e6:>10.1f} {bw:>8.1f} {bw / ref_bw:>6.2f} {tflops:>8.2f} {experts:>8.1f} "
        f"{ref_bw:>7.1f} {pf:>6} {'on' if dyn else 'off':>4} {ri:>4} {fr:>6}{f'  gap {gap_us} us' if gap_us else ''}"
        f"{f'  ipt {ipt}' if args.items_per_thread else ''}  {ph}",
        flush=True
    )
    return row


def run(args) -> dict:
    torch.manual_seed(0)
    e, k, h, i = args.E, args.k, args.H, args.I
    prefetch = args.prefetch if args.prefetch is not None else [CPUEngineSettings().prefetch_bytes]
    settings = [dataclasses.replace(CPUEngineSettings(), prefetch_bytes=pf) for pf in prefetch]  # validated here
    pool = CPUThreadPool(args.threads, args.threadpool_count, settings=settings[0])
    t0 = time.time()
    gu = torch.randn(e, 2 * i, h) / h**0.5
    dn = torch.randn(e, h, i) / i**0.5
    methods = args.method.upper().split(",")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"--method: unknown {bad}; choose from {METHODS}")
    packs = {}
    for m in methods:
        base = pack_layer(gu, dn, m, group_size=args.group_size, symmetric=not args.asym)
        packs[m] = [base] + [clone_layer(base) for _ in range(args.layers - 1)]
    del gu, dn

    def layer_sets():
        return [(m, [CPUMoELayer(p, isa=args.isa, pool=pool) for p in ps], expert_bytes(ps[0]))
                for m, ps in packs.items()]

    sets = layer_sets()
    layers = sets[0][1]
    prep_s = time.time() - t0
    torch.set_num_threads(1)  # torch's idle OpenMP workers must not spin on the pool's cores
    ebytes = sets[0][2]
    stream = pool.stream_read_gbps(args.stream_bytes, 10)
    for m, ls, eb in sets:
        print(f"# method={m} isa={ls[0].isa} kernel={ls[0].kernel_name} threads={pool.threads} "
              f"subpools={pool.subpools} E={e} k={k} H={h} I={i} layers={args.layers} expert={eb / 1e6:.2f} MB")
    print(f"# prep={prep_s:.1f}s; stream-read bandwidth (library pool, {args.stream_bytes >> 20} MiB): {stream:.1f} GB/s")
    print(f"{'method':>8} {'T':>6} {'us/layer':>10} {'GB/s':>8} {'ratio':>6} {'TFLOP/s':>8} {'experts':>8} "
          f"{'stream':>7} {'pf':>6} {'dyn':>4} {'ri':>4} {'fuse':>6}")
    rows = []
    probes = [stream]
    for st in settings:
        if st is not settings[0]:  # another prefetch distance: a pool (and layers on it) of its own
            del sets, layers
            pool.close()
            pool = CPUThreadPool(args.threads, args.threadpool_count, settings=st)
            sets = layer_sets()
            layers = sets[0][1]
        rows += run_pool(args, pool, sets, stream, probes)
    # The machine's read bandwidth moved between probes of one run (82-150 GB/s seen on the H200
    # host): the conservative ceiling is the best any probe of the run saw.
    best = max(probes)
    for r in rows:
        r["ratio_to_best_probe"] = r["eff_bw_gbps"] / best
    print(f"# best stream probe of the run {best:.1f} GB/s (median {statistics.median(probes):.1f}); "
          "effective bandwidth over it: " + ", ".join(f"{r['method']} T={r['T']}: {r['ratio_to_best_probe']:.2f}"
                                                     for r in rows if r["T"] <= 64))
    return {
        "config": {
        "method": args.method,
            "methods": methods,
            "isa": layers[0].isa,
            "kernel": layers[0].kernel_name,
            "threads": pool.threads,
            "threadpool_count": pool.subpools,
            "cpus": pool.cpus,
            "E": e,
            "k": k,
            "H": h,
            "I": i,
            "group_size": args.group_size,
            "asym": args.asym,
            "layers": args.layers,
            "settings": [dataclasses.asdict(st) for st in settings],  # one pool each
            "expert_bytes": ebytes,
            "expert_bytes_by_method": {m: eb for m, _, eb in sets},
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
        },
        "stream_read_gbps": stream,
        "stream_probes_gbps": probes,
        "results": rows,
    }


def _fuse_list(s: str) -> list[str]:
    vals = s.split(",")
    for v in vals:
        if v not in FUSE_MODES:
            raise argparse.ArgumentTypeError(f"{v!r}: one of {', '.join(FUSE_MODES)}")
    return vals


def _on_off_list(s: str) -> list[bool]:
    vals = {"on": True, "off": False}
    try:
        return [vals[v.strip()] for v in s.split(",")]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected a comma list of on/off, got {s!r}") from None


def _int_list(what: str, lo: int, hi: int):
    """An argparse type: a comma list of ints in [lo, hi] (`what` names them in the error)."""

    def parse(s: str) -> list[int]:
        try:
            vals = [int(v) for v in s.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {what}, got {s!r}") from None
        if any(not lo <= v <= hi for v in vals):
            raise argparse.ArgumentTypeError(f"{what} must be in [{lo}, {hi}], got {s!r}")
        return vals

    return parse


_rows_list = _int_list("row counts", 0, 1 << 30)
_us_list = _int_list("gaps in microseconds", 0, 1_000_000)
_ipt_list = _int_list("items per thread", 1, 64)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--E", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--I", type=int, default=768)
    ap.add_argument("--method", default="AMXINT8", help=f"one of {METHODS}, or a comma list to interleave")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--asym", action="store_true", help="asymmetric int4")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores - 1")
    ap.add_argument("--threadpool-count", type=int, default=1)
    ap.add_argument("--isa", default=None, choices=[None, *native.ISAS])
    ap.add_argument("--layers", type=int, default=None,
                    help="distinct layer copies rotated over (default 8; 2 with --dummy-*: one is 11-17 GB at INT8)")
    add_dummy_flags(ap)  # --dummy-deepseek-v3 / --dummy-kimi-k2: E, k, H, I of that model (shapes.py)
    ap.add_argument("--T", type=lambda s: [int(v) for v in s.split(",")], default=DEFAULT_T)
    ap.add_argument("--seconds", type=float, default=1.0, help="time budget per T")
    ap.add_argument("--min-iters", type=int, default=3)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--stream-bytes", type=int, default=1 << 30)
    ap.add_argument("--profile", action="store_true", help="print mean us per phase")
    ap.add_argument("--prefetch", type=lambda s: [int(v) for v in s.split(",")], default=None,
                    help="software prefetch distances (bytes) to compare, e.g. 0,512,2048 (default: CPUEngineSettings')")
    ap.add_argument("--dynamic", type=_on_off_list, default=None,
                    help="on,off: every row with the pool's dynamic phases on and off in turn "
                         "(CPUThreadPool.dynamic_phases; off: each phase waits for every thread)")
    ap.add_argument("--reduce-inline", type=_rows_list, default=None,
                    help="e.g. 16,0: every row with the pool's reduce_inline_rows at each value in turn (the "
                         "weighted sum of T * K rows on the leader alone up to that many; 0: always on all "
                         "threads)")
    ap.add_argument("--fuse", type=_fuse_list, default=None,
                    help="e.g. on,off or on,reduce,quant,off: every row with the pool's fuse_mode at each value in "
                         "turn (CPUThreadPool.fuse_mode: a one-token task's weighted sum inside its down phase "
                         "(reduce), a decode task's activation conversion inside its gate/up phase (quant), both "
                         "(on, the default) or neither (off))")
    ap.add_argument("--gap-us", type=_us_list, default=None,
                    help="e.g. 0,100: every row at each value in turn, the tasks spaced by that many microseconds "
                         "(the pool idle between tasks, as between a hybrid decode's layers at deferral 0; 0: back "
                         "to back)")
    ap.add_argument("--items-per-thread", type=_ipt_list, default=None,
                    help="e.g. 8,4,2: every row with the pool's items_per_thread at each value in turn (a decode "
                         "task's items sized for about that many a thread: fewer, longer weight streams)")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    if args.dummy_model is not None:
        shape = shape_flags(dummy_config(args.dummy_model))
        args.E, args.k, args.H, args.I = shape["E"], shape["k"], shape["H"], shape["I"]
    if args.layers is None:
        args.layers = 2 if args.dummy_model is not None else 8
    res = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
