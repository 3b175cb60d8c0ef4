"""LoRA decode cost: a full-size MoE model with random weights (default: Qwen3-30B-A3B shape, 32 GPU
experts, AMXINT8), once without LoRA and once serving rank-R adapters on attention (q/k/v/o_proj) and
on every routed expert (both the GPU and the CPU share), both alive in one process and timed
interleaved (--repeat, medians): batch 1 base against batch 1 on an adapter, batch B base against B
requests on B different adapters. Issue 17's targets: 0.9 and 0.8 of the base tok/s.

One adapter directory is written (PEFT layout, per-expert keys as convert-lora writes them) and
loaded under B names: each name takes its own slot, which is what the step pays for.

Where the adapter's time goes: every run carries the split bench_hybrid_decode.py prints (CPU busy
per step from the native profile, with the expert LoRA rank-product phases on their own, "other" =
the rest of the step, and the CPU trace: the pool's idle time before each task and each task's run
time, hybridmoe/cpu/trace.py), and the summary gives, per batch, what the adapter added to a step
(ms, and us per layer) and to each part. `--gpu-experts 32 128` runs the whole thing once per
setting (models of one setting freed before the next): with 128 (every expert on the GPU, no CPU
task) the added time is the GPU side's alone (attention LoRA kernels, fused-MoE expert LoRA), so
the two settings tell which side grew. `--all-gpu-layers` cuts the depth of the all-GPU setting
(two bf16 models with every expert must fit the GPU: 48 layers of the 30B shape do not).

    python benchmarks/bench_lora_decode.py --gpu-experts 32 128 --all-gpu-layers 24 --out lora_decode.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import add_shape_args, parse_shape_args, write_config  # noqa: E402

from hybridmoe import envs  # noqa: E402


def write_adapter(d: Path, a: argparse.Namespace, rank: int) -> Path:
    """Random rank-`rank` LoRA on q/k/v/o_proj of every layer and on every expert of every layer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    t: dict[str, torch.Tensor] = {}

    def pair(prefix: str, n_in: int, n_out: int) -> None:
        t[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) / n_in**0.5).bfloat16()
        t[f"{prefix}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * 0.01).bfloat16()

    h, i, qd, kd = a.hidden, a.inter, a.heads * a.head_dim, a.kv_heads * a.head_dim
    for layer in range(a.layers):
        p = f"base_model.model.model.layers.{layer}"
        for name, n_in, n_out in (("q_proj", h, qd), ("k_proj", h, kd), ("v_proj", h, kd), ("o_proj", qd, h)):
            pair(f"{p}.self_attn.{name}", n_in, n_out)
        for e in range(a.experts):
            pair(f"{p}.mlp.experts.{e}.gate_proj", h, i)
            pair(f"{p}.mlp.experts.{e}.up_proj", h, i)
            pair(f"{p}.mlp.experts.{e}.down_proj", i, h)
    d.mkdir(parents=True, exist_ok=True)
    save_file(t, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "task_type": "CAUSAL_LM",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "base_model_name_or_path": "random"}))
    return d


def start_decode(llm, loras: list[str | None], prompt_len: int, steps: int, vocab: int) -> list:
    """`len(loras)` requests on those adapters through prefill and the first decode step (not timed)."""
    eng = llm.engine
    g = torch.Generator().manual_seed(len(loras))
    reqs = [eng.make_request(input_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                             sampling_params={"max_new_tokens": steps + 2, "temperature": 0, "ignore_eos": True},
                             lora_path=name) for name in loras]
    for r in reqs:
        eng.submit(r)
    while any(len(r.output_ids) < 2 for r in reqs):
        eng.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return reqs


