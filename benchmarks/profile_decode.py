"""Where one decode step's time goes on the GPU: a torch.profiler (CUPTI) trace of a few decode
steps of a full-size model with random weights, summarised as GPU kernels and copies per step
(count, total and mean microseconds, by name), GPU busy time per step and the idle gaps between
GPU operations (launch latency, host functions, waits on the CPU experts).

    python benchmarks/profile_decode.py                       # all experts on the GPU
    python benchmarks/profile_decode.py --gpu-experts 32      # hybrid: the rest on the CPU (AMXINT8)
    python benchmarks/profile_decode.py --trace trace.json    # also a Chrome trace

Default shape: Qwen3-30B-A3B (bench_decode.add_shape_args). CUDA graphs on unless --no-graphs.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import add_shape_args, parse_shape_args, write_config  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--gpu-experts", type=int, default=None, help="--kt-num-gpu-experts (default: all on the GPU)")
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--deferred", type=int, default=0)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", default=None, help="write a Chrome trace here")
    p.add_argument("--segment-gap-us", type=float, default=50.0,
                   help="GPU idle gaps longer than this split the timeline into segments (hybrid: the waits for the "
                        "CPU experts); the last --segments segments are printed with their GPU busy time")
    p.add_argument("--segments", type=int, default=24)
    p.add_argument("--prefill", type=int, default=0,
                   help="profile the prefill of one prompt of this many tokens instead (after one untimed prompt of "
                        "the same length: Triton compiles excluded), to its first token")
    p.add_argument("--align-ab", action="store_true",
                   help="with --prefill: time the eager prefill (wall, 3 interleaved rounds) with the fused MoE's "
                        "large expert grouping on the torch and the grid path (HYBRIDMOE_ALIGN_LARGE), check all "
                        "variants give the same first token, then profile the default")
    p.add_argument("--out", default=None, help="with --align-ab / --prefill-graph-ab: write the walls as JSON here")
    p.add_argument("--routing", default="model", choices=["model", "spread"],
                   help="spread: tokens reach experts nearly uniformly (benchmarks/spread_routing.py)")
    p.add_argument("--prefill-graph-ab", action="store_true",
                   help="with --prefill: the same with the prefill CUDA graphs off and on")
    a = parse_shape_args(p)

    from torch.profiler import ProfilerActivity, profile

    from hybridmoe import LLM

    with tempfile.TemporaryDirectory() as d:
        write_config(Path(d), a)
        opts = {}
        if a.gpu_experts is not None:
            opts = dict(kt_method=a.method, kt_num_gpu_experts=a.gpu_experts,
                        kt_max_deferred_experts_per_token=a.deferred)
        llm = LLM(d, device="cuda", dtype="bfloat16", load_format="dummy", progress=False, skip_tokenizer_init=True,
                  disable_cuda_graph=a.no_graphs, cuda_graph_max_bs=max(a.batch, 1), max_running_requests=a.batch,
                  max_total_tokens=a.batch * 512, context_length=4096, **opts)
        if a.routing == "spread":
            import spread_routing

            spread_routing.install(llm)
        eng = llm.engine
        g = torch.Generator().manual_seed(0)
        if a.prefill:
            profile_prefill(eng, a, g, profile, ProfilerActivity)
            llm.shutdown()
            return
        reqs = [eng.make_request(input_ids=torch.randint(0, a.vocab, (32,), generator=g).tolist(),
                                 sampling_params={"max_new_tokens": a.steps + 8, "temperature": 0, "ignore_eos": True})
                for _ in range(a.batch)]
        for r in reqs:
            eng.submit(r)
        while any(len(r.output_ids) < 4 for r in reqs):  # prefill and warm-up decode steps
            eng.step()
        torch.cuda.synchronize()
        pool, cpu_events = None, None
        if a.gpu_experts is not None:
            from hybridmoe.cpu.engine import default_pool

            pool = default_pool()
            pool.sync()
            pool.trace_start(1 << 18)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(a.steps):
                eng.step()
            torch.cuda.synchronize()
        if pool is not None:
            from hybridmoe.cpu.trace import format_summary
            from hybridmoe.cpu.trace import summarize as cpu_summary

            pool.sync()
            cpu_events = pool.trace_stop()
            print(f"CPU trace: {format_summary(cpu_summary(cpu_events))}")
        llm.shutdown()

    summarize(prof, a, a.steps, "decode steps", cpu_events)


def profile_prefill(eng, a, g, profile, activity) -> None:
    import time

    def one() -> int:
        r = eng.make_request(input_ids=torch.randint(0, a.vocab, (a.prefill,), generator=g).tolist(),
                             sampling_params={"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})
        eng.submit(r)
        while not r.finished:
            eng.step()
        torch.cuda.synchronize()
        return r.output_ids[0]

    import os

    from hybridmoe import envs

    runner = eng.runner
    captured = runner.prefill_graphs
    if a.prefill_graph_ab and captured is None:
        print(f"prefill graphs: none here ({runner.prefill_graphs_blocker()})")

    def state(align: str | None, graphs: bool):  # each variant sets everything it depends on
        def setup() -> None:
            if align is None:
                os.environ.pop(envs.ALIGN_LARGE, None)
            else:
                os.environ[envs.ALIGN_LARGE] = align
            runner.prefill_graphs = captured if graphs else None
        return setup

    variants = {}
    if a.align_ab:  # eager prefills (the align's eager cost is what differs)
        variants.update({"eager, align torch": state("torch", False), "eager, align grid": state("grid", False)})
    if a.prefill_graph_ab and captured is not None:
        variants.update({"prefill graphs off": state(None, False), "prefill graphs on": state(None, True)})
    if variants:
        walls_by: dict[str, list[float]] = {k: [] for k in variants}
        firsts: dict[str, list[int]] = {k: [] for k in variants}
        for rnd in range(4):  # round 0 compiles; rounds 1-3 are timed
            for k, setup in variants.items():
                setup()
                g.manual_seed(1234 + rnd)  # the same prompt for every variant, not served from the prefix cache
                eng.flush_cache()
                t = time.perf_counter()
                firsts[k].append(one())
                if rnd:
                    walls_by[k].append(time.perf_counter() - t)
        state(None, True)()
        for k, ws in walls_by.items():
            print(f"{k}: prefill of {a.prefill} tokens to the first token: "
                  f"{', '.join(f'{1e3 * w:.1f}' for w in ws)} ms (wall), median {1e3 * sorted(ws)[1]:.1f}")
        same = all(f == next(iter(firsts.values())) for f in firsts.values())
        print(f"first tokens {'equal' if same else 'DIFFER'} across {', '.join(variants)}: "
              + " / ".join(str(f) for f in firsts.values()))
        if a.out:
            rows = {k: {"walls_ms": [1e3 * w for w in ws], "median_ms": 1e3 * sorted(ws)[1], "first_tokens": firsts[k]}
                    for k, ws in walls_by.items()}
            Path(a.out).write_text(json.dumps({"benchmark": "prefill_ttft", "prompt_tokens": a.prefill,
                                               "device": torch.cuda.get_device_name(), "variants": rows,
                                               "first_tokens_equal": same}, indent=1))
            print(f"wrote {a.out}")
    one()  # compiles and first-touch allocations
    walls = []
    for _ in range(3):
        t = time.perf_counter()
        one()
        walls.append(time.perf_counter() - t)
    print(f"prefill of {a.prefill} tokens to the first token: {', '.join(f'{1e3 * w:.1f}' for w in walls)} ms (wall)")
    with profile(activities=[activity.CUDA, activity.CPU]) as prof:
        one()
    summarize(prof, a, 1, f"prefill of {a.prefill} tokens")


def summarize(prof, a, n: int, what: str, cpu_events: torch.Tensor | None = None) -> None:
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]  # kernels, memcpys, memsets
    if not events:
        print("no GPU events recorded (CUPTI unavailable?)")
        return
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    spans = []
    for e in events:
        dur = e.time_range.end - e.time_range.start  # us
        by_name[e.name].append(dur)
        spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, gaps, cur_s, cur_e = 0.0, [], spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = spans[-1][1] - spans[0][0]
    print(f"{n} {what}, batch {a.batch}, graphs {'off' if a.no_graphs else 'on'}, "
          f"{'all experts on the GPU' if a.gpu_experts is None else f'{a.gpu_experts} GPU experts ({a.method})'}")
    print(f"per step: window {window / n / 1e3:.2f} ms, GPU busy {busy / n / 1e3:.2f} ms, idle {(window - busy) / n / 1e3:.2f} "
          f"ms in {len(gaps) / n:.0f} gaps (median gap {sorted(gaps)[len(gaps) // 2] if gaps else 0:.1f} us, "
          f"gaps > 20 us: {sum(gp for gp in gaps if gp > 20) / n / 1e3:.2f} ms)")
    print(f"GPU operations per step: {len(events) / n:.0f}")
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[: a.top]
    print(f"{'per step: count':>16} {'total us':>9} {'mean us':>8}  name")
    for name, durs in rows:
        print(f"{len(durs) / n:>16.1f} {sum(durs) / n:>9.1f} {sum(durs) / len(durs):>8.2f}  {name[:110]}")
    trace = a.trace or str(Path(tempfile.mkdtemp()) / "trace.json")
    prof.export_chrome_trace(trace)
    print_segments(json.loads(Path(trace).read_text()), a.segment_gap_us, a.segments, cpu_events)


# The pool's trace is on the steady clock (CLOCK_MONOTONIC); the profiler's trace is on the system clock less its
# baseTimeNanoseconds. Measured once at import: the two clocks do not drift apart over a profile.
_MONO_TO_UNIX_NS = time.time_ns() - time.monotonic_ns()
_CPU_KINDS = {0: "submit", 1: "start", 2: "end", 3: "wait", 4: "release"}


def print_segments(trace: dict, gap_us: float, last: int, cpu_events: torch.Tensor | None) -> None:
    """The GPU timeline cut at idle gaps > gap_us: per segment its length, GPU busy time, operation count and
    longest operations, then the gap after it. In a hybrid step the gaps are the waits for the CPU experts and a
    segment is the GPU path from one layer's CPU result to the next layer's CPU task (plus the GPU experts). With
    the CPU pool's trace, each segment also lists the pool's events from the gap before it to its end, in us from
    the segment's start (the same clock): when the stream was released, when the next task was submitted, etc."""
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    evs = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_CATS),
                 key=lambda e: e["ts"])
    segs: list[list] = []
    for e in evs:
        s, t = e["ts"], e["ts"] + e["dur"]
        if not segs or s - segs[-1][1] > gap_us:
            segs.append([s, t, []])
        else:
            segs[-1][1] = max(segs[-1][1], t)
        segs[-1][2].append(e)
    cpu = []
    if cpu_events is not None:
        for t_ns, tid, kind in cpu_events.tolist():
            if kind in _CPU_KINDS:
                cpu.append(((t_ns + _MONO_TO_UNIX_NS) / 1e3 - base_us, tid, _CPU_KINDS[kind]))
        cpu.sort()
    print(f"timeline segments (cut at gaps > {gap_us:.0f} us), the last {min(last, len(segs))} of {len(segs)}:")
    for i in range(max(0, len(segs) - last), len(segs)):
        s, t, es = segs[i]
        busy = sum(e["dur"] for e in es)  # overlapping ops counted twice (rare)
        gap = segs[i + 1][0] - t if i + 1 < len(segs) else 0.0
        top = sorted(es, key=lambda e: -e["dur"])[:3]
        names = ", ".join(f"{e['name'][:28]} {e['dur']:.0f}" for e in top)
        print(f"  seg {i}: {t - s:7.1f} us, busy {busy:7.1f} us, {len(es):3d} ops [{names}]; gap after {gap:7.1f} us")
        if cpu:
            lo = segs[i - 1][1] if i > 0 else s - gap_us
            near = [f"{k} #{tid} {ts - s:+.1f}" for ts, tid, k in cpu if lo <= ts <= t]
            if near:
                print(f"      CPU pool (us from the segment start): {', '.join(near)}")


if __name__ == "__main__":
    main()
