"""Hybrid prefill of a long prompt, with and without layerwise GPU prefill, and the memory checks.

A full-size MoE model with random weights (default: Qwen3-30B-A3B shape; --dummy-deepseek-v3 /
--dummy-kimi-k2 with --layers N: shapes.py), N experts per layer on
the GPU and the rest on the CPU engine (AMXINT8). One prompt of --prompt-len tokens (one chunk):
  - threshold on (--threshold, default 1024): every layer's CPU-resident experts are streamed to
    the GPU through pinned buffers; bound = CPU-resident expert bytes of all layers / pinned
    host-to-device bandwidth measured in the same run; prints the ratio bound / time.
  - threshold off: the CPU engine computes its experts; prints the speed-up of the layerwise path.
Memory: peak host RSS against 1.1 x CPU expert bytes + 4 GB, and peak GPU memory (allocator
reserved) against the startup plan's total.

    python benchmarks/bench_hybrid_prefill.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import add_shape_args, parse_shape_args, write_config  # noqa: E402

GB = 1e9


def pinned_h2d_bandwidth(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return nbytes / sorted(times[1:])[len(times[1:]) // 2]


def cpu_expert_bytes(model) -> int:
    total = 0
    for block in model.moe_blocks():
        cpu = getattr(block.experts, "cpu", None)
        if cpu is not None:
            total += sum(t.numel() * t.element_size() for t in cpu.layer.packed.tensors().values())
    return total


def prefill_seconds(llm, prompt_len: int, vocab: int, seed: int) -> float:
    eng = llm.engine
    ids = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    req = eng.make_request(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0, "ignore_eos": True})
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.submit(req)
    while not req.finished:
        eng.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--gpu-experts", type=int, default=32)
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--threshold", type=int, default=1024)
    p.add_argument("--skip-off", action="store_true", help="do not time the CPU path (threshold off)")
    p.add_argument("--profile", action="store_true", help="print the GPU kernels of one layerwise prefill by time")
    p.add_argument("--out", default=None)
    a = parse_shape_args(p)

    from hybridmoe import LLM

    res: dict = {"shape": vars(a)}
    h2d = pinned_h2d_bandwidth()
    print(f"pinned host-to-device copy: {h2d / GB:.1f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as d:
        write_config(Path(d), a)
        t = time.perf_counter()
        llm = LLM(d, device="cuda", dtype="bfloat16", load_format="dummy", progress=False, skip_tokenizer_init=True,
                  kt_method=a.method, kt_num_gpu_experts=a.gpu_experts, kt_gpu_prefill_token_threshold=a.threshold,
                  chunked_prefill_size=a.prompt_len, max_total_tokens=a.prompt_len + 256, max_running_requests=4,
                  cuda_graph_max_bs=4, context_length=a.prompt_len + 256)
        print(f"model ready in {time.perf_counter() - t:.1f} s", flush=True)
        runner = llm.engine.runner
        ready_alloc = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        plan = runner.hybrid
        cpu_bytes = cpu_expert_bytes(runner.model)
        bound_s = cpu_bytes / h2d
        prefill_seconds(llm, a.prompt_len, a.vocab, seed=1)  # warm-up: kernels compiled at this size
        on = min(prefill_seconds(llm, a.prompt_len, a.vocab, seed=2 + i) for i in range(2))
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                prefill_seconds(llm, a.prompt_len, a.vocab, seed=99)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60),
                  flush=True)
        res.update(h2d_gbps=h2d / GB, cpu_expert_bytes=cpu_bytes, bound_s=bound_s, layerwise_s=on,
                   layerwise_tokens_per_s=a.prompt_len / on, ratio_to_bound=bound_s / on)
        print(f"layerwise prefill of {a.prompt_len} tokens: {on:.3f} s ({a.prompt_len / on:.0f} tok/s); bound "
              f"{cpu_bytes / GB:.2f} GB of CPU experts / {h2d / GB:.1f} GB/s = {bound_s:.3f} s -> ratio "
              f"{bound_s / on:.2f}", flush=True)
        if not a.skip_off:
            plan.prefill_threshold = None  # the CPU engine computes its experts again
            off = prefill_seconds(llm, a.prompt_len, a.vocab, seed=9)
            res.update(cpu_path_s=off, speedup=off / on)
            print(f"threshold off: {off:.3f} s ({a.prompt_len / off:.0f} tok/s) -> layerwise is {off / on:.1f}x "
                  f"faster", flush=True)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        host_limit = 1.1 * cpu_bytes + 4 * GB  # issue 15's bound
        gpu_peak = torch.cuda.max_memory_reserved()
        peak_alloc = torch.cuda.max_memory_allocated()
        res.update(gpu_allocated_at_ready=ready_alloc, gpu_peak_allocated_in_prefill=peak_alloc)
        print(f"GPU allocated: {ready_alloc / GB:.2f} GB when ready, peak {peak_alloc / GB:.2f} GB in the prefills "
              f"(+{(peak_alloc - ready_alloc) / GB:.2f} GB of activations and temporaries)", flush=True)
        mplan = runner.moe.memory_plan  # the startup plan, its KV cache line as allocated
        gpu_plan = sum(mplan.gpu.values()) if mplan is not None else float("nan")
        res.update(peak_rss=rss, host_limit=host_limit, gpu_peak_reserved=gpu_peak, gpu_plan=gpu_plan,
                   gpu_peak_over_plan=gpu_peak / gpu_plan)
        print(f"host: peak RSS {rss / GB:.2f} GB, limit 1.1 x {cpu_bytes / GB:.2f} + 4 = {host_limit / GB:.2f} GB "
              f"({'ok' if rss <= host_limit else 'OVER'}); GPU: peak reserved {gpu_peak / GB:.2f} GB, plan "
              f"{gpu_plan / GB:.2f} GB (ratio {gpu_peak / gpu_plan:.3f})", flush=True)
        llm.shutdown()
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