def timed_decode(llm, loras: list[str | None], prompt_len: int, steps: int, vocab: int) -> dict:
    """tok/s of `len(loras)` requests decoding together and where a step's time went (the split of
    bench_hybrid_decode.run_batch: CPU busy from the native profile, per phase; the rest of the
    step; the CPU pool's trace)."""
    from hybridmoe.cpu import native
    from hybridmoe.cpu.engine import default_pool
    from hybridmoe.cpu.trace import summarize

    eng = llm.engine
    reqs = start_decode(llm, loras, prompt_len, steps, vocab)
    pool = default_pool()
    native.profile(reset=True)
    pool.sync()
    pool.trace_start(1 << 19)  # submit/start/end/wait times of every CPU task (~50 ns each)
    t0, n, nsteps = time.perf_counter(), 0, 0
    while not all(r.finished for r in reqs):
        n += len(eng.step())
        nsteps += 1
    dt = time.perf_counter() - t0
    pool.sync()
    trace = summarize(pool.trace_stop())
    prof = native.profile(reset=True)
    tasks = prof.pop("tasks")
    cpu_busy = sum(prof.values())
    return {"tokens_per_s": n / dt, "steps": nsteps, "ms_per_step": 1e3 * dt / nsteps,
            "cpu_busy_ms_per_step": 1e3 * cpu_busy / nsteps, "other_ms_per_step": 1e3 * (dt - cpu_busy) / nsteps,
            "cpu_tasks_per_step": tasks / nsteps,
            "cpu_phase_us_per_task": {k: 1e6 * v / tasks if tasks else 0.0 for k, v in prof.items()},
            "cpu_trace": trace}


SPLIT = ("ms_per_step", "cpu_busy_ms_per_step", "other_ms_per_step", "cpu_tasks_per_step")
TRACE = ("run_us", "idle_before_us", "wait_submit_us", "start_latency_us", "blocked_us", "gpu_path_us")


def _med(rows: list[dict], get) -> float:
    vals = [get(r) for r in rows]
    vals = [v for v in vals if v == v]  # NaN: a run without CPU tasks
    return statistics.median(vals) if vals else float("nan")


def summarize_setting(runs: list[dict], gpu_experts: int, batch: int, target: float, layers: int) -> dict:
    """Medians of one (GPU experts, batch) pair of settings, base and LoRA, and what the adapter added."""
    out: dict = {"gpu_experts": gpu_experts, "batch": batch, "target": target, "layers": layers}
    for kind in ("base", "lora"):
        rows = [r for r in runs if (r["gpu_experts"], r["kind"], r["batch"]) == (gpu_experts, kind, batch)]
        m = {"tokens_per_s": _med(rows, lambda r: r["tokens_per_s"])}
        m.update({k: _med(rows, lambda r, k=k: r[k]) for k in SPLIT})
        m.update({f"trace_{k}": _med(rows, lambda r, k=k: r["cpu_trace"][k]) for k in TRACE})
        phases = rows[0]["cpu_phase_us_per_task"].keys()
        m["cpu_phase_us_per_task"] = {k: _med(rows, lambda r, k=k: r["cpu_phase_us_per_task"][k]) for k in phases}
        out[kind] = m
    b, lo = out["base"], out["lora"]
    out["ratio"] = lo["tokens_per_s"] / b["tokens_per_s"]
    out["added"] = {k: lo[k] - b[k] for k in SPLIT + tuple(f"trace_{k}" for k in TRACE)}
    out["added"]["us_per_layer"] = 1e3 * out["added"]["ms_per_step"] / layers
    out["added"]["cpu_phase_us_per_task"] = {k: lo["cpu_phase_us_per_task"][k] - b["cpu_phase_us_per_task"][k]
                                             for k in b["cpu_phase_us_per_task"]}
    # per repeat (the settings of one repeat ran back to back: the host's drift between repeats cancels)
    by = {(r["rep"], r["kind"]): r["tokens_per_s"] for r in runs if (r["gpu_experts"], r["batch"]) == (gpu_experts, batch)}
    reps = sorted({rep for rep, _ in by})
    per = [by[(rep, "lora")] / by[(rep, "base")] for rep in reps if (rep, "lora") in by and (rep, "base") in by]
    out["ratio_per_rep"] = per
    out["ratio_per_rep_median"] = statistics.median(per) if per else None
    unf = [by[(rep, "lora-unfused")] / by[(rep, "base")] for rep in reps if (rep, "lora-unfused") in by]
    if unf:
        out["unfused_ratio_per_rep"] = unf
        out["fused_over_unfused_per_rep"] = [by[(rep, "lora")] / by[(rep, "lora-unfused")] for rep in reps
                                             if (rep, "lora-unfused") in by]
    return out


def format_setting(s: dict) -> str:
    b, lo, ad = s["base"], s["lora"], s["added"]
    who = "1 adapter" if s["batch"] == 1 else f"{s['batch']} adapters"
    line = (f"gpu-experts {s['gpu_experts']} batch {s['batch']}: base {b['tokens_per_s']:.1f} tok/s, LoRA ({who}) "
            f"{lo['tokens_per_s']:.1f} tok/s: ratio {s['ratio']:.3f} (target {s['target']})\n"
            f"  step {b['ms_per_step']:.2f} -> {lo['ms_per_step']:.2f} ms ({ad['ms_per_step']:+.2f} ms, "
            f"{ad['us_per_layer']:+.1f} us per layer of {s['layers']}): CPU busy {b['cpu_busy_ms_per_step']:.2f} -> "
            f"{lo['cpu_busy_ms_per_step']:.2f} ms ({ad['cpu_busy_ms_per_step']:+.2f}), other "
            f"{b['other_ms_per_step']:.2f} -> {lo['other_ms_per_step']:.2f} ms ({ad['other_ms_per_step']:+.2f})")
    line += "\n  LoRA / base per repeat: " + " ".join(f"{v:.3f}" for v in s["ratio_per_rep"])
    if s["ratio_per_rep_median"] is not None:
        line += f" (median {s['ratio_per_rep_median']:.3f})"
    if "unfused_ratio_per_rep" in s:
        line += ("; unfused LoRA / base " + " ".join(f"{v:.3f}" for v in s["unfused_ratio_per_rep"]) +
                 "; fused / unfused " + " ".join(f"{v:.3f}" for v in s["fused_over_unfused_per_rep"]))
    if b["cpu_tasks_per_step"]:
        ph = ", ".join(f"{k} {v:+.1f}" for k, v in ad["cpu_phase_us_per_task"].items())
        line += (f"\n  per CPU task ({lo['cpu_tasks_per_step']:.0f} a step): run {b['trace_run_us']:.1f} -> "
                 f"{lo['trace_run_us']:.1f} us, pool idle before it {b['trace_idle_before_us']:.1f} -> "
                 f"{lo['trace_idle_before_us']:.1f} us (nothing submitted {b['trace_wait_submit_us']:.1f} -> "
                 f"{lo['trace_wait_submit_us']:.1f}), stream blocked {b['trace_blocked_us']:.1f} -> "
                 f"{lo['trace_blocked_us']:.1f} us, next submit after a release {b['trace_gpu_path_us']:.1f} -> "
                 f"{lo['trace_gpu_path_us']:.1f} us; phases (us per task) {ph}")
    return line


def run_setting(a: argparse.Namespace, d: Path, gpu_experts: int, results: dict) -> None:
    """Base and LoRA models with `gpu_experts` GPU experts per layer, timed interleaved; both freed after."""
    from hybridmoe import LLM
    from hybridmoe.cpu.trace import format_summary
    from hybridmoe.lora.engine_ops import loaded

    cuda = a.device == "cuda"
    s = copy.copy(a)
    if gpu_experts >= a.experts and a.all_gpu_layers:
        s.layers = a.all_gpu_layers
    d = d / f"gpu{gpu_experts}"
    d.mkdir()
    write_config(d, s)
    t = time.perf_counter()
    adapter = write_adapter(d / "adapter", s, a.rank)
    print(f"[gpu-experts {gpu_experts}, {s.layers} layers] adapter written in {time.perf_counter() - t:.1f} s",
          flush=True)
    common = dict(device=a.device, dtype="bfloat16" if cuda else "float32", load_format="dummy", progress=False,
                  skip_tokenizer_init=True, kt_method=a.method, kt_num_gpu_experts=gpu_experts,
                  cuda_graph_max_bs=max(a.batch, 1), max_running_requests=a.batch,
                  max_total_tokens=a.batch * (a.prompt_len + a.steps + 64), context_length=1024)
    t = time.perf_counter()
    base = LLM(d, **common)
    names = [f"a{k}" for k in range(a.batch)]
    lora = LLM(d, **common, lora_paths=[f"{n}={adapter}" for n in names], max_loras_per_batch=a.batch,
               max_lora_rank=a.rank)
    unfused = None
    if a.unfused:  # the same LoRA model with the linears' unfused form (HYBRIDMOE_LORA_FUSED=0 while it loads)
        os.environ[envs.LORA_FUSED] = "0"
        try:
            unfused = LLM(d, **common, lora_paths=[f"{n}={adapter}" for n in names], max_loras_per_batch=a.batch,
                          max_lora_rank=a.rank)
        finally:
            del os.environ[envs.LORA_FUSED]
    print(f"models ready in {time.perf_counter() - t:.1f} s", flush=True)
    results["adapters"] = sorted(loaded(lora.engine))
    settings = [("base", 1, base, [None]), ("lora", 1, lora, names[:1]),
                ("base", a.batch, base, [None] * a.batch), ("lora", a.batch, lora, names)]
    if unfused is not None:
        settings.insert(2, ("lora-unfused", 1, unfused, names[:1]))
    for rep in range(a.repeat):
        for kind, b, llm, loras in settings:
            row = {"gpu_experts": gpu_experts, "layers": s.layers, "rep": rep, "kind": kind, "batch": b,
                   **timed_decode(llm, loras, a.prompt_len, a.steps, a.vocab)}
            results["runs"].append(row)
            print(f"gpu-experts {gpu_experts} rep {rep} {kind:4s} batch {b}: {row['tokens_per_s']:8.1f} tok/s "
                  f"{row['ms_per_step']:7.2f} ms/step (CPU busy {row['cpu_busy_ms_per_step']:.2f}, other "
                  f"{row['other_ms_per_step']:.2f})", flush=True)
            if row["cpu_tasks_per_step"]:
                print(f"  CPU trace: {format_summary(row['cpu_trace'])}", flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps(results, indent=2))
    lora.shutdown()
    base.shutdown()
    if unfused is not None:
        unfused.shutdown()
    del base, lora, unfused
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    for b, target in ((1, 0.9), (a.batch, 0.8)):
        summary = summarize_setting(results["runs"], gpu_experts, b, target, s.layers)
        results["summary"].append(summary)
        print(format_setting(summary), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p)
    p.add_argument("--gpu-experts", type=int, nargs="+", default=[32],
                   help="GPU experts per MoE layer; several: one setting each (--experts: no CPU experts)")
    p.add_argument("--all-gpu-layers", type=int, default=None,
                   help="layers of a setting with every expert on the GPU (default: --layers)")
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="the multi-adapter batch: this many adapters")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (tests), not a measurement")
    p.add_argument("--unfused", action="store_true",
                   help="also time batch 1 on a third model whose LoRA linears keep the unfused form (GEMM + shrink + "
                        "expand; HYBRIDMOE_LORA_FUSED=0), interleaved with the others: what the fused form saves")
    p.add_argument("--out", default=None)
    a = parse_shape_args(p)

    results: dict = {"shape": vars(a), "runs": [], "summary": []}
    with tempfile.TemporaryDirectory() as d:
        for g in a.gpu_experts:
            run_setting(a, Path(d), g, results)
    print("summary:")
    for s in results["summary"]:
        print(format_setting(s))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
